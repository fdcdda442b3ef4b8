"""Object stores for embeddings: what :class:`~kvstrata.impl.embedding.cache.EmbeddingCache`
hands its I/O jobs.

Every call names *extents*: a store key and a host address range (inside the registered pool) to
read from (``put``) or write into (``get``). The store reads a put's ranges at any time before the
call returns and writes a get's ranges only during the call, so the cache keeps every range of a
pending call pinned. Calls run on the worker thread; none raises for a store failure (a failed
extent is ``False``).

* :class:`MemoryEmbeddingStore`: over a :class:`~kvstrata.impl.storage.memory.MemoryStore` (the
  in-process object layer of the memory backend), with a fault hook for tests.
* :class:`MooncakeEmbeddingStore`: over a :class:`~kvstrata.impl.storage.mooncake.MooncakeClient`
  (``batch_is_exist`` / ``batch_put_from`` / ``batch_get_into``, zero-copy from the pool).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from collections.abc import Sequence
from typing import Protocol

import attrs

from kvstrata.impl.errors import StoreError
from kvstrata.impl.storage.memory import MemoryStore
from kvstrata.impl.storage.mooncake import MooncakeClient
from kvstrata.model.keys import StoreKey

__all__ = ["EmbeddingStore", "Extent", "MemoryEmbeddingStore", "MooncakeEmbeddingStore"]

log = logging.getLogger("kvstrata.embedding")
_OWNERS = itertools.count(1)


@attrs.frozen
class Extent:
    """One object of a batch call: its key and the host range ``[ptr, ptr + nbytes)``."""

    key: StoreKey
    ptr: int
    nbytes: int


class EmbeddingStore(Protocol):
    """The object operations the embedding cache needs (see the module docstring)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...

    def exists(self, keys: Sequence[StoreKey]) -> list[bool]: ...

    def put(self, extents: Sequence[Extent]) -> list[bool]: ...

    def get(self, extents: Sequence[Extent]) -> list[bool]: ...


class MemoryEmbeddingStore:
    """In-process objects (shared by every adapter on the same :class:`MemoryStore`).

    Test hook: ``fail_next`` (int) makes that many next ``put`` / ``get`` calls fail as a whole,
    touching nothing. ``drop(keys)`` is the store's own eviction."""

    def __init__(self, objects: MemoryStore | None = None) -> None:
        self.objects = objects if objects is not None else MemoryStore()
        self.fail_next = 0
        self._owner = next(_OWNERS)

    def register(self, ptr: int, nbytes: int) -> None:
        """Nothing to register in process."""

    def unregister(self, ptr: int) -> None:
        """Nothing to unregister in process."""

    def exists(self, keys: Sequence[StoreKey]) -> list[bool]:
        return [data is not None for data in self._peek(keys)]

    def _peek(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        visible = set(self.objects.visible_keys())
        return [None if key not in visible else b"" for key in keys]

    def _failing(self) -> bool:
        if self.fail_next > 0:
            self.fail_next -= 1
            return True
        return False

    def put(self, extents: Sequence[Extent]) -> list[bool]:
        if self._failing():
            return [False] * len(extents)
        objects = [(e.key, ctypes.string_at(e.ptr, e.nbytes)) for e in extents]
        status, _evicted = self.objects.write(objects, (), owner=self._owner, hold=False)
        return [status.ok] * len(extents)

    def get(self, extents: Sequence[Extent]) -> list[bool]:
        if self._failing():
            return [False] * len(extents)
        found = self.objects.read([e.key for e in extents])
        done = []
        for extent, data in zip(extents, found, strict=True):
            ok = data is not None and len(data) == extent.nbytes
            if ok and data is not None:
                ctypes.memmove(extent.ptr, data, extent.nbytes)
            done.append(ok)
        return done

    def drop(self, keys: Sequence[StoreKey]) -> int:
        return self.objects.drop(keys)


class MooncakeEmbeddingStore:
    """Embeddings in a Mooncake cluster through a ready :class:`MooncakeClient` (not owned)."""

    def __init__(self, client: MooncakeClient) -> None:
        self.client = client

    def register(self, ptr: int, nbytes: int) -> None:
        self.client.register_buffer(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        self.client.unregister_buffer(ptr)

    def exists(self, keys: Sequence[StoreKey]) -> list[bool]:
        try:
            return [rc == 1 for rc in self.client.batch_is_exist(keys)]
        except StoreError as error:
            log.warning("embedding exists failed: %r", error)
            return [False] * len(keys)

    def put(self, extents: Sequence[Extent]) -> list[bool]:
        try:
            codes = self.client.batch_put_from(
                [e.key for e in extents], [e.ptr for e in extents], [e.nbytes for e in extents]
            )
        except StoreError as error:
            log.warning("embedding put failed: %r", error)
            return [False] * len(extents)
        return [rc == 0 for rc in codes]

    def get(self, extents: Sequence[Extent]) -> list[bool]:
        try:
            codes = self.client.batch_get_into(
                [e.key for e in extents], [e.ptr for e in extents], [e.nbytes for e in extents]
            )
        except StoreError as error:
            log.warning("embedding get failed: %r", error)
            return [False] * len(extents)
        return [rc == e.nbytes for rc, e in zip(codes, extents, strict=True)]
