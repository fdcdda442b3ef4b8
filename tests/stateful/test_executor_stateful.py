"""The background executor (kvstrata.impl.executors.ThreadExecutor) with callers that run its queued
jobs themselves (``run_queued``, issue 20), against the simplest model there is: the jobs in the order
they were submitted.

The worker and the callers race for the queue, so which side runs a job is left to the threads;
what must hold under every timing is checked after every step:

* order: the jobs that ran are a prefix of the submitted ones, in submission order;
* one at a time: no job starts while another runs (the worker's or a caller's);
* merging: with ``merge``, each run is one job or consecutive jobs of one key within the first's
  page limit, as the worker forms them;
* a caller waits: ``run_queued()`` returns only when every job submitted before it has finished,
  and a caller with a timeout that meets a job held on the worker runs nothing beside it;
* ``run_here`` (issue 20, part 28): a caller's own job has run when it returns, without a signal
  to an idle worker, and a job it had to leave queued is handed to the worker (mutant
  ``impl_executor_run_here_strands_a_job``), also while another thread closes the executor (mutant
  ``impl_executor_run_here_behind_the_stop``);
* ``run_now`` (part 29) runs a job at once only when nothing is queued or running (mutants
  ``impl_executor_run_now_ahead_of_the_queue``, ``impl_executor_run_now_beside_the_worker``);
* a plain ``submit`` that races ``close`` still runs, in order: ahead of the stop mark while the
  worker has not reached it, on the submitter once it has (mutant
  ``impl_executor_submit_behind_the_stop``).

The worker is parked now and then in a gate job (started, so no caller can take it) while jobs queue
behind it. A caller that took jobs without waiting for the worker's (mutant
``impl_executor_caller_beside_worker``) breaks the order and the one-at-a-time rule at once.
"""

from __future__ import annotations

import threading
import time

import hypothesis.strategies as st
from hypothesis import note
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvstrata.impl.executors import Mergeable, ThreadExecutor

LIMIT = 3  # merge_limit of every job: at most three pages of one key per run


class Log:
    """What ran, shared by the jobs: the groups in the order they ran, and overlaps seen."""

    def __init__(self) -> None:
        self.groups: list[tuple[Job, ...]] = []
        self.active = 0
        self.overlaps = 0
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.active += 1
            self.overlaps += self.active > 1

    def leave(self, group: tuple[Job, ...]) -> None:
        with self.lock:
            self.groups.append(group)
            self.active -= 1

    def ran(self) -> list[Job]:
        with self.lock:
            return [job for group in self.groups for job in group]


class Job:
    """A Mergeable job of ``merge_key`` (``None``: never merged) that logs how it ran."""

    def __init__(self, number: int, key: int | None, log: Log) -> None:
        self.number, self.merge_key, self.log = number, key, log
        self.merge_pages, self.merge_limit = 1, LIMIT

    def __repr__(self) -> str:
        return f"Job({self.number}, key={self.merge_key})"

    def __call__(self) -> None:
        self.run_merged([])

    def run_merged(self, others: list[Mergeable]) -> None:
        self.log.enter()
        self.log.leave((self, *others))  # type: ignore[arg-type]  # the machine's own jobs


class Gate(Job):
    """A job that holds the worker until opened."""

    def __init__(self, number: int, log: Log) -> None:
        super().__init__(number, None, log)
        self.started = threading.Event()
        self.opened = threading.Event()

    def run_merged(self, others: list[Mergeable]) -> None:
        self.log.enter()
        self.started.set()
        self.opened.wait(30)
        self.log.leave((self,))


class Outer(Job):
    """A job that, wherever it runs, hands ``inner`` to ``run_here`` from inside itself: that call
    cannot run it (it would run ahead of this job), so ``inner`` is left queued, unannounced."""

    def __init__(self, number: int, log: Log, executor: ThreadExecutor, inner: Job) -> None:
        super().__init__(number, None, log)
        self.executor, self.inner = executor, inner
        self.ran_here: int | None = None

    def run_merged(self, others: list[Mergeable]) -> None:
        self.log.enter()
        inner = self.inner
        self.ran_here = self.executor.run_here(inner, lambda: inner in self.log.ran(), 0.005)
        self.log.leave((self,))


