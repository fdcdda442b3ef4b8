"""The L3 store as the model sees it (SPEC §4): a map from :class:`StoreKey` to content identity.

Writes are two-phase, like Mooncake's put: :meth:`StoreModel.begin_put` reserves a key (invisible to
every reader), :meth:`StoreModel.end_put` makes it visible. ``exists`` and ``get`` see visible objects
only (I2: visible implies durable). Puts are content-addressed and idempotent: a key that is visible or
being written is not written again (exists-then-put-missing). The store may drop any visible object at
any time (:meth:`StoreModel.evict`), so a page is present only while *all* its component objects are.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import attrs

from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.keys import StoreKey

__all__ = ["StoreModel"]


def _check_key(key: object) -> StoreKey:
    if not isinstance(key, StoreKey):
        raise MisuseError(f"the store takes StoreKey values only, got {type(key).__name__}")
    return key


@attrs.define
class StoreModel:
    """Visible objects and in-flight writes, disjoint by construction."""

    _visible: dict[StoreKey, Hashable] = attrs.field(factory=dict)
    _writing: dict[StoreKey, Hashable] = attrs.field(factory=dict)

    def contains(self, key: StoreKey) -> bool:
        return _check_key(key) in self._visible

    def get(self, key: StoreKey) -> Hashable | None:
        """The content of a visible object, or ``None`` (never a partially written one)."""
        return self._visible.get(_check_key(key))

    def begin_put(self, key: StoreKey) -> bool:
        """Reserve ``key`` for a write; ``False`` (nothing to write) if it is visible or being written."""
        _check_key(key)
        if key in self._visible or key in self._writing:
            return False
        self._writing[key] = None
        return True

    def end_put(self, key: StoreKey, content: Hashable) -> None:
        """Complete a write begun with :meth:`begin_put`: the object becomes visible."""
        if _check_key(key) not in self._writing:
            raise InvariantViolation("I2", f"end_put of {key} without begin_put")
        del self._writing[key]
        self._visible[key] = content

    def abort_put(self, key: StoreKey) -> None:
        if _check_key(key) not in self._writing:
            raise InvariantViolation("I2", f"abort_put of {key} without begin_put")
        del self._writing[key]

    def evict(self, key: StoreKey) -> bool:
        """The store drops a visible object (its own eviction, a crash of the owner, ...)."""
        if _check_key(key) not in self._visible:
            return False
        del self._visible[key]
        return True

    def exists_pages(self, pages: Iterable[Sequence[StoreKey]]) -> int:
        """How many pages, from the first, have every one of their component keys visible."""
        count = 0
        for keys in pages:
            if not keys or not all(self.contains(key) for key in keys):
                break
            count += 1
        return count

    def visible_items(self) -> tuple[tuple[StoreKey, Hashable], ...]:
        return tuple(sorted(self._visible.items(), key=lambda item: item[0].text))

    def writing_keys(self) -> frozenset[StoreKey]:
        return frozenset(self._writing)

    def __len__(self) -> int:
        return len(self._visible)
