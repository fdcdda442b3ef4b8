"""The in-memory L3 backend: a dict of objects in this process, for fast tests and as the
fault-injection store of the storage controller's tests.

:class:`MemoryStore` holds the objects (``StoreKey`` → a private copy of the page component's bytes)
with an optional byte capacity and LRU eviction of whole objects. Objects are evicted independently,
so a page can lose one component and become a miss, as in a real store. Several
:class:`MemoryBackend` instances (each with its own key space, writer role and faults) can share one
store, which is how two cache instances share L3 in a test.

Test hooks (all on :class:`MemoryBackend`, all documented as such, none used by the cache):

``evict(namespace, page, component=None)``
    drop visible objects exactly as the store's own eviction would.
``down``
    while True every call fails as against an unreachable store: ``exists`` → 0, every put page
    ``FAILED``, every get page ``FAILED`` (``writer=False`` still answers ``SKIPPED``: it never talks to
    the store).
``full``
    while True every page with a missing object gets ``FULL`` (pages that already exist still answer
    ``EXISTED``).
``fail_next(n, status=..., op=..., after=...)``
    the next ``n`` calls with at least one page (of ``op`` only, when given) serve their first
    ``after`` pages and fail the rest: put pages get ``status`` (``FAILED`` or ``FULL``), get pages
    ``FAILED``, and ``exists`` stops counting there. ``after > 0`` models a partial batch.
``hold_puts`` / ``release_puts(keys=None)`` / ``abort_puts(keys=None)``
    a store that lags (and Mooncake's two-phase puts): while ``hold_puts`` is True the store accepts a
    write (its objects count against capacity) but keeps them invisible to every reader until
    ``release_puts()`` publishes them, or loses them for good with ``abort_puts()`` (a lost put, or a
    writer that died mid-put); both take all held objects or only ``keys``. The backend's confirm
    step sees them invisible, so such a page answers ``FAILED``, never ``STORED``. Any put of a key
    that is held answers ``FAILED`` ("another writer mid-put").

Recency: a successful read and a write make an object most recently used; ``exists`` and an
``EXISTED`` put do not (probing a prefix is not using it).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Sequence

import attrs

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.sizes import parse_size
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.objects import ObjectBackend, Op, Payload
from kvstrata.model.keys import KeySpace, Namespace, PageHash, StoreKey

__all__ = ["MemoryBackend", "MemoryStore"]


_OWNERS = itertools.count(1)
"""Owner ids of held puts: one per backend, never reused (``id()`` could be, after collection)."""


def _sized(data: bytes | None, nbytes: int) -> bool:
    return data is not None and len(data) == nbytes


@attrs.frozen
class _Pending:
    """An object reserved by a two-phase put: invisible until published."""

    owner: int
    data: bytes


class MemoryStore:
    """The objects of one in-process store, shared by every :class:`MemoryBackend` built on it.

    Invariants, true whenever :attr:`lock` is free: visible and pending keys are disjoint;
    :attr:`used_bytes` is the payload size of both; with a capacity, ``used_bytes <= capacity_bytes``;
    visible objects are kept in LRU order (least recently used first). A visible object of the expected
    size never changes bytes: writing its key again is skipped (first bytes kept); one of another size
    (written through a differently shaped pool) is unusable and is replaced.
    """

    capacity_bytes: int | None
    lock: threading.Lock

    def __init__(self, capacity_bytes: int | str | None = None) -> None:
        self.capacity_bytes = (
            None
            if capacity_bytes is None
            else parse_size(capacity_bytes, what="MemoryStore.capacity_bytes")
        )
        self.lock = threading.Lock()
        self._visible: collections.OrderedDict[StoreKey, bytes] = collections.OrderedDict()
        self._pending: dict[StoreKey, _Pending] = {}
        self._used = 0

    # ------------------------------------------------------------------------------ object operations
    def present(self, keys: Sequence[StoreKey], nbytes: int) -> list[bool]:
        """Per key: visible with exactly ``nbytes`` bytes."""
        with self.lock:
            return [_sized(self._visible.get(key), nbytes) for key in keys]

    def read(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        """The bytes of each visible key (``None`` for the others); every key found becomes most
        recently used when all were found."""
        with self.lock:
            found = [self._visible.get(key) for key in keys]
            if all(data is not None for data in found):
                for key in keys:
                    self._visible.move_to_end(key)
            return found

    def write(
        self,
        objects: Sequence[tuple[StoreKey, Payload]],
        protect: Sequence[StoreKey],
        *,
        owner: int,
        hold: bool,
    ) -> tuple[PutStatus, int]:
        """Store copies of ``objects`` (published now, or held for ``owner`` when ``hold``), evicting
        least recently used visible objects other than ``protect`` to make room for all of them at
        once. Returns the status and how many objects were evicted; ``FULL`` changes nothing. Keys
        another put holds are skipped, key by key as Mooncake's batch put does, and the answer is
        then ``FAILED`` (another writer mid-put) even though the other objects were written."""
        with self.lock:
            busy = any(key in self._pending for key, _ in objects)
            todo = [
                (key, bytes(data))
                for key, data in objects
                if key not in self._pending and not _sized(self._visible.get(key), len(data))
            ]
            replaced = sum(len(self._visible[key]) for key, _ in todo if key in self._visible)
            need = sum(len(data) for _, data in todo) - replaced
            evicted = 0
            if self.capacity_bytes is not None and self._used + need > self.capacity_bytes:
                kept = {key for key, _ in todo} | set(protect)
                victims = self._victims(self._used + need - self.capacity_bytes, kept)
                if victims is None:
                    return PutStatus.FULL, 0
                for key in victims:
                    self._used -= len(self._visible.pop(key))
                evicted = len(victims)
            for key, data in todo:
                if key in self._visible:
                    self._used -= len(self._visible.pop(key))
                if hold:
                    self._pending[key] = _Pending(owner, data)
                else:
                    self._visible[key] = data
                self._used += len(data)
            return (PutStatus.FAILED if busy else PutStatus.STORED), evicted

    def _victims(self, amount: int, kept: set[StoreKey]) -> list[StoreKey] | None:
        """The least recently used visible keys outside ``kept`` that free at least ``amount`` bytes,
        or ``None`` when even all of them would not."""
        victims, freed = [], 0
        for key, data in self._visible.items():
            if freed >= amount:
                break
            if key not in kept:
                victims.append(key)
                freed += len(data)
        return victims if freed >= amount else None

    def drop(self, keys: Sequence[StoreKey]) -> int:
        """Remove the visible ones of ``keys`` (the store's own eviction); how many were removed."""
        with self.lock:
            removed = 0
            for key in keys:
                data = self._visible.pop(key, None)
                if data is not None:
                    self._used -= len(data)
                    removed += 1
            return removed

    def _held(self, owner: int, keys: Sequence[StoreKey] | None) -> list[StoreKey]:
        chosen = None if keys is None else set(keys)
        return [
            key
            for key, held in self._pending.items()
            if held.owner == owner and (chosen is None or key in chosen)
        ]

    def publish(self, owner: int, keys: Sequence[StoreKey] | None = None) -> int:
        """Make ``owner``'s held objects (only ``keys``, when given) visible, most recently used;
        how many."""
        with self.lock:
            mine = self._held(owner, keys)
            for key in mine:
                self._visible[key] = self._pending.pop(key).data
            return len(mine)

    def discard(self, owner: int, keys: Sequence[StoreKey] | None = None) -> int:
        """Forget ``owner``'s held objects (only ``keys``, when given): a lost put, or a writer that
        died mid-put; how many."""
        with self.lock:
            mine = self._held(owner, keys)
            for key in mine:
                self._used -= len(self._pending.pop(key).data)
            return len(mine)

    # ----------------------------------------------------------------------------------- inspection
    @property
    def used_bytes(self) -> int:
        with self.lock:
            return self._used

    def visible_keys(self) -> tuple[StoreKey, ...]:
        """The visible keys, least recently used first."""
        with self.lock:
            return tuple(self._visible)

    def pending_keys(self) -> frozenset[StoreKey]:
        with self.lock:
            return frozenset(self._pending)

    def __len__(self) -> int:
        with self.lock:
            return len(self._visible)


@attrs.frozen
class _Fault:
    op: Op | None
    status: PutStatus
    after: int


class MemoryBackend(ObjectBackend):
    """An L3 backend over a :class:`MemoryStore` (a new private one unless ``store`` is given).

    ``capacity_bytes`` (an int or a size string such as ``"64MiB"``) sizes the private store; give it
    to :class:`MemoryStore` instead when sharing one. ``writer=False`` makes every put ``SKIPPED``
    (replicated MLA KV written by another rank). Thread-safe: the store's one lock guards the objects
    and this backend's injected faults. See the module docstring for the test hooks.
    """

    name = "memory"
    store: MemoryStore
    down: bool
    """Test hook: every call fails as against an unreachable store."""
    full: bool
    """Test hook: every page with a missing object is ``FULL``."""
    hold_puts: bool
    """Test hook: puts stay invisible until :meth:`release_puts` (two-phase put)."""

    def __init__(
        self,
        keyspace: KeySpace,
        *,
        store: MemoryStore | None = None,
        capacity_bytes: int | str | None = None,
        writer: bool = True,
    ) -> None:
        super().__init__(keyspace, writer=writer)
        if store is not None and not isinstance(store, MemoryStore):
            raise MisuseError(f"MemoryBackend.store: expected a MemoryStore, got {store!r}")
        if store is not None and capacity_bytes is not None:
            raise ConfigError(
                "MemoryBackend: give capacity_bytes to the shared MemoryStore, not to one backend"
            )
        self.store = MemoryStore(capacity_bytes) if store is None else store
        self.down = False
        self.full = False
        self.hold_puts = False
        self._faults: collections.deque[_Fault] = collections.deque()
        self._owner = next(_OWNERS)

    # ---------------------------------------------------------------------------------- object layer
    def _present(self, keys: Sequence[StoreKey], nbytes: int) -> list[bool] | None:
        return self.store.present(keys, nbytes)

    def _write(
        self, objects: Sequence[tuple[StoreKey, Payload]], page_keys: Sequence[StoreKey]
    ) -> PutStatus:
        if self.full:
            return PutStatus.FULL
        status, evicted = self.store.write(
            objects, page_keys, owner=self._owner, hold=self.hold_puts
        )
        self.counters.add(objects_evicted=evicted)
        return status

    def _read(self, keys: Sequence[StoreKey], nbytes: int) -> list[Payload] | GetStatus:
        found = self.store.read(keys)
        if any(data is None for data in found):
            return GetStatus.MISSING
        if any(data is not None and len(data) != nbytes for data in found):
            return GetStatus.FAILED  # a short object: never a hit
        return [data for data in found if data is not None]

    def _admit(self, op: Op, pages: int) -> tuple[int, PutStatus]:
        if self.down:
            return 0, PutStatus.FAILED
        if pages == 0:
            return 0, PutStatus.FAILED
        with self.store.lock:
            if self._faults and self._faults[0].op in (None, op):
                fault = self._faults.popleft()
                return min(fault.after, pages), fault.status
        return pages, PutStatus.FAILED

    def _close_store(self) -> None:
        self.store.discard(self._owner)

    # ------------------------------------------------------------------------------------- test hooks
    def evict(self, namespace: Namespace, page: PageHash, component: str | None = None) -> int:
        """Test hook: drop ``page``'s objects (only ``component``'s when given) as the store's own
        eviction would; how many objects were dropped."""
        return self.drop(self._component_keys(namespace, page, component))

    def drop(self, keys: Sequence[StoreKey]) -> int:
        """Test hook: drop the objects of ``keys`` (any pool's) as the store's own eviction would;
        how many were dropped."""
        return self.store.drop(keys)

    def fail_next(
        self,
        n: int = 1,
        *,
        status: PutStatus = PutStatus.FAILED,
        op: Op | str | None = None,
        after: int = 0,
    ) -> None:
        """Test hook: the next ``n`` calls with pages (of ``op`` only, when given) serve their first
        ``after`` pages and fail the rest (put pages get ``status``: ``FAILED`` or ``FULL``).

        Queued faults are taken first in, first out: the oldest waits for a call it matches, and
        the ones queued after it wait behind it."""
        for name, value, least in (("n", n, 1), ("after", after, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise MisuseError(f"fail_next.{name}: expected an int >= {least}, got {value!r}")
        if status not in (PutStatus.FAILED, PutStatus.FULL):
            raise MisuseError(f"fail_next.status: expected FAILED or FULL, got {status!r}")
        try:
            which = None if op is None else Op(op.value if isinstance(op, Op) else op)
        except ValueError as error:
            raise MisuseError(f"fail_next.op: expected exists, put or get, got {op!r}") from error
        with self.store.lock:
            self._faults.extend(_Fault(which, status, after) for _ in range(n))

    def clear_faults(self) -> None:
        """Test hook: forget every fault queued by :meth:`fail_next` and reset ``down`` and
        ``full``."""
        with self.store.lock:
            self._faults.clear()
        self.down = False
        self.full = False

    def release_puts(self, keys: Sequence[StoreKey] | None = None) -> int:
        """Test hook: publish the objects this backend's held puts reserved (all, or ``keys``);
        how many."""
        return self.store.publish(self._owner, keys)

    def abort_puts(self, keys: Sequence[StoreKey] | None = None) -> int:
        """Test hook: lose the objects this backend's held puts reserved (all, or ``keys``); how
        many."""
        return self.store.discard(self._owner, keys)
