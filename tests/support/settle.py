"""Running a cache's real worker threads to a condition by events, not by a wall clock (issue 19,
item 5).

A step waits until every worker thread (the copy executor, the store link's lanes) has finished what
it was given (``ThreadExecutor.wait_drained``: a condition variable, not a poll), then applies what
finished (``check_events``). :func:`settle_until` repeats steps until a condition holds. When it does
not hold, no worker has anything left to do and nothing is scheduled for later (a backup retry's
back-off, a probe of a down store), nothing can ever make it hold: that is reported at once, as a
bug, never after a deadline. A scheduled retry or probe is waited for until its own due time.

The only timeout left is :data:`HANG_GUARD_S` on a single job: a store call that never returns
(a hang, which is a different report than a lost event).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.transfer import ThreadExecutor

HANG_GUARD_S = 300.0


def workers(cache: HierarchicalRadixCache) -> list[ThreadExecutor]:
    """The cache's worker threads (copies and the store link's lanes), each once."""
    found: list[ThreadExecutor] = []
    if cache.transfer is not None and isinstance(cache.transfer.executor, ThreadExecutor):
        found.append(cache.transfer.executor)
    if cache.l3 is not None:
        lanes = cache.l3.link.lanes
        for executor in lanes.executors():
            if isinstance(executor, ThreadExecutor) and executor not in found:
                found.append(executor)
    return found


def next_due(cache: HierarchicalRadixCache) -> float | None:
    """The earliest time something is scheduled for (a backup retry, a probe), if any."""
    l3 = cache.l3
    if l3 is None:
        return None
    times = [t for t in (l3.backup.next_retry_at(), l3.link.probe_at) if t is not None]
    return min(times, default=None)


def settle_until(
    cache: HierarchicalRadixCache, done: Callable[[], bool], what: str = "the cache to go idle"
) -> None:
    """Step ``cache``'s workers until ``done()``; a state no event can change is an error at once."""
    threads = workers(cache)
    while True:
        for executor in threads:
            assert executor.wait_drained(HANG_GUARD_S), f"a background job hung waiting for {what}"
        cache.check_events()
        if done():
            return
        if any(executor.busy for executor in threads):
            continue  # what was just applied started more work
        due = next_due(cache)
        assert due is not None, (
            f"nothing left to run or scheduled, yet not {what}: {cache.pending()}"
        )
        time.sleep(max(0.0, due - time.monotonic()))


def settle(cache: HierarchicalRadixCache) -> None:
    """Every copy, backup and prefetch applied (``cache.idle()``), by events."""
    settle_until(cache, cache.idle)
