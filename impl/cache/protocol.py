"""The scheduler's contract with the cache, on one screen (SPEC §1, §3; docs/scheduler.md).

A scheduler thread (one per tensor-parallel rank) calls these verbs and nothing else; it never reads
a queue or a node's fields beyond the results below. Every verb is single-threaded, validates its
input before it changes anything (:class:`~kvstrata.impl.errors.MisuseError` and subclasses, nothing
changed) and never raises for a store failure (L3 degrades to a smaller cache). Background copies
and store I/O reach the tree only inside :meth:`SchedulerCache.check_events`.
``mypy`` checks that :class:`~kvstrata.impl.cache.api.HierarchicalRadixCache` satisfies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvstrata.impl.cache.node import CacheEvent, InsertResult, MatchResult, Node, Pages, PendingWork
from kvstrata.model.keys import Namespace

__all__ = ["MUTATING", "SchedulerCache", "Tokens"]

MUTATING = (
    "attach_l3", "match_prefix", "alloc_device", "free_device", "insert", "lock", "unlock",
    "evict", "evict_host", "load_back", "alloc_device_state", "free_device_state", "evict_state",
    "check_events", "prefetch", "prefetch_ready", "prefetch_commit", "prefetch_abort", "reset",
)  # fmt: skip
"""The verbs that change the cache: only its owner thread calls them, only while it is open
(:mod:`kvstrata.impl.guard`). Queries (``pending``, ``idle``, ``nodes``, ...) and ``close`` are free."""

Tokens = Sequence[int] | npt.NDArray[np.integer]
ExtraKey = str | Namespace | None


class SchedulerCache(Protocol):
    @property
    def page_size(self) -> int:
        """Tokens per page; only whole pages are matched, cached and moved."""

    @property
    def has_l3(self) -> bool:
        """Whether an L3 store is attached (``prefetch`` may then return an op)."""

    def check_events(self) -> list[CacheEvent]:
        """Apply every finished copy and store result, in order; the L1/L2 copy events."""

    def match_prefix(self, tokens: Tokens, extra_key: ExtraKey = None) -> MatchResult:
        """The cached prefix: L1 pages, the L2-only continuation; splits, touches LRU."""

    def prefetch(self, tokens: Tokens, extra_key: ExtraKey = None) -> int | None:
        """Start reading from L3 what follows the local match; ``None`` if not applicable."""

    def prefetch_ready(self, op_id: int) -> bool:
        """Whether to stop waiting for prefetch ``op_id`` now (its policy, bounded)."""

    def prefetch_commit(self, op_id: int) -> int:
        """Arrived pages become host-only nodes; the pages the tree gained."""

    def prefetch_abort(self, op_id: int) -> None:
        """Release everything prefetch ``op_id`` reserved."""

    def load_back(self, node: Node) -> int | None:
        """Copy the host-only chain ending at ``node`` to L1, all or nothing; ``None``: declined."""

    def lock(self, node: Node) -> None:
        """Path-lock ``node``: nothing on its path is evicted until :meth:`unlock`."""

    def unlock(self, node: Node) -> None:
        """Drop one lock taken with :meth:`lock` (MisuseError if none is held)."""

    def alloc_device(self, pages: int) -> Pages:
        """Fresh L1 pages (evicting unlocked leaves); CapacityError, nothing changed, if short."""

    def free_device(self, pages: Sequence[int] | Pages) -> None:
        """Give back pages from :meth:`alloc_device` that were not inserted."""

    def insert(
        self,
        tokens: Tokens,
        device_indices: Sequence[int] | Pages,
        extra_key: ExtraKey = None,
        state_slot: int | None = None,
    ) -> InsertResult:
        """Cache the KV of ``tokens``; the cache owns every page (and state slot) given."""

    def evict(self, pages: int) -> int:
        """Free at least ``pages`` L1 pages if possible; the pages freed."""

    def evict_host(self, pages: int) -> int:
        """Free at least ``pages`` L2 pages if possible; the pages freed."""

    def alloc_device_state(self) -> int:
        """A fresh L1 state slot (TRAILING_PAGES side pools); CapacityError if none."""

    def free_device_state(self, slot: int) -> None:
        """Give back a state slot that was not inserted."""

    def evict_state(self, node: Node, *, host: bool = False) -> None:
        """Drop the idle L1 (or L2) state at ``node``'s end without touching its KV."""

    def pending(self) -> PendingWork:
        """Background work not applied yet, per kind (copies, backups, prefetches)."""

    def idle(self) -> bool:
        """Whether nothing is pending: every copy, backup and prefetch has been applied (backups
        deferred while the store is down excepted; under TP, from agreed facts only)."""

    def reset(self) -> None:
        """Drop every cached page (``MisuseError`` unless idle and unlocked; nothing changed)."""

    def close(self) -> None:
        """Finish queued work, stop the workers, close the store."""
