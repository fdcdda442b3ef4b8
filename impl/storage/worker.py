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

Side pools (SPEC §5): over a :class:`~kvstrata.impl.storage.hybrid.HybridStorage` a backup job
writes its pages' ``ALL_PAGES`` objects with them and the states it names (host state slots, pinned
by the cache like the pages), a query answers the usable prefix, and a fetch reads KV and
``ALL_PAGES`` objects, then (the KV range known) the state of the deepest arrived page whose state
is in the store into the op's state slot: :attr:`FetchResult.usable` is where the prefix ends.
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
from kvstrata.impl.storage.hybrid import HybridStorage
from kvstrata.impl.transfer import Executor, ThreadExecutor, drain
from kvstrata.model.keys import Namespace, PageHash

__all__ = ["BackupResult", "FetchResult", "QueryResult", "StorageResult", "StorageWorker"]

log = logging.getLogger("kvstrata.storage")
T = TypeVar("T")
S = TypeVar("S", PutStatus, GetStatus)
Indices: TypeAlias = Sequence[int] | npt.NDArray[np.int64]


@attrs.frozen
class BackupResult:
    """What happened to each page of backup op ``op_id`` (in the op's page order) and to each
    state it wrote (in the op's state order; empty without states)."""

    op_id: int
    statuses: tuple[PutStatus, ...]
    states: tuple[PutStatus, ...] = ()


@attrs.frozen
class QueryResult:
    """Prefetch op ``op_id``'s query: the page hashes of the continuation (32 bytes each, as the
    cache's chain computed them) and how many leading pages the store holds completely."""

    op_id: int
    digests: bytes
    hit: int


@attrs.frozen
class FetchResult:
    """What arrived for each reserved page of prefetch op ``op_id``. ``usable`` (side pools with a
    state slot only): how many leading pages are usable, the op's state slot holding the state at
    the end of the last of them (0: none; the slot's bytes are then unspecified)."""

    op_id: int
    statuses: tuple[GetStatus, ...]
    usable: int | None = None


StorageResult: TypeAlias = BackupResult | QueryResult | FetchResult


def _pages(digests: bytes) -> list[PageHash]:
    return [PageHash(digests[i : i + 32]) for i in range(0, len(digests), 32)]


class StorageWorker:
    """Runs backup, query and fetch jobs against one backend on one executor."""

    def __init__(
        self, backend: StorageBackend | HybridStorage, executor: Executor | None = None
    ) -> None:
        self.backend = backend
        self.hybrid = backend if isinstance(backend, HybridStorage) else None
        self.plain: StorageBackend | None = None if isinstance(backend, HybridStorage) else backend
        self.executor: Executor = (
            executor if executor is not None else ThreadExecutor("kvstrata-storage")
        )
        self._done: queue.SimpleQueue[StorageResult] = queue.SimpleQueue()
        self.submitted = 0

    # ------------------------------------------------------------------ jobs
    def backup(
        self,
        op_id: int,
        namespace: Namespace,
        digests: bytes,
        host_indices: Indices,
        *,
        state_digests: bytes = b"",
        state_slots: Indices = (),
    ) -> None:
        """Store the pages named by ``digests`` from ``host_indices`` (exists-then-put-missing),
        and (hybrid storage) the states at the end of the pages named by ``state_digests`` from
        host state slots ``state_slots``."""
        pages = _pages(digests)
        indices = [int(i) for i in host_indices]
        state_pages = _pages(state_digests)
        slots = [int(i) for i in state_slots]
        hybrid = self.hybrid

        def put() -> list[PutStatus]:
            if hybrid is None:
                assert self.plain is not None
                return self.plain.put(namespace, pages, indices)
            return hybrid.put(namespace, pages, indices).pages if pages else []

        def run() -> None:
            statuses = self._statuses(
                self._guard(put, [PutStatus.FAILED] * len(pages), "put"),
                len(pages),
                PutStatus.FAILED,
                "put",
            )
            states: list[PutStatus] = []
            if state_pages:
                assert hybrid is not None, "states need a HybridStorage"
                states = self._statuses(
                    self._guard(
                        lambda: hybrid.put_states(namespace, state_pages, slots),
                        [PutStatus.FAILED] * len(state_pages),
                        "put",
                    ),
                    len(state_pages),
                    PutStatus.FAILED,
                    "put",
                )
            self._done.put(BackupResult(op_id, tuple(statuses), tuple(states)))

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
            hybrid = self.hybrid
            plain = self.plain
            if plain is not None:
                hit = self._guard(lambda: plain.exists(namespace, pages), 0, "exists")
            else:  # the prefix usable in every pool, never the bare KV hit
                assert hybrid is not None
                hit = self._guard(lambda: hybrid.exists(namespace, pages).usable, 0, "exists")
            count = hit if isinstance(hit, int) else 0
            self._done.put(QueryResult(op_id, digests, max(0, min(count, len(pages)))))

        self._submit(run)

    def fetch(
        self,
        op_id: int,
        namespace: Namespace,
        digests: bytes,
        host_indices: Indices,
        *,
        state_slot: int | None = None,
    ) -> None:
        """Read the pages named by ``digests`` into the reserved ``host_indices`` (with their
        ``ALL_PAGES`` objects over hybrid storage), then, with a ``state_slot``, the state of the
        deepest arrived page that has one in the store (:meth:`HybridStorage.read_state`)."""
        pages = _pages(digests)
        indices = [int(i) for i in host_indices]
        hybrid = self.hybrid

        def get() -> list[GetStatus]:
            if hybrid is None:
                assert self.plain is not None
                return self.plain.get(namespace, pages, indices)
            return hybrid.get(namespace, pages, indices).pages

        def run() -> None:
            failed = [GetStatus.FAILED] * len(pages)
            statuses = self._statuses(
                self._guard(get, failed, "get"), len(pages), GetStatus.FAILED, "get"
            )
            usable: int | None = None
            if state_slot is not None:
                assert hybrid is not None, "a state slot needs a HybridStorage"
                whole = next(
                    (i for i, s in enumerate(statuses) if s is not GetStatus.LOADED), len(pages)
                )
                got = self._guard(
                    lambda: hybrid.read_state(namespace, pages, whole, state_slot), 0, "get"
                )
                usable = got if isinstance(got, int) and 0 <= got <= whole else 0
            self._done.put(FetchResult(op_id, tuple(statuses), usable))

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
