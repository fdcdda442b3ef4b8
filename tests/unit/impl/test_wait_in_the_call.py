"""A verb that submits and waits in one call (issue 20, part 28).

``ThreadExecutor.run_here`` queues a job without waking the worker and runs the queue on the
caller's thread up to it; the embedding cache's ``insert_batch`` / ``commit`` / ``prefetch`` take
``wait=True`` and return once their own op's result was applied. What must hold:

- with an idle worker the job runs on the caller's thread and the worker is never signalled (the
  wake-up is the cost this saves);
- no job is ever stranded in the queue of a sleeping worker: when ``run_here`` returns or raises
  with jobs left (a timeout, an interrupt, a call from inside a job), the worker is woken for them;
- ``run_now`` (part 29) runs a job at once only on an idle executor (nothing queued, nothing
  running, not from inside a job), and a ``wait=True`` verb of a node with no other op pending
  takes it;
- the cache's results are applied before the verb returns (bit for bit on a real Mooncake master:
  ``storage/test_embedding_mooncake.py``), and a ``ManualExecutor`` (which runs nothing until a
  test says so) is refused with a typed error that changes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from support.embeddings import same_bits, seeded_embedding

from kvstrata.impl.embedding import (
    EmbeddingCache,
    EmbeddingPool,
    MemoryEmbeddingStore,
    PoolShape,
)
from kvstrata.impl.errors import MisuseError
from kvstrata.impl.executors import (
    InlineExecutor,
    ManualExecutor,
    ManualJoinableExecutor,
    RunsHere,
    ThreadExecutor,
)
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, PageHash, Shard, content_hash
from kvstrata.model.lifecycles import EntryState

DIM = 32
KEYSPACE = KeySpace(
    ModelIdentity(name="clip-wait", dtype="fp16", kind=KVKind.EMBEDDING, dim=DIM),
    shard=Shard.replicated(),
)
A, B, C = (content_hash(f"wait-{name}".encode()) for name in ("a", "b", "c"))


def embedding(media: PageHash, tokens: int) -> torch.Tensor:
    return seeded_embedding(media, tokens, DIM, torch.float16)


def parked(executor: ThreadExecutor) -> None:
    """Wait until the worker sleeps for work (it then takes nothing it was not woken for). It
    looks at the worker's condition's waiters: CPython's ``threading.Condition`` internals."""
    deadline = time.monotonic() + 10
    while not executor._queued._waiters:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the worker never went to sleep"
        time.sleep(0.001)


def test_run_here_runs_on_the_callers_thread_without_waking_an_idle_worker() -> None:
    executor = ThreadExecutor("test-run-here")
    try:
        assert isinstance(executor, RunsHere) and isinstance(ManualJoinableExecutor(), RunsHere)
        assert not isinstance(ManualExecutor(), RunsHere)
        executor.submit(lambda: None)
        assert executor.wait_drained(10)
        parked(executor)
        woken = executor.wake_ups
        threads: list[int] = []
        for _ in range(20):
            done = threading.Event()

            def job(done: threading.Event = done) -> None:
                threads.append(threading.get_ident())
                done.set()

            assert executor.run_here(job, done.is_set) == 1
        assert threads == [threading.get_ident()] * 20
        assert executor.wake_ups == woken  # the worker was never signalled
    finally:
        executor.close()


def test_a_job_left_queued_by_run_here_is_handed_to_the_worker() -> None:
    """``run_here`` called from inside a job that a caller runs (it cannot run ahead of that job):
    it returns at once, and the worker is woken for what it queued, which then runs."""
    executor = ThreadExecutor("test-run-here-left")
    ran: list[str] = []
    inner_done = threading.Event()

    def inner() -> None:
        ran.append("inner")
        inner_done.set()

    answers: list[int] = []

    def outer() -> None:
        ran.append("outer")
        answers.append(executor.run_here(inner, inner_done.is_set))

    try:
        parked(executor)
        assert executor.run_here(outer, lambda: "outer" in ran) == 1 and answers == [0]
        assert inner_done.wait(10), "a job queued without a wake-up was stranded"
        assert ran == ["outer", "inner"] and executor.wait_drained(10)
    finally:
        executor.close()


def held_job(order: list[str]) -> tuple[Callable[[], None], threading.Event, threading.Event]:
    """A job that says it started, waits for its gate (at most 10 s), then logs "held" in
    ``order``; with its gate and its started event."""
    gate, started = threading.Event(), threading.Event()

    def held() -> None:
        started.set()
        gate.wait(10)
        order.append("held")

    return held, gate, started


