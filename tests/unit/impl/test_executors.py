"""``ThreadExecutor.run_queued``: a caller about to wait runs the queued jobs itself (issue 20).

Whoever runs a job, the worker or a caller, the jobs run one at a time in submission order, merged
as the worker merges them. Which side runs which job depends on the threads' timing, so these tests
check only what holds under every timing, and park the worker in a job when a test needs to know.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from kvstrata.impl.executors import InlineExecutor, Joinable, ManualExecutor, ThreadExecutor


class Gate:
    """A job that keeps the worker busy until :meth:`open` (everything after it stays queued)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.opened = threading.Event()

    def __call__(self) -> None:
        self.started.set()
        self.opened.wait(10)

    def open(self) -> None:
        self.opened.set()


class Recorder:
    """Jobs that log (name, thread) and fail the test's check when two ever overlap."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.active = 0
        self.overlaps = 0

    def job(self, name: str, pause: float = 0.0) -> object:
        def run() -> None:
            self.active += 1
            self.overlaps += self.active > 1
            if pause:
                time.sleep(pause)
            self.log.append((name, threading.get_ident()))
            self.active -= 1

        return run


def parked(executor: ThreadExecutor) -> Gate:
    """The worker held in a gate job (started, so no caller can take it)."""
    gate = Gate()
    executor.submit(gate)
    assert gate.started.wait(10)
    return gate


def test_thread_executor_is_joinable_and_the_others_are_not() -> None:
    executor = ThreadExecutor("test-joinable")
    try:
        assert isinstance(executor, Joinable)
        assert not isinstance(ManualExecutor(), Joinable)  # a test decides when its jobs run
        assert not isinstance(InlineExecutor(), Joinable)  # nothing is ever queued
    finally:
        executor.close()


@pytest.mark.parametrize("pause", [0.0, 0.002])
def test_run_queued_runs_every_job_in_order_and_never_beside_the_worker(pause: float) -> None:
    executor = ThreadExecutor("test-order")
    recorder = Recorder()
    try:
        gate = parked(executor)
        for i in range(12):
            executor.submit(recorder.job(f"j{i}", pause))
        threading.Timer(0.05, gate.open).start()
        executor.run_queued()  # waits for the gate's job, then takes what the worker has not
        # everything submitted before the call has finished when it returns
        assert [name for name, _ in recorder.log] == [f"j{i}" for i in range(12)]
        assert recorder.overlaps == 0
        assert not executor.busy
    finally:
        executor.close()


def test_run_queued_runs_on_the_callers_thread_what_the_worker_did_not_take() -> None:
    executor = ThreadExecutor("test-caller")
    recorder = Recorder()
    try:
        gate = parked(executor)
        executor.submit(recorder.job("a"))
        # the worker is held: a caller with a timeout gives up and leaves the job queued
        assert executor.run_queued(timeout=0.02) == 0
        assert recorder.log == []
        gate.open()
        assert executor.wait_drained(10)
        assert [name for name, _ in recorder.log] == ["a"]
        # with the worker idle and the GIL held until the call, the caller takes the job
        ran = 0
        for i in range(20):
            executor.submit(recorder.job(f"b{i}"))
            ran += executor.run_queued()
        mine = sum(ident == threading.get_ident() for _, ident in recorder.log)
        assert ran == mine
        # the worker needs the GIL to take a job and the caller holds it from submit on, so the
        # caller takes nearly all of them (only a preemption longer than the switch interval
        # lets the worker in first)
        assert ran >= 1
        assert not executor.busy
    finally:
        executor.close()


def test_run_queued_merges_as_the_worker_does() -> None:
    log: list[tuple[str, ...]] = []

    class Job:
        merge_pages, merge_limit = 1, 3

        def __init__(self, name: str, key: object) -> None:
            self.name, self.merge_key = name, key

        def __call__(self) -> None:
            log.append((self.name,))

        def run_merged(self, others: list[Job]) -> None:
            log.append((self.name, *(other.name for other in others)))

    executor = ThreadExecutor("test-merge-caller", merge=True)
    try:
        gate = parked(executor)
        for name, key in [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 2), ("f", None)]:
            executor.submit(Job(name, key))
        threading.Timer(0.05, gate.open).start()
        executor.run_queued()
        assert log == [("a", "b", "c"), ("d",), ("e",), ("f",)]
    finally:
        executor.close()


def test_after_job_and_the_drain_count_the_jobs_a_caller_ran() -> None:
    bumps: list[int] = []
    executor = ThreadExecutor("test-after", after_job=lambda: bumps.append(1))
    recorder = Recorder()
    try:
        for i in range(5):
            executor.submit(recorder.job(f"j{i}"))
        executor.run_queued()
        assert executor.wait_drained(0)  # nothing left: the count includes the caller's jobs
        assert len(bumps) == 5
    finally:
        executor.close()


def test_run_queued_does_nothing_on_the_worker_or_after_close_and_a_late_job_still_runs() -> None:
    executor = ThreadExecutor("test-reentry")
    recorder = Recorder()
    answers: list[int] = []

    def reentrant() -> None:
        executor.submit(recorder.job("late"))
        answers.append(executor.run_queued())  # on the worker: it would run ahead of itself

    executor.submit(reentrant)
    assert executor.wait_drained(10)
    assert answers == [0]
    assert [name for name, _ in recorder.log] == ["late"]  # the worker ran it afterwards
    executor.close()
    executor.submit(recorder.job("after close"))  # the worker stopped: it runs here, at once
    assert [name for name, _ in recorder.log] == ["late", "after close"]
    assert executor.run_queued() == 0  # nothing is left queued after the stop
    assert executor.wait_drained(0)


def test_a_job_that_raises_on_the_caller_is_logged_and_the_rest_run() -> None:
    executor = ThreadExecutor("test-raise")
    recorder = Recorder()

    def boom() -> None:
        raise RuntimeError("job failed")

    try:
        parked_gate = parked(executor)
        executor.submit(boom)
        executor.submit(recorder.job("after"))
        threading.Timer(0.02, parked_gate.open).start()
        executor.run_queued()
        assert [name for name, _ in recorder.log] == ["after"]
        assert not executor.busy
    finally:
        executor.close()


def test_close_returns_only_after_a_callers_job_finished() -> None:
    executor = ThreadExecutor("test-close-race")
    started, finished = threading.Event(), threading.Event()
    ran_on: list[int] = []

    def slow() -> None:
        ran_on.append(threading.get_ident())
        started.set()
        time.sleep(0.2)
        finished.set()

    def caller() -> None:  # submits and runs the queue at once: it nearly always takes the job
        executor.submit(slow)
        executor.run_queued()

    helper = threading.Thread(target=caller)
    helper.start()
    assert started.wait(10)
    executor.close()  # from a third thread, while the job may still run on the caller's
    assert finished.is_set(), f"close returned before the job ended (ran on {ran_on})"
    helper.join(10)


def test_an_interrupt_in_a_callers_job_still_counts_the_job_finished() -> None:
    bumps: list[int] = []
    executor = ThreadExecutor("test-interrupt", after_job=lambda: bumps.append(1))
    main = threading.get_ident()

    def interrupted() -> None:
        if threading.get_ident() == main:  # an interrupt reaches only the main thread
            raise KeyboardInterrupt

    try:
        executor.submit(interrupted)
        with contextlib.suppress(KeyboardInterrupt):  # it reaches the caller that ran the job
            executor.run_queued()
        assert executor.wait_drained(10) and not executor.busy
        assert len(bumps) == 1
    finally:
        executor.close()


def test_until_leaves_the_jobs_behind_the_callers_own_to_the_worker() -> None:
    executor = ThreadExecutor("test-until")
    recorder = Recorder()
    try:
        gate = parked(executor)
        for i in range(4):
            executor.submit(recorder.job(f"j{i}"))
        threading.Timer(0.02, gate.open).start()
        executor.run_queued(until=lambda: any(name == "j1" for name, _ in recorder.log))
        names = [name for name, _ in recorder.log]
        assert names[:2] == ["j0", "j1"]  # ran up to the wanted job, in order
        assert executor.wait_drained(10)
        assert [name for name, _ in recorder.log] == ["j0", "j1", "j2", "j3"]
    finally:
        executor.close()


def test_a_job_that_runs_the_queue_again_on_a_callers_thread_gets_nothing() -> None:
    executor = ThreadExecutor("test-nested")
    answers: list[int] = []
    recorder = Recorder()
    try:
        gate = parked(executor)
        executor.submit(lambda: answers.append(executor.run_queued()))
        executor.submit(recorder.job("after"))
        threading.Timer(0.02, gate.open).start()
        executor.run_queued()
        assert answers == [0] and [name for name, _ in recorder.log] == ["after"]
    finally:
        executor.close()


def test_a_job_with_a_merge_key_that_is_no_mergeable_neither_merges_nor_stops_the_worker() -> None:
    executor = ThreadExecutor("test-odd-merge", merge=True)
    recorder = Recorder()
    try:
        gate = parked(executor)
        for name in ("a", "b"):
            job = recorder.job(name)
            job.merge_key = 1  # type: ignore[attr-defined]  # a key, but no run_merged
            executor.submit(job)
        gate.open()
        assert executor.wait_drained(10)
        assert [name for name, _ in recorder.log] == ["a", "b"]
    finally:
        executor.close()


def test_a_caller_whose_result_the_worker_made_returns_without_the_job_behind_it() -> None:
    """The worker runs the caller's own job while another waits behind it: once the caller's
    job is done, ``run_queued(until=...)`` returns at once; it neither waits for the next job
    nor runs it (the review's find of 2026-11-28: a wait for a 0.2 s get took 2.2 s)."""
    executor = ThreadExecutor("test-until-worker")
    mine, behind = Gate(), Gate()
    try:
        executor.submit(mine)
        assert mine.started.wait(10)
        executor.submit(behind)
        returned = threading.Event()

        def wait() -> None:
            executor.run_queued(timeout=30, until=mine.opened.is_set)
            returned.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.05)  # the caller is waiting for the worker's job
        mine.open()
        assert returned.wait(5), "run_queued waited for the job behind the caller's own"
        assert behind.started.wait(5)  # the worker took it, not the caller
        waiter.join(5)
    finally:
        behind.open()
        executor.close()


class SlowExitLock:
    """A real lock whose ``with`` on the worker's thread holds it 0.3 s longer: a legal
    interleaving, widened so that a caller tries the lock while the worker stops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.worker: threading.Thread | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> SlowExitLock:
        self._lock.acquire()
        return self

    def __exit__(self, *_exc: object) -> None:
        if threading.current_thread() is self.worker:
            time.sleep(0.3)
        self._lock.release()


def test_a_caller_waiting_while_the_worker_stops_returns() -> None:
    """The worker holds ``_running`` for the stop mark while a caller's try fails: the worker
    lets go on that path too, so the caller looks again and returns (a review found it waiting
    forever for a turn that never came)."""
    executor = ThreadExecutor("test-stop-race")
    lock = SlowExitLock()
    lock.worker = executor._thread
    executor._running = lock  # type: ignore[assignment]
    closer = threading.Thread(target=executor.close)
    closer.start()
    time.sleep(0.1)  # the worker holds _running for the stop mark
    returned: list[int] = []
    caller = threading.Thread(target=lambda: returned.append(executor.run_queued()), daemon=True)
    caller.start()
    closer.join(5)
    caller.join(5)
    assert not caller.is_alive() and returned == [0]
