"""The cache's L3 side: :class:`Backups` (L2 -> L3) and :class:`Prefetches` (L3 -> L2) over one
:class:`~kvstrata.impl.storage.worker.StorageWorker` (SPEC §3, §4, §9).

Owned by one cache and run on its scheduler thread; the store I/O runs on the worker. It reaches the
tree only through a :class:`~kvstrata.impl.l3.port.TreePort`. :meth:`L3Tier.poll` is the one place
where store results change anything (the cache's ``check_events`` calls it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from kvstrata.impl.config import StorageConfig
from kvstrata.impl.l3.backup import BackupOp, Backups
from kvstrata.impl.l3.context import L3Context
from kvstrata.impl.l3.counters import L3Counters
from kvstrata.impl.l3.port import TreePort
from kvstrata.impl.l3.prefetch import Prefetches, PrefetchOp
from kvstrata.impl.storage.base import StorageBackend
from kvstrata.impl.storage.hybrid import HybridStorage
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
        executor: Executor | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        page_nbytes: int = 0,
    ) -> None:
        self.config = config
        self.hybrid = backend if isinstance(backend, HybridStorage) else None
        states = self.hybrid is not None and tree.has_states
        self.worker = StorageWorker(backend, executor)
        self.counters = L3Counters()
        self._now = clock  # read through now(): a test may swap the clock after construction
        context = L3Context(tree, self.worker, config, self.counters, states, self.now, page_nbytes)
        self.backup = Backups(context)
        self.prefetch = Prefetches(context)
        self.last_applied: list[StorageResult] = []  # what the latest poll applied (for tests)

    def now(self) -> float:
        return self._now()

    @property
    def backups(self) -> dict[int, BackupOp]:
        return self.backup.ops

    @property
    def prefetches(self) -> dict[int, PrefetchOp]:
        return self.prefetch.ops

    def poll(self) -> list[StorageResult]:
        """Apply every storage result that finished (scheduler thread), then resubmit due retries."""
        results = self.worker.results()
        self.last_applied = results
        for result in results:
            if isinstance(result, BackupResult):
                self.backup.apply(result)
            elif isinstance(result, QueryResult):
                self.prefetch.apply_query(result)
            else:
                self.prefetch.apply_fetch(result)
        self.backup.resubmit_due()
        return results

    def pending(self) -> dict[str, int]:
        return {"backup": len(self.backup.ops), "prefetch": len(self.prefetch.ops)}

    def idle(self) -> bool:
        return not self.backup.ops and not self.prefetch.ops

    def close(self) -> None:
        self.worker.close()

    def describe(self) -> dict[str, Any]:
        return attrs.asdict(self.counters)
