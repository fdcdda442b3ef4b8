"""The multimodal embedding cache of one node, as a pure model (SPEC §6).

Theory of operation
-------------------
An encoder output (a ``[tokens, dim]`` tensor) is cached under the content hash of its media item.
One :class:`EmbeddingCacheModel` is one node's cache: a paged local pool of ``capacity`` units (an
entry of ``size`` units takes ``size`` slots of a :class:`~kvstrata.model.slots.SlotPool`) and a
:class:`~kvstrata.model.store.StoreModel` shared with every other node (two models with the same
store and key space see each other's pushes). The model moves no bytes: unit ``i`` of media ``m``
is the content identity ``Unit(m, i)``, written into the slots, read back from them, and copied to
and from the store as a tuple.

Every entry advances only through :data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY`: a new entry
is FREE -> FILLING -> READY (``insert_batch``) or FREE -> LOADING -> READY (``prefetch``, then
``ack_get``); a READY entry whose key the store accepted is PUSHING until ``ack_push`` or
``fail_push``; a READY entry may be evicted (FREE: forgotten, slots freed); a failed GET is FREE at
once (forgotten, slots freed). Entries are immutable values, replaced with ``attrs.evolve``.

Pushes and GETs are ops with a handle, completed when the caller (a test, or the I/O worker) says
so, item by item as a real batch call answers (one code per key): ``ack_push(handle, failed)`` /
``ack_get(handle, failed)`` complete the items not in ``failed`` normally, while a failed PUSH item
is READY again (its write aborted, counted in ``push_failed``) and a failed GET item is freed and
forgotten (counted in ``load_failed``); ``fail_push`` / ``fail_get`` fail every item. The store is
pessimistic: it may read a pushed buffer any time before the ack, and the model
reads it *at* the ack, so a slot freed and reused while its offset is with the store shows up as
wrong bytes in the store.

Every public call validates its arguments and plans its work before it mutates anything: a bad
call raises :class:`MisuseError` or :class:`CapacityError` and changes nothing. Every mutating
call ends with :meth:`EmbeddingCacheModel.check_invariants`.

Invariants (and the SPEC label a violation is reported under)
    I5  accounting: the pool's allocated slots are exactly the slots of live entries; no slot
        belongs to two entries; no entry outlives a call in FREE or FILLING.
    I5  pins and offsets: an entry is PUSHING (LOADING) exactly while one pending push (GET) op
        holds its offset, and every offset a pending op holds belongs to its entry's *current*
        generation and slots (no stale offset: pinned entries are never evicted or reused).
    I7  a READY or PUSHING entry's slots hold its own units; a LOADING entry's are unwritten.
    I2  every key of a pending push is reserved (invisible) in the store; every visible embedding
        object holds exactly the units its key names (the store is never poisoned).

Design choice: ``get`` returns content for READY entries only, as SPEC §6 says ("only ready
entries are read"); a PUSHING entry's bytes are complete, but it is a miss until its push acks.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence

import attrs

from kvstrata.model.errors import CapacityError, InvariantViolation, MisuseError
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    Namespace,
    PageHash,
    StoreKey,
    parse_store_key,
)
from kvstrata.model.lifecycles import EMBEDDING_ENTRY, EntryEvent, EntryState
from kvstrata.model.slots import UNWRITTEN, SlotPool
from kvstrata.model.store import StoreModel

__all__ = [
    "COMPONENT",
    "POOL",
    "EmbeddingCacheModel",
    "EmbeddingStats",
    "Entry",
    "InsertResult",
    "Offset",
    "OpHandle",
    "OpKind",
    "PrefetchResult",
    "Unit",
    "embedding_content",
]

#: The pool and component segments of every embedding store key.
POOL = "emb"
COMPONENT = "emb"

_PINNED = frozenset({EntryState.LOADING, EntryState.PUSHING})
_COMPLETE = frozenset({EntryState.READY, EntryState.PUSHING})


@attrs.frozen
class Unit:
    """The content identity of unit ``index`` of the embedding of ``media``."""

    media: PageHash
    index: int


def embedding_content(media: PageHash, size: int) -> tuple[Unit, ...]:
    """The embedding of ``media``, unit by unit: the object the store holds under its key."""
    return tuple(Unit(media, index) for index in range(size))


class OpKind(enum.Enum):
    PUSH = "push"  # one batch PUT
    GET = "get"  # one batch GET


@attrs.frozen
class OpHandle:
    """Names one pending op of one node."""

    node: str
    kind: OpKind
    seq: int


@attrs.frozen
class Offset:
    """What an op hands to the store: a key and the slots of one entry of one generation."""

    key: StoreKey
    media: PageHash
    generation: int
    slots: tuple[int, ...]


@attrs.frozen
class Entry:
    """One cached media item. ``generation`` is new for every allocation; ``stamp`` orders LRU."""

    media: PageHash
    size: int
    state: EntryState
    slots: tuple[int, ...]
    generation: int
    stamp: int


@attrs.frozen
class InsertResult:
    """What one ``insert_batch`` did. ``re_pushed`` local hits were handed to the batch PUT
    again; ``stored`` keys were accepted by the store, ``store_skipped`` ones it already had (or
    was writing); ``busy`` local entries were loading or already pushing and were left alone."""

    op: OpHandle | None
    new: int
    re_pushed: int
    stored: int
    store_skipped: int
    busy: int
    skipped_no_space: int


@attrs.frozen
class PrefetchResult:
    """What one ``prefetch`` did: ``loading`` entries are in the GET ``op``; ``local`` were already
    here; ``missing`` are not visible in the store; ``skipped_no_space`` did not fit."""

    op: OpHandle | None
    loading: int
    local: int
    missing: int
    skipped_no_space: int


@attrs.frozen
class EmbeddingStats:
    """Counters since construction."""

    new: int = 0
    re_pushed: int = 0
    pushed: int = 0
    push_failed: int = 0
    loaded: int = 0
    load_failed: int = 0
    evicted: int = 0


@attrs.frozen
class _PendingOp:
    handle: OpHandle
    items: tuple[Offset, ...]


def _check_name(_instance: object, _attribute: object, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise MisuseError(f"name must be a non-empty string, got {value!r}")


def _check_capacity(_instance: object, _attribute: object, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MisuseError(f"capacity must be an int > 0 (units), got {value!r}")


def _check_keyspace(_instance: object, _attribute: object, value: KeySpace) -> None:
    if not isinstance(value, KeySpace) or value.model.kind is not KVKind.EMBEDDING:
        raise MisuseError(f"keyspace must be a KeySpace of an EMBEDDING model, got {value!r}")


@attrs.define
class EmbeddingCacheModel:
    """One node's embedding cache over a shared store. See the module docstring for the rules."""

    name: str = attrs.field(validator=_check_name)
    capacity: int = attrs.field(validator=_check_capacity)
    keyspace: KeySpace = attrs.field(validator=_check_keyspace)
    store: StoreModel = attrs.field(validator=attrs.validators.instance_of(StoreModel))
    namespace: Namespace = attrs.field(
        default=DEFAULT_NAMESPACE, validator=attrs.validators.instance_of(Namespace)
    )
    stats: EmbeddingStats = attrs.field(init=False, factory=EmbeddingStats)
    _pool: SlotPool = attrs.field(init=False)
    _entries: dict[PageHash, Entry] = attrs.field(init=False, factory=dict)
    _ops: dict[OpHandle, _PendingOp] = attrs.field(init=False, factory=dict)
    _requests: dict[str, OpHandle | None] = attrs.field(init=False, factory=dict)
    _clock: int = attrs.field(init=False, default=0)
    _next_generation: int = attrs.field(init=False, default=0)
    _next_op: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._pool = SlotPool(f"{self.name}/emb", self.capacity)

    # ----------------------------------------------------------------------------- queries

    @property
    def used_units(self) -> int:
        return self._pool.used_count

    @property
    def free_units(self) -> int:
        return self._pool.free_count

    def key(self, media: PageHash) -> StoreKey:
        """The store key of ``media``'s embedding (the one place this model renders keys)."""
        return self.keyspace.key(self.namespace, POOL, COMPONENT, media)

    def entry(self, media: PageHash) -> Entry | None:
        return self._entries.get(_check_hash(media))

    def entries(self) -> tuple[Entry, ...]:
        return tuple(sorted(self._entries.values(), key=lambda entry: entry.media.digest))

    def pending_ops(self) -> tuple[OpHandle, ...]:
        return tuple(sorted(self._ops, key=lambda handle: handle.seq))

    def op_media(self, handle: OpHandle) -> tuple[PageHash, ...]:
        """The media items a pending op covers."""
        return tuple(item.media for item in self._op(handle).items)

    def exists(self, hashes: Iterable[PageHash]) -> tuple[bool, ...]:
        """Whether each embedding is visible in the (shared) store."""
        return tuple(self.store.contains(self.key(media)) for media in _check_hashes(hashes))

    def is_ready(self, request_id: str) -> bool:
        """Whether the GET that ``prefetch(request_id, ...)`` started is complete (or was empty)."""
        return self._request(request_id) not in self._ops

    # ----------------------------------------------------------------------------- operations

    def insert_batch(self, hashes: Iterable[PageHash], sizes: Iterable[int]) -> InsertResult:
        """Insert freshly computed embeddings and push the whole batch to the store as one PUT.

        New items are allocated (evicting LRU READY entries outside the batch if needed), filled and
        pushed. Local READY hits are pushed again: local presence does not mean global presence.
        """
        batch = self._check_batch(hashes, sizes)
        # The batch's own hits are never victims: the PUT below hands their offsets to the store.
        protect = frozenset(media for media, _size in batch)
        hits = {media: self._entries[media] for media, _size in batch if media in self._entries}
        misses = [(media, size) for media, size in batch if media not in hits]
        victims, fits, no_space = self._plan_room(misses, protect)
        # Nothing has changed so far; every step below is legal by construction.
        for victim in victims:
            self._forget(victim, EntryEvent.EVICT)
        fresh = {media: self._fill(media, size) for media, size in fits}
        offsets: list[Offset] = []
        re_pushed = store_skipped = busy = 0
        for media, _size in batch:
            entry = fresh.get(media) or hits.get(media)
            if entry is None:  # did not fit
                continue
            if entry.state is not EntryState.READY:  # loading, or already being pushed: pinned
                busy += 1
                continue
            if media in hits:
                re_pushed += 1
            key = self.key(media)
            entry = attrs.evolve(entry, stamp=self._tick())
            if self.store.begin_put(key):
                entry = attrs.evolve(
                    entry, state=EMBEDDING_ENTRY.next(entry.state, EntryEvent.PUSH)
                )
                offsets.append(Offset(key, media, entry.generation, entry.slots))
            else:
                store_skipped += 1
            self._entries[media] = entry
        op = self._open_op(OpKind.PUSH, offsets)
        self.stats = attrs.evolve(
            self.stats, new=self.stats.new + len(fresh), re_pushed=self.stats.re_pushed + re_pushed
        )
        self.check_invariants()
        return InsertResult(
            op=op,
            new=len(fresh),
            re_pushed=re_pushed,
            stored=len(offsets),
            store_skipped=store_skipped,
            busy=busy,
            skipped_no_space=no_space,
        )

    def ack_push(self, handle: OpHandle, failed: Iterable[PageHash] = ()) -> int:
        """The store answers a batch PUT, item by item (a real batch call returns one code per
        key). Every item not in ``failed`` is written: the store reads its buffer now, the object
        becomes visible and the entry is READY (unpinned) again (``PUSH_ACK``). Every item in
        ``failed`` is not: its write is aborted and its entry is READY again (``PUSH_FAILED``;
        a later insert pushes it again). ``failed`` must name media of this op, else
        :class:`MisuseError` and nothing changes. Returns the number of objects written."""
        op = self._op(handle, OpKind.PUSH)
        lost = self._check_failed(op, failed)
        del self._ops[handle]
        for item in op.items:
            if item.media in lost:
                self.store.abort_put(item.key)
                self._advance(item.media, EntryEvent.PUSH_FAILED)
                continue
            content = tuple(self._pool.read(slot) for slot in item.slots)
            self.store.end_put(item.key, content)
            self._advance(item.media, EntryEvent.PUSH_ACK)
        written = len(op.items) - len(lost)
        self.stats = attrs.evolve(
            self.stats,
            pushed=self.stats.pushed + written,
            push_failed=self.stats.push_failed + len(lost),
        )
        self.check_invariants()
        return written

    def fail_push(self, handle: OpHandle) -> int:
        """The whole batch PUT failed (:meth:`ack_push` with every item failed). Returns the number
        of objects that were not written."""
        media = [item.media for item in self._op(handle, OpKind.PUSH).items]
        self.ack_push(handle, failed=media)
        return len(media)

    def prefetch(
        self, request_id: str, hashes: Iterable[PageHash], sizes: Iterable[int]
    ) -> PrefetchResult:
        """Start one batch GET for the items of a request that are not local but in the store.

        Their entries are allocated (evicting LRU READY entries outside the request if needed) and
        LOADING (pinned) until :meth:`ack_get` or :meth:`fail_get`."""
        if not isinstance(request_id, str) or request_id in self._requests:
            raise MisuseError(f"{self.name}: request id must be a new string, got {request_id!r}")
        batch = self._check_batch(hashes, sizes)
        local = [media for media, _size in batch if media in self._entries]
        remote = [
            (media, size)
            for media, size in batch
            if media not in self._entries and self.store.contains(self.key(media))
        ]
        victims, fits, no_space = self._plan_room(remote, frozenset(m for m, _ in batch))
        # Nothing has changed so far; every step below is legal by construction.
        for victim in victims:
            self._forget(victim, EntryEvent.EVICT)
        for media in local:
            self._entries[media] = attrs.evolve(self._entries[media], stamp=self._tick())
        offsets: list[Offset] = []
        for media, size in fits:
            entry = Entry(
                media=media,
                size=size,
                state=EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.LOAD),
                slots=self._pool.alloc(size),
                generation=self._new_generation(),
                stamp=self._tick(),
            )
            self._entries[media] = entry
            offsets.append(Offset(self.key(media), media, entry.generation, entry.slots))
        op = self._open_op(OpKind.GET, offsets)
        self._requests[request_id] = op
        self.check_invariants()
        return PrefetchResult(
            op=op,
            loading=len(offsets),
            local=len(local),
            missing=len(batch) - len(local) - len(remote),
            skipped_no_space=no_space,
        )

    def ack_get(self, handle: OpHandle, failed: Iterable[PageHash] = ()) -> int:
        """The store answers a batch GET, item by item. Every item not in ``failed`` whose object
        the store still holds (with the expected size) is written into its entry's slots
        (``LOADED``: READY); every other item failed (``LOAD_FAILED``): its entry is freed and
        forgotten. ``failed`` must name media of this op, else :class:`MisuseError` and nothing
        changes. Returns the number of entries loaded."""
        op = self._op(handle, OpKind.GET)
        lost = self._check_failed(op, failed)
        del self._ops[handle]
        loaded = 0
        for item in op.items:
            entry = self._entries[item.media]
            content = None if item.media in lost else self.store.get(item.key)
            if not isinstance(content, tuple) or len(content) != entry.size:
                self._forget(entry, EntryEvent.LOAD_FAILED)
                continue
            for slot, unit in zip(item.slots, content, strict=True):
                self._pool.write(slot, unit)
            self._advance(item.media, EntryEvent.LOADED)
            loaded += 1
        self.stats = attrs.evolve(
            self.stats,
            loaded=self.stats.loaded + loaded,
            load_failed=self.stats.load_failed + len(op.items) - loaded,
        )
        self.check_invariants()
        return loaded

    def fail_get(self, handle: OpHandle) -> int:
        """The whole batch GET failed (:meth:`ack_get` with every item failed): every entry it was
        loading is freed and forgotten. Returns the number of entries freed."""
        media = [item.media for item in self._op(handle, OpKind.GET).items]
        self.ack_get(handle, failed=media)
        return len(media)

    def release(self, request_id: str) -> None:
        """Forget a request (its GET, if still pending, completes on its own)."""
        self._request(request_id)
        del self._requests[request_id]

    def get(self, hashes: Iterable[PageHash]) -> tuple[tuple[Hashable, ...] | None, ...]:
        """The content of each READY entry (read from its slots, and touched for LRU); ``None`` for
        anything else."""
        out: list[tuple[Hashable, ...] | None] = []
        for media in _check_hashes(hashes):
            entry = self._entries.get(media)
            if entry is None or entry.state is not EntryState.READY:
                out.append(None)
                continue
            out.append(tuple(self._pool.read(slot) for slot in entry.slots))
            self._entries[media] = attrs.evolve(entry, stamp=self._tick())
        self.check_invariants()
        return tuple(out)

    def evict(self, n_units: int) -> int:
        """Evict unpinned READY entries in LRU order until ``n_units`` units were freed (or none is
        left). Returns the units freed."""
        if isinstance(n_units, bool) or not isinstance(n_units, int) or n_units < 0:
            raise MisuseError(f"{self.name}: evict takes an int >= 0, got {n_units!r}")
        freed = 0
        for victim in self._lru(frozenset()):
            if freed >= n_units:
                break
            self._forget(victim, EntryEvent.EVICT)
            freed += victim.size
        self.check_invariants()
        return freed

    # ----------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise :class:`InvariantViolation` unless the module docstring's invariants all hold."""
        owner: dict[int, PageHash] = {}
        for media, entry in self._entries.items():
            if media != entry.media or entry.state not in _PINNED | _COMPLETE:
                raise InvariantViolation("I5", f"{self.name}: bad live entry {entry!r}")
            if len(entry.slots) != entry.size:
                raise InvariantViolation("I5", f"{self.name}: {entry!r} has the wrong slot count")
            for slot in entry.slots:
                if slot in owner:
                    raise InvariantViolation(
                        "I5", f"{self.name}: slot {slot} belongs to {owner[slot]} and {media}"
                    )
                owner[slot] = media
        if frozenset(owner) != self._pool.allocated():
            raise InvariantViolation(
                "I5",
                f"{self.name}: allocated slots {sorted(self._pool.allocated())} "
                f"!= entry slots {sorted(owner)}",
            )
        self._check_offsets()
        for entry in self._entries.values():
            contents = [self._pool.peek(slot) for slot in entry.slots]
            if entry.state in _COMPLETE:
                if contents != list(embedding_content(entry.media, entry.size)):
                    raise InvariantViolation("I7", f"{self.name}: {entry!r} holds {contents}")
            elif any(content is not UNWRITTEN for content in contents):
                raise InvariantViolation("I7", f"{self.name}: loading {entry!r} holds {contents}")
        self._check_store()

    def _check_offsets(self) -> None:
        held: dict[PageHash, OpKind] = {}
        writing = self.store.writing_keys()
        for handle, op in self._ops.items():
            for item in op.items:
                entry = self._entries.get(item.media)
                want = EntryState.PUSHING if handle.kind is OpKind.PUSH else EntryState.LOADING
                if (
                    entry is None
                    or entry.state is not want
                    or entry.generation != item.generation
                    or entry.slots != item.slots
                    or item.media in held
                ):
                    raise InvariantViolation(
                        "I5", f"{self.name}: stale offset {item!r} in {handle!r}; entry {entry!r}"
                    )
                if handle.kind is OpKind.PUSH and item.key not in writing:
                    raise InvariantViolation("I2", f"{self.name}: {item.key} is not reserved")
                held[item.media] = handle.kind
        for entry in self._entries.values():
            if entry.state in _PINNED and entry.media not in held:
                raise InvariantViolation("I5", f"{self.name}: {entry!r} is pinned by no op")

    def _check_store(self) -> None:
        for key, content in self.store.visible_items():
            parts = parse_store_key(key)
            if parts.model.kind is not KVKind.EMBEDDING or parts.pool != POOL:
                continue
            size = len(content) if isinstance(content, tuple) else 0
            if size == 0 or content != embedding_content(parts.page_hash, size):
                raise InvariantViolation("I2", f"store object {key} holds {content!r}")

    # ----------------------------------------------------------------------------- helpers

    def _check_batch(
        self, hashes: Iterable[PageHash], sizes: Iterable[int]
    ) -> list[tuple[PageHash, int]]:
        """The batch as (media, size) pairs, duplicates merged; raises on misuse."""
        hashes = _check_hashes(hashes)
        sizes = tuple(sizes)
        if len(hashes) != len(sizes):
            raise MisuseError(f"{self.name}: {len(hashes)} hashes but {len(sizes)} sizes")
        batch: dict[PageHash, int] = {}
        for media, size in zip(hashes, sizes, strict=True):
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise MisuseError(f"{self.name}: a size is an int > 0 (units), got {size!r}")
            if size > self.capacity:
                raise CapacityError(f"{self.name}: {size} units asked, capacity {self.capacity}")
            entry = self._entries.get(media)
            known = batch.get(media, entry.size if entry is not None else size)
            if known != size:
                raise MisuseError(f"{self.name}: {media} is {known} units, not {size}")
            batch[media] = size
        return list(batch.items())

    def _lru(self, protect: frozenset[PageHash]) -> list[Entry]:
        """Evictable entries (READY, unpinned, not protected), least recently used first."""
        return sorted(
            (
                entry
                for entry in self._entries.values()
                if entry.state is EntryState.READY and entry.media not in protect
            ),
            key=lambda entry: entry.stamp,
        )

    def _plan_room(
        self, needs: Sequence[tuple[PageHash, int]], protect: frozenset[PageHash]
    ) -> tuple[list[Entry], list[tuple[PageHash, int]], int]:
        """Which entries to evict (LRU first) so that the needs that can fit do; changes nothing.

        Returns the victims, the needs that fit (in order) and how many did not."""
        candidates = self._lru(protect)
        spare = sum(entry.size for entry in candidates)
        free = self._pool.free_count
        victims: list[Entry] = []
        fits: list[tuple[PageHash, int]] = []
        for media, size in needs:
            if size > free + spare:
                continue
            while free < size:
                victim = candidates[len(victims)]
                victims.append(victim)
                free += victim.size
                spare -= victim.size
            free -= size
            fits.append((media, size))
        return victims, fits, len(needs) - len(fits)

    def _fill(self, media: PageHash, size: int) -> Entry:
        filling = EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.FILL)
        slots = self._pool.alloc(size)
        for slot, unit in zip(slots, embedding_content(media, size), strict=True):
            self._pool.write(slot, unit)
        entry = Entry(
            media=media,
            size=size,
            state=EMBEDDING_ENTRY.next(filling, EntryEvent.FILLED),
            slots=slots,
            generation=self._new_generation(),
            stamp=self._tick(),
        )
        self._entries[media] = entry
        return entry

    def _advance(self, media: PageHash, event: EntryEvent) -> None:
        entry = self._entries[media]
        self._entries[media] = attrs.evolve(entry, state=EMBEDDING_ENTRY.next(entry.state, event))

    def _forget(self, entry: Entry, event: EntryEvent) -> None:
        """Take ``entry`` to FREE through ``event``: it is forgotten and its slots are freed."""
        if EMBEDDING_ENTRY.next(entry.state, event) is not EntryState.FREE:
            raise InvariantViolation("I5", f"{self.name}: {event} does not free {entry!r}")
        del self._entries[entry.media]
        self._pool.free(entry.slots)
        if event is EntryEvent.EVICT:
            self.stats = attrs.evolve(self.stats, evicted=self.stats.evicted + 1)

    def _open_op(self, kind: OpKind, offsets: Sequence[Offset]) -> OpHandle | None:
        if not offsets:
            return None
        handle = OpHandle(self.name, kind, self._next_op)
        self._next_op += 1
        self._ops[handle] = _PendingOp(handle, tuple(offsets))
        return handle

    def _op(self, handle: OpHandle, kind: OpKind | None = None) -> _PendingOp:
        op = self._ops.get(handle) if isinstance(handle, OpHandle) else None
        if op is None or (kind is not None and handle.kind is not kind):
            raise MisuseError(f"{self.name}: no pending {kind or 'op'} {handle!r}")
        return op

    def _check_failed(self, op: _PendingOp, failed: Iterable[PageHash]) -> frozenset[PageHash]:
        """The failed items of a per-item completion of ``op``; :class:`MisuseError` unless each
        is a media item of ``op`` (checked before anything changes)."""
        lost = frozenset(_check_hashes(failed))
        unknown = lost - {item.media for item in op.items}
        if unknown:
            raise MisuseError(
                f"{self.name}: {sorted(m.digest.hex()[:8] for m in unknown)} "
                f"are not items of {op.handle!r}"
            )
        return lost

    def _request(self, request_id: str) -> OpHandle | None:
        if not isinstance(request_id, str) or request_id not in self._requests:
            raise MisuseError(f"{self.name}: unknown request {request_id!r}")
        return self._requests[request_id]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_generation(self) -> int:
        self._next_generation += 1
        return self._next_generation


def _check_hash(media: PageHash) -> PageHash:
    if not isinstance(media, PageHash):
        raise MisuseError(f"a media hash is a PageHash, got {type(media).__name__}")
    return media


def _check_hashes(hashes: Iterable[PageHash]) -> tuple[PageHash, ...]:
    if isinstance(hashes, PageHash | str | bytes):
        raise MisuseError(f"expected an iterable of PageHash, got {type(hashes).__name__}")
    return tuple(_check_hash(media) for media in hashes)