def test_run_here_after_close_runs_the_job_after_those_ahead_of_the_stop() -> None:
    """A caller that hands a job over while ``close`` stops the worker: the worker ends at the stop
    mark, so the job runs on the caller, after every job queued before the mark."""
    executor = ThreadExecutor("test-run-here-closed")
    order: list[str] = []
    held, gate, started = held_job(order)

    executor.submit(held)
    assert started.wait(10)
    executor.submit(lambda: order.append("queued"))
    closer = threading.Thread(target=executor.close)
    closer.start()
    deadline = time.monotonic() + 10
    while not executor._closing:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(0.001)
    threading.Timer(0.05, gate.set).start()
    ran = executor.run_here(lambda: order.append("mine"), lambda: "mine" in order)
    closer.join(10)
    assert order == ["held", "queued", "mine"] and ran in (1, 2)
    assert executor.run_here(lambda: order.append("late"), lambda: "late" in order) == 1
    assert order[-1] == "late" and executor.wait_drained(1)


def test_an_interrupted_run_here_wakes_the_worker_for_the_job() -> None:
    executor = ThreadExecutor("test-run-here-raise")
    ran = threading.Event()

    def interrupted() -> bool:
        raise KeyboardInterrupt  # the caller gives up before it took the job

    try:
        with pytest.raises(KeyboardInterrupt):
            executor.run_here(ran.set, interrupted)
        assert ran.wait(10), "a job queued without a wake-up was stranded"
    finally:
        executor.close()


def test_run_now_runs_at_once_only_on_an_idle_executor() -> None:
    """``run_now`` (part 29) runs the job on the caller when nothing is queued or running, and
    does nothing otherwise: with the worker held in a job, and with a job queued ahead."""
    executor = ThreadExecutor("test-run-now")
    order: list[str] = []
    held, gate, started = held_job(order)

    try:
        parked(executor)
        woken = executor.wake_ups
        assert executor.run_now(lambda: order.append(threading.current_thread().name))
        assert order == [threading.current_thread().name] and executor.ran_now == 1
        assert executor.wake_ups == woken and not executor.busy
        order.clear()
        executor.submit(held)
        assert started.wait(10)
        assert not executor.run_now(lambda: order.append("beside"))  # the worker holds a job
        executor.submit(lambda: order.append("queued"))
        gate.set()
        assert executor.wait_drained(10) and order == ["held", "queued"]
        assert executor.ran_now == 1
    finally:
        gate.set()
        executor.close()


def test_run_now_refuses_a_job_queued_ahead_and_from_inside_a_job() -> None:
    executor = ManualJoinableExecutor()
    order: list[str] = []
    executor.submit(lambda: order.append("first"))
    assert not executor.run_now(lambda: order.append("second")) and order == []
    assert executor.run_all() == 1 and executor.run_now(lambda: order.append("now"))
    assert order == ["first", "now"]
    thread_executor = ThreadExecutor("test-run-now-inside")
    answers: list[bool] = []
    try:
        thread_executor.submit(lambda: answers.append(thread_executor.run_now(lambda: None)))
        assert thread_executor.wait_drained(10) and answers == [False]  # on the worker
        inside: list[bool] = []
        assert thread_executor.run_now(lambda: inside.append(thread_executor.run_now(lambda: None)))
        assert inside == [False]  # inside a job this thread runs: it would run beside it
    finally:
        thread_executor.close()


def test_wait_true_on_an_idle_node_runs_its_store_call_at_once() -> None:
    """A ``wait=True`` verb with no other op of the node pending takes ``run_now`` (no queue, no
    wake-up); with an op in flight it takes ``run_here`` behind it."""
    store = MemoryEmbeddingStore()
    executor = ThreadExecutor("test-run-now-cache")
    shape = PoolShape(8, 4, DIM, torch.float16)
    cache = EmbeddingCache(EmbeddingPool(shape), store, KEYSPACE, executor=executor)
    try:
        parked(executor)
        woken = executor.wake_ups
        assert cache.insert_batch([A], [embedding(A, 4)], wait=True).stored == 1
        assert executor.ran_now == 1 and executor.wake_ups == woken
        assert cache.prefetch("r", [A], [4], wait=True).local == 1  # no store call: nothing run
        assert executor.ran_now == 1
        cache.insert_batch([B], [embedding(B, 4)])  # in flight (or applied by now)
        cache.insert_batch([C], [embedding(C, 4)], wait=True)
        assert cache.pending_ops() == () and cache.counters.pushed == 3
        assert executor.ran_now in (1, 2)  # 2 only when B's put had finished and was applied
    finally:
        cache.close()