def closing_with_jobs_held(
    queued: int, name: str
) -> tuple[Log, ThreadExecutor, Gate, list[Job], Job, threading.Thread]:
    """A fresh executor whose worker is held in a gate with ``queued`` jobs behind it, and a
    thread that is closing it (returned once the stop mark is queued); and the caller's own job,
    not handed over yet."""
    log = Log()
    executor = ThreadExecutor(f"test-executor-{name}")
    gate = Gate(0, log)
    jobs = [Job(n + 1, None, log) for n in range(queued)]
    mine = Job(queued + 1, None, log)
    executor.submit(gate)
    assert gate.started.wait(30)
    for job in jobs:
        executor.submit(job)
    closer = threading.Thread(target=executor.close)
    closer.start()
    while not executor._closing:  # the stop mark is queued (the worker is held in the gate)
        time.sleep(0.0005)
    return log, executor, gate, jobs, mine, closer


class ExecutorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.executor: ThreadExecutor | None = None
        self.merge = False
        self.log = Log()
        self.submitted: list[Job] = []  # the model: submission order
        self.gate: Gate | None = None

    @initialize(merge=st.booleans())
    def start(self, merge: bool) -> None:
        self.merge = merge
        self.executor = ThreadExecutor("test-executor-machine", merge=merge)

    def _executor(self) -> ThreadExecutor:
        assert self.executor is not None
        return self.executor

    @rule(keys=st.lists(st.sampled_from([None, 1, 2]), min_size=1, max_size=5))
    def submit(self, keys: list[int | None]) -> None:
        for key in keys:
            job = Job(len(self.submitted), key, self.log)
            self.submitted.append(job)
            self._executor().submit(job)

    @rule()
    def toggle_gate(self) -> None:
        """Open the gate, or hold the worker in a new one and wait until it runs (the jobs
        before it ran first). One rule, not two with preconditions: Hypothesis gives up on an
        example when it draws disabled rules several times running."""
        if self.gate is not None:
            self.gate.opened.set()
            self.gate = None
            return
        gate = Gate(len(self.submitted), self.log)
        self.submitted.append(gate)
        self._executor().submit(gate)
        assert gate.started.wait(30), "the worker never reached the gate"
        self.gate = gate

    @rule()
    def run_queued(self) -> None:
        executor = self._executor()
        if self.gate is not None:
            before = len(self.log.ran())
            ran = executor.run_queued(timeout=0.005)
            note(f"run_queued with the worker parked: {ran}")
            assert ran == 0, "a caller ran a job beside the worker's"
            assert len(self.log.ran()) == before
            return
        ran = executor.run_queued()
        note(f"run_queued: {ran}")
        assert self.log.ran() == self.submitted, "run_queued returned before the queue ran"

    @rule(key=st.sampled_from([None, 1, 2]), inside=st.booleans())
    def run_here(self, key: int | None, inside: bool) -> None:
        """A caller that waits for its job at once (``run_here``): with the worker idle, the job
        runs by the time it returns and the worker is never signalled; with the worker parked,
        nothing runs beside it. ``inside``: the job itself hands another job to ``run_here``,
        which cannot run it there; that job must still run soon, on the worker, which
        ``run_here`` wakes for it (a sleeping worker never sees an unannounced job)."""
        executor = self._executor()
        if self.gate is not None:
            job = Job(len(self.submitted), key, self.log)
            self.submitted.append(job)
            before = len(self.log.ran())
            ran = executor.run_here(job, lambda: job in self.log.ran(), timeout=0.005)
            assert ran == 0 and len(self.log.ran()) == before, "a job ran beside the worker's"
            return
        woken = executor.wake_ups
        if inside:
            inner = Job(len(self.submitted) + 1, key, self.log)
            job = Outer(len(self.submitted), self.log, executor, inner)
            self.submitted += [job, inner]
        else:
            job = Job(len(self.submitted), key, self.log)
            self.submitted.append(job)
        executor.run_here(job, lambda: job in self.log.ran())
        assert job in self.log.ran(), "run_here returned before its job ran"
        if not inside:
            assert executor.wake_ups == woken, "run_here signalled the worker for its own job"
            assert self.log.ran() == self.submitted
            return
        assert isinstance(job, Outer) and job.ran_here == 0
        drained = executor.wait_drained(5)
        if not drained:  # wake the worker, so that the teardown does not wait for it again
            executor.submit(lambda: None)
        assert drained, "a job left queued by run_here was never run"
        note(f"run_here from inside a job: {executor.wake_ups - woken} wake-up(s)")

    @rule(queued=st.integers(0, 3))
    def run_now(self, queued: int) -> None:
        """A caller that would run its job at once (``run_now``, part 29) right after submitting
        ``queued`` jobs: it runs only when nothing is queued or running (then after every job
        submitted before it, never beside one); with the worker parked in the gate it never runs.
        Whether the worker has taken the queued jobs yet is the threads' race: both outcomes are
        legal, the order invariant says which one is not."""
        executor = self._executor()
        for _ in range(queued):
            job = Job(len(self.submitted), None, self.log)
            self.submitted.append(job)
            executor.submit(job)
        mine = Job(len(self.submitted), None, self.log)
        self.submitted.append(mine)
        ran = executor.run_now(mine)
        note(f"run_now after {queued} queued: {ran}")
        if not ran:
            self.submitted.pop()  # never handed over: it is not the executor's
            assert mine not in self.log.ran(), "run_now said no but ran the job"
            return
        assert self.gate is None, "run_now ran a job beside the worker's"
        assert self.log.ran()[-1] is mine, "run_now returned before its job ran"

    @rule(queued=st.integers(0, 2))
    def run_here_while_closing(self, queued: int) -> None:
        """A caller hands a job to ``run_here`` while another thread closes the executor (its own
        executor, with ``queued`` jobs behind a held one): the worker stops at the mark, so the
        job must run on the caller, after every job ahead of the mark, never beside one."""
        log, executor, gate, jobs, mine, closer = closing_with_jobs_held(queued, "closing")
        threading.Timer(0.002, gate.opened.set).start()
        executor.run_here(mine, lambda: mine in log.ran())
        closer.join(30)
        assert not closer.is_alive()
        assert log.ran() == [gate, *jobs, mine], f"after the stop mark: {log.ran()}"
        assert log.overlaps == 0

    @rule(queued=st.integers(0, 2), stopped=st.booleans())
    def submit_while_closing(self, queued: int, stopped: bool) -> None:
        """A plain ``submit`` that races ``close`` (its own executor, ``queued`` jobs behind a
        held one): before the worker reaches the stop mark, the job goes ahead of the mark and the
        worker runs it before it stops; once the worker has stopped (``stopped``), it runs on the
        submitting thread at once. Either way it runs, after every job submitted before it, never
        beside one, and nothing waits for it forever."""
        log, executor, gate, jobs, mine, closer = closing_with_jobs_held(queued, "submit-closing")
        if stopped:
            gate.opened.set()
            closer.join(30)
            assert not closer.is_alive()
            executor.submit(mine)
            assert log.ran() == [gate, *jobs, mine], "a job submitted after the stop did not run"
        else:
            executor.submit(mine)
            gate.opened.set()
            closer.join(30)
            assert not closer.is_alive()
            assert log.ran() == [gate, *jobs, mine], f"submitted while closing: {log.ran()}"
        assert executor.wait_drained(5), "a job submitted while closing is counted unfinished"
        assert log.overlaps == 0

    @invariant()
    def in_order_one_at_a_time(self) -> None:
        ran = self.log.ran()
        assert ran == self.submitted[: len(ran)], f"out of order: {ran}"
        assert self.log.overlaps == 0, "two jobs ran at once"

    @invariant()
    def merged_as_the_worker_merges(self) -> None:
        with self.log.lock:
            groups = list(self.log.groups)
        for group in groups:
            if len(group) == 1:
                continue
            assert self.merge, f"merged without merge: {group}"
            assert group[0].merge_key is not None and len(group) <= LIMIT
            assert all(job.merge_key == group[0].merge_key for job in group)

    def teardown(self) -> None:
        if self.executor is None:
            return
        if self.gate is not None:
            self.gate.opened.set()
        try:
            assert self.executor.wait_drained(30)
            assert self.log.ran() == self.submitted
            assert self.log.overlaps == 0
        finally:
            self.executor.close()


TestExecutor = ExecutorMachine.TestCase
