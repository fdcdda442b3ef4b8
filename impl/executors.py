"""Executors: where background jobs run (the transfer controller's copies, the store link's lanes,
the embedding cache's I/O).

- :class:`ThreadExecutor`: one worker thread, jobs in submission order; with ``merge``, a
  :class:`Mergeable` job runs together with the jobs already queued right behind it that join it
  (the store link's backup and fetch calls: one store call for several ops, issue 20); a caller
  about to wait may run the queued jobs itself (:class:`Joinable`: no hand-off to the worker);
- :class:`InlineExecutor`: every job at once on the submitting thread;
- :class:`ManualExecutor`: nothing runs until a test says so (whole jobs, merged groups, or a
  step of a job that has steps); :class:`ManualJoinableExecutor` also lets a caller that waits run
  the queued jobs itself, as a :class:`ThreadExecutor`'s does.

Every executor runs jobs in submission order; a merged group runs as one call of its first job
(:meth:`Mergeable.run_merged`), which reports every member as if it had run alone.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from kvstrata.impl.jobs import (
    Executor,
    JobGroup,
    Joinable,
    Mergeable,
    RunsHere,
    Stepped,
    deadline_after,
    drain,
    seconds_left,
)

__all__ = [
    "Executor",
    "InlineExecutor",
    "Joinable",
    "ManualExecutor",
    "ManualJoinableExecutor",
    "Mergeable",
    "RunsHere",
    "Stepped",
    "ThreadExecutor",
    "deadline_after",
    "drain",
    "seconds_left",
]

log = logging.getLogger("kvstrata.transfer")


class ThreadExecutor:
    """One worker thread running jobs in submission order. ``after_job`` (if given) runs after each
    job, also after one that raised: a raising job is logged and the worker keeps going (the cache's
    jobs report their own failures as completions). With ``merge``, a :class:`Mergeable` job runs
    together with the jobs already queued right behind it that join it (none waits for more).

    A caller about to wait for the jobs may run the queued ones itself (:meth:`run_queued`): no
    hand-off to the worker and back, which on a small VM costs a thread wake-up each way (issue
    20). Invariant, for the worker and every helper alike: a job is taken from the queue and run
    while holding ``_running``, so jobs never overlap and run in submission order."""

    def __init__(
        self,
        name: str = "kvstrata-transfer",
        after_job: Callable[[], None] | None = None,
        *,
        merge: bool = False,
    ) -> None:
        self._after_job = after_job
        self._merge = merge
        self._lock = threading.Lock()  # guards _queue and _unfinished
        self._queue: deque[Callable[[], None] | None] = deque()  # None: the worker stops there
        self._unfinished = 0  # jobs submitted and not finished
        self._turns = 0  # times a thread let go of _running (a waiting caller looks again)
        self._turn_waiters = 0  # callers of run_queued waiting for a turn (under _lock)
        self._queued = threading.Condition(self._lock)
        self._drained = threading.Condition(self._lock)
        self._running = threading.Lock()  # held while a group is taken and run
        self._holder: int | None = None  # the caller thread holding _running, if one does
        self.wake_ups = 0  # times the worker was signalled for queued jobs (under _lock)
        self.ran_now = 0  # jobs run_now ran (written only while holding _running)
        self._closing = False  # close() queued the stop mark (under _lock)
        self._stopped = False  # the worker reached the stop mark and ended (under _lock)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _take(self) -> JobGroup | None:
        """The oldest queued job and the queued jobs that join it, out of the queue; ``None``
        when the queue is empty or the stop mark is next (only the worker takes that)."""
        with self._lock:
            queue_ = self._queue
            if not queue_ or queue_[0] is None:
                return None
            group = JobGroup(queue_.popleft())  # type: ignore[arg-type]  # not None, checked
            while self._merge and group.key is not None and queue_:
                job = queue_[0]
                if job is None or not group.take(job):
                    break
                queue_.popleft()
            return group

    def _execute(self, group: JobGroup) -> None:
        """Run ``group``; its jobs count as finished whatever happens, also when something other
        than an ``Exception`` (a ``KeyboardInterrupt`` on a caller's thread) goes through."""
        try:
            try:
                group.run()
            except Exception:
                log.exception("kvstrata: background job raised")
        finally:
            try:
                if self._after_job is not None:
                    for _ in group.jobs:
                        self._after_job()
            finally:
                with self._lock:
                    self._unfinished -= len(group.jobs)
                    self._drained.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._queued.wait()
            try:
                with self._running:  # the stop mark too: a caller's job ends before the worker's
                    with self._lock:
                        if self._queue and self._queue[0] is None:
                            self._stopped = True
                            return
                    try:
                        group = self._take()
                        if group is not None:
                            self._execute(group)
                    except Exception:  # never lose the worker: later jobs would never run
                        log.exception("kvstrata: the background worker failed on a job")
            finally:
                self._let_go()  # also at the stop mark: a waiting caller looks again and ends

    def _let_go(self) -> None:
        """``_running`` was just released: wake the callers waiting in :meth:`run_queued` (a
        caller counts itself in ``_turn_waiters`` under ``_lock`` before it waits, so a turn is
        never missed; with none, no condition is signalled: the common case of :meth:`run_now`)."""
        with self._lock:
            self._turns += 1
            if self._turn_waiters:
                self._drained.notify_all()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` for the worker. Invariant: a submitted job always runs, also one that
        races :meth:`close`: while the worker has not reached the stop mark, the job is queued
        right before it (every job ahead of the mark was submitted earlier, so the order holds and
        the worker runs it before it stops); once the worker has stopped, the job runs on this
        thread at once (:meth:`_run_after_the_stop`), never beside another."""
        with self._lock:
            self._unfinished += 1
            stopped = self._stopped
            if not stopped:
                if self._closing:  # the stop mark is the queue's last entry (close queues one)
                    self._queue.insert(len(self._queue) - 1, job)
                else:
                    self._queue.append(job)
                self.wake_ups += 1
                self._queued.notify()
        if stopped:
            self._run_after_the_stop(job)

    def run_here(
        self, job: Callable[[], None], until: Callable[[], bool], timeout: float | None = None
    ) -> int:
        """Queue ``job`` behind the queued jobs *without waking the worker*, then run the queue
        on this thread as :meth:`run_queued` does until ``until()`` is true (the caller's result
        of ``job`` arrived); how many jobs ran here. For a caller that waits for ``job`` at once:
        the worker's wake-up would do no useful work (issue 20, part 28: 14-26 us a call on a
        2-core VM). Invariant: a job is never stranded. Whenever this returns or raises with jobs
        still queued (``timeout``, an interrupt, a call from the worker or from inside a job), the
        worker is woken for them; once :meth:`close` queued the stop mark (the worker stops
        there), ``job`` runs here after the jobs ahead of the mark (:meth:`_run_after_the_stop`).
        A caller that must see ``job`` run before it returns asks :meth:`can_run_here` first."""
        with self._lock:
            self._unfinished += 1
            closing = self._closing
            if not closing:
                self._queue.append(job)
        if closing:
            return self._run_after_the_stop(job)
        try:
            return self.run_queued(timeout, until)
        finally:
            with self._lock:
                if self._queue:
                    self.wake_ups += 1
                    self._queued.notify()

    def run_now(self, job: Callable[[], None]) -> bool:
        """Run ``job`` on this thread at once when no job is queued or running; whether it ran
        (``False``: nothing happened, the caller hands it to :meth:`run_here`). The fast path of a
        caller that waits for its job on an idle executor (issue 20, part 29): no queue, no
        condition, no wake-up; about 4 µs a call less than :meth:`run_here` on the 2-core VM.
        Invariant: as for every job, it runs while holding ``_running`` (never beside another)
        and after every job submitted before it (the queue is empty when it takes the lock, and
        a job queued later waits for the lock). ``after_job`` runs after it; an exception it
        raises is logged. It is never counted in :attr:`busy`: it is run, not submitted."""
        me = threading.get_ident()
        if self._queue or self._holder == me or threading.current_thread() is self._thread:
            return False
        if not self._running.acquire(blocking=False):
            return False
        try:
            if self._queue:  # queued between the first look and the lock: theirs go first
                return False
            self._holder = me
            self.ran_now += 1
            try:
                job()
            except Exception:
                log.exception("kvstrata: background job raised")
            finally:
                self._holder = None
                if self._after_job is not None:
                    self._after_job()
        finally:
            self._running.release()
            self._let_go()
        return True

    def can_run_here(self) -> bool:
        """Whether :meth:`run_here` called now on this thread can run its job here: not on the
        worker, not inside a job this thread runs (either would wait for itself)."""
        return threading.current_thread() is not self._thread and self._holder != (
            threading.get_ident()
        )

    def _run_after_the_stop(self, job: Callable[[], None]) -> int:
        """:meth:`run_here` after :meth:`close` queued the stop mark, or :meth:`submit` after the
        worker stopped there: the jobs ahead of the mark run first (:meth:`run_queued`: here, or
        the worker's current one to its end), then ``job`` here, never beside another; how many
        ran here."""
        if not self.can_run_here():  # this thread already runs a job: nothing runs beside it
            self._execute(JobGroup(job))
            return 1
        ran = self.run_queued()  # returns at the stop mark
        with self._running:  # after the job the worker may still be running
            self._holder = threading.get_ident()
            try:
                self._execute(JobGroup(job))
            finally:
                self._holder = None
        self._let_go()
        return ran + 1

    def run_queued(
        self, timeout: float | None = None, until: Callable[[], bool] | None = None
    ) -> int:
        """Run on this thread every job queued now or while this runs, in submission order, each
        after the job the worker may be running (never beside it), merged as the worker would;
        how many ran. It stops early when ``timeout`` seconds pass waiting for the worker's job
        (the rest stays queued for the worker), and runs nothing when called from the worker or
        after :meth:`close`. A job this runs runs to its end: ``timeout`` does not cut it. With
        ``until``, it stops before the next job once ``until()`` is true (the caller's own result
        arrived: the jobs behind it stay with the worker), and it looks again each time a job
        finishes, so a caller whose result the worker produced returns then, not after the
        worker's next job (the review's find of 2026-11-28: it waited for unrelated I/O). A job
        that calls it again on the same thread gets 0 (the jobs must not run ahead of the one
        running)."""
        me = threading.get_ident()
        if threading.current_thread() is self._thread or self._holder == me:
            return 0
        deadline = deadline_after(timeout)
        ran = 0
        while until is None or not until():
            with self._lock:
                seen = self._turns
            if self._running.acquire(blocking=False):
                self._holder = me
                try:
                    if until is not None and until():
                        return ran
                    group = self._take()
                    if group is None:
                        return ran
                    self._execute(group)
                    ran += len(group.jobs)
                finally:
                    self._holder = None
                    self._running.release()
                    self._let_go()
                continue
            left = seconds_left(deadline)  # another thread holds _running: wait until it lets go
            if left is not None and left <= 0:
                return ran
            with self._lock:
                self._turn_waiters += 1
                try:
                    self._drained.wait_for(lambda seen=seen: self._turns != seen, left)  # type: ignore[misc]
                finally:
                    self._turn_waiters -= 1
        return ran

    @property
    def busy(self) -> bool:
        """Whether a submitted job has not finished yet."""
        with self._lock:
            return self._unfinished > 0

    def wait_drained(self, timeout: float | None = None) -> bool:
        """Block until every job submitted so far has finished (an event, not a poll); ``False``
        if ``timeout`` seconds passed first (a hang guard, for tests and shutdown)."""
        with self._lock:
            return self._drained.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self) -> None:
        """Finish every submitted job, then stop the worker. The stop mark is queued once, so a
        second (or concurrent) close only waits for the worker."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._queue.append(None)
                self._queued.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()


class InlineExecutor:
    """Runs every job at once, on the submitting thread, before ``submit`` returns (a raising job
    is logged, as on a worker). For callers that wait for each result anyway (an encoder worker
    pushing embeddings; a reader that needs them now): no thread hand-off. A
    :class:`ThreadExecutor` whose waiters call :meth:`ThreadExecutor.run_queued` saves the same
    hand-off and still runs in the background what nobody waits for (docs/benchmarks.md, issue 20)."""

    def submit(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:
            log.exception("kvstrata: inline job raised")

    def close(self) -> None:
        """Nothing is ever pending."""


class ManualExecutor:
    """Runs nothing until told: ``run_next()`` runs the oldest submitted job. For tests."""

    def __init__(self) -> None:
        self.jobs: deque[Callable[[], None]] = deque()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.append(job)

    def run_next(self) -> bool:
        if not self.jobs:
            return False
        self.jobs.popleft()()
        return True

    def run_merged(self) -> int:
        """Run the oldest job together with the queued jobs right behind it that join it (as
        :class:`ThreadExecutor` with ``merge`` does); how many jobs ran."""
        if not self.jobs:
            return 0
        group = JobGroup(self.jobs.popleft())
        while self.jobs and group.take(self.jobs[0]):
            self.jobs.popleft()
        group.run()
        return len(group.jobs)

    def step_next(self) -> bool:
        """Advance the oldest job by one step (a :class:`Stepped` job such as the transfer
        controller's ``CopyJob``; any other job runs whole); the job leaves the queue once it
        finished. Whether a job was there to step."""
        if not self.jobs:
            return False
        job = self.jobs[0]
        if not isinstance(job, Stepped):
            self.jobs.popleft()
            job()
        elif job.step():
            self.jobs.popleft()
        return True

    def begin_next(self) -> bool:
        """Begin the oldest job without finishing it (a call left hanging): its ``begin()`` runs
        if it has one (the store link's calls note when they started); ``run_next`` finishes it."""
        if not self.jobs:
            return False
        begin = getattr(self.jobs[0], "begin", None)
        if begin is not None:
            begin()
        return True

    def run_all(self) -> int:
        count = 0
        while self.run_next():
            count += 1
        return count

    def close(self) -> None:
        self.run_all()


class ManualJoinableExecutor(ManualExecutor):
    """A :class:`ManualExecutor` that a waiting caller may drive (:class:`Joinable`): nothing runs
    until a test says so *or* a caller waits for a job, which then runs the queued jobs itself, in
    order, as with :meth:`ThreadExecutor.run_queued`. For tests of callers that wait for some jobs
    and leave others in the background (the connector worker's L3 puts)."""

    def run_queued(
        self, timeout: float | None = None, until: Callable[[], bool] | None = None
    ) -> int:
        """Run the queued jobs in order until ``until()`` is true or none is left; how many ran
        (``timeout`` is not needed: nothing else runs them)."""
        ran = 0
        while (until is None or not until()) and self.run_next():
            ran += 1
        return ran

    def run_here(
        self, job: Callable[[], None], until: Callable[[], bool], timeout: float | None = None
    ) -> int:
        """Queue ``job`` and run the queue until ``until()`` is true, as
        :meth:`ThreadExecutor.run_here` (nothing to wake here)."""
        self.submit(job)
        return self.run_queued(timeout, until)

    def can_run_here(self) -> bool:
        """Always: any thread may drive a manual executor."""
        return True

    def run_now(self, job: Callable[[], None]) -> bool:
        """Run ``job`` at once when nothing is queued, as :meth:`ThreadExecutor.run_now`;
        whether it ran."""
        if self.jobs:
            return False
        job()
        return True
