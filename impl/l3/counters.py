"""The L3 tier's counters: plain ints and dicts bumped on the scheduler thread, read by the metrics
collector at scrape time (no locking on the hot path)."""

from __future__ import annotations

import attrs

from kvstrata.impl.storage.base import GetStatus, PutStatus

__all__ = ["L3Counters"]


@attrs.define
class L3Counters:
    """Plain counters (read by the metrics collector at scrape time; no locking on the hot path)."""

    backup_ops: int = 0
    backup_pages: dict[str, int] = attrs.field(factory=lambda: {s.value: 0 for s in PutStatus})
    backup_bytes: int = 0
    backup_retries: int = 0
    backup_abandoned_pages: int = 0
    backup_dropped_pages: int = 0  # deferred while the store was down, dropped to stay bounded
    republished_pages: int = 0  # backed up again after the store came back empty
    prefetch_ops: int = 0
    prefetch_queried_pages: int = 0
    prefetch_hit_pages: int = 0
    prefetch_pages: dict[str, int] = attrs.field(factory=lambda: {s.value: 0 for s in GetStatus})
    prefetch_bytes: int = 0
    prefetch_committed_pages: int = 0
    prefetch_skipped: int = 0  # queries with a hit that could not reserve (limit, no room)
    prefetch_unserved: int = 0  # prefetches answered "nothing" at once: the store was down
