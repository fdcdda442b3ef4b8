"""The cache's L3 side: backup L2 -> L3 and prefetch L3 -> L2 (SPEC §3, §4, §9; model: ``CacheModel``'s
backup and prefetch sections).

:class:`L3Tier` is owned by one :class:`~kvstrata.impl.radix_cache.HierarchicalRadixCache` and runs on
its scheduler thread; the store I/O runs on a :class:`~kvstrata.impl.storage.worker.StorageWorker`.

Backup. When a write-through (or a write_back staging copy) has put pages on L2, the cache calls
:meth:`L3Tier.enqueue_backup` with the nodes covering them. The op captures, *at that moment*, the
pages' hashes and host indices (a later split cannot change what it covers: I4) and pins every node
(``Node.backup_pins``: a pinned node's host pages are never evicted or reused: I5), then submits a
job at once. A result's pages that are in the store (stored, existed, or a non-writer's skip) are
done; the rest (store full, failures, not yet visible) form a retry op with back-off, and after
``StorageConfig.backup_retries`` retries they are abandoned and counted. Nodes are unpinned as soon
as none of their pages is pending any more.

Prefetch. :meth:`L3Tier.start_prefetch` mirrors ``CacheModel.prefetch`` except that the store query
is asynchronous: the op first *queries* (the worker hashes the continuation and asks ``exists``;
only the anchor is locked), and when the query's result is drained it reserves host pages for
exactly the hit count (evicting L2 leaves if needed; all of it or nothing, within the reservation
limit) and starts the *fetch*; when the fetch result is drained the leading pages that arrived
complete count as arrived (a partial page ends the op there: I2). The scheduler asks
:meth:`L3Tier.ready` (policy), then :meth:`L3Tier.commit` (arrived pages become host-only nodes under
the prefix, exactly as the model's ``_commit_pages``) or :meth:`L3Tier.abort`. An op committed or
aborted while a job is in flight keeps its reserved slots until that job's result is drained
(CANCELLING -> DONE), so the worker never writes into a slot the pool has handed out again.

Side pools (SPEC §5; model: the side-pool parts of the same ``CacheModel`` methods). With side
pools the tier drives a :class:`~kvstrata.impl.storage.hybrid.HybridStorage` over the cache's host
side buffers. A backup op writes its pages' ``ALL_PAGES`` objects with them (a page is done only
when all of its objects are) and the state at the end of the copied node (``BackupOp.states``:
the state's page hash and host state slot fixed at enqueue, its :class:`StateInfo` pinned by
``host_pins`` so the slot is neither dropped nor reused until the store confirms it; the model's
``state_info[page].host_pins``). A result unpins each state that is in the store and retries the
rest with the failed pages (the model's ``ack_backup`` / ``fail_backup``). A prefetch queries the
usable prefix, reserves exactly that many L2 pages and, with a ``TRAILING_PAGES`` pool, one L2
state slot (dropping the LRU unpinned L2 state if none is free; all of it or nothing); the fetch
reads KV and indexer objects, then the state of the deepest arrived page whose state is in the
store, and the pages after it do not count as arrived. Commit attaches that state host-only at the
end of the committed range if that node is valid on L2 and has no state (else frees the slot);
abort and drain release the state slot like the page slots (held while a read may write it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.config import StorageConfig
from kvstrata.impl.errors import MisuseError
from kvstrata.impl.fingerprint import FINGERPRINT_BYTES
from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.impl.storage.hybrid import HybridStorage
from kvstrata.impl.storage.worker import (
    BackupResult,
    FetchResult,
    QueryResult,
    StorageResult,
    StorageWorker,
)
from kvstrata.impl.transfer import Executor
from kvstrata.model.keys import Namespace
from kvstrata.model.lifecycles import (
    BACKUP_OP,
    HOST_CLAIMED,
    HOST_VALID,
    PREFETCH_OP,
    BackupEvent,
    BackupState,
    PrefetchEvent,
    PrefetchState,
    Residency,
    ResidencyEvent,
    StateEvent,
)
from kvstrata.model.prefetch import wait_over

if TYPE_CHECKING:
    from kvstrata.impl.radix_cache import HierarchicalRadixCache, Node, StateInfo

__all__ = ["BackupOp", "L3Counters", "L3Tier", "PageRef", "PrefetchOp"]

Pages = npt.NDArray[np.int64]
_HOST_CLAIMED_T = tuple(HOST_CLAIMED)
_HOST_VALID_T = tuple(HOST_VALID)
_DIGEST = 32


@attrs.define(eq=False)
class PageRef:
    """Which node holds one page of a backup op, and where in it (re-pointed by splits)."""

    node: Node
    offset: int


@attrs.define(eq=False)
class BackupOp:
    """Pages of L2 being written to L3. ``digests``/``host`` are fixed at enqueue; ``refs[i]`` names
    the node holding page ``i`` (splits re-point it). Every distinct node among ``refs`` carries
    one ``backup_pins`` for this op until none of its pages is pending here. ``states[i]`` (side
    pools) is the state at the end of the page named by ``state_digests[i]``, read from host state
    slot ``state_slots[i]`` (both fixed at enqueue); it carries one ``host_pins`` for this op until
    it is in the store or abandoned."""

    op_id: int
    namespace: Namespace
    digests: bytes
    host: Pages
    refs: list[PageRef]
    state: BackupState = BackupState.QUEUED
    attempts: int = 0
    retry_at: float = 0.0
    states: list[StateInfo] = attrs.field(factory=list)
    state_digests: bytes = b""
    state_slots: Pages = attrs.field(factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_pages(self) -> int:
        return len(self.host)

    def nodes(self) -> list[Node]:
        """The distinct nodes this op pins, in page order."""
        seen: dict[int, Node] = {}
        for ref in self.refs:
            seen.setdefault(id(ref.node), ref.node)
        return list(seen.values())


@attrs.define(eq=False)
class PrefetchOp:
    """One L3 -> L2 read for one request. ``state is None`` while the store is being queried."""

    op_id: int
    namespace: Namespace
    anchor: Node
    tokens: npt.NDArray[np.uint32]  # prefix + continuation, whole pages
    prefix_pages: int
    started: float
    state: PrefetchState | None = None
    anchor_locked: bool = True
    in_flight: bool = True  # a job whose result will write or name this op's slots
    cancelled: bool = False  # committed/aborted while querying: the result is dropped
    digests: bytes = b""
    host: Pages = attrs.field(factory=lambda: np.zeros(0, dtype=np.int64))
    arrived: int = 0
    released: int = 0  # host[released:] are still reserved by the op
    state_slot: int | None = None  # the L2 state slot reserved for the trailing state (side pools)
    state_read: bool = False  # the slot holds the state at the end of page ``arrived - 1``
    state_released: bool = False  # the slot was taken by commit or freed

    @property
    def reserved(self) -> int:
        return len(self.host) - self.released


@attrs.define
class L3Counters:
    """Plain counters (read by the metrics collector at scrape time; no locking on the hot path)."""

    backup_ops: int = 0
    backup_pages: dict[str, int] = attrs.field(factory=lambda: {s.value: 0 for s in PutStatus})
    backup_bytes: int = 0
    backup_retries: int = 0
    backup_abandoned_pages: int = 0
    prefetch_ops: int = 0
    prefetch_queried_pages: int = 0
    prefetch_hit_pages: int = 0
    prefetch_pages: dict[str, int] = attrs.field(factory=lambda: {s.value: 0 for s in GetStatus})
    prefetch_bytes: int = 0
    prefetch_committed_pages: int = 0
    prefetch_skipped: int = 0  # queries with a hit that could not reserve (limit, no room)


class L3Tier:
    """Backup and prefetch state of one cache (scheduler thread only)."""

    def __init__(
        self,
        cache: HierarchicalRadixCache,
        backend: StorageBackend | HybridStorage,
        config: StorageConfig,
        executor: Executor | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        page_nbytes: int = 0,
    ) -> None:
        self._cache = cache
        self.config = config
        self.hybrid = backend if isinstance(backend, HybridStorage) else None
        self._states = self.hybrid is not None and cache.has_states
        self.worker = StorageWorker(backend, executor)
        self._now = clock
        self._page_nbytes = page_nbytes
        self.backups: dict[int, BackupOp] = {}
        self.prefetches: dict[int, PrefetchOp] = {}
        self._retry: list[BackupOp] = []
        self.counters = L3Counters()
        self.last_applied: list[StorageResult] = []  # what the latest poll applied (for tests)

    # ------------------------------------------------------------------ backup
    def enqueue_backup(
        self, namespace: Namespace, nodes: list[Node], state_node: Node | None = None
    ) -> None:
        """Back up the pages of ``nodes`` (in order; each has a host copy and its hashes), in
        batches of at most ``backup_batch_pages`` pages (a long node is cut across batches), and
        (side pools) the L2 state at the end of ``state_node`` with the last batch."""
        refs = [PageRef(node, i) for node in nodes for i in range(node.num_pages)]
        digests = b"".join(node.hashes for node in nodes)
        hosts = [node.host for node in nodes if node.host is not None]
        host = np.concatenate(hosts) if hosts else np.zeros(0, dtype=np.int64)
        assert len(host) * _DIGEST == len(digests) == len(refs) * _DIGEST, "a page lacks a copy"
        info = None
        if state_node is not None and self._states:
            info = self._cache._state_info[state_node]
            assert info.host is not None and state_node.last_hash is not None
        if not refs and info is None:
            return
        limit = self.config.backup_batch_pages
        starts = list(range(0, len(refs), limit)) or [0]
        for start in starts:
            end = start + limit
            op = BackupOp(
                self._cache._new_op(),
                namespace,
                digests[start * _DIGEST : end * _DIGEST],
                host[start:end].copy(),
                refs[start:end],
            )
            if info is not None and start == starts[-1]:
                assert state_node is not None and state_node.last_hash is not None
                assert info.host is not None
                op.states = [info]
                op.state_digests = state_node.last_hash.digest
                op.state_slots = np.array([info.host], dtype=np.int64)
                info.host_pins += 1  # the host state slot is read until the store confirms
            for node in op.nodes():
                node.backup_pins += 1
            self.backups[op.op_id] = op
            self.counters.backup_ops += 1
            self._start_backup(op)

    def _start_backup(self, op: BackupOp) -> None:
        op.state = BACKUP_OP.next(op.state, BackupEvent.START)
        op.attempts += 1
        self.worker.backup(
            op.op_id,
            op.namespace,
            op.digests,
            op.host,
            state_digests=op.state_digests,
            state_slots=op.state_slots,
        )

    def on_split(self, node: Node, prefix: Node) -> None:
        """``node`` was split and ``prefix`` took its first pages: page references move to the
        prefix where they fall in it, and each op pins exactly the nodes it still covers."""
        cut = prefix.num_pages
        prefix.backup_pins = 0
        for op in self.backups.values():
            had = False
            for ref in op.refs:
                if ref.node is node:
                    had = True
                    if ref.offset < cut:
                        ref.node = prefix
                    else:
                        ref.offset -= cut
            if not had:
                continue
            covers = {id(ref.node) for ref in op.refs}
            if id(prefix) in covers:
                prefix.backup_pins += 1
            if id(node) not in covers:
                node.backup_pins -= 1

    def _apply_backup(self, result: BackupResult) -> None:
        """The model's ``ack_backup`` (every part in the store) or its retry: pages and states in
        the store are done (nodes with no page pending here and those states are unpinned); the
        rest is retried with back-off, or abandoned (and unpinned) after ``backup_retries``."""
        op = self.backups.get(result.op_id)
        if op is None:
            return
        failed = [not status.ok for status in result.statuses]
        states_failed = [not status.ok for status in result.states]
        if len(states_failed) != len(op.states):  # a result without its states: none is stored
            states_failed = [True] * len(op.states)
        counters = self.counters
        for status in result.statuses:
            counters.backup_pages[status.value] += 1
        counters.backup_bytes += self._page_nbytes * sum(
            status is PutStatus.STORED for status in result.statuses
        )
        retry_any = any(failed) or any(states_failed)
        event = BackupEvent.RETRY if retry_any else BackupEvent.ACK
        op.state = BACKUP_OP.next(op.state, event)
        del self.backups[op.op_id]
        abandon = retry_any and op.attempts > self.config.backup_retries
        pending = {id(ref.node) for ref, bad in zip(op.refs, failed, strict=True) if bad}
        for node in op.nodes():  # unpin every node with nothing left to retry here
            if abandon or id(node) not in pending:
                node.backup_pins -= 1
        for info, bad in zip(op.states, states_failed, strict=True):
            if abandon or not bad:  # in the store (or given up): the host state slot is free
                info.host_pins -= 1
        if not retry_any:
            return
        if abandon:
            counters.backup_abandoned_pages += sum(failed)
            return
        mask = np.asarray(failed, dtype=bool)
        digests = b"".join(
            op.digests[i * _DIGEST : (i + 1) * _DIGEST] for i in np.flatnonzero(mask)
        )
        state_mask = np.asarray(states_failed, dtype=bool)
        retry = BackupOp(
            op.op_id,
            op.namespace,
            digests,
            op.host[mask] if len(mask) else op.host,
            [ref for ref, bad in zip(op.refs, failed, strict=True) if bad],
            attempts=op.attempts,
            retry_at=self._now() + self.config.backoff(op.attempts),
            states=[info for info, bad in zip(op.states, states_failed, strict=True) if bad],
            state_digests=b"".join(
                op.state_digests[i * _DIGEST : (i + 1) * _DIGEST]
                for i in np.flatnonzero(state_mask)
            ),
            state_slots=op.state_slots[state_mask] if len(state_mask) else op.state_slots,
        )
        self.backups[retry.op_id] = retry
        self._retry.append(retry)
        counters.backup_retries += 1

    def _resubmit_due(self) -> None:
        if not self._retry:
            return
        now = self._now()
        due = [op for op in self._retry if op.retry_at <= now]
        self._retry = [op for op in self._retry if op.retry_at > now]
        for op in due:
            self._start_backup(op)

    # ------------------------------------------------------------------ prefetch
    def reserved(self) -> int:
        return sum(op.reserved for op in self.prefetches.values())

    def start_prefetch(
        self,
        tokens: npt.NDArray[np.uint32],
        namespace: Namespace,
        anchor: Node,
        prefix_pages: int,
        hasher: Callable[[], bytes],
    ) -> PrefetchOp:
        """Query the store for the continuation after ``prefix_pages`` (``anchor`` ends the prefix
        and is host-claimed or a root; the cache checked the threshold)."""
        cache = self._cache
        op = PrefetchOp(
            cache._new_op(), namespace, anchor, tokens, prefix_pages, started=self._now()
        )
        if anchor.is_root:
            op.anchor_locked = False
        else:
            cache._lock(anchor, +1)
        self.prefetches[op.op_id] = op
        self.counters.prefetch_ops += 1
        remaining = len(tokens) // cache.page_size - prefix_pages
        self.counters.prefetch_queried_pages += remaining
        self.worker.query(op.op_id, namespace, hasher, remaining)
        return op

    def _release_anchor(self, op: PrefetchOp) -> None:
        if op.anchor_locked:
            op.anchor_locked = False
            self._cache._lock(op.anchor, -1)

    def _apply_query(self, result: QueryResult) -> None:
        op = self.prefetches.get(result.op_id)
        if op is None:
            return
        op.in_flight = False
        if op.cancelled:
            del self.prefetches[op.op_id]
            return
        cache = self._cache
        host = cache._host
        assert host is not None
        hit = result.hit
        self.counters.prefetch_hit_pages += hit
        limit = int(host.num_pages * self.config.prefetch_reserve_fraction)
        if hit and self.reserved() + hit <= limit:
            if hit > host.free_count:
                cache._evict_host(hit - host.free_count)
            # the model's rules: pages first, then room for one L2 state slot (both with the
            # anchor locked); nothing is allocated unless both fit
            if hit <= host.free_count and (not self._states or cache._free_state_slot(host=True)):
                op.digests = result.digests[: hit * _DIGEST]
                op.host = np.asarray(host.alloc(hit), dtype=np.int64)
                if self._states:
                    op.state_slot = cache._alloc_state(host=True)
                op.state = PrefetchState.LOADING
                op.in_flight = True
                self.worker.fetch(
                    op.op_id, op.namespace, op.digests, op.host, state_slot=op.state_slot
                )
                return
        if hit:
            self.counters.prefetch_skipped += 1
        # nothing to read: the op is complete with no pages; the anchor is free again
        self._release_anchor(op)
        op.state = PrefetchState.COMPLETE

    def _apply_fetch(self, result: FetchResult) -> None:
        op = self.prefetches.get(result.op_id)
        if op is None:
            return
        op.in_flight = False
        arrived = 0
        for status in result.statuses:
            self.counters.prefetch_pages[status.value] += 1
            if status is not GetStatus.LOADED:
                break
            arrived += 1
        if op.state_slot is not None:  # usable only up to a state (the model's _read_state)
            arrived = min(arrived, result.usable or 0)
            op.state_read = arrived > 0
        self.counters.prefetch_bytes += arrived * self._page_nbytes
        if op.state is PrefetchState.CANCELLING:  # committed or aborted meanwhile: drain
            op.state = PREFETCH_OP.next(op.state, PrefetchEvent.DRAIN)
            self._settle(op)
            return
        op.arrived = arrived
        assert op.state is not None
        op.state = PREFETCH_OP.next(op.state, PrefetchEvent.COMPLETE)

    def op(self, op_id: object) -> PrefetchOp:
        found = self.prefetches.get(op_id) if isinstance(op_id, int) else None
        if found is None or found.cancelled:
            raise MisuseError(f"no prefetch op {op_id!r}")
        return found

    def ready(self, op_id: int) -> bool:
        """Whether the scheduler stops waiting for ``op_id`` now (its prefetch policy)."""
        op = self.op(op_id)
        pages = len(op.tokens) // self._cache.page_size - op.prefix_pages
        return wait_over(
            self.config.prefetch_policy,
            loading=op.state is None or op.state is PrefetchState.LOADING,
            waited=self._now() - op.started,
            limit=self.config.prefetch_timeout(pages * self._cache.page_size),
        )

    def commit(self, op_id: int) -> int:
        """Insert the pages that arrived as host-only nodes; returns how many the tree gained."""
        op = self.op(op_id)
        if op.state is None:  # still querying: nothing reserved, the result will be dropped
            op.cancelled = True
            self._release_anchor(op)
            return 0
        state = PREFETCH_OP.next(op.state, PrefetchEvent.COMMIT)
        self._release_anchor(op)
        added, end = self._commit_pages(op)
        if op.state_read and not op.state_released:
            self._commit_state(op, end)
        self.counters.prefetch_committed_pages += added
        op.released = op.arrived
        op.state = state
        self._settle(op)
        return added

    def abort(self, op_id: int) -> None:
        """The request went away: release everything the op reserved (in-flight slots on drain)."""
        op = self.op(op_id)
        if op.state is None:
            op.cancelled = True
            self._release_anchor(op)
            return
        state = PREFETCH_OP.next(op.state, PrefetchEvent.ABORT)
        self._release_anchor(op)
        host = self._cache._host
        assert host is not None
        if op.arrived:
            host.free(op.host[: op.arrived])
        op.released = op.arrived
        op.state = state
        self._settle(op)

    def _settle(self, op: PrefetchOp) -> None:
        if op.state is PrefetchState.DONE:
            host = self._cache._host
            assert host is not None
            if op.released < len(op.host):
                host.free(op.host[op.released :])
            op.released = len(op.host)
            if op.state_slot is not None and not op.state_released:
                self._cache._free_state(op.state_slot, host=True)
                op.state_released = True
            del self.prefetches[op.op_id]

    def _commit_state(self, op: PrefetchOp, end: Node | None) -> None:
        """The model's ``_commit_state``: the state read by ``op`` becomes the L2 state at the end
        of its last arrived page if that page ends node ``end`` of the tree, valid on L2 and
        without a state; else its slot is freed."""
        cache = self._cache
        slot = op.state_slot
        assert slot is not None
        if end is not None and end.state in _HOST_VALID_T and end not in cache._state_info:
            info = cache._new_state_info(end, host=slot)
            cache._advance_state(end, info, StateEvent.COMMIT_PREFETCH)
        else:
            cache._free_state(slot, host=True)
        op.state_released = True

    def _commit_pages(self, op: PrefetchOp) -> tuple[int, Node | None]:
        """The model's ``_commit_pages``: pages the tree already has give their slot back; the
        rest become one host-only leaf if its parent is host-claimed (I3), else are given back.
        Returns the pages added and the node the arrived range ends at (``None``: not in the
        tree, or nothing arrived)."""
        cache = self._cache
        host = cache._host
        assert host is not None
        arrived = op.arrived
        size = cache.page_size
        tokens = op.tokens[: (op.prefix_pages + arrived) * size]
        root, path, matched, fps = cache._walk_split(tokens, op.namespace)
        last = path[-1] if path else root
        have = max(0, min(arrived, matched - op.prefix_pages))
        spare = [op.host[:have]]
        added = 0
        end: Node | None = last if arrived and have == arrived and not last.is_root else None
        if have < arrived and (last.is_root or last.state in _HOST_CLAIMED_T):
            start = op.prefix_pages + have
            leaf = cache._add_leaf(
                last,
                fps[start * FINGERPRINT_BYTES :],
                op.digests[have * _DIGEST : arrived * _DIGEST],
                Residency.NEW,
            )
            leaf.host = op.host[have:arrived].copy()
            cache._advance(leaf, ResidencyEvent.COMMIT_PREFETCH)
            added = arrived - have
            end = leaf
        else:
            spare.append(op.host[have:arrived])
        freed = np.concatenate(spare)
        if len(freed):
            host.free(freed)
        return added, end

    # ------------------------------------------------------------------ results
    def poll(self) -> list[StorageResult]:
        """Apply every storage result that finished (scheduler thread), then resubmit due retries."""
        results = self.worker.results()
        self.last_applied = results
        for result in results:
            if isinstance(result, BackupResult):
                self._apply_backup(result)
            elif isinstance(result, QueryResult):
                self._apply_query(result)
            else:
                self._apply_fetch(result)
        self._resubmit_due()
        return results

    def pending(self) -> dict[str, int]:
        return {"backup": len(self.backups), "prefetch": len(self.prefetches)}

    def idle(self) -> bool:
        return not self.backups and not self.prefetches

    def close(self) -> None:
        self.worker.close()

    def describe(self) -> dict[str, Any]:
        return attrs.asdict(self.counters)
