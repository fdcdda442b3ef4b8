"""The reference scheduler integration: how an inference engine's scheduler drives kvstrata for one
request (SPEC §1, §3). docs/scheduler.md walks through :meth:`ReferenceScheduler.serve` step by step.

Per request, on the scheduler thread:

1. ``check_events()`` — apply finished copies and store results (the only place background work
   changes the tree);
2. ``match_prefix(tokens)`` — the L1 prefix (device pages, usable as they are) and the L2-only
   continuation after it;
3. if the local match does not cover the request and an L3 is attached: ``prefetch(tokens)`` asks L3
   for what follows (the cache decides whether it applies: the match must end at a host-backed node and
   leave at least ``prefetch_threshold`` tokens); the scheduler waits as its prefetch policy says
   (``prefetch_ready``, draining events meanwhile), then ``prefetch_commit`` turns the pages that
   arrived into host-only nodes, extending the L2 continuation;
4. ``load_back(host_node)`` copies the whole L2 continuation to L1 (all or nothing; it may decline),
   and the scheduler waits for that copy's event before using the pages;
5. ``match_prefix`` again gives the device pages of everything now on L1, and ``lock`` keeps them
   from eviction while the request runs;
6. ``alloc_device`` takes L1 pages for the rest (evicting unlocked leaves; a :class:`CapacityError`
   after the pending copies drained means the request cannot be admitted now: *refused*);
7. the model computes the KV of the new pages into them (here: :class:`~.kv.KVSynth` writes it);
8. ``insert(tokens, cached + new pages)`` hands every page to the cache (write-through to L2 and the
   backup to L3 follow in the background), and ``unlock`` ends the request.

Hit accounting (tokens the request did not have to compute): L1 = the first match's device pages; L3 =
the pages this request's prefetch committed, once loaded to L1 (they are the tail of the L2
continuation); L2 = the rest of what was loaded. A load-back that was declined or failed serves nothing
from L2/L3: those pages are recomputed. A refused request is served nothing.

Settling. Copies and store I/O overlap the next requests, as in an engine, so a slow store or a
starved copy thread can cost hits (a node whose write-through is unacked cannot be evicted to make room;
a host page whose backup is pending cannot be reused). With ``settle`` the scheduler waits after each
request until its background work finished: the hit ratios then depend on the trace and the capacities
only, not on machine speed (the tests use it).

Invariants checked here: every page served (L1 hits and loaded pages alike) holds exactly the KV of its
tokens when ``verify`` is on (:class:`~.errors.VerifyError` otherwise), and every wait for background
work is bounded (:class:`~.errors.ReplayStalled`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.cache import HierarchicalRadixCache, MatchResult
from kvstrata.impl.errors import CapacityError
from kvstrata.impl.pools import KVPool
from kvstrata.impl.replay.background import Progress
from kvstrata.impl.replay.errors import ReplayStalled, VerifyError
from kvstrata.impl.replay.kv import KVSynth
from kvstrata.impl.transfer import Direction

__all__ = ["ReferenceScheduler", "Served"]

T = TypeVar("T")
_POLL_S = 0.01  # longest sleep between checks while waiting (the timeout policy reads the clock)
_now_ns = time.perf_counter_ns


@attrs.define(slots=True)
class Served:
    """What one request got. Invariant: ``l1_pages + l2_pages + l3_pages <= pages``; all three are 0
    for a refused request."""

    pages: int
    l1_pages: int = 0
    l2_pages: int = 0
    l3_pages: int = 0
    refused: bool = False
    scheduler_ns: int = 0  # in the cache's calls (the scheduler-path cost)
    wait_ns: int = 0  # blocked on background work (prefetch, load-back)
    l3_wait_ns: int = 0  # the part of it spent waiting for an L3 prefetch
    kv_ns: int = 0  # hashing, writing and verifying synthetic KV (the model's share)

    @property
    def hit_pages(self) -> int:
        return self.l1_pages + self.l2_pages + self.l3_pages


class ReferenceScheduler:
    """Serves requests one after another against ``cache`` (see the module docstring).

    ``progress`` must be bumped by the cache's copy and storage executors (``background``), so waits
    sleep until something finished instead of spinning."""

    def __init__(
        self,
        cache: HierarchicalRadixCache,
        device_pool: KVPool,
        kv: KVSynth,
        progress: Progress,
        *,
        verify: bool = True,
        settle: bool = False,
        wait_limit_s: float = 300.0,
    ) -> None:
        self.cache = cache
        self.device_pool = device_pool
        self.kv = kv
        self.progress = progress
        self.verify = verify
        self.settle = settle
        self.wait_limit_s = wait_limit_s
        self.pages_verified = 0
        self._loads: dict[int, bool] = {}  # finished load-back op id -> ok
        self._served: Served = Served(0)
        self._request = 0

    # ------------------------------------------------------------------ plumbing
    def _call(self, call: Callable[[], T]) -> T:
        """Run one cache call, counting its time as scheduler path."""
        start = _now_ns()
        try:
            return call()
        finally:
            self._served.scheduler_ns += _now_ns() - start

    def check_events(self, *, timed: bool = True) -> None:
        """Drain finished background work into the tree (and note which load-backs finished);
        ``timed`` counts the call as scheduler path (the calls made while waiting count as
        waiting)."""
        events = self._call(self.cache.check_events) if timed else self.cache.check_events()
        for event in events:
            if event.direction is Direction.LOAD:
                for op_id in event.op_ids:
                    self._loads[op_id] = event.ok

    def _wait(self, done: Callable[[], bool], what: str) -> int:
        """Drain events until ``done()``; sleep meanwhile until a background job finishes. The
        nanoseconds waited."""
        start = _now_ns()  # everything until done, the draining included, is waiting
        deadline = time.monotonic() + self.wait_limit_s
        while True:
            seen = self.progress.done
            self.check_events(timed=False)
            if done():
                break
            if time.monotonic() > deadline:
                raise ReplayStalled(
                    f"request {self._request}: {what} did not finish within {self.wait_limit_s:g} s"
                )
            self.progress.wait(seen, _POLL_S)
        waited = _now_ns() - start
        self._served.wait_ns += waited
        return waited

    def idle_until(self, deadline: float) -> None:
        """Keep draining events until ``time.monotonic()`` reaches ``deadline`` (between requests
        when timestamps are honoured)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            seen = self.progress.done
            self.progress.wait(seen, left)
            self.cache.check_events()

    def _copies_done(self) -> bool:
        pending = self.cache.pending()
        return not pending.write and not pending.load

    def _idle(self) -> bool:
        return self.cache.idle()

    def drain(self) -> Served:
        """Wait until no copy, backup or prefetch is pending (bounded); the time it took."""
        self._served = Served(0)
        self._wait(self._idle, "draining background work")
        return self._served

    # ------------------------------------------------------------------ one request
    def serve(self, tokens: npt.NDArray[np.uint32], request: int = 0) -> Served:
        """Run one request through the cache (steps 1-8 of the module docstring); with ``settle``,
        then wait until every copy and backup it caused has finished."""
        served = self._serve(tokens, request)
        if self.settle:
            self._wait(self._idle, "settling background work")
        return served

    def _serve(self, tokens: npt.NDArray[np.uint32], request: int) -> Served:
        cache = self.cache
        total = len(tokens) // cache.page_size
        served = self._served = Served(total)
        self._request = request
        self.check_events()  # 1
        if total == 0:
            return served
        start = _now_ns()
        hashes = self.kv.page_hashes(tokens)
        served.kv_ns += _now_ns() - start

        first = self._call(lambda: cache.match_prefix(tokens))  # 2
        committed = 0
        if first.device_pages + first.host_pages < total and cache.has_l3:  # 3
            committed = self._prefetch(tokens)
        match = self._call(lambda: cache.match_prefix(tokens)) if committed else first
        if match.host_pages:  # 4
            match = self._load_back(tokens, match)
        loaded = match.device_pages - first.device_pages

        node = match.device_node  # 5
        locked = match.device_pages > 0
        if locked:
            self._call(lambda: cache.lock(node))
        try:
            self._check_served(match, hashes, first.device_pages)
            fresh = self._alloc(total - match.device_pages)  # 6
            if fresh is None:
                served.refused = True
                return served
            start = _now_ns()  # 7
            self.kv.write(self.device_pool, fresh, hashes[match.device_pages :])
            served.kv_ns += _now_ns() - start
            pages = np.concatenate([match.device_indices, fresh])
            self._call(lambda: cache.insert(tokens, pages))  # 8
        finally:
            if locked:
                self._call(lambda: cache.unlock(node))
        served.l1_pages = first.device_pages
        served.l3_pages = min(committed, loaded)
        served.l2_pages = loaded - served.l3_pages
        return served

    def _prefetch(self, tokens: npt.NDArray[np.uint32]) -> int:
        """Step 3: L3 -> L2 for the continuation; the pages the tree gained."""
        cache = self.cache
        started = self._call(lambda: cache.prefetch(tokens))
        if started is None:
            return 0
        op: int = started
        self._served.l3_wait_ns += self._wait(lambda: cache.prefetch_ready(op), "an L3 prefetch")
        return self._call(lambda: cache.prefetch_commit(op))

    def _load_back(self, tokens: npt.NDArray[np.uint32], match: MatchResult) -> MatchResult:
        """Step 4: copy the L2 continuation to L1 and wait for it; the match afterwards. A load-back
        declined while copies are pending is tried once more after they drained (pages being
        written through are pinned on L1 until acked), so the outcome does not depend on how fast
        the copy thread happened to be."""
        cache = self.cache
        started = self._call(lambda: cache.load_back(match.host_node))
        if started is None and not self._copies_done():
            self._wait(self._copies_done, "pending L1 copies")
            match = self._call(lambda: cache.match_prefix(tokens))
            if not match.host_pages:
                return match
            host_node = match.host_node
            started = self._call(lambda: cache.load_back(host_node))
        if started is None:
            return match
        op: int = started
        self._wait(lambda: op in self._loads, "an L2 -> L1 load-back")
        del self._loads[op]
        return self._call(lambda: cache.match_prefix(tokens))

    def _alloc(self, pages: int) -> npt.NDArray[np.int64] | None:
        """Step 6: fresh L1 pages; after a CapacityError, once more when pending copies drained (they
        pin L1 pages), else None (refused)."""
        cache = self.cache
        try:
            return self._call(lambda: cache.alloc_device(pages))
        except CapacityError:
            pass
        if not self._copies_done():
            self._wait(self._copies_done, "pending L1 copies")
            try:
                return self._call(lambda: cache.alloc_device(pages))
            except CapacityError:
                pass
        return None

    def _check_served(self, match: MatchResult, hashes: list[bytes], l1_pages: int) -> None:
        """Every served page holds the KV of its tokens (when verifying)."""
        if not self.verify or not match.device_pages:
            return
        start = _now_ns()
        count = match.device_pages
        bad = self.kv.first_mismatch(self.device_pool, match.device_indices, hashes[:count])
        self._served.kv_ns += _now_ns() - start
        if bad is not None:
            source = "an L1 hit" if bad < l1_pages else "loaded from L2/L3"
            raise VerifyError(
                f"request {self._request}: page {bad} of {count} served ({source}, L1 page "
                f"{int(match.device_indices[bad])}) holds KV bytes that differ from its tokens' KV"
            )
        self.pages_verified += count
