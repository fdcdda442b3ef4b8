"""The hierarchical radix cache's scheduler verbs (SPEC §3; contract:
:class:`~kvstrata.impl.cache.protocol.SchedulerCache`), held to the reference model
(``kvstrata.model.cache``) by the differential stateful tests.

:class:`HierarchicalRadixCache` is a facade: each verb validates its input (a typed error from
:mod:`kvstrata.impl.errors`, nothing changed), ticks the step clock and delegates to the piece that
owns the data (:mod:`.parts` wires them; docs/architecture.md draws them). Everything is
single-threaded on the scheduler's side: copies and store I/O run on workers and change the tree only
inside :meth:`HierarchicalRadixCache.check_events`, in FIFO order. Indices are page indices (one per
``page_size`` tokens), never token indices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from kvstrata.impl.cache.agreement import Agreement
from kvstrata.impl.cache.build import Buildable
from kvstrata.impl.cache.index import TreeIndex, as_tokens
from kvstrata.impl.cache.node import (
    Allocator,
    CacheEvent,
    CacheStats,
    Delegate,
    InsertResult,
    MatchResult,
    Node,
    Pages,
    PendingWork,
)
from kvstrata.impl.cache.pages import EMPTY
from kvstrata.impl.cache.parts import assemble
from kvstrata.impl.cache.protocol import MUTATING, SchedulerCache
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.errors import MisuseError
from kvstrata.impl.guard import Guard, guarded
from kvstrata.impl.hashing import PageHasher
from kvstrata.impl.l3 import L3Tier
from kvstrata.impl.pools.group import PoolGroup
from kvstrata.impl.tp import TpGroup
from kvstrata.impl.transfer import Direction, SideCopyFunction, TransferController
from kvstrata.model.errors import page_count
from kvstrata.model.keys import Namespace, PageHash
from kvstrata.model.lifecycles import DEVICE_VALID, HOST_VALID, Residency

__all__ = ["HierarchicalRadixCache"]

Tokens = Sequence[int] | npt.NDArray[np.integer]
_DEVICE_VALID_T = tuple(DEVICE_VALID)
_HOST_VALID_T = tuple(HOST_VALID)


@guarded(*MUTATING)
class HierarchicalRadixCache(Buildable):
    """L1/L2 radix cache (L3 attached by :meth:`build`); ``MUTATING`` verbs are guarded."""

    def __init__(
        self,
        config: RadixCacheConfig,
        device: Allocator,
        host: Allocator | None = None,
        transfer: TransferController | None = None,
        copy_now: Callable[[Direction, Pages, Pages], int] | None = None,
        *,
        device_states: Allocator | None = None,
        host_states: Allocator | None = None,
        side_copy_now: SideCopyFunction | None = None,
        page_nbytes: int = 0,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        parts = assemble(
            config,
            device,
            host,
            transfer,
            copy_now,
            device_states=device_states,
            host_states=host_states,
            side_copy_now=side_copy_now,
        )
        self._clock, self._locks, self._index = parts.clock, parts.locks, parts.index
        self._states, self._tiers, self._held = parts.states, parts.tiers, parts.held
        self._lookup, self.port = parts.lookup, parts.port
        self._finish = parts.tiers.flush
        parts.tiers.page_nbytes = page_nbytes
        self._l3: L3Tier | None = None
        self.device_group: PoolGroup | None = None  # set by build() with side pools
        self.host_group: PoolGroup | None = None
        self._guard = Guard("HierarchicalRadixCache")
        self._released = False  # close() has stopped the workers
        self.agreement: Agreement | None = None  # TP (SPEC §10): set by agree_with

    def agree_with(self, group: TpGroup) -> None:
        """Mirror the other ranks of TP group ``group`` (``build(tp_group=...)`` calls this once):
        background results change the tree only by agreement, at each :meth:`check_events`."""
        if self.agreement is not None:
            raise MisuseError("this cache is in a TP group already")
        self.agreement = Agreement(group, self._tiers, self._clock, self._guard)
        if self._l3 is not None:
            self.agreement.attach_l3(self._l3)

    def attach_l3(self, tier: L3Tier) -> None:
        """Back L2 up to ``tier`` and prefetch from it (``build`` calls this once)."""
        if self._l3 is not None:
            raise MisuseError("an L3 tier is attached already")
        self._l3 = tier
        if self.agreement is not None:
            self.agreement.attach_l3(tier)
        self._tiers.backup = tier.backup.enqueue
        self._index.on_split = tier.backup.on_split

    # ------------------------------------------------------------------ parts and sizes
    transfer = Delegate["TransferController | None"]("_tiers", "transfer")

    @property
    def l3(self) -> L3Tier | None:
        """The L3 side (backup and prefetch state, counters), if a storage backend is attached."""
        return self._l3

    @property
    def has_l3(self) -> bool:
        return self._l3 is not None

    hasher = Delegate[PageHasher]("_index", "hasher")  # a worker thread or the caller's
    stats = Delegate[CacheStats]("_tiers", "stats")
    page_nbytes = Delegate[int]("_tiers", "page_nbytes")  # bytes of one KV page (byte counters)
    clock = Delegate[int]("_clock", "now")  # the step clock: one tick per public call
    roots = Delegate[dict[Namespace, Node]]("_index", "roots")
    evictable_pages = Delegate[int]("_locks", "evictable_pages")
    protected_pages = Delegate[int]("_locks", "protected_pages")
    has_states = Delegate[bool]("_states", "enabled")  # a TRAILING_PAGES pool: states per node end
    device_free = Delegate[int]("_tiers", "device_free")
    host_free = Delegate[int]("_tiers", "host_free")  # 0 without an L2
    device_states_free = Delegate[int]("_states", "device_free")  # 0 without a TRAILING_PAGES pool
    host_states_free = Delegate[int]("_states", "host_free")  # 0 without one, or without an L2

    has_host = Delegate[bool]("_tiers", "has_host")

    def pending(self) -> PendingWork:
        """Background work not applied yet (applied only by :meth:`check_events`)."""
        copies, l3 = self._tiers.copies, self._l3
        store = {} if l3 is None else l3.pending()
        return PendingWork(len(copies.write), len(copies.load), **store)

    def idle(self) -> bool:
        """Whether every copy, backup and prefetch has been applied (nothing pending), backups
        deferred while the store is down excepted. Under TP it derives from agreed facts only
        (alike on every rank): a backup one rank deferred counts only once no rank runs a job of
        it or has one due (``kvstrata.model.tp``: ``PARKED`` and ``QUIET``)."""
        copies = self._tiers.copies
        return not copies.write and not copies.load and (self._l3 is None or self._l3.idle())

    def close(self) -> None:
        """Finish queued copies, store I/O and page hashing, stop the workers and close the
        backend. Idempotent; every mutating call afterwards raises :class:`CacheClosed`."""
        if self._released:
            return
        self._released = self._guard.closed = True  # (closed already after a failed TP agreement)
        if self.agreement is not None:
            self.agreement.finish()
        if self._tiers.transfer is not None:
            self._tiers.transfer.close()
        if self._l3 is not None:
            self._l3.close()
        self._index.hasher.close()

    namespace_of = staticmethod(TreeIndex.namespace_of)
    ancestors = staticmethod(TreeIndex.ancestors)

    def nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        return self._index.nodes()

    def _check_node(self, node: Node) -> None:
        if not isinstance(node, Node):
            raise MisuseError(f"expected a Node, got {type(node).__name__}")
        if node.is_root or node.state in (None, Residency.GONE):
            raise MisuseError(f"{node!r} is not a node of this cache")

    # ------------------------------------------------------------------ queries (no split, no touch)
    def residency(
        self, tokens: Tokens, extra_key: str | Namespace | None = None
    ) -> tuple[Residency, ...]:
        """Residency of each full page of ``tokens`` in the tree."""
        return self._index.residency(tokens, extra_key)

    def state_residency(
        self, tokens: Tokens, extra_key: str | Namespace | None = None
    ) -> tuple[Residency | None, ...]:
        """Residency of the state at the end of each full page of ``tokens`` (``None``: none)."""
        return self._states.along(self._index.cached_path(tokens, extra_key))

    def page_hashes(
        self, tokens: Tokens, extra_key: str | Namespace | None = None
    ) -> tuple[PageHash, ...]:
        """The page hashes the tree holds for the cached pages of ``tokens`` (for L3 keys);
        :class:`MisuseError` when it keeps none (``RadixCacheConfig.page_hashes=False``)."""
        return self._index.page_hashes(tokens, extra_key)

    def cached_pages(self) -> dict[str, int]:
        """Pages per tier held by the tree."""
        return self._index.cached_pages()

    # ------------------------------------------------------------------ match
    def match_prefix(self, tokens: Tokens, extra_key: str | Namespace | None = None) -> MatchResult:
        """The cached prefix of ``tokens``: its L1 pages and the L2-only continuation after them,
        splitting the node the match ends inside and touching the matched path (LRU). With a
        ``TRAILING_PAGES`` pool both parts end where a state is valid in the tier read (I6)."""
        return self._lookup.match(as_tokens(tokens), self._index.namespace_of(extra_key))

    # ------------------------------------------------------------------ allocation and insert
    def alloc_device(self, pages: int) -> Pages:
        """Fresh L1 pages for a request's new KV (evicting unlocked L1 leaves as needed). Raises
        :class:`CapacityError` if L1 is still short; the caller owns the pages until ``insert`` or
        ``free_device``."""
        pages = page_count(pages)
        self._clock.tick()
        try:
            evictable, tiers = self._locks.evictable_pages, self._tiers
            return self._held.take(pages, tiers.device, tiers.evict_device, evictable)
        finally:
            self._finish()

    def held_pages(self) -> Pages:
        """L1 pages the scheduler took with :meth:`alloc_device` and has not handed back yet."""
        return self._held.pages()

    def free_device(self, pages: Sequence[int] | Pages) -> None:
        """Give back pages taken with :meth:`alloc_device` (a request that went away)."""
        array = self._held.as_array(pages, "pages")
        self._held.claim(array, EMPTY, "pages")  # all of them the scheduler's; no longer held
        self._clock.tick()
        self._tiers.device.free(array)
        self._finish()

    def insert(
        self,
        tokens: Tokens,
        device_indices: Sequence[int] | Pages,
        extra_key: str | Namespace | None = None,
        state_slot: int | None = None,
    ) -> InsertResult:
        """Cache the KV of ``tokens`` (whole pages; a trailing partial page is ignored).

        ``device_indices`` has one L1 page per full page: the cached pages ``match_prefix`` returned
        for the L1 prefix, pages from :meth:`alloc_device` (holding the computed KV) for the rest.
        The cache owns all of them afterwards: pages it already holds on L1 give their fresh page
        back, host-only pages are revived with it, new pages form a new leaf.

        ``state_slot`` (a ``TRAILING_PAGES`` pool only): an L1 state slot from
        :meth:`alloc_device_state` holding the state at the end of the last full page. It becomes
        that page's L1 state unless the page already has one on L1 (or loading), or nothing was
        cached below a loading node: then it is given back (``state_kept`` False). A slot the
        scheduler does not hold is a :class:`MisuseError`."""
        query = as_tokens(tokens)
        namespace = self._index.namespace_of(extra_key)
        total = len(query) // self.page_size
        given = self._held.as_array(device_indices, "device_indices")
        if len(given) != total:
            raise MisuseError(f"{total} L1 pages needed for {total} pages, got {len(given)}")
        if state_slot is not None:
            self._states.check_held(state_slot)
            if total == 0:
                raise MisuseError("a state belongs to the end of a full page; tokens have none")
        return self._lookup.insert(query, namespace, given, state_slot, tokens)

    # ------------------------------------------------------------------ locks and eviction
    def lock(self, node: Node) -> None:
        """Lock ``node`` and its path: none of them is evicted until :meth:`unlock`."""
        self._check_node(node)
        self._clock.tick()
        self._locks.lock(node, +1)

    def unlock(self, node: Node) -> None:
        self._check_node(node)
        if node.pins - self._tiers.copies.op_pins(node) <= 0:
            raise MisuseError(f"{node!r} is not locked by the caller")
        self._clock.tick()
        self._locks.lock(node, -1)

    def evict(self, pages: int) -> int:
        """Free at least ``pages`` L1 pages if possible (LRU over unlocked L1 leaves)."""
        pages = page_count(pages)
        self._clock.tick()
        freed = self._tiers.evict_device(pages)
        self._finish()
        return freed

    def evict_host(self, pages: int) -> int:
        """Free at least ``pages`` L2 pages if possible (LRU over unlocked host-only leaves)."""
        pages = page_count(pages)
        self._clock.tick()
        freed = self._tiers.evict_host(pages)
        self._finish()
        return freed

    def load_back(self, node: Node) -> int | None:
        """Start loading the host-only chain ending at ``node`` back to L1, all or nothing. Returns
        the op id, or ``None`` when skipped (below the threshold, over the quota, no L1 room).
        With a ``TRAILING_PAGES`` pool the state at ``node``'s end comes along if it is on L2 only."""
        self._check_node(node)
        self._clock.tick()
        op_id = self._tiers.load_back(node)
        self._finish()
        return op_id

    # ------------------------------------------------------------------ side-pool states
    def alloc_device_state(self) -> int:
        """One fresh L1 state slot for the trailing state a request is about to compute, dropping
        the least recently used unlocked L1 state copy if none is free. :class:`CapacityError` if
        still none (a dropped copy stays dropped). The caller owns the slot until ``insert``
        (``state_slot=``) or :meth:`free_device_state`; it writes the state into entry ``slot`` of
        every trailing pool of ``device_group``."""
        self._states.require()
        self._clock.tick()
        try:
            return self._states.take_device_slot()
        finally:
            self._finish()

    def free_device_state(self, slot: int) -> None:
        """Give back a state slot taken with :meth:`alloc_device_state` (a request that went away)."""
        self._states.check_held(slot)
        self._clock.tick()
        self._states.give_back_device_slot(slot)
        self._finish()

    def held_state_slots(self) -> frozenset[int]:
        """L1 state slots the scheduler took and has not handed back yet."""
        return frozenset(self._states.held)

    def evict_state(self, node: Node, *, host: bool = False) -> None:
        """Drop the state at ``node``'s end from L1 (or, with ``host``, from L2) without touching its
        KV; matches then report less, never wrong. :class:`MisuseError`, nothing changed, unless the
        state has an idle copy in that tier (not being copied) and the node is unlocked."""
        self._states.require()
        self._check_node(node)
        self._states.check_evictable(node, host=host)
        self._clock.tick()
        self._states.drop(node, host=host)
        self._finish()

    # ------------------------------------------------------------------ background work
    def check_events(self) -> list[CacheEvent]:
        """Apply every copy batch that finished since the last call (FIFO), then every store
        result; returns the copy events applied. The only place where background work changes the
        tree. In a TP group every rank calls it at the same points: it agrees first
        (:mod:`.agreement`; ``TpAgreementError`` closes the cache)."""
        if self.agreement is not None:
            return self.agreement.run()
        tiers = self._tiers
        if tiers.transfer is None:
            return []
        copies = tiers.copies
        events = [copies.apply(c, tiers.ack, tiers.fail) for c in tiers.transfer.completed()]
        if self._l3 is not None:
            self._clock.tick()
            self._l3.poll()
            self._finish()
        return events

    # ------------------------------------------------------------------ prefetch (L3 -> L2)
    def prefetch(self, tokens: Tokens, extra_key: str | Namespace | None = None) -> int | None:
        """Start reading from L3 what follows the local match of ``tokens`` (SPEC §3). Returns an
        op id for :meth:`prefetch_ready` / :meth:`prefetch_commit` / :meth:`prefetch_abort`, or
        ``None`` when there is no L3, the match does not end at a host-backed node (or a root), or
        fewer than ``prefetch_threshold`` tokens of whole pages follow it. The store query runs in
        the background; its result is applied by :meth:`check_events`."""
        query = as_tokens(tokens)
        namespace = self._index.namespace_of(extra_key)
        if self._l3 is None:
            return None
        self._clock.tick()
        try:
            return self._l3.prefetch.request(query, namespace)
        finally:
            self._finish()

    def _l3_tier(self) -> L3Tier:
        if self._l3 is None:
            raise MisuseError("this cache has no L3 storage backend")
        return self._l3

    def prefetch_ready(self, op_id: int) -> bool:
        """Whether the scheduler should stop waiting for prefetch ``op_id`` now (its policy:
        ``best_effort`` always, ``wait_complete`` once every reserved page arrived or failed,
        ``timeout`` then or after the configured time)."""
        return self._l3_tier().prefetch.ready(op_id)

    def prefetch_commit(self, op_id: int) -> int:
        """Insert the pages of ``op_id`` that arrived as host-only nodes; returns how many pages
        the tree gained. Pages still in flight are released when their read is drained."""
        prefetches = self._l3_tier().prefetch
        prefetches.op(op_id)
        self._clock.tick()
        added = prefetches.commit(op_id)
        self._finish()
        return added

    def prefetch_abort(self, op_id: int) -> None:
        """Release everything prefetch ``op_id`` reserved (the request went away)."""
        prefetches = self._l3_tier().prefetch
        prefetches.op(op_id)
        self._clock.tick()
        prefetches.abort(op_id)
        self._finish()

    def prefetch_reserved(self) -> int:
        """Host pages currently reserved by prefetches (arrived or in flight, not committed)."""
        return 0 if self._l3 is None else self._l3.prefetch.reserved()

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Drop every cached page (pending copies must have been drained first). Backups waiting
        for a store that is down are dropped too (counted in ``backup_dropped_pages``): their host
        pages are freed here, and L3 must never get another prefix's bytes under their keys."""
        if not self.idle():
            raise MisuseError(
                "reset with copies, backups or prefetches in flight: "
                "call check_events until none is pending"
            )
        if any(node.lock_ref for node in self._index.nodes()):
            raise MisuseError("reset while nodes are locked")
        if self._l3 is not None:
            self._l3.reset()
        self._tiers.reset()
        self._states.reset()
        self._locks.reset()
        self._index.reset()


def _satisfies_the_protocol(cache: HierarchicalRadixCache) -> SchedulerCache:
    """Never called: ``mypy`` checks here that the cache satisfies :class:`SchedulerCache`."""
    return cache
