"""One node's embedding cache over a shared object store (SPEC §6), the implementation of
:class:`~kvstrata.model.embedding.EmbeddingCacheModel`.

Theory of operation
-------------------
An encoder output (a ``[tokens, dim]`` tensor of the pool's dtype) is cached under the content
hash of its media item. Its entry takes ``ceil(tokens / unit_tokens)`` units of the
:class:`~kvstrata.impl.embedding.pool.EmbeddingPool`; in the store it is one object per unit,
keyed ``KeySpace.key(namespace, "emb", "u<i>of<n>", media)`` (the unit count is part of the key,
so a reader that expects another token count misses; a media item whose objects are not *all*
visible is a miss).

Every entry advances only through :data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY`, with the
model's rules: ``reserve`` allocates new entries (FREE -> FILLING) for the caller to write in
place, ``commit`` makes them READY, touches every READY entry of the batch and hands the new ones
and the local hits the store lacks to *one* batch put (READY -> PUSHING); ``insert_batch`` is the
two with one copy between; ``prefetch`` allocates LOADING entries for the items that are not local
(and visible in the store, unless ``probe=False``) and hands them to *one* batch get; ``borrow``
lends READY entries in place until ``give_back``; LRU eviction takes unlent READY entries only.
The I/O runs on an :class:`~kvstrata.impl.transfer.Executor` (a thread, an
:class:`~kvstrata.impl.transfer.InlineExecutor`, or a
:class:`~kvstrata.impl.transfer.ManualExecutor` in tests); results are queued and applied only on
the caller's thread (:meth:`EmbeddingCache.poll`, called by every public operation). A result is
per store object (one status per key, as a real batch call answers), applied item by item as the
model's ``ack_push(op, failed)`` / ``ack_get(op, failed)``: an item whose *every* object is DONE
completes; an item with *any* failed object failed (a put item is READY again and is pushed again
by a later insert; a get item is freed and forgotten), whatever the other items of the batch did.

The facade validates and delegates to pieces that own their state, mirroring the model's file
names: :mod:`.entries` (the entry table, the only module that advances ``EMBEDDING_ENTRY``) and
:mod:`.ops` (the ops in flight, the requests, the executor and its results, the store keys).

Upheld here (the facade; checked by the differential machine against the model):
    * a call with bad input raises a typed error before it changes anything, and plans its room
      before it evicts;
    * a batch's own local hits are never its LRU victims, and their extents are captured only
      once they are pinned (PUSHING), so every extent handed to the store belongs to its entry's
      current generation;
    * only READY entries are read (``get``) or pushed (the model's guard sets); a failed get
      frees and forgets its entry (:mod:`.ops`, through :mod:`.entries`).

With ``wait=True``, ``insert_batch`` / ``commit`` / ``prefetch`` return once their op (and each
older one) was applied, the store call made on this thread, the worker not woken (``Ops.submit``).

Deviation from the bare issue API, forced by the model: ``prefetch`` and ``exists`` take each
item's token count (the model's prefetch takes sizes: a reader must know how much room to
allocate). Store round trips on the caller's thread: ``insert_batch`` asks ``exists`` only for
its local hits (a hit the store holds is not pinned; new entries are pushed unasked, the store
skips what it holds), ``prefetch`` asks for what is not local unless ``probe=False``.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

from kvstrata.impl.embedding.checks import check_hashes, check_insert, check_sizes, check_wait
from kvstrata.impl.embedding.entries import Entries, Entry, LiveEntry
from kvstrata.impl.embedding.holds import Holds, Loan, Reservation, Reserved
from kvstrata.impl.embedding.ops import Ops
from kvstrata.impl.embedding.pool import EmbeddingPool
from kvstrata.impl.embedding.store import EmbeddingStore
from kvstrata.impl.errors import MisuseError
from kvstrata.impl.guard import Guard, guarded
from kvstrata.impl.transfer import Executor, ThreadExecutor
from kvstrata.model.embedding.entries import PUSHABLE, READABLE
from kvstrata.model.errors import whole_count
from kvstrata.model.keys import DEFAULT_NAMESPACE, KeySpace, KVKind, Namespace, PageHash, StoreKey
from kvstrata.model.lifecycles import EntryEvent

__all__ = [
    "EmbeddingCache",
    "EmbeddingCounters",
    "Entry",
    "InsertResult",
    "Loan",
    "PrefetchResult",
    "Reservation",
]


@attrs.frozen
class InsertResult:
    """What one ``insert_batch`` did (the fields of the model's ``InsertResult``)."""

    op: int | None
    new: int
    re_pushed: int
    stored: int
    store_skipped: int
    busy: int
    skipped_no_space: int


@attrs.frozen
class PrefetchResult:
    """What one ``prefetch`` did (the fields of the model's ``PrefetchResult``)."""

    op: int | None
    loading: int
    local: int
    missing: int
    skipped_no_space: int


@attrs.frozen
class EmbeddingCounters:
    """Counters since construction, in items (media), not store objects.

    ``skipped_no_space``: items that found no room in the local pool (everything else was pinned);
    ``failed``: items whose put or get failed (an item fails when *any* of its objects did);
    ``store_full``: the failed put items the store refused for lack of room (also in ``failed``)."""

    new: int = 0
    re_pushed: int = 0
    skipped_no_space: int = 0
    failed: int = 0
    store_full: int = 0
    pushed: int = 0
    loaded: int = 0
    evicted: int = 0


@guarded(
    "insert_batch",
    "reserve",
    "commit",
    "abort",
    "borrow",
    "give_back",
    "prefetch",
    "release",
    "get",
    "evict",
    "flush",
    "poll",
    "is_ready",
    "wait",
)
class EmbeddingCache:
    """One node's embedding cache. See the module docstring for the rules. Its verbs run only on
    the owner thread and only while open (:mod:`kvstrata.impl.guard`)."""

    def __init__(
        self,
        pool: EmbeddingPool,
        store: EmbeddingStore,
        keyspace: KeySpace,
        *,
        namespace: Namespace = DEFAULT_NAMESPACE,
        executor: Executor | None = None,
    ) -> None:
        if not isinstance(pool, EmbeddingPool):
            raise MisuseError(f"EmbeddingCache takes an EmbeddingPool, got {pool!r}")
        if not isinstance(keyspace, KeySpace) or keyspace.model.kind is not KVKind.EMBEDDING:
            raise MisuseError(
                f"keyspace must be a KeySpace of an EMBEDDING model, got {keyspace!r}"
            )
        if keyspace.model.dim != pool.shape.dim:
            raise MisuseError(f"keyspace dim {keyspace.model.dim} != pool dim {pool.shape.dim}")
        self.pool = pool
        self.store = store
        self.keyspace = keyspace
        self.namespace = namespace
        self.executor: Executor = (
            executor if executor is not None else ThreadExecutor("kvstrata-embedding")
        )
        # what the facade counts (results are counted by ops): plain ints, a hot path
        self._counted = dict.fromkeys(("new", "re_pushed", "skipped_no_space", "evicted"), 0)
        self._entries = Entries(pool)
        self._ops = Ops(self._entries, store, keyspace, namespace, self.executor)
        self._holds = Holds(self._entries)
        self.store.register(pool.ptr, pool.nbytes)
        self._guard = Guard("EmbeddingCache")

    # ----------------------------------------------------------------------------- queries

    @property
    def counters(self) -> EmbeddingCounters:
        """Counters since construction (see :class:`EmbeddingCounters`)."""
        ops = self._ops
        return EmbeddingCounters(
            **self._counted,
            failed=ops.failed,
            store_full=ops.store_full,
            pushed=ops.pushed,
            loaded=ops.loaded,
        )

    @property
    def used_units(self) -> int:
        return self.pool.used_count

    def entry(self, media: PageHash) -> Entry | None:
        """The entry of ``media`` as it is now (a snapshot), or ``None``."""
        return self._entries.snapshot(media)

    def entries(self) -> tuple[Entry, ...]:
        return self._entries.sorted()

    def pending_ops(self) -> tuple[int, ...]:
        return self._ops.handles()

    def open_holds(self) -> tuple[int, ...]:
        """The open reservations and loans, by hold number."""
        return self._holds.handles()

    def object_keys(self, media: PageHash, tokens: int) -> tuple[StoreKey, ...]:
        """The store keys of the embedding of ``media`` with ``tokens`` rows, unit by unit."""
        return self._ops.object_keys(media, tokens)

    def exists(self, hashes: Iterable[PageHash], tokens: Iterable[int]) -> tuple[bool, ...]:
        """Whether each embedding is visible, every unit of it, in the (shared) store."""
        batch = check_sizes(self._entries, hashes, tokens, merge=False)
        return tuple(self._ops.visible(batch))

    def is_ready(self, request_id: str) -> bool:
        """Whether the get that ``prefetch(request_id, ...)`` started was applied (or was empty)."""
        self._ops.poll()  # already guarded: the verb itself checked the caller
        return not self._ops.is_pending(self._ops.request(request_id))

    def wait(self, request_id: str, timeout: float | None = None) -> bool:
        """Block until :meth:`is_ready` (the I/O must be running: not for a ManualExecutor);
        ``False`` if ``timeout`` seconds passed first. With a thread executor, the store calls
        still queued run on this thread (no hand-off to the I/O thread and back)."""
        return self._ops.wait(self._ops.request(request_id), timeout)

    # ----------------------------------------------------------------------------- operations

    def insert_batch(
        self, hashes: Iterable[PageHash], tensors: Iterable[torch.Tensor], *, wait: bool = False
    ) -> InsertResult:
        """Insert freshly computed embeddings (one copy each into the pool) and push every READY
        one in one batch put: :meth:`reserve`, the copies, :meth:`commit` (``wait`` as there)."""
        check_wait(wait, self._ops.wait_refused)
        self._ops.poll()  # already guarded: the verb itself checked the caller
        batch, first = check_insert(self._entries, hashes, tensors)
        reservation = self._reserve(batch, views=False)  # written here, never handed out
        try:
            for media in reservation.new:
                self.pool.write(self._entries[media].units, first[media])
        except BaseException:  # a copy failed: nothing of this batch is kept half-written
            self._abort(reservation)
            raise
        return self._commit(reservation, wait)

    def reserve(self, hashes: Iterable[PageHash], tokens: Iterable[int]) -> Reservation:
        """The first half of an insert without a copy: FILLING entries for the new items that fit
        (LRU READY entries outside the batch evicted if needed), to be written in place (see
        :class:`Reservation`), then :meth:`commit` or :meth:`abort`."""
        self._ops.poll()  # already guarded: the verb itself checked the caller
        return self._reserve(check_sizes(self._entries, hashes, tokens, merge=True))

    def commit(self, reservation: Reservation, *, wait: bool = False) -> InsertResult:
        """The second half of an insert: the reservation's entries are READY, and every READY
        entry of its batch the store may lack goes to one batch put (see the module docstring).
        ``wait=True``: ``commit`` then :meth:`flush` of that put in one call (module docstring)."""
        check_wait(wait, self._ops.wait_refused)
        self._ops.poll()  # already guarded: the verb itself checked the caller
        return self._commit(reservation, wait)

    def abort(self, reservation: Reservation) -> int:
        """Give up a reservation: its FILLING entries are freed and forgotten; how many."""
        return self._abort(reservation)

    def _abort(self, reservation: Reservation) -> int:
        reserved = self._holds.close_reservation(reservation)
        for entry in reserved.fresh:
            self._entries.forget(entry, EntryEvent.FILL_FAILED)
        return len(reserved.fresh)

    def borrow(self, hashes: Iterable[PageHash]) -> Loan:
        """:meth:`get` without a copy: each READY entry's bytes in place in the pool (touched for
        LRU), kept from eviction until :meth:`give_back` or the end of ``with loan:``; ``None``
        for anything else."""
        self._ops.poll()  # already guarded: the verb itself checked the caller
        asked = check_hashes(hashes)
        table = self._entries
        lent = [e for m in dict.fromkeys(asked) if (e := table.get(m)) and e.state in READABLE]
        views = {entry.media: table.view(entry) for entry in lent}
        hold = self._holds.lend(lent)
        return Loan(hold, tuple(views.get(m) for m in asked), self.give_back, owner=self._holds)

    def give_back(self, loan: Loan) -> int:
        """Close a loan (its views must not be used any more); how many entries it named."""
        return self._holds.give_back(loan)

    def prefetch(
        self,
        request_id: str,
        hashes: Iterable[PageHash],
        tokens: Iterable[int],
        *,
        probe: bool = True,
        wait: bool = False,
    ) -> PrefetchResult:
        """Start one batch get for the items that are not local but visible in the store; their
        entries are LOADING (pinned) until the result is applied. ``probe=False`` skips the
        ``exists`` round trip (the caller just asked :meth:`exists`): every item that is not
        local is fetched, and one the store lacks after all fails its load and frees its room.
        ``wait=True``: ``prefetch`` then :meth:`wait` in one call (see the module docstring)."""
        if not isinstance(probe, bool):
            raise MisuseError(f"prefetch: probe is a bool, got {probe!r}")
        check_wait(wait, self._ops.wait_refused)
        self._ops.poll()  # already guarded: the verb itself checked the caller
        self._ops.check_new_request(request_id)
        table = self._entries
        batch = check_sizes(table, hashes, tokens, merge=True)
        local, others = table.partition(batch)
        seen = self._ops.visible(others) if probe else [True] * len(others)
        remote = [item for item, there in zip(others, seen, strict=True) if there]
        protect = frozenset(media for media, _tokens in batch)
        victims, fits, no_space = table.plan_room(remote, protect)
        # Nothing has changed so far; every step below is legal by construction.
        self._evict(victims)  # never a local entry: the batch is protected
        table.touch_all(local)
        op = self._ops.submit(False, table.loads(fits), wait=wait)
        self._ops.start_request(request_id, op)
        self._count(skipped_no_space=no_space)
        return PrefetchResult(
            op, len(fits), len(local), len(batch) - len(local) - len(remote), no_space
        )

    def release(self, request_id: str) -> None:
        """Forget a request (its get, if still pending, completes on its own)."""
        self._ops.release(request_id)

    def get(self, hashes: Iterable[PageHash]) -> tuple[torch.Tensor | None, ...]:
        """A copy of each READY entry's embedding (touched for LRU); ``None`` for anything else."""
        self._ops.poll()  # already guarded: the verb itself checked the caller
        out: list[torch.Tensor | None] = []
        table = self._entries
        for media in check_hashes(hashes):
            entry = table.get(media)
            if entry is None or entry.state not in READABLE:
                out.append(None)
                continue
            out.append(table.read(entry))
            table.touch(entry)
        return tuple(out)

    def evict(self, n_units: int) -> int:
        """Evict READY entries in LRU order until ``n_units`` units were freed; the units freed."""
        n_units = whole_count(n_units, "evict's n_units")
        self._ops.poll()  # already guarded: the verb itself checked the caller
        freed = 0
        for victim in self._entries.lru(frozenset()):
            if freed >= n_units:
                break
            self._evict([victim])
            freed += len(victim.units)
        return freed

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every pending op was applied (the I/O must be running: not for a
        ManualExecutor); ``False`` if ``timeout`` seconds passed first. With a thread executor,
        the store calls still queued run on this thread (no hand-off to the I/O thread and back)."""
        return self._ops.flush(timeout)

    def poll(self) -> int:
        """Apply every I/O result queued so far (on this thread); how many ops completed."""
        return self._ops.poll()

    def close(self) -> None:
        """Finish the pending I/O, apply it and unregister the pool from the store. Idempotent;
        every verb afterwards raises :class:`~kvstrata.impl.errors.CacheClosed`."""
        if self._guard.closed:
            return
        self.executor.close()
        self._ops.poll()  # not the guarded verb: close may come from any thread
        self._guard.closed = True
        self.store.unregister(self.pool.ptr)

    # ----------------------------------------------------------------------------- helpers

    def _reserve(self, batch: list[tuple[PageHash, int]], *, views: bool = True) -> Reservation:
        """The reservation of ``batch``; ``views=False`` leaves :attr:`Reservation.views` empty
        (for :meth:`insert_batch`, which writes through :meth:`EmbeddingPool.write` itself)."""
        protect = frozenset(media for media, _tokens in batch)
        table = self._entries
        found, misses = table.partition(batch)
        hits = tuple(entry.media for entry in found)
        victims, fits, no_space = table.plan_room(misses, protect)
        # Nothing has changed so far; every step below is legal by construction.
        self._evict(victims)
        fresh = table.begin_fills(fits)
        reserved = Reserved(tuple(batch), tuple(fresh), hits, no_space)
        self._counted["skipped_no_space"] += no_space
        view = self.pool.view
        return Reservation(
            self._holds.reserve(reserved),
            tuple(e.media for e in fresh),
            no_space,
            views={e.media: view(e.units, e.tokens) for e in fresh} if views else {},
            places={e.media: (e.units, e.tokens) for e in fresh},
            pool=self.pool,
            owner=self._holds,
        )

    def _commit(self, reservation: Reservation, wait: bool) -> InsertResult:
        reserved = self._holds.close_reservation(reservation)
        table = self._entries
        if len(reserved.fresh) == len(reserved.batch):  # the common case: every item is new
            written = reserved.fresh  # in batch order (the misses were planned in order)
            table.push_filled(written)
            self._counted["new"] += len(written)
            op = self._ops.submit(True, written, wait=wait)
            return InsertResult(op, len(written), 0, len(written), 0, 0, 0)
        fresh = {entry.media: entry for entry in reserved.fresh}
        hits = {m: e for m in reserved.hits if m not in fresh and (e := table.get(m))}
        # Only the hits are looked up: a new entry is pushed unasked (the store skips a key it
        # holds), a hit the store holds stays READY (readable and evictable).
        ready = [(m, e.tokens) for m, e in hits.items() if e.state in PUSHABLE]
        visible = dict(zip([m for m, _ in ready], self._ops.visible(ready), strict=True))
        pushed: list[LiveEntry] = []
        re_pushed = skipped = busy = 0
        for media, _tokens in reserved.batch:
            entry = fresh.get(media)
            if entry is not None:  # written by the caller: pushed unasked
                table.push_filled((entry,))
                pushed.append(entry)
                continue
            entry = hits.get(media)
            if entry is None:  # did not fit, or gone since the reserve
                continue
            if entry.state not in PUSHABLE:
                busy += 1
                continue
            re_pushed += 1
            table.touch(entry)
            if visible.get(media, False):
                skipped += 1
            else:
                table.advance(entry, EntryEvent.PUSH)
                pushed.append(entry)
        self._count(new=len(fresh), re_pushed=re_pushed)
        op = self._ops.submit(True, pushed, wait=wait)
        return InsertResult(
            op, len(fresh), re_pushed, len(pushed), skipped, busy, reserved.skipped_no_space
        )

    def _evict(self, victims: Iterable[LiveEntry]) -> None:
        self._counted["evicted"] += self._entries.forget_all(victims, EntryEvent.EVICT)

    def _count(self, **deltas: int) -> None:
        for name, delta in deltas.items():
            self._counted[name] += delta
