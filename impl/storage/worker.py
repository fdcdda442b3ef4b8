"""The storage worker: L3 I/O off the scheduler thread (SPEC §3, §9).

The cache hands the worker *jobs* with everything they need fixed at submission (namespace, page
hashes, host page indices); the worker runs them on its executor (a thread by default, a
:class:`~kvstrata.impl.transfer.ManualExecutor` in tests) and appends one *result* per job to a
thread-safe queue. The tree only learns of results when the scheduler drains them
(:meth:`StorageWorker.results`, called from ``check_events``).

Invariants:

- a job never raises into the worker: whatever the backend does (including raising, which a
  well-behaved backend does not), the result is a complete, per-page account, failures included;
- calls run on the lanes of a :class:`~kvstrata.impl.storage.link.StoreLink` (reads, writes and
  probes apart; FIFO within a lane) and are refused there while the store is down (the methods
  return ``False`` and nothing runs); results are delivered in the order the calls returned;
- a call *faults* when a backend call raised or the backend counted an unreachable store or a
  timeout during it (``outages``, an optional counter of the backend); the link judges it;
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
import time
from collections.abc import Callable, Sequence
from typing import TypeAlias, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.errors import StoreError
from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.impl.storage.hybrid import HybridStorage
from kvstrata.impl.storage.link import Body, Lanes, Merge, StoreLink
from kvstrata.impl.storage.results import BackupResult, FetchResult, QueryResult, StorageResult
from kvstrata.impl.transfer import Executor
from kvstrata.model.keys import Namespace, PageHash
from kvstrata.model.l3.health import CallKind, HealthConfig, Recovery

__all__ = ["BackupResult", "FetchResult", "QueryResult", "StorageResult", "StorageWorker"]

log = logging.getLogger("kvstrata.storage")
T = TypeVar("T")
S = TypeVar("S", PutStatus, GetStatus)
Indices: TypeAlias = Sequence[int] | npt.NDArray[np.int64]


def _pages(digests: bytes) -> list[PageHash]:
    return [PageHash(digests[i : i + 32]) for i in range(0, len(digests), 32)]


@attrs.frozen
class _BackupPart:
    """One backup op's share of a store call: what :meth:`StorageWorker.backup` was given."""

    op_id: int
    namespace: Namespace
    pages: list[PageHash]
    indices: list[int]
    state_pages: list[PageHash]
    slots: list[int]


@attrs.frozen
class _FetchPart:
    """One prefetch op's share of a get: what :meth:`StorageWorker.fetch` was given."""

    op_id: int
    namespace: Namespace
    pages: list[PageHash]
    indices: list[int]
    state_slot: int | None = None


@attrs.define
class _Trace:
    """Whether a backend call of one store call raised."""

    raised: bool = False


_NO_PAGE = PageHash(bytes(32))


