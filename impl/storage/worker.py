"""The storage worker: L3 I/O off the scheduler thread (SPEC §3, §9).

The cache hands the worker *jobs* with everything they need fixed at submission (namespace, page
hashes, host page indices); the worker runs them on its executor (a thread by default, a
:class:`~kvstrata.impl.transfer.ManualExecutor` in tests) and appends one *result* per job to a
thread-safe queue. The tree only learns of results when the scheduler drains them
(:meth:`StorageWorker.results`, called from ``check_events``).

Invariants:

- a job never raises into the worker: whatever the backend does (including raising, which a
  well-behaved backend does not), the result is a complete, per-page account, failures included;
- results are delivered in submission order (one executor, FIFO);
- the worker never touches the tree, the allocators or the scheduler's state; it reads host pages
  named by a backup job and writes host pages named by a fetch job, which the cache keeps pinned
  (backup) or reserved (fetch) until the result is drained.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence
from typing import TypeAlias, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.impl.transfer import Executor, ThreadExecutor, drain
from kvstrata.model.keys import Namespace, PageHash

__all__ = ["BackupResult", "FetchResult", "QueryResult", "StorageResult", "StorageWorker"]

log = logging.getLogger("kvstrata.storage")
T = TypeVar("T")
S = TypeVar("S", PutStatus, GetStatus)
Indices: TypeAlias = Sequence[int] | npt.NDArray[np.int64]


@attrs.frozen
class BackupResult:
    """What happened to each page of backup op ``op_id`` (in the op's page order)."""

    op_id: int
    statuses: tuple[PutStatus, ...]


@attrs.frozen
class QueryResult:
    """Prefetch op ``op_id``'s query: the page hashes of the continuation (32 bytes each, as the
    cache's chain computed them) and how many leading pages the store holds completely."""

    op_id: int
    digests: bytes
    hit: int


@attrs.frozen
class FetchResult:
    """What arrived for each reserved page of prefetch op ``op_id``."""

    op_id: int
    statuses: tuple[GetStatus, ...]


StorageResult: TypeAlias = BackupResult | QueryResult | FetchResult


def _pages(digests: bytes) -> list[PageHash]:
    return [PageHash(digests[i : i + 32]) for i in range(0, len(digests), 32)]


class StorageWorker:
    """Runs backup, query and fetch jobs against one backend on one executor."""

    def __init__(self, backend: StorageBackend, executor: Executor | None = None) -> None:
        self.backend = backend
        self.executor: Executor = (
            executor if executor is not None else ThreadExecutor("kvstrata-storage")
        )
        self._done: queue.SimpleQueue[StorageResult] = queue.SimpleQueue()
        self.submitted = 0

    # ------------------------------------------------------------------ jobs
    def backup(
        self, op_id: int, namespace: Namespace, digests: bytes, host_indices: Indices
    ) -> None:
        """Store the pages named by ``digests`` from ``host_indices`` (exists-then-put-missing)."""
        pages = _pages(digests)
        indices = [int(i) for i in host_indices]

        def run() -> None:
            failed = [PutStatus.FAILED] * len(pages)
            statuses = self._statuses(
                self._guard(lambda: self.backend.put(namespace, pages, indices), failed, "put"),
                len(pages),
                PutStatus.FAILED,
                "put",
            )
            self._done.put(BackupResult(op_id, tuple(statuses)))

        self._submit(run)

    def query(
        self, op_id: int, namespace: Namespace, hasher: Callable[[], bytes], max_pages: int
    ) -> None:
        """Compute the continuation's page hashes with ``hasher`` (off the scheduler thread) and ask
        the store how many leading pages (at most ``max_pages``) it holds."""

        def run() -> None:
            try:
                digests = hasher()[: max_pages * 32]
            except Exception:  # a hashing failure is a miss, never an exception on the worker
                log.exception("kvstrata: prefetch query %d could not hash its pages", op_id)
                self._done.put(QueryResult(op_id, b"", 0))
                return
            pages = _pages(digests)
            hit = self._guard(lambda: self.backend.exists(namespace, pages), 0, "exists")
            count = hit if isinstance(hit, int) else 0
            self._done.put(QueryResult(op_id, digests, max(0, min(count, len(pages)))))

        self._submit(run)

    def fetch(
        self, op_id: int, namespace: Namespace, digests: bytes, host_indices: Indices
    ) -> None:
        """Read the pages named by ``digests`` into the reserved ``host_indices``."""
        pages = _pages(digests)
        indices = [int(i) for i in host_indices]

        def run() -> None:
            failed = [GetStatus.FAILED] * len(pages)
            statuses = self._statuses(
                self._guard(lambda: self.backend.get(namespace, pages, indices), failed, "get"),
                len(pages),
                GetStatus.FAILED,
                "get",
            )
            self._done.put(FetchResult(op_id, tuple(statuses)))

        self._submit(run)

    # ------------------------------------------------------------------ plumbing
    def _submit(self, job: Callable[[], None]) -> None:
        self.submitted += 1
        self.executor.submit(job)

    @staticmethod
    def _guard(call: Callable[[], T], fallback: T, what: str) -> T:
        """Run ``call``; on an exception, log it and return ``fallback`` instead."""
        try:
            return call()
        except Exception:
            log.exception("kvstrata: storage %s raised; reported as failed", what)
            return fallback

    @staticmethod
    def _statuses(statuses: list[S], count: int, failed: S, what: str) -> list[S]:
        """``statuses`` if it has one entry per page, else every page ``failed``."""
        if isinstance(statuses, list) and len(statuses) == count:
            return statuses
        log.error("kvstrata: storage %s gave %r for %d pages", what, statuses, count)
        return [failed] * count

    def results(self) -> list[StorageResult]:
        """Every result finished since the last call, in completion (= submission) order."""
        return drain(self._done)

    def close(self) -> None:
        """Finish submitted jobs, stop the executor and close the backend."""
        self.executor.close()
        self.backend.close()
