"""Object stores for embeddings: what :class:`~kvstrata.impl.embedding.cache.EmbeddingCache`
hands its I/O jobs.

Every call names *extents*: a store key and a host address range (inside the registered pool) to
read from (``put``) or write into (``get``). The store reads a put's ranges at any time before the
call returns and writes a get's ranges only during the call, so the cache keeps every range of a
pending call pinned. Calls run on the worker thread; none raises for a store failure.

Results are per extent, as a real batch call answers one code per key: a batch may finish with
some extents :attr:`~ExtentStatus.DONE` and others failed (the store was full for the keys that did
not fit, an object was missing, ...). The cache, not the store, decides what a failed extent means
for its entry (an item whose *any* extent failed is failed).

* :class:`MemoryEmbeddingStore`: over a :class:`~kvstrata.impl.storage.memory.MemoryStore` (the
  in-process object layer of the memory backend), with fault hooks for tests.
* :class:`MooncakeEmbeddingStore`: over a :class:`~kvstrata.impl.storage.mooncake.MooncakeClient`
  (``batch_is_exist`` / ``batch_put_from`` / ``batch_get_into``, zero-copy from the pool); each
  native code is mapped with :func:`~kvstrata.impl.storage.mooncake.classify`.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import attrs

from kvstrata.impl.errors import MisuseError, StoreError
from kvstrata.impl.storage.base import PutStatus
from kvstrata.impl.storage.memory import MemoryStore
from kvstrata.impl.storage.mooncake import ErrorKind, MooncakeClient, classify
from kvstrata.model.keys import RenderedKeys, StoreKey

__all__ = [
    "EmbeddingStore",
    "Extent",
    "ExtentStatus",
    "Extents",
    "MemoryEmbeddingStore",
    "MooncakeEmbeddingStore",
]

log = logging.getLogger("kvstrata.embedding")
_OWNERS = itertools.count(1)


@attrs.frozen
class Extent:
    """One object of a batch call: its key and the host range ``[ptr, ptr + nbytes)``."""

    key: StoreKey
    ptr: int
    nbytes: int


@attrs.frozen
class Extents:
    """The objects of one batch call as columns: object ``i`` is ``keys.texts[i]`` (rendered by
    the key space as one batch: no object per key) at the host range ``[ptrs[i], ptrs[i] +
    sizes[i])``. The three have one length (checked when made)."""

    keys: RenderedKeys
    ptrs: Sequence[int]
    sizes: Sequence[int]

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.keys, RenderedKeys):
            raise MisuseError(f"Extents takes RenderedKeys, got {self.keys!r}")
        if not len(self.keys) == len(self.ptrs) == len(self.sizes):
            raise MisuseError("Extents: keys, pointers and sizes differ in length")

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[Extent]:
        """Object by object (for a store that takes them one at a time)."""
        for text, ptr, nbytes in zip(self.keys.texts, self.ptrs, self.sizes, strict=True):
            yield Extent(StoreKey(text), ptr, nbytes)

    @staticmethod
    def of(extents: Iterable[Extent]) -> Extents:
        """The columns of ``extents``, in order (tests, benchmarks: a call made by hand). Their
        keys are :class:`StoreKey` values, so the texts were rendered by a key space too."""
        listed = list(extents)
        for extent in listed:
            if not isinstance(extent, Extent) or not isinstance(extent.key, StoreKey):
                raise MisuseError(f"Extents.of takes Extent values of StoreKeys, got {extent!r}")
        keys = RenderedKeys([extent.key.text for extent in listed])
        return Extents(keys, [e.ptr for e in listed], [e.nbytes for e in listed])


class ExtentStatus(enum.Enum):
    """What a batch call did with one extent."""

    DONE = "done"
    """put: stored, or already in the store (the first bytes stay); get: every byte read."""
    FULL = "full"
    """put: the store had no room for it (Mooncake -200)."""
    MISSING = "missing"
    """get: the object is not in the store (Mooncake -704, a replica gone)."""
    FAILED = "failed"
    """Anything else: unreachable store, short read, lease, transfer failure, bad arguments."""


class EmbeddingStore(Protocol):
    """The object operations the embedding cache needs (see the module docstring)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...

    def exists(self, keys: Sequence[StoreKey] | RenderedKeys) -> list[bool]: ...

    def put(self, extents: Extents) -> list[ExtentStatus]: ...

    def get(self, extents: Extents) -> list[ExtentStatus]: ...


