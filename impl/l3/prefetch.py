"""L3 -> L2 prefetch (SPEC §3, §5; model: ``kvstrata.model.l3.prefetch``).

:meth:`Prefetches.start` mirrors the model's ``prefetch`` except that the store query is
asynchronous: the op first *queries* (the worker hashes the continuation and asks ``exists``; only
the anchor is locked), and when the query's result is drained it reserves host pages for exactly the
hit count (evicting L2 leaves if needed; all of it or nothing, within the reservation limit) and
starts the *fetch*; when the fetch result is drained the leading pages that arrived complete count as
arrived (a partial page ends the op there: I2). The scheduler asks :meth:`Prefetches.ready` (the
model's ``wait_over``), then :meth:`Prefetches.commit` (arrived pages join the tree through the port)
or :meth:`Prefetches.abort`. An op committed or aborted while a job is in flight keeps its reserved
slots until that job's result is drained (CANCELLING -> DONE), so the worker never writes into a
slot the pool has handed out again (no stale offsets: I5, I7).

Side pools: a prefetch queries the usable prefix, reserves exactly that many L2 pages and, with a
``TRAILING_PAGES`` pool, one L2 state slot (all of it or nothing); the fetch reads KV and indexer
objects, then the state of the deepest arrived page whose state is in the store, and the pages after
it do not count as arrived. Commit attaches that state host-only at the end of the committed range if
that node is valid on L2 and has no state (else frees the slot); abort and drain release the state
slot like the page slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.l3.context import L3Context
from kvstrata.impl.l3.port import Pages
from kvstrata.impl.storage.base import GetStatus
from kvstrata.impl.storage.worker import FetchResult, QueryResult
from kvstrata.model.keys import Namespace
from kvstrata.model.l3.policy import wait_over
from kvstrata.model.lifecycles import PREFETCH_OP, PrefetchEvent, PrefetchState

if TYPE_CHECKING:
    from kvstrata.impl.cache.node import Node

__all__ = ["PrefetchOp", "Prefetches"]

_DIGEST = 32


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
    overdue: bool = False  # TP: some rank's clock says the wait is over (agreed)

    @property
    def reserved(self) -> int:
        return len(self.host) - self.released


class Prefetches:
    """Every prefetch op of one cache, keyed by op id, until it is committed or aborted and its
    last job drained."""

    def __init__(self, context: L3Context) -> None:
        self._tree, self._worker, self.config = context.tree, context.worker, context.config
        self._counters, self._states = context.counters, context.states
        self._now, self._page_nbytes = context.now, context.page_nbytes
        self.ops: dict[int, PrefetchOp] = {}
        #: TP (``kvstrata.model.tp``): where a job the worker refused leaves its empty result, so
        #: the op goes on like every other rank's and the agreed minimum decides
        self.hold: Callable[[QueryResult | FetchResult], None] | None = None

    def reserved(self) -> int:
        """Host pages currently reserved by prefetches (arrived or in flight, not committed)."""
        return sum(op.reserved for op in self.ops.values())

    def request(self, query: npt.NDArray[np.uint32], namespace: Namespace) -> int | None:
        """Start a prefetch of what follows the local match of ``query``: an op id, or ``None``
        when the match does not end where L3 pages may join or fewer than ``prefetch_threshold``
        tokens of whole pages follow it (SPEC §3)."""
        size = self._tree.page_size
        total = len(query) // size
        found = self._tree.continuation(query, namespace)
        if found is None:
            return None
        anchor, matched = found
        remaining = total - matched
        if remaining == 0 or remaining * size < self.config.prefetch_threshold:
            return None
        whole = query[: total * size].copy()
        hasher = self._tree.chain_after(anchor, whole, matched, namespace)
        op = self.start(whole, namespace, anchor, matched, hasher)
        return None if op is None else op.op_id

    def start(
        self,
        tokens: npt.NDArray[np.uint32],
        namespace: Namespace,
        anchor: Node,
        prefix_pages: int,
        hasher: Callable[[], bytes],
    ) -> PrefetchOp | None:
        """Query the store for the continuation after ``prefix_pages`` (``anchor`` ends the prefix
        and is host-claimed or a root; the cache checked the threshold). ``None`` at once, nothing
        locked or reserved, when the store is down."""
        tree = self._tree
        op = PrefetchOp(tree.new_op(), namespace, anchor, tokens, prefix_pages, started=self._now())
        remaining = len(tokens) // tree.page_size - prefix_pages
        if not self._worker.query(op.op_id, namespace, hasher, remaining):
            self._counters.prefetch_unserved += 1
            if self.hold is None:
                return None
            self.hold(QueryResult(op.op_id, b"", 0))  # this rank hits nothing: the minimum is 0
        if anchor.is_root:
            op.anchor_locked = False
        else:
            tree.lock(anchor, +1)
        self.ops[op.op_id] = op
        self._counters.prefetch_ops += 1
        self._counters.prefetch_queried_pages += remaining
        return op

    def _release_anchor(self, op: PrefetchOp) -> None:
        if op.anchor_locked:
            op.anchor_locked = False
            self._tree.lock(op.anchor, -1)

    def apply_query(self, result: QueryResult, agreed: int | None = None) -> None:
        """Reserve and fetch what the query found (``agreed``, TP: the ranks' minimum hit)."""
        op = self.ops.get(result.op_id)
        if op is None:
            return
        op.in_flight = False
        if op.cancelled:
            del self.ops[op.op_id]
            return
        hit = result.hit if agreed is None else agreed
        self._counters.prefetch_hit_pages += hit
        limit = int(self._tree.host_capacity * self.config.prefetch_reserve_fraction)
        if hit and self.reserved() + hit <= limit:
            reserved = self._tree.reserve_host(hit, state=self._states)
            if reserved is not None:
                digests = result.digests[: hit * _DIGEST]
                host, slot = reserved
                if self._worker.fetch(op.op_id, op.namespace, digests, host, state_slot=slot):
                    op.digests, op.host, op.state_slot = digests, host, slot
                    op.state = PrefetchState.LOADING
                    op.in_flight = True
                    return
                if self.hold is not None:  # TP: reserved like every rank; this one reads nothing
                    op.digests, op.host, op.state_slot = digests, host, slot
                    op.state = PrefetchState.LOADING
                    op.in_flight = True
                    self._counters.prefetch_unserved += 1
                    self.hold(FetchResult(op.op_id, (), None if slot is None else 0))
                    return
                self._tree.free_host(host)  # the store went down meanwhile: nothing to read
                if slot is not None:
                    self._tree.free_host_state(slot)
                self._counters.prefetch_unserved += 1
                hit = 0
        if hit:
            self._counters.prefetch_skipped += 1
        # nothing to read: the op is complete with no pages; the anchor is free again
        self._release_anchor(op)
        op.state = PrefetchState.COMPLETE

    @staticmethod
    def delivered(op: PrefetchOp, result: FetchResult) -> int:
        """Leading pages ``result`` delivered complete; with a state slot, usable only up to a
        state (the model's ``_read_state``)."""
        arrived = 0
        for status in result.statuses:
            if status is not GetStatus.LOADED:
                break
            arrived += 1
        return arrived if op.state_slot is None else min(arrived, result.usable or 0)

    def apply_fetch(
        self, result: FetchResult, agreed: int | None = None, state_agreed: bool = True
    ) -> None:
        """The pages that arrived (``agreed``, TP: the ranks' minimum; their state only if
        ``state_agreed``: every rank read the same page's state)."""
        op = self.ops.get(result.op_id)
        if op is None:
            return
        op.in_flight = False
        for status in result.statuses:
            self._counters.prefetch_pages[status.value] += 1
            if status is not GetStatus.LOADED:
                break
        arrived = self.delivered(op, result) if agreed is None else agreed
        if op.state_slot is not None:
            op.state_read = arrived > 0 and state_agreed
        self._counters.prefetch_bytes += arrived * self._page_nbytes
        if op.state is PrefetchState.CANCELLING:  # committed or aborted meanwhile: drain
            op.state = PREFETCH_OP.next(op.state, PrefetchEvent.DRAIN)
            self._settle(op)
            return
        op.arrived = arrived
        assert op.state is not None
        op.state = PREFETCH_OP.next(op.state, PrefetchEvent.COMPLETE)

    def op(self, op_id: object) -> PrefetchOp:
        """Op ``op_id`` as the scheduler names it; ``MisuseError`` for an unknown id and for an op
        it already committed or aborted (during the query, or ``CANCELLING`` until the drain)."""
        found = self.ops.get(op_id) if isinstance(op_id, int) else None
        if found is None or found.cancelled or found.state is PrefetchState.CANCELLING:
            raise MisuseError(f"no prefetch op {op_id!r}")
        return found

    def ready(self, op_id: int) -> bool:
        """Whether the scheduler stops waiting for ``op_id`` now (its prefetch policy)."""
        op = self.op(op_id)
        loading = op.state is None or op.state is PrefetchState.LOADING
        if self.hold is not None:  # TP: the clock's part was agreed at the last check_events
            loading = loading and not op.overdue
            return wait_over(self.config.prefetch_policy, loading=loading, waited=0.0, limit=1.0)
        return self.overdue(op, loading=loading)

    def overdue(self, op: PrefetchOp, *, loading: bool = True) -> bool:
        """Whether this rank's clock ends the wait for ``op`` (``loading``: even if it still
        reads)."""
        size = self._tree.page_size
        pages = len(op.tokens) // size - op.prefix_pages
        return wait_over(
            self.config.prefetch_policy,
            loading=loading,
            waited=self._now() - op.started,
            limit=self.config.prefetch_timeout(pages * size),
            deadline=self.config.prefetch_deadline_s,
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
        self._counters.prefetch_committed_pages += added
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
        if op.arrived:
            self._tree.free_host(op.host[: op.arrived])
        op.released = op.arrived
        op.state = state
        self._settle(op)

    def _settle(self, op: PrefetchOp) -> None:
        if op.state is PrefetchState.DONE:
            if op.released < len(op.host):
                self._tree.free_host(op.host[op.released :])
            op.released = len(op.host)
            if op.state_slot is not None and not op.state_released:
                self._tree.free_host_state(op.state_slot)
                op.state_released = True
            del self.ops[op.op_id]

    def _commit_state(self, op: PrefetchOp, end: Node | None) -> None:
        """The model's ``_commit_state``: the state read by ``op`` becomes the L2 state at the end
        of its last arrived page if that page ends node ``end`` of the tree, valid on L2 and
        without a state; else its slot is freed (the port decides, with the table's guard)."""
        slot = op.state_slot
        assert slot is not None
        self._tree.commit_state(end, slot)
        op.state_released = True

    def _commit_pages(self, op: PrefetchOp) -> tuple[int, Node | None]:
        """The arrived pages join the tree through the port (the model's ``_commit_pages``)."""
        size = self._tree.page_size
        end = (op.prefix_pages + op.arrived) * size
        return self._tree.commit_pages(
            op.tokens[:end], op.namespace, op.prefix_pages, op.host[: op.arrived], op.digests
        )
