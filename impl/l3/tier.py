"""The cache's L3 side: :class:`Backups` (L2 -> L3) and :class:`Prefetches` (L3 -> L2) over one
:class:`~kvstrata.impl.storage.worker.StorageWorker` (SPEC §3, §4, §9).

Owned by one cache and run on its scheduler thread; the store I/O runs on the worker. It reaches the
tree only through a :class:`~kvstrata.impl.l3.port.TreePort`. :meth:`L3Tier.poll` is the one place
where store results change anything (the cache's ``check_events`` calls it): it also runs the store
link's judgements (deadlines, health, probes; :mod:`kvstrata.impl.storage.link`) and, when the
store comes back, resumes deferred backups and, after an outage that reached ``DOWN`` or one that
emptied the store, re-publishes L2 (exists-then-put: only what the store lost is written).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from kvstrata.impl.config import StorageConfig
from kvstrata.impl.l3.agreed import L3Reports, Layout
from kvstrata.impl.l3.backup import BackupOp, Backups
from kvstrata.impl.l3.context import L3Context
from kvstrata.impl.l3.counters import L3Counters
from kvstrata.impl.l3.port import TreePort
from kvstrata.impl.l3.prefetch import Prefetches, PrefetchOp
from kvstrata.impl.storage.base import StorageBackend
from kvstrata.impl.storage.hybrid import HybridStorage
from kvstrata.impl.storage.link import Lanes, StoreLink
from kvstrata.impl.storage.worker import (
    BackupResult,
    QueryResult,
    StorageResult,
    StorageWorker,
)
from kvstrata.impl.transfer import Executor

__all__ = ["L3Tier"]


class L3Tier:
    """Backup and prefetch state of one cache (scheduler thread only). ``backups`` / ``prefetches``
    map op ids to the ops in flight (read by tests and metrics; changed only here)."""

    def __init__(
        self,
        tree: TreePort,
        backend: StorageBackend | HybridStorage,
        config: StorageConfig,
        executor: Executor | Lanes | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        page_nbytes: int = 0,
    ) -> None:
        self.config = config
        self.hybrid = backend if isinstance(backend, HybridStorage) else None
        states = self.hybrid is not None and tree.has_states
        self._now = clock  # read through now(): a test may swap the clock after construction
        self._tree = tree
        self.worker = StorageWorker(
            backend,
            executor,
            health=config.health(),
            clock=self.now,
            merge_pages=config.backup_merge_pages,
            fetch_merge_pages=config.prefetch_merge_pages,
        )
        self.counters = L3Counters()
        context = L3Context(tree, self.worker, config, self.counters, states, self.now, page_nbytes)
        self.backup = Backups(context)
        self.prefetch = Prefetches(context)
        self.last_applied: list[StorageResult] = []  # what the latest poll applied (for tests)
        self.reports: L3Reports | None = None  # TP: results held until the ranks agree

    def agree_across_ranks(self) -> L3Reports:
        """From now on store results wait for a TP agreement (:meth:`hold_results`, then the
        cache's agreement applies them through :class:`L3Reports`)."""
        self.reports = reports = L3Reports()
        self.backup.agreed = True
        self.prefetch.hold = reports.hold
        return reports

    def hold_results(self) -> None:
        """TP: keep every returned result for the agreement; the store link's own recovery runs
        here (resuming deferred backups changes no pin), a re-publish waits for the agreement."""
        assert self.reports is not None
        results, recovery = self.worker.poll()
        self.last_applied = results
        if recovery is not None and recovery.republish:
            self.backup.recovered()  # before this poll's results are judged
        for result in results:
            self.reports.hold(result)
        if recovery is not None:
            self.backup.resume()
            self.reports.republish |= recovery.republish
        self.backup.resubmit_due()

    def reports_facts(self) -> tuple[Layout, list[int]]:
        assert self.reports is not None
        return self.reports.facts(self.backup, self.prefetch)

    def apply_agreed(self, layout: Layout, agreed: list[int]) -> None:
        assert self.reports is not None
        if self.reports.apply(layout, agreed, self.backup, self.prefetch):
            self.backup.recovered()  # every rank, also one whose own link never went down
            self.backup.republish(self._tree.host_nodes())
        self.backup.resubmit_due()

    def now(self) -> float:
        return self._now()

    @property
    def backups(self) -> dict[int, BackupOp]:
        return self.backup.ops

    @property
    def prefetches(self) -> dict[int, PrefetchOp]:
        return self.prefetch.ops

    def poll(self) -> list[StorageResult]:
        """Apply every storage result that returned (scheduler thread); if the store came back,
        resume deferred backups (and re-publish L2 if it came back empty); resubmit due retries."""
        results, recovery = self.worker.poll()
        self.last_applied = results
        if recovery is not None and recovery.republish:
            self.backup.recovered()  # before this poll's results are judged
        for result in results:
            if isinstance(result, BackupResult):
                self.backup.apply(result)
            elif isinstance(result, QueryResult):
                self.prefetch.apply_query(result)
            else:
                self.prefetch.apply_fetch(result)
        if recovery is not None:
            self.backup.resume()
            if recovery.republish:
                self.backup.republish(self._tree.host_nodes())
        self.backup.resubmit_due()
        return results

    @property
    def link(self) -> StoreLink:
        return self.worker.link

    def pending(self) -> dict[str, int]:
        """Backup and prefetch ops not finished; ``deferred``: backup ops with no job, waiting
        for the store to come back (nothing finishes them while it is down) or, under TP, for the
        ranks to agree that no rank defers them any more."""
        deferred = len(self.backup.deferred) + len(self.backup.ready)
        return {
            "backup": len(self.backup.ops) - deferred,
            "prefetch": len(self.prefetch.ops),
            "deferred": deferred,
        }

    def idle(self) -> bool:
        """Nothing in flight or due: every backup op is done or deferred while the store is down
        (waiting for it would not end), and no prefetch op is open."""
        if self.prefetch.ops:
            return False
        if self.reports is not None:  # TP: what every rank agreed on (a deferral is local)
            return all(op.parked and op.quiet for op in self.backup.ops.values())
        return len(self.backup.ops) == len(self.backup.deferred)

    def reset(self) -> None:
        """The cache drops every page (it is idle): the backups waiting for the store are
        dropped with them, never resumed over pages freed and reused meanwhile (TP: with the
        results held for them)."""
        self.backup.drop_all()
        if self.reports is not None:
            self.reports.backups.clear()

    def close(self) -> None:
        self.worker.close()

    def describe(self) -> dict[str, Any]:
        return {**attrs.asdict(self.counters), "store": dict(self.worker.link.describe())}