class MemoryEmbeddingStore:
    """In-process objects (shared by every adapter on the same :class:`MemoryStore`). Each object
    of a put is written on its own, so with a capacity a batch may store some objects and answer
    FULL for the others (LRU objects outside the batch are evicted first), as Mooncake does.

    Test hooks: ``fail_next`` (int) makes that many next ``put`` / ``get`` calls fail as a whole
    (every extent FAILED), touching nothing. ``fail_keys`` (a set of keys, kept until cleared)
    fails every extent of a ``put`` / ``get`` whose key is in it (not written; destination
    untouched) while the call serves the others, answering ``fail_as`` for each (FAILED unless
    set: FULL as a put the store has no room for, MISSING as a get of a dropped object).
    ``drop(keys)`` is the store's own eviction."""

    def __init__(self, objects: MemoryStore | None = None) -> None:
        self.objects = objects if objects is not None else MemoryStore()
        self.fail_next = 0
        self.fail_keys: set[StoreKey] = set()
        self.fail_as = ExtentStatus.FAILED
        self._owner = next(_OWNERS)

    def register(self, ptr: int, nbytes: int) -> None:
        """Nothing to register in process."""

    def unregister(self, ptr: int) -> None:
        """Nothing to unregister in process."""

    def exists(self, keys: Sequence[StoreKey] | RenderedKeys) -> list[bool]:
        visible = {key.text for key in self.objects.visible_keys()}
        texts = keys.texts if isinstance(keys, RenderedKeys) else [key.text for key in keys]
        return [text in visible for text in texts]

    def _failing(self) -> bool:
        if self.fail_next > 0:
            self.fail_next -= 1
            return True
        return False

    def put(self, extents: Extents) -> list[ExtentStatus]:
        if self._failing():
            return [ExtentStatus.FAILED] * len(extents)
        listed = list(extents)
        batch = [e.key for e in listed]
        done = []
        for extent in listed:
            if extent.key in self.fail_keys:
                done.append(self.fail_as)
                continue
            data = ctypes.string_at(extent.ptr, extent.nbytes)
            status, _evicted = self.objects.write(
                [(extent.key, data)], batch, owner=self._owner, hold=False
            )
            done.append(_PUT_STATUS.get(status, ExtentStatus.FAILED))
        return done

    def get(self, extents: Extents) -> list[ExtentStatus]:
        if self._failing():
            return [ExtentStatus.FAILED] * len(extents)
        listed = list(extents)
        found = self.objects.read([e.key for e in listed])
        done = []
        for extent, data in zip(listed, found, strict=True):
            if extent.key in self.fail_keys:
                done.append(self.fail_as)
            elif data is None:
                done.append(ExtentStatus.MISSING)
            elif len(data) != extent.nbytes:
                done.append(ExtentStatus.FAILED)  # Mooncake: -600, the slot is not the object
            else:
                ctypes.memmove(extent.ptr, data, extent.nbytes)
                done.append(ExtentStatus.DONE)
        return done

    def drop(self, keys: Sequence[StoreKey]) -> int:
        return self.objects.drop(keys)


_PUT_STATUS = {
    PutStatus.STORED: ExtentStatus.DONE,
    PutStatus.EXISTED: ExtentStatus.DONE,
    PutStatus.FULL: ExtentStatus.FULL,
}


def status_of_put(code: int) -> ExtentStatus:
    """One native ``batch_put_from`` code: 0 is stored (or already there), -200 full."""
    if code == 0:
        return ExtentStatus.DONE
    return ExtentStatus.FULL if classify(code) is ErrorKind.FULL else ExtentStatus.FAILED


def status_of_get(code: int, nbytes: int) -> ExtentStatus:
    """One native ``batch_get_into`` code: the bytes read (exactly ``nbytes``), or negative
    (-704 missing; -600 the slot is not the object's size; -703, -707, -800, -900, ...)."""
    if code >= 0:
        return ExtentStatus.DONE if code == nbytes else ExtentStatus.FAILED
    return ExtentStatus.MISSING if classify(code) is ErrorKind.MISSING else ExtentStatus.FAILED


def _log_failures(what: str, codes: Sequence[int]) -> None:
    """One warning per failed call, with the count of each native code (nothing is counted for
    a call without a failure: the common case, once per call)."""
    if not codes or min(codes) >= 0:
        return
    bad = collections.Counter(code for code in codes if code < 0)
    if bad:
        summary = ", ".join(f"{count} x {code}" for code, count in sorted(bad.items()))
        log.warning("embedding %s: %s", what, summary)


class MooncakeEmbeddingStore:
    """Embeddings in a Mooncake cluster through a ready :class:`MooncakeClient` (not owned).

    Per-key codes (MOONCAKE.md §3.2, §3.3): a put answers 0 (stored, or the key existed: the master
    skips it) or negative (-200 no room for this key: FULL); a get answers the bytes read (DONE
    only when that is the extent's size) or negative (-704: MISSING; -600, -703, -707, -800,
    -900: FAILED). A call that raises a :class:`StoreError` (client closed, ...) fails every
    extent.

    Embeddings are small objects: a client that has also put multi-MiB objects puts objects of
    64-128 KiB 1.2-1.8x slower over TCP afterwards (Mooncake's pooled connections keep the state of
    the large transfers; docs/operations.md), so a process with both may give this store a client
    of its own."""

    def __init__(self, client: MooncakeClient) -> None:
        self.client = client

    def register(self, ptr: int, nbytes: int) -> None:
        self.client.register_buffer(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        self.client.unregister_buffer(ptr)

    def exists(self, keys: Sequence[StoreKey] | RenderedKeys) -> list[bool]:
        try:
            return [rc == 1 for rc in self.client.batch_is_exist(keys)]
        except StoreError as error:
            log.warning("embedding exists failed: %r", error)
            return [False] * len(keys)

    def put(self, extents: Extents) -> list[ExtentStatus]:
        try:
            codes = self.client.batch_put_from(extents.keys, extents.ptrs, extents.sizes)
        except StoreError as error:
            log.warning("embedding put failed: %r", error)
            return [ExtentStatus.FAILED] * len(extents)
        _log_failures("put", codes)
        return [status_of_put(code) for code in codes]

    def get(self, extents: Extents) -> list[ExtentStatus]:
        try:
            codes = self.client.batch_get_into(extents.keys, extents.ptrs, extents.sizes)
        except StoreError as error:
            log.warning("embedding get failed: %r", error)
            return [ExtentStatus.FAILED] * len(extents)
        _log_failures("get", codes)
        return [status_of_get(code, size) for code, size in zip(codes, extents.sizes, strict=True)]
