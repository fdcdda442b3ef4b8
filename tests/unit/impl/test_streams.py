"""Copy streams and stepwise copy jobs (issue 19, item 3): data lands only when the stream says so,
and a batch is reported only after its stream synchronised, also when it failed."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.transfer import (
    Completion,
    CopyJob,
    DeferredStream,
    Direction,
    ImmediateStream,
    ManualExecutor,
    TransferController,
)


class Pages:
    """A fake pair of pools: ``copy`` moves values from ``src`` into ``dst`` when it runs."""

    def __init__(self) -> None:
        self.src = np.arange(10, 20)
        self.dst = np.zeros(10, dtype=np.int64)
        self.calls = 0

    def copy(self, direction: Direction, src: np.ndarray, dst: np.ndarray) -> int:
        self.calls += 1
        self.dst[dst] = self.src[src]
        return 8 * len(src)


def controller(pages: Pages, stream: DeferredStream, chunk: int | None = 1) -> TransferController:
    transfer = TransferController(pages.copy, ManualExecutor())
    transfer.use_stream(stream, chunk_pages=chunk)
    return transfer


def test_immediate_stream_lands_at_issue_and_reports_bytes_at_synchronize() -> None:
    stream = ImmediateStream()
    stream.issue(lambda: 5)
    stream.issue(lambda: 7)
    assert stream.synchronize() == 12
    assert stream.synchronize() == 0


def test_deferred_stream_lands_in_order_and_only_when_told() -> None:
    pages, stream = Pages(), DeferredStream()
    transfer = controller(pages, stream)
    transfer.enqueue(Direction.WRITE, 1, np.array([0, 1, 2]), np.array([5, 6, 7]))
    transfer.flush()
    executor = transfer.executor
    assert isinstance(executor, ManualExecutor)
    assert isinstance(executor.jobs[0], CopyJob)
    for _ in range(3):  # one issue per page: nothing has landed
        assert executor.step_next()
    assert len(stream.issued) == 3 and pages.calls == 0 and not pages.dst.any()
    assert stream.land()  # the oldest lands now
    assert pages.dst[5] == 10 and pages.dst[6] == 0
    assert executor.step_next()  # synchronise: the rest lands
    assert list(pages.dst[5:8]) == [10, 11, 12]
    assert transfer.completed() == []  # not reported yet
    assert executor.step_next() and not executor.jobs  # report
    assert transfer.completed() == [Completion(Direction.WRITE, (1,), True, 24)]


def test_a_copy_that_fails_as_it_lands_fails_the_batch_at_synchronize() -> None:
    pages, stream = Pages(), DeferredStream()
    transfer = controller(pages, stream)
    transfer.enqueue(Direction.LOAD, 4, np.array([0, 1]), np.array([3, 4]))
    transfer.flush()

    def broken() -> int:
        raise RuntimeError("boom")

    executor = transfer.executor
    assert isinstance(executor, ManualExecutor)
    executor.step_next()
    stream.issued[0] = broken
    executor.run_next()
    assert not stream.issued and pages.dst[4] == 11  # the other copy still landed
    assert transfer.completed() == [Completion(Direction.LOAD, (4,), False, 0)]


def test_a_failed_launch_waits_for_what_the_batch_already_issued() -> None:
    pages, stream = Pages(), DeferredStream()
    transfer = controller(pages, stream)
    transfer.enqueue(Direction.WRITE, 2, np.array([0, 1, 2]), np.array([5, 6, 7]))
    transfer.flush()
    executor = transfer.executor
    assert isinstance(executor, ManualExecutor)
    executor.step_next()  # the first page is in flight
    stream.refuse_next = True
    executor.run_next()  # the second fails to launch
    assert not stream.issued, "a reported batch left a copy in flight"
    assert pages.dst[5] == 10 and pages.dst[6] == 0
    assert transfer.completed() == [Completion(Direction.WRITE, (2,), False, 0)]


def test_whole_batches_issue_one_copy_and_run_whole_on_any_executor() -> None:
    pages, stream = Pages(), DeferredStream()
    transfer = controller(pages, stream, chunk=None)
    transfer.enqueue(Direction.WRITE, 1, np.array([0]), np.array([1]))
    transfer.enqueue(Direction.WRITE, 2, np.array([2, 3]), np.array([2, 3]))
    transfer.flush()
    executor = transfer.executor
    assert isinstance(executor, ManualExecutor)
    executor.run_next()
    assert pages.calls == 1 and list(pages.dst[1:4]) == [10, 12, 13]
    assert transfer.completed() == [Completion(Direction.WRITE, (1, 2), True, 24)]


def test_use_stream_is_refused_once_batches_ran_or_with_a_bad_chunk() -> None:
    pages = Pages()
    transfer = TransferController(pages.copy, ManualExecutor())
    with pytest.raises(MisuseError):
        transfer.use_stream(DeferredStream(), chunk_pages=0)
    transfer.enqueue(Direction.WRITE, 1, np.array([0]), np.array([1]))
    transfer.flush()
    with pytest.raises(MisuseError):
        transfer.use_stream(DeferredStream())