class StorageWorker:
    """Runs backup, query and fetch jobs against one backend on one executor."""

    def __init__(
        self,
        backend: StorageBackend | HybridStorage,
        executor: Executor | Lanes | None = None,
        *,
        health: HealthConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        merge_pages: int = 0,
        fetch_merge_pages: int = 0,
    ) -> None:
        #: At most this many pages in one store call shared by queued backups (0: never shared).
        self.merge_pages = merge_pages
        #: The same for queued prefetch fetches (one get; each state still read on its own).
        self.fetch_merge_pages = fetch_merge_pages
        self.backend = backend
        self.hybrid = backend if isinstance(backend, HybridStorage) else None
        self.plain: StorageBackend | None = None if isinstance(backend, HybridStorage) else backend
        self._kv: StorageBackend = (
            backend.backend if isinstance(backend, HybridStorage) else backend
        )
        if executor is None:
            lanes = Lanes.threads()
        elif isinstance(executor, Lanes):
            lanes = executor
        else:
            lanes = Lanes.shared(executor)
        self.link = StoreLink(lanes, self._probe, health or HealthConfig(), clock)
        self.submitted = 0
        #: The last page a backup confirmed while the store was healthy: a probe that finds it
        #: gone after an outage means the store came back empty.
        self.sentinel: tuple[Namespace, PageHash] | None = None

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
    ) -> bool:
        """Store the pages named by ``digests`` from ``host_indices`` (exists-then-put-missing),
        and (hybrid storage) the states at the end of the pages named by ``state_digests`` from
        host state slots ``state_slots``. ``False``: the store is down, nothing was issued. With
        ``merge_pages``, a write lane that merges may make one store call for this backup and
        the backups of ``namespace`` queued right behind it (at most ``merge_pages`` pages)."""
        part = _BackupPart(
            op_id,
            namespace,
            _pages(digests),
            [int(i) for i in host_indices],
            _pages(state_digests),
            [int(i) for i in state_slots],
        )

        def skip() -> BackupResult:
            failed = PutStatus.FAILED
            count, states = len(part.pages), len(part.state_pages)
            return BackupResult(op_id, (failed,) * count, (failed,) * states, skipped=True)

        merge = None
        if self.merge_pages:
            merge = Merge(
                (CallKind.BACKUP, namespace),
                len(part.pages),
                self.merge_pages,
                part,
                lambda parts: self._body(lambda trace: self._backups(parts, trace))(),
            )
        return self._submit(
            CallKind.BACKUP,
            op_id,
            len(part.pages),
            lambda trace: self._backups([part], trace)[0],
            skip,
            merge=merge,
        )

    def _backups(self, parts: list[_BackupPart], trace: _Trace) -> list[BackupResult]:
        """One store call for the backups ``parts`` (one namespace): their pages in one put, their
        states in one ``put_states``; each part's result is its own slice of the statuses."""
        namespace = parts[0].namespace
        pages = [page for part in parts for page in part.pages]
        indices = [index for part in parts for index in part.indices]
        state_pages = [page for part in parts for page in part.state_pages]
        slots = [slot for part in parts for slot in part.slots]
        hybrid = self.hybrid

        def put() -> list[PutStatus]:
            if hybrid is None:
                assert self.plain is not None
                return self.plain.put(namespace, pages, indices)
            return hybrid.put(namespace, pages, indices).pages if pages else []

        failed = PutStatus.FAILED
        statuses = self._statuses(
            self._guard(put, [failed] * len(pages), "put", trace), len(pages), failed, "put"
        )
        states: list[PutStatus] = []
        if state_pages:
            assert hybrid is not None, "states need a HybridStorage"
            states = self._statuses(
                self._guard(
                    lambda: hybrid.put_states(namespace, state_pages, slots),
                    [failed] * len(state_pages),
                    "put",
                    trace,
                ),
                len(state_pages),
                failed,
                "put",
            )
        results = []
        page_at = state_at = 0
        for part in parts:
            mine = statuses[page_at : page_at + len(part.pages)]
            theirs = states[state_at : state_at + len(part.state_pages)]
            page_at, state_at = page_at + len(part.pages), state_at + len(part.state_pages)
            stored = [i for i, status in enumerate(mine) if status.ok]
            last = (namespace, part.pages[stored[-1]]) if stored else None
            results.append(BackupResult(part.op_id, tuple(mine), tuple(theirs), last))
        return results

    def query(
        self, op_id: int, namespace: Namespace, hasher: Callable[[], bytes], max_pages: int
    ) -> bool:
        """Compute the continuation's page hashes with ``hasher`` (off the scheduler thread) and ask
        the store how many leading pages (at most ``max_pages``) it holds. ``False``: the store is
        down, nothing was issued (the answer is "nothing")."""

        def run(trace: _Trace) -> QueryResult:
            try:
                digests = hasher()[: max_pages * 32]
            except Exception:  # a hashing failure is a miss, never an exception on the worker
                log.exception("kvstrata: prefetch query %d could not hash its pages", op_id)
                return QueryResult(op_id, b"", 0)
            pages = _pages(digests)
            hybrid = self.hybrid
            plain = self.plain
            if plain is not None:
                hit = self._guard(lambda: plain.exists(namespace, pages), 0, "exists", trace)
            else:  # the prefix usable in every pool, never the bare KV hit
                assert hybrid is not None
                hit = self._guard(
                    lambda: hybrid.exists(namespace, pages).usable, 0, "exists", trace
                )
            count = hit if isinstance(hit, int) else 0
            return QueryResult(op_id, digests, max(0, min(count, len(pages))))

        return self._submit(
            CallKind.QUERY, op_id, max_pages, run, lambda: QueryResult(op_id, b"", 0)
        )

    def fetch(
        self,
        op_id: int,
        namespace: Namespace,
        digests: bytes,
        host_indices: Indices,
        *,
        state_slot: int | None = None,
    ) -> bool:
        """Read the pages named by ``digests`` into the reserved ``host_indices`` (with their
        ``ALL_PAGES`` objects over hybrid storage), then, with a ``state_slot``, the state of the
        deepest arrived page that has one in the store (:meth:`HybridStorage.read_state`).
        ``False``: the store is down, nothing was issued (the slots are the caller's again). With
        ``fetch_merge_pages``, a read lane that merges may make one get for this fetch and the
        fetches of ``namespace`` queued right behind it (each state is still read on its own)."""
        indices = [int(i) for i in host_indices]
        part = _FetchPart(op_id, namespace, _pages(digests), indices, state_slot)

        def skip() -> FetchResult:
            failed = (GetStatus.FAILED,) * len(part.pages)
            return FetchResult(op_id, failed, None if state_slot is None else 0)

        merge = None
        if self.fetch_merge_pages:
            merge = Merge(
                (CallKind.FETCH, namespace),
                len(part.pages),
                self.fetch_merge_pages,
                part,
                lambda parts: self._body(lambda trace: self._fetches(parts, trace))(),
            )
        return self._submit(
            CallKind.FETCH,
            op_id,
            len(part.pages),
            lambda trace: self._fetches([part], trace)[0],
            skip,
            merge=merge,
        )

    def _fetches(self, parts: list[_FetchPart], trace: _Trace) -> list[FetchResult]:
        """One get for the fetches ``parts`` (one namespace); each part's statuses are its own
        slice, and each part with a state slot then reads its own state."""
        namespace = parts[0].namespace
        pages = [page for part in parts for page in part.pages]
        indices = [index for part in parts for index in part.indices]
        hybrid = self.hybrid

        def get() -> list[GetStatus]:
            if hybrid is None:
                assert self.plain is not None
                return self.plain.get(namespace, pages, indices)
            return hybrid.get(namespace, pages, indices).pages

        failed = GetStatus.FAILED
        statuses = self._statuses(
            self._guard(get, [failed] * len(pages), "get", trace), len(pages), failed, "get"
        )
        results = []
        at = 0
        for part in parts:
            mine = statuses[at : at + len(part.pages)]
            at += len(part.pages)
            usable = None if part.state_slot is None else self._read_state(part, mine, trace)
            results.append(FetchResult(part.op_id, tuple(mine), usable))
        return results

    def _read_state(self, part: _FetchPart, statuses: list[GetStatus], trace: _Trace) -> int:
        """How many leading pages of ``part`` are usable with the state read into its slot."""
        hybrid, slot = self.hybrid, part.state_slot
        assert hybrid is not None and slot is not None, "a state slot needs a HybridStorage"
        loaded = GetStatus.LOADED
        whole = next((i for i, s in enumerate(statuses) if s is not loaded), len(statuses))
        got = self._guard(
            lambda: hybrid.read_state(part.namespace, part.pages, whole, slot), 0, "get", trace
        )
        return got if isinstance(got, int) and 0 <= got <= whole else 0

    # ------------------------------------------------------------------ plumbing
    def _outages(self) -> int:
        count = getattr(self._kv, "outages", 0)
        return count if isinstance(count, int) else 0

    def _body(self, run: Callable[[_Trace], T]) -> Body:
        """``run`` as a link call body: its result and whether the call faulted."""

        def body() -> tuple[T, bool]:
            trace = _Trace()
            before = self._outages()
            result = run(trace)
            return result, trace.raised or self._outages() > before

        return body

    def _submit(
        self,
        kind: CallKind,
        op_id: int,
        pages: int,
        run: Callable[[_Trace], T],
        skip: Callable[[], T],
        *,
        merge: Merge | None = None,
    ) -> bool:
        if not self.link.submit(kind, op_id, pages, self._body(run), skip, merge=merge):
            return False
        self.submitted += 1
        return True

    def _probe(self) -> Body:
        """A probe: can the store answer, and does it still hold the sentinel page? Its outcome
        is ``True`` when the sentinel is gone (the store came back empty)."""
        kv = self._kv

        probe = getattr(kv, "probe", None)  # a backend's fast single-key check, if it has one

        def run(trace: _Trace) -> bool:
            sentinel = self.sentinel
            namespace, page = sentinel if sentinel is not None else (Namespace(), _NO_PAGE)
            if callable(probe):
                hit = self._guard(lambda: int(bool(probe(namespace, page))), 0, "probe", trace)
            else:
                hit = self._guard(lambda: kv.exists(namespace, [page]), 0, "probe", trace)
            return sentinel is not None and hit == 0

        return self._body(run)

    @staticmethod
    def _guard(call: Callable[[], T], fallback: T, what: str, trace: _Trace) -> T:
        """Run ``call``; on an exception, note it in ``trace``, log it and return ``fallback``
        (a store error at debug level: the link reports outages once, not per call)."""
        try:
            return call()
        except StoreError as error:
            trace.raised = True
            log.debug("kvstrata: storage %s failed: %s", what, error)
            return fallback
        except Exception:
            trace.raised = True
            log.exception("kvstrata: storage %s raised; reported as failed", what)
            return fallback

    @staticmethod
    def _statuses(statuses: list[S], count: int, failed: S, what: str) -> list[S]:
        """``statuses`` if it has one entry per page, else every page ``failed``."""
        if isinstance(statuses, list) and len(statuses) == count:
            return statuses
        log.error("kvstrata: storage %s gave %r for %d pages", what, statuses, count)
        return [failed] * count

    def poll(self) -> tuple[list[StorageResult], Recovery | None]:
        """Every result that returned since the last call, in return order, and a recovery of the
        store if one happened (the link judged the calls; see :meth:`StoreLink.poll`). A backup
        judged healthy moves the sentinel to its last stored page; a recovery that found the
        store empty clears it."""
        calls, recovery = self.link.poll()
        results: list[StorageResult] = []
        for call in calls:
            result = call.outcome
            if not isinstance(result, BackupResult | QueryResult | FetchResult):
                continue  # pragma: no cover - a body that raised (logged as a bug)
            if call.healthy_ok and isinstance(result, BackupResult) and result.sentinel:
                self.sentinel = result.sentinel
            results.append(result)
        if recovery is not None and recovery.lost:
            self.sentinel = None
        return results, recovery

    def close(self) -> None:
        """Let issued calls return, stop the lanes and close the backend."""
        self.link.close()
        self.backend.close()
