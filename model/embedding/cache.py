"""The multimodal embedding cache of one node, as a pure model (SPEC §6): the facade.

Theory of operation
-------------------
An encoder output (a ``[tokens, dim]`` tensor) is cached under the content hash of its media item.
One :class:`EmbeddingCacheModel` is one node's cache: a paged local pool of ``capacity`` units (an
entry of ``size`` units takes ``size`` slots of a :class:`~kvstrata.model.slots.SlotPool`) and a
:class:`~kvstrata.model.store.StoreModel` shared with every other node (two models with the same
store and key space see each other's pushes). The model moves no bytes: unit ``i`` of media ``m``
is the content identity ``Unit(m, i)``, written into the slots, read back from them, and copied to
and from the store as a tuple.

Every entry advances only through :data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY`, in
:mod:`.entries` alone: a new entry is FREE -> FILLING (``reserve``: the caller writes it in place)
-> READY (``commit``; ``insert_batch`` is both) or FREE -> LOADING -> READY (``prefetch``, then
``ack_get``); a READY entry in a PUT is PUSHING until ``ack_push`` or ``fail_push``; a READY entry
no loan names (``borrow`` / ``give_back``) may be evicted (FREE: forgotten, slots freed); a failed
GET, or an aborted reservation, is FREE at once. Entries are immutable values.

Pushes and GETs are ops with a handle (:mod:`.ops`), completed when the caller (a test, or the I/O
worker) says so, item by item as a real batch call answers (one code per key): ``ack_push(handle,
failed)`` / ``ack_get(handle, failed)`` complete the items not in ``failed`` normally, while a
failed PUSH item is READY again (its write aborted, counted in ``push_failed``) and a failed GET
item is freed and forgotten (counted in ``load_failed``); ``fail_push`` / ``fail_get`` fail every
item. The store is pessimistic: it may read a pushed buffer any time before the ack, and the model
reads it *at* the ack, so a slot freed and reused while its offset is with the store shows up as
wrong bytes in the store.

Upheld here (the facade): every public call validates its arguments and plans its work before it
mutates anything (a bad call raises :class:`MisuseError` or :class:`CapacityError` and changes
nothing); a batch's own local hits are never its LRU victims (the PUT hands their offsets to the
store); only READY entries are read (``get``) or pushed; every mutating call ends with
:meth:`EmbeddingCacheModel.check_invariants`, which also checks I2: every visible embedding object
holds exactly the units its key names (the store is never poisoned). I5 and I7 are checked by the
pieces that own the state they are about (:mod:`.entries`, :mod:`.ops`, :mod:`.holds`).

Design choice: ``get`` returns content for READY entries only, as SPEC §6 says ("only ready
entries are read"); a PUSHING entry's bytes are complete, but it is a miss until its push acks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import attrs

from kvstrata.model.embedding.entries import (
    PUSHABLE,
    READABLE,
    Entries,
    Entry,
    check_hash,
    check_hashes,
    embedding_content,
)
from kvstrata.model.embedding.holds import Hold, Holds, Reserved
from kvstrata.model.embedding.ops import Offset, OpHandle, OpKind, Ops
from kvstrata.model.embedding.results import (
    EmbeddingStats,
    InsertResult,
    PrefetchResult,
    ReserveResult,
)
from kvstrata.model.errors import CapacityError, InvariantViolation, MisuseError, whole_count
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    Namespace,
    PageHash,
    StoreKey,
    parse_store_key,
)
from kvstrata.model.lifecycles import EntryEvent
from kvstrata.model.slots import SlotPool
from kvstrata.model.store import StoreModel

__all__ = [
    "COMPONENT",
    "POOL",
    "EmbeddingCacheModel",
    "EmbeddingStats",
    "InsertResult",
    "PrefetchResult",
    "ReserveResult",
]

#: What an entry holds, unit by unit (the model moves content identities, not bytes).
Content = tuple[Hashable, ...]

#: The pool and component segments of every embedding store key.
POOL = "emb"
COMPONENT = "emb"


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
    _entries: Entries = attrs.field(init=False)
    _ops: Ops = attrs.field(init=False)
    _holds: Holds = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._entries = Entries(self.name, SlotPool(f"{self.name}/emb", self.capacity))
        self._ops = Ops(self.name, self._entries, self.store)
        self._holds = Holds(self.name, self._entries)

    # ----------------------------------------------------------------------------- queries

    @property
    def used_units(self) -> int:
        return self._entries.pool.used_count

    @property
    def free_units(self) -> int:
        return self._entries.pool.free_count

    def key(self, media: PageHash) -> StoreKey:
        """The store key of ``media``'s embedding (the one place this model renders keys)."""
        return self.keyspace.key(self.namespace, POOL, COMPONENT, media)

    def entry(self, media: PageHash) -> Entry | None:
        return self._entries.get(check_hash(media))

    def entries(self) -> tuple[Entry, ...]:
        return self._entries.sorted()

    def pending_ops(self) -> tuple[OpHandle, ...]:
        return self._ops.handles()

    def op_media(self, handle: OpHandle) -> tuple[PageHash, ...]:
        """The media items a pending op covers."""
        return self._ops.media(handle)

    def exists(self, hashes: Iterable[PageHash]) -> tuple[bool, ...]:
        """Whether each embedding is visible in the (shared) store."""
        return tuple(self.store.contains(self.key(media)) for media in check_hashes(hashes))

    def is_ready(self, request_id: str) -> bool:
        """Whether the GET that ``prefetch(request_id, ...)`` started is complete (or was empty)."""
        return self._ops.is_ready(request_id)

    # ----------------------------------------------------------------------------- operations

    def insert_batch(self, hashes: Iterable[PageHash], sizes: Iterable[int]) -> InsertResult:
        """Insert freshly computed embeddings and push the batch to the store as one PUT:
        :meth:`reserve`, the caller's bytes written, :meth:`commit`."""
        return self.commit(self.reserve(hashes, sizes).hold)

    def reserve(self, hashes: Iterable[PageHash], sizes: Iterable[int]) -> ReserveResult:
        """The first half of an insert: allocate a FILLING entry for each new item that fits
        (evicting LRU READY entries outside the batch if needed; the batch's own hits are never
        victims), for the caller to write in place. Nothing is readable or pushed until
        :meth:`commit`; :meth:`abort` frees the entries."""
        batch = self._check_batch(hashes, sizes)
        protect = frozenset(media for media, _size in batch)
        hits = tuple(media for media, _size in batch if media in self._entries)
        misses = [(media, size) for media, size in batch if media not in self._entries]
        victims, fits, no_space = self._entries.plan_room(misses, protect)
        # Nothing has changed so far; every step below is legal by construction.
        self._evict(victims)
        fresh = [self._entries.begin_fill(media, size) for media, size in fits]
        reserved = Reserved(
            tuple(batch), tuple((e.media, e.generation) for e in fresh), hits, no_space
        )
        hold = self._holds.reserve(reserved)
        self.check_invariants()
        return ReserveResult(hold, tuple(e.media for e in fresh), no_space)

    def commit(self, hold: Hold) -> InsertResult:
        """The second half of an insert: the reservation's entries are written (READY), and every
        READY one of its batch is handed to one PUT, unasked: the store skips a key it holds or
        is writing (MOONCAKE.md §3.4); such an item is pinned until the ack like the others (its
        offset is not ``reserved``: it writes only if the store lost the key by the ack). The
        batch's local hits are pushed again (local presence is not global presence) only when
        the store lacks them: a hit the store holds stays READY (``store_skipped``). A hit gone
        since :meth:`reserve` is left out."""
        reserved = self._holds.close_reservation(hold)
        fresh = {media: self._entries.end_fill(media) for media, _gen in reserved.fresh}
        offsets: list[Offset] = []
        re_pushed = store_skipped = busy = 0
        for media, _size in reserved.batch:
            entry = fresh.get(media)
            if entry is None and media in reserved.hits:
                entry = self._entries.get(media)
            if entry is None:  # did not fit, or gone since the reserve
                continue
            if entry.state not in PUSHABLE:  # loading, or already being pushed: pinned
                busy += 1
                continue
            key = self.key(media)
            entry = self._entries.stamp(entry)
            began = self.store.begin_put(key)
            if media not in fresh:
                re_pushed += 1
                if not began:  # the store holds (or is writing) it: the hit stays READY
                    store_skipped += 1
                    self._entries.put(entry)
                    continue
            entry = self._entries.step(entry, EntryEvent.PUSH)
            offsets.append(Offset(key, media, entry.generation, entry.slots, began))
            self._entries.put(entry)
        op = self._ops.open(OpKind.PUSH, offsets)
        self.stats = attrs.evolve(
            self.stats, new=self.stats.new + len(fresh), re_pushed=self.stats.re_pushed + re_pushed
        )
        self.check_invariants()
        return InsertResult(
            op, len(fresh), re_pushed, len(offsets), store_skipped, busy, reserved.skipped_no_space
        )

    def abort(self, hold: Hold) -> int:
        """Give up a reservation: its FILLING entries are freed and forgotten; how many."""
        reserved = self._holds.close_reservation(hold)
        for media, _gen in reserved.fresh:
            self._entries.forget(self._entries[media], EntryEvent.FILL_FAILED)
        self.check_invariants()
        return len(reserved.fresh)

    def borrow(self, hashes: Iterable[PageHash]) -> tuple[Hold, tuple[Content | None, ...]]:
        """:meth:`get` without a copy: the content of each READY entry, read in place, and a loan
        (one reader on each entry lent, touched for LRU) that keeps those entries from eviction
        until :meth:`give_back`; ``None`` for anything else."""
        media_list = check_hashes(hashes)
        lent = [m for m in dict.fromkeys(media_list) if self._readable(m)]
        out = tuple(
            self._entries.read(self._entries[m].slots) if m in lent else None for m in media_list
        )
        for media in lent:
            self._entries.touch(media)
        hold = self._holds.lend(lent)
        self.check_invariants()
        return hold, out

    def give_back(self, hold: Hold) -> int:
        """Close a loan: its entries may be evicted again; how many it named."""
        count = self._holds.give_back(hold)
        self.check_invariants()
        return count

    def ack_push(self, handle: OpHandle, failed: Iterable[PageHash] = ()) -> int:
        """The store answers a batch PUT, item by item (a real batch call returns one code per
        key). Every item not in ``failed`` is written: the store reads its buffer now, the object
        becomes visible and the entry is READY (unpinned) again (``PUSH_ACK``). Every item in
        ``failed`` is not: its write is aborted and its entry is READY again (``PUSH_FAILED``;
        a later insert pushes it again). ``failed`` must name media of this op, else
        :class:`MisuseError` and nothing changes. Returns the number of objects written."""
        written, lost = self._ops.ack_push(handle, failed)
        self.stats = attrs.evolve(
            self.stats,
            pushed=self.stats.pushed + written,
            push_failed=self.stats.push_failed + lost,
        )
        self.check_invariants()
        return written

    def fail_push(self, handle: OpHandle) -> int:
        """The whole batch PUT failed (:meth:`ack_push` with every item failed). Returns the number
        of objects that were not written."""
        media = self._ops.media(handle, OpKind.PUSH)
        self.ack_push(handle, failed=media)
        return len(media)

    def prefetch(
        self,
        request_id: str,
        hashes: Iterable[PageHash],
        sizes: Iterable[int],
        *,
        probe: bool = True,
    ) -> PrefetchResult:
        """Start one batch GET for the items of a request that are not local but in the store.

        Their entries are allocated (evicting LRU READY entries outside the request if needed) and
        LOADING (pinned) until :meth:`ack_get` or :meth:`fail_get`. With ``probe=False`` the store
        is not asked first (the caller just did, with :meth:`exists`): every item that is not local
        is fetched, and one the store lacks after all fails its load (``load_failed``) and frees
        the room it took; ``missing`` is then 0."""
        if not isinstance(probe, bool):
            raise MisuseError(f"{self.name}: probe is a bool, got {probe!r}")
        self._ops.check_new_request(request_id)
        batch = self._check_batch(hashes, sizes)
        local = [media for media, _size in batch if media in self._entries]
        remote = [
            (media, size)
            for media, size in batch
            if media not in self._entries and (not probe or self.store.contains(self.key(media)))
        ]
        protect = frozenset(media for media, _size in batch)
        victims, fits, no_space = self._entries.plan_room(remote, protect)
        # Nothing has changed so far; every step below is legal by construction.
        self._evict(victims)
        for media in local:
            self._entries.touch(media)
        offsets: list[Offset] = []
        for media, size in fits:
            entry = self._entries.load(media, size)
            offsets.append(Offset(self.key(media), media, entry.generation, entry.slots))
        op = self._ops.open(OpKind.GET, offsets)
        self._ops.start_request(request_id, op)
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
        loaded, lost = self._ops.ack_get(handle, failed)
        self.stats = attrs.evolve(
            self.stats,
            loaded=self.stats.loaded + loaded,
            load_failed=self.stats.load_failed + lost,
        )
        self.check_invariants()
        return loaded

    def fail_get(self, handle: OpHandle) -> int:
        """The whole batch GET failed (:meth:`ack_get` with every item failed): every entry it was
        loading is freed and forgotten. Returns the number of entries freed."""
        media = self._ops.media(handle, OpKind.GET)
        self.ack_get(handle, failed=media)
        return len(media)

    def release(self, request_id: str) -> None:
        """Forget a request (its GET, if still pending, completes on its own)."""
        self._ops.release(request_id)

    def get(self, hashes: Iterable[PageHash]) -> tuple[Content | None, ...]:
        """The content of each READY entry (read from its slots, and touched for LRU); ``None`` for
        anything else."""
        out: list[Content | None] = []
        for media in check_hashes(hashes):
            if not self._readable(media):
                out.append(None)
                continue
            out.append(self._entries.read(self._entries[media].slots))
            self._entries.touch(media)
        self.check_invariants()
        return tuple(out)

    def evict(self, n_units: int) -> int:
        """Evict unpinned READY entries in LRU order until ``n_units`` units were freed (or none is
        left). Returns the units freed."""
        n_units = whole_count(n_units, f"{self.name}: evict's n_units")
        freed = 0
        for victim in self._entries.lru(frozenset()):
            if freed >= n_units:
                break
            self._evict([victim])
            freed += victim.size
        self.check_invariants()
        return freed

    # ----------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise :class:`InvariantViolation` unless the invariants of every piece all hold."""
        self._entries.check_accounting()
        self._ops.check()
        self._holds.check()
        self._entries.check_contents()
        for key, content in self.store.visible_items():
            parts = parse_store_key(key)
            if parts.model.kind is not KVKind.EMBEDDING or parts.pool != POOL:
                continue
            size = len(content) if isinstance(content, tuple) else 0
            if size == 0 or content != embedding_content(parts.page_hash, size):
                raise InvariantViolation("I2", f"store object {key} holds {content!r}")

    # ----------------------------------------------------------------------------- helpers

    def _readable(self, media: PageHash) -> bool:
        entry = self._entries.get(media)
        return entry is not None and entry.state in READABLE

    def _evict(self, victims: Iterable[Entry]) -> None:
        for victim in victims:
            self._entries.forget(victim, EntryEvent.EVICT)
            self.stats = attrs.evolve(self.stats, evicted=self.stats.evicted + 1)

    def _check_batch(
        self, hashes: Iterable[PageHash], sizes: Iterable[int]
    ) -> list[tuple[PageHash, int]]:
        """The batch as (media, size) pairs, duplicates merged; raises on misuse."""
        hashes = check_hashes(hashes)
        sizes = tuple(sizes)
        if len(hashes) != len(sizes):
            raise MisuseError(f"{self.name}: {len(hashes)} hashes but {len(sizes)} sizes")
        batch: dict[PageHash, int] = {}
        for media, given in zip(hashes, sizes, strict=True):
            size = whole_count(given, f"{self.name}: a size (units)", least=1)
            if size > self.capacity:
                raise CapacityError(f"{self.name}: {size} units asked, capacity {self.capacity}")
            entry = self._entries.get(media)
            known = batch.get(media, entry.size if entry is not None else size)
            if known != size:
                raise MisuseError(f"{self.name}: {media} is {known} units, not {size}")
            batch[media] = size
        return list(batch.items())
