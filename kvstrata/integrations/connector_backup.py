"""The connector worker's store calls, behind the engine's step: :class:`BackupLane`.

A step's saves copy the engine's new full blocks into host slots (L2) and back those slots up to
the store (L3). The copy must finish inside the step (the engine reuses its blocks), the put need
not: the lane queues it on an :class:`~kvstrata.impl.executors.Executor` and the step goes on
(vLLM's ``wait_for_save`` returns once the bytes are in L2). The put's outcome is applied later, on
the worker's thread (:meth:`BackupLane.landed`).

A put reads its slots at any time until it lands, so a slot with a put pending is a **pinned
offset**: writing it first would send the next page's bytes under this page's key (the stale-offset
bug; the shared store poisoned). Upheld here:

* **C4** a slot is written (by a save's copy or a load's get) only when no put reading it is
  pending: :meth:`BackupLane.settle` before a copy; a get runs on the same executor behind every
  put queued before it (an executor runs its jobs one at a time, in order), and the caller waits
  for it;
* every store call runs on the executor's one lane (the worker thread, or a caller that runs the
  queued calls itself: :class:`~kvstrata.impl.executors.Joinable`), so one thread at a time drives
  the backend (:class:`~kvstrata.impl.storage.base.StorageBackend`'s thread model);
* a call that raises fails all its pages (a put's are retried by the worker, a get's are misses);
  none raises into the executor.

With an :class:`~kvstrata.impl.executors.InlineExecutor` every call runs before it returns: the
worker is synchronous, as before this lane existed.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence

import attrs

from kvstrata.impl.errors import CacheClosed, MisuseError
from kvstrata.impl.executors import Executor, InlineExecutor, Joinable, ThreadExecutor, drain
from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.model.keys import Namespace, PageHash

__all__ = ["BackupLane", "LandedPut", "lane_executor"]

log = logging.getLogger("kvstrata.integrations.connector_backup")


def lane_executor(behind_step: bool) -> Executor:
    """The executor of a worker's lane: a thread of its own (``kvstrata-l3``), so a step's puts
    land behind it, or an :class:`InlineExecutor`, so each save waits for its puts."""
    return ThreadExecutor("kvstrata-l3") if behind_step else InlineExecutor()


@attrs.frozen
class LandedPut:
    """One put's outcome: its pages and slots in order, one status per page, the call's seconds."""

    pages: tuple[PageHash, ...]
    slots: tuple[int, ...]
    statuses: tuple[PutStatus, ...]
    seconds: float


class BackupLane:
    """The store calls of one connector worker (see the module docstring for the rules)."""

    def __init__(self, backend: StorageBackend, namespace: Namespace, executor: Executor) -> None:
        if not isinstance(executor, (InlineExecutor, Joinable)):
            raise MisuseError(
                f"BackupLane needs an executor a caller can wait on (InlineExecutor, or Joinable "
                f"such as ThreadExecutor), got {executor!r}"
            )
        self.backend, self.namespace, self.executor = backend, namespace, executor
        self._results: queue.SimpleQueue[tuple[int, LandedPut]] = queue.SimpleQueue()
        self._arrived: dict[int, LandedPut] = {}  # results taken off the queue, not handed out
        self._reading: dict[int, tuple[int, PageHash]] = {}  # slot -> newest pending put, page
        self._pending: set[int] = set()  # puts queued or running, not handed out by landed()
        self._landed: set[int] = set()  # puts whose result is queued (added on the I/O side)
        self._next = 0
        self._closed = False

    @property
    def pending(self) -> int:
        """Puts not handed out yet (queued, running, or landed and waiting for :meth:`landed`)."""
        return len(self._pending)

    @property
    def pinned(self) -> dict[int, PageHash]:
        """Each slot a put not handed out yet reads, with the page that put stores from it (the
        slot must hold that page's bytes until :meth:`settle`)."""
        return {slot: page for slot, (_number, page) in self._reading.items()}

    def put(self, pages: Sequence[PageHash], slots: Sequence[int]) -> None:
        """Queue one put of ``pages`` from host ``slots`` (pinned until it lands)."""
        self._check_open()
        pages, slots = tuple(pages), tuple(slots)
        if len(pages) != len(slots):
            raise MisuseError(f"BackupLane.put: {len(pages)} pages for {len(slots)} slots")
        if not pages:
            return
        number, self._next = self._next, self._next + 1
        self._pending.add(number)
        for slot, page in zip(slots, pages, strict=True):
            self._reading[slot] = (number, page)
        backend, namespace = self.backend, self.namespace
        results, landed = self._results, self._landed

        def job() -> None:
            statuses: tuple[PutStatus, ...] = (PutStatus.FAILED,) * len(pages)
            started = time.perf_counter()
            try:
                statuses = tuple(backend.put(namespace, pages, slots))
            except Exception:  # a job never raises into the executor: the put failed
                log.exception("kvstrata connector: an L3 put raised")
            finally:  # also for an interrupt on a caller's thread: never left pending
                seconds = time.perf_counter() - started
                try:  # the result first: a waiter that sees the mark takes it off the queue
                    results.put((number, LandedPut(pages, slots, statuses, seconds)))
                finally:
                    landed.add(number)

        self.executor.submit(job)

    def get(self, pages: Sequence[PageHash], slots: Sequence[int]) -> tuple[list[GetStatus], float]:
        """Read ``pages`` into host ``slots`` now, after every put queued before it (one thread
        drives the store), on this thread where the executor lets a waiter run the queue; one
        status per page, and the seconds of the store call itself (not the wait for the puts)."""
        self._check_open()
        box: list[tuple[list[GetStatus], float]] = []
        backend, namespace = self.backend, self.namespace

        def job() -> None:
            statuses = [GetStatus.FAILED] * len(pages)
            started = time.perf_counter()
            try:
                statuses = list(backend.get(namespace, pages, slots))
            except Exception:
                log.exception("kvstrata connector: an L3 get raised")
            finally:
                box.append((statuses, time.perf_counter() - started))

        self.executor.submit(job)
        self._wait_for(lambda: bool(box))
        return box[0]

    def settle(self, slots: Sequence[int]) -> None:
        """Wait until every put reading any of ``slots`` has landed and its outcome is ready for
        :meth:`landed` (before those slots are written)."""
        self._collect({self._reading[slot][0] for slot in slots if slot in self._reading})

    def flush(self) -> None:
        """Wait until every put queued so far has landed and its outcome is ready."""
        self._collect(set(self._pending))

    def landed(self) -> list[LandedPut]:
        """The puts that landed since the last call, in the order they were queued; their slots
        are free to write once no later put reads them. Called on the worker's thread only."""
        self._take(block=False)
        out = []
        for number in sorted(self._arrived):
            put = self._arrived.pop(number)
            self._pending.discard(number)
            self._landed.discard(number)
            for slot in put.slots:
                if self._reading.get(slot, (None,))[0] == number:
                    del self._reading[slot]
            out.append(put)
        if len(self._landed) > len(self._pending):  # a mark added after its result was taken
            self._landed.intersection_update(self._pending)
        return out

    def close(self) -> None:
        """Let every queued put land, then stop the executor (the outcomes stay for
        :meth:`landed`). Idempotent; ``put`` and ``get`` afterwards raise :class:`CacheClosed`."""
        if not self._closed:
            self.flush()
            self.executor.close()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosed("BackupLane: the connector worker was closed")

    def _collect(self, numbers: set[int]) -> None:
        """Run or wait for the queued calls until the puts ``numbers`` landed, then take their
        results off the queue (each is queued right after its put is marked landed)."""
        numbers -= self._arrived.keys()
        if not numbers:
            return
        landed = self._landed
        self._wait_for(lambda: numbers <= landed)
        while not numbers <= self._arrived.keys():
            self._take(block=True)

    def _take(self, *, block: bool) -> None:
        """Move results off the queue into ``_arrived`` (one, waiting, if ``block``; else all)."""
        if block:
            number, put = self._results.get()
            self._arrived[number] = put
        for number, put in drain(self._results):
            self._arrived[number] = put

    def _wait_for(self, condition: Callable[[], bool]) -> None:
        """Run or wait for the queued calls until ``condition()`` holds (the executor's worker
        may be running the one it needs: then poll its progress with a short sleep). Everything
        queued lands before :meth:`close` returns, so nothing is waited for after it."""
        if self._closed:
            return
        if isinstance(self.executor, Joinable):
            self.executor.run_queued(until=condition)
        while not condition():  # the worker took the job: it lands soon
            time.sleep(0.0002)
