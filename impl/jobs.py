"""What the executors (:mod:`kvstrata.impl.executors`) run and how their callers wait: the
executor protocols, the job kinds (:class:`Stepped`, :class:`Mergeable`), a merged group of jobs
(:class:`JobGroup`) and the deadline helpers. Re-exported by :mod:`kvstrata.impl.executors`."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Protocol, TypeVar, runtime_checkable

__all__ = [
    "Executor",
    "JobGroup",
    "Joinable",
    "Mergeable",
    "RunsHere",
    "Stepped",
    "deadline_after",
    "drain",
    "seconds_left",
]

T = TypeVar("T")


def deadline_after(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` reading ``timeout`` seconds from now; ``None``: no deadline."""
    return None if timeout is None else time.monotonic() + timeout


def seconds_left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (never negative); ``None``: no deadline."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def drain(results: queue.SimpleQueue[T]) -> list[T]:
    """Everything in ``results`` now, oldest first, without blocking (the scheduler thread's side
    of a worker's result queue)."""
    out: list[T] = []
    while True:
        try:
            out.append(results.get_nowait())
        except queue.Empty:
            return out


class Executor(Protocol):
    def submit(self, job: Callable[[], None]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Joinable(Protocol):
    """An executor whose queued jobs a caller that is about to wait for them may run itself, on its
    own thread, in their order (:meth:`ThreadExecutor.run_queued`)."""

    def run_queued(
        self, timeout: float | None = None, until: Callable[[], bool] | None = None
    ) -> int: ...


@runtime_checkable
class RunsHere(Protocol):
    """A :class:`Joinable` executor that also takes a job for a caller about to wait for it and
    runs it on the caller's thread without waking its worker (:meth:`ThreadExecutor.run_here`),
    or at once when nothing is queued or running (:meth:`ThreadExecutor.run_now`)."""

    def run_here(
        self, job: Callable[[], None], until: Callable[[], bool], timeout: float | None = None
    ) -> int: ...

    def can_run_here(self) -> bool: ...

    def run_now(self, job: Callable[[], None]) -> bool: ...


@runtime_checkable
class Stepped(Protocol):
    """A job a :class:`ManualExecutor` can advance a step at a time: :meth:`step` runs the next
    step and says whether the job finished (calling the job runs every step left)."""

    def __call__(self) -> None: ...

    def step(self) -> bool: ...


@runtime_checkable
class Mergeable(Protocol):
    """A job that may run together with the jobs queued right behind it (the store link's backup
    and fetch calls: one store call for several ops). Jobs join the first while their ``merge_key``
    equals its (``None``: never merged) and their ``merge_pages`` sum to at most its
    ``merge_limit``; :meth:`run_merged` runs the group (the first job, then ``others`` in queue
    order) and reports each job as if it had run alone."""

    merge_key: object
    merge_pages: int
    merge_limit: int

    def __call__(self) -> None: ...

    def run_merged(self, others: list[Mergeable]) -> None: ...


class JobGroup:
    """A job and the queued jobs that joined it (see :class:`Mergeable`), with their pages."""

    def __init__(self, first: Callable[[], None]) -> None:
        self.jobs = [first]
        self.key = getattr(first, "merge_key", None)
        self.pages = getattr(first, "merge_pages", 0)

    def take(self, job: object) -> bool:
        """Add ``job`` if it joins (same key, pages within the first's limit); whether it did."""
        if self.key is None or getattr(job, "merge_key", None) != self.key:
            return False
        first = self.jobs[0]
        if not isinstance(first, Mergeable) or not isinstance(job, Mergeable):
            return False  # a merge_key alone does not make a job mergeable
        if self.pages + job.merge_pages > first.merge_limit:
            return False
        self.jobs.append(job)
        self.pages += job.merge_pages
        return True

    def run(self) -> None:
        first, *others = self.jobs
        if not others:
            first()
            return
        assert isinstance(first, Mergeable)
        first.run_merged(others)  # type: ignore[arg-type]  # take() checked every member