@pytest.mark.parametrize("kind", ["thread", "inline", "joinable"])
def test_wait_true_applies_the_verbs_own_op_before_it_returns(kind: str) -> None:
    store = MemoryEmbeddingStore()
    executors = {
        "thread": ThreadExecutor,
        "inline": InlineExecutor,
        "joinable": ManualJoinableExecutor,
    }
    shape = PoolShape(8, 4, DIM, torch.float16)
    writer = EmbeddingCache(EmbeddingPool(shape), store, KEYSPACE, executor=executors[kind]())
    reader = EmbeddingCache(EmbeddingPool(shape), store, KEYSPACE, executor=executors[kind]())
    try:
        report = writer.insert_batch([A], [embedding(A, 4)], wait=True)
        assert report.stored == 1 and writer.pending_ops() == ()
        entry = writer.entry(A)
        assert entry is not None and entry.state is EntryState.READY
        assert writer.counters.pushed == 1 and writer.exists([A], [4]) == (True,)
        reservation = writer.reserve([B, C], [4, 7])
        for media, tokens in zip(reservation.new, [4, 7], strict=True):
            reservation.write(media, embedding(media, tokens))
        assert writer.commit(reservation, wait=True).stored == 2 and writer.pending_ops() == ()
        assert writer.counters.pushed == 3
        fetched = reader.prefetch("r", [A, B, C], [4, 4, 7], probe=False, wait=True)
        assert fetched.loading == 3 and reader.is_ready("r") and reader.pending_ops() == ()
        got = reader.get([A, B, C])
        assert all(
            same_bits(g, embedding(m, t)) for g, m, t in zip(got, [A, B, C], [4, 4, 7], strict=True)
        )
    finally:
        writer.close()
        reader.close()


def test_wait_true_settles_the_ops_queued_before_it_in_order() -> None:
    store = MemoryEmbeddingStore()
    executor = ManualJoinableExecutor()
    cache = EmbeddingCache(
        EmbeddingPool(PoolShape(8, 4, DIM, torch.float16)), store, KEYSPACE, executor=executor
    )
    first = cache.insert_batch([A], [embedding(A, 4)])
    assert first.op is not None and cache.pending_ops() == (first.op,)
    second = cache.insert_batch([B], [embedding(B, 4)], wait=True)
    assert second.op is not None and cache.pending_ops() == () and not executor.jobs
    assert cache.counters.pushed == 2
    cache.close()


def test_wait_true_on_a_manual_executor_is_refused_and_changes_nothing() -> None:
    store = MemoryEmbeddingStore()
    cache = EmbeddingCache(
        EmbeddingPool(PoolShape(8, 4, DIM, torch.float16)),
        store,
        KEYSPACE,
        executor=ManualExecutor(),
    )
    reservation = cache.reserve([A], [4])
    reservation.write(A, embedding(A, 4))
    with pytest.raises(MisuseError, match="ManualExecutor"):
        cache.commit(reservation, wait=True)
    with pytest.raises(MisuseError, match="ManualExecutor"):
        cache.insert_batch([B], [embedding(B, 4)], wait=True)
    with pytest.raises(MisuseError, match="ManualExecutor"):
        cache.prefetch("r", [C], [4], probe=False, wait=True)
    with pytest.raises(MisuseError, match="wait is a bool"):
        cache.commit(reservation, wait="yes")  # type: ignore[arg-type]
    entry = cache.entry(A)
    assert entry is not None and entry.state is EntryState.FILLING  # still open
    assert cache.entry(B) is None and cache.entry(C) is None and cache.pending_ops() == ()
    assert cache.commit(reservation).stored == 1  # the reservation was left as it was
    cache.close()


def test_wait_true_inside_a_job_of_its_own_executor_is_refused_and_changes_nothing() -> None:
    """A verb with ``wait=True`` made from inside a job this thread runs for the cache's executor
    would wait for itself (its put queues behind the running job): refused, nothing changed."""
    executor = ThreadExecutor("test-wait-inside")
    cache = EmbeddingCache(
        EmbeddingPool(PoolShape(8, 4, DIM, torch.float16)),
        MemoryEmbeddingStore(),
        KEYSPACE,
        executor=executor,
    )
    raised: list[BaseException] = []
    finished = threading.Event()

    def job() -> None:
        try:
            cache.insert_batch([A], [embedding(A, 4)], wait=True)
        except MisuseError as error:
            raised.append(error)
        finally:
            finished.set()

    try:
        parked(executor)
        executor.run_here(job, finished.is_set)
        assert len(raised) == 1 and "wait for itself" in str(raised[0])
        assert cache.entry(A) is None and cache.pending_ops() == ()
        assert cache.insert_batch([A], [embedding(A, 4)], wait=True).stored == 1
    finally:
        cache.close()
