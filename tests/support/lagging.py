"""A real Mooncake client seen through a store that lags (issue 19, item 2): puts are accepted (rc 0)
while their objects stay invisible to every reader until the test publishes them, or are lost for
good (removed from the real store). Used by the real-Mooncake L3 machines; the in-memory twin is
``MemoryBackend.hold_puts``.

What it changes, call by call (everything else goes to the real client):

- ``batch_put_from`` / ``batch_put_parts`` while :attr:`LaggingClient.hold` is set: keys the real
  store did not hold before and stored now become hidden;
- ``batch_is_exist`` / ``is_exist``: a hidden key answers 0 (not there);
- ``batch_get_into`` / ``batch_get_parts``: a hidden key answers -703 (not ready, as for another
  writer's unfinished put) and its slots are not written (the real read is made for the visible keys
  only).

Several views can share one hidden set (:meth:`LaggingClient.view`): the store lags for every reader,
but only the view with ``hold`` set writes lagging objects (the peer's and strangers' puts show at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstrata.impl.storage.mooncake import MooncakeClient
from kvstrata.model.keys import RenderedKeys, StoreKey

NOT_READY = -703


class LaggingClient:
    """See the module docstring."""

    def __init__(self, client: MooncakeClient, hidden: dict[str, StoreKey] | None = None) -> None:
        self._client = client
        self.hidden: dict[str, StoreKey] = {} if hidden is None else hidden
        self.hold = False

    def view(self) -> LaggingClient:
        """Another client over the same store and the same hidden objects, not holding."""
        return LaggingClient(self._client, self.hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    # ------------------------------------------------------------------------------ the store's view
    def batch_is_exist(self, keys: Sequence[StoreKey] | RenderedKeys) -> list[int]:
        codes = self._client.batch_is_exist(keys)
        texts = keys.texts if isinstance(keys, RenderedKeys) else [key.text for key in keys]
        return [0 if text in self.hidden else code for text, code in zip(texts, codes, strict=True)]

    def is_exist(self, key: StoreKey) -> int:
        return 0 if key.text in self.hidden else self._client.is_exist(key)

    def batch_put_from(self, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        return self._put(self._client.batch_put_from, keys, ptrs, sizes)

    def batch_put_parts(self, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        return self._put(self._client.batch_put_parts, keys, ptrs, sizes)

    def batch_get_into(self, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        return self._get(self._client.batch_get_into, keys, ptrs, sizes)

    def batch_get_parts(self, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        return self._get(self._client.batch_get_parts, keys, ptrs, sizes)

    def _put(self, put: Any, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        keys = _store_keys(keys)
        before = self._client.batch_is_exist(keys) if self.hold else []
        codes: list[int] = put(keys, ptrs, sizes)
        if self.hold:
            for key, was, code in zip(keys, before, codes, strict=True):
                if code == 0 and was != 1:
                    self.hidden[key.text] = key
        return codes

    def _get(self, get: Any, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        keys = _store_keys(keys)
        shown = [i for i, key in enumerate(keys) if key.text not in self.hidden]
        codes = [NOT_READY] * len(keys)
        if shown:
            got = get([keys[i] for i in shown], [ptrs[i] for i in shown], [sizes[i] for i in shown])
            for i, code in zip(shown, got, strict=True):
                codes[i] = code
        return codes

    # ---------------------------------------------------------------------------- the test's hooks
    def publish(self, keys: Sequence[StoreKey]) -> int:
        """The hidden ``keys`` become visible at last; how many were hidden."""
        return sum(self.hidden.pop(key.text, None) is not None for key in keys)

    def lose(self, keys: Sequence[StoreKey]) -> int:
        """The hidden ``keys`` are lost for good (removed from the real store); how many."""
        lost = [key for key in keys if self.hidden.pop(key.text, None) is not None]
        if lost:
            self._client.batch_remove(lost, force=True)
        return len(lost)


def _store_keys(keys: Sequence[StoreKey] | RenderedKeys) -> list[StoreKey]:
    """A batch's keys one by one (a rendered batch holds only their texts)."""
    if isinstance(keys, RenderedKeys):
        return [StoreKey(text) for text in keys.texts]
    return list(keys)
