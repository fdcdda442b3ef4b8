"""The transfer controller: L1 <-> L2 page copies off the scheduler thread (SPEC §3).

Theory of operation
-------------------
The cache *enqueues* copy ops (a write-through L1 -> L2 or a load-back L2 -> L1: an op id and the exact
page index arrays it covers, fixed at enqueue). :meth:`TransferController.flush` merges everything
enqueued since the last flush into one batch per direction and hands each batch to the executor: the
copies of one scheduler step run as one vectorised gather/scatter. Batches run in submission order, so
op ids complete in FIFO order. The worker only appends finished op ids to a thread-safe queue; the tree
learns about them only when the scheduler drains that queue (:meth:`TransferController.completed`,
called from ``check_events``).

Hybrid models (SPEC §5): an op may carry per-pool transfer descriptors (:class:`PoolTransfer`) for its
side pools with their own slots (Mamba states) next to its KV pages (which the ``ALL_PAGES`` side pools,
indexed by KV page, follow through the same page arrays). They are merged per pool like the pages and
copied by the injected ``side_copy`` in the same job, so a batch is acked only when every pool of it is
copied, and fails as a whole if any pool's copy fails.

The executor is injected (``kvstrata.impl.executors``, re-exported here): :class:`ThreadExecutor` (a
single worker thread) or :class:`ManualExecutor`, with which a test decides when each batch runs, whole
or a step at a time.

A batch is a :class:`CopyJob` of steps: one *issue* per chunk of pages (``chunk_pages``; the whole batch
by default) and per side pool, then *synchronize*, then *report*. Copies are issued on a
:class:`CopyStream`, and data counts as landed only once the stream is synchronised:

- :class:`ImmediateStream` (CPU): a copy lands when issued;
- :class:`CudaStream` (CUDA present): the controller's own CUDA stream (non-blocking copies through
  pinned staging); needs a GPU, so CI (CPU only) does not run it;
- :class:`DeferredStream` (tests): the CPU stand-in for a CUDA stream. An issued copy lands only when
  the test says so or at synchronisation, and reads its source when it lands. An ack before
  synchronisation, or a freed page a copy still writes, then shows as wrong bytes on CPU.

Invariants: a batch is reported (done or failed) only after its stream was synchronised, so no copy of
a reported batch can still land; a failed batch, too, first waits for what it already issued.
"""

from __future__ import annotations

import enum
import functools
import logging
import queue
from collections.abc import Callable, Iterator

import attrs
import numpy as np
import torch

from kvstrata.impl.errors import KvStrataError, MisuseError
from kvstrata.impl.executors import (
    Executor,
    InlineExecutor,
    ManualExecutor,
    Mergeable,
    ThreadExecutor,
    drain,
)
from kvstrata.impl.streams import CopyStream, CudaStream, DeferredStream, ImmediateStream

__all__ = [
    "CopyFunction",
    "CopyJob",
    "CopyStream",
    "CudaStream",
    "DeferredStream",
    "Direction",
    "ImmediateStream",
    "Executor",
    "InlineExecutor",
    "ManualExecutor",
    "Mergeable",
    "PoolTransfer",
    "SideCopyFunction",
    "ThreadExecutor",
    "TransferController",
    "TransferFailed",
    "drain",
]


log = logging.getLogger("kvstrata.transfer")


class TransferFailed(KvStrataError):
    """A copy batch raised on the worker; the batch's ops are reported as failed, never as done."""


class Direction(enum.Enum):
    WRITE = "write"  # L1 -> L2 (write-through)
    LOAD = "load"  # L2 -> L1 (load-back)


class CopyJob:
    """One batch's copies as steps (see the module docstring): :meth:`step` runs the next one and
    says whether the job finished; calling the job runs every step left (a worker thread's way)."""

    def __init__(self, steps: Iterator[None]) -> None:
        self._steps = steps
        self.started = False

    def step(self) -> bool:
        self.started = True
        return next(self._steps, StopIteration) is StopIteration

    def __call__(self) -> None:
        self.started = True
        for _ in self._steps:
            pass


#: ``copy(direction, src_pages, dst_pages) -> bytes moved`` (the pools' vectorised page copy).
CopyFunction = Callable[[Direction, np.ndarray, np.ndarray], int]


def _entries(value: object) -> np.ndarray:
    return np.asarray(value, dtype=np.int64)


@attrs.frozen
class PoolTransfer:
    """One side pool's part of a copy op: its entries ``src`` (in the source tier) go to ``dst``
    (in the target tier), pairwise. Fixed at enqueue, like the op's page arrays."""

    pool: str
    src: np.ndarray = attrs.field(converter=_entries)
    dst: np.ndarray = attrs.field(converter=_entries)

    def __attrs_post_init__(self) -> None:
        if self.src.ndim != 1 or self.src.shape != self.dst.shape:
            raise ValueError(f"{self.pool}: source and destination entries differ in count")


#: ``side_copy(direction, transfer) -> bytes moved`` (a side pool's vectorised entry copy).
SideCopyFunction = Callable[[Direction, PoolTransfer], int]


@attrs.define
class _Pending:
    op_ids: list[int] = attrs.field(factory=list)
    src: list[np.ndarray] = attrs.field(factory=list)
    dst: list[np.ndarray] = attrs.field(factory=list)
    side: dict[str, list[PoolTransfer]] = attrs.field(factory=dict)

    def merged_side(self) -> tuple[PoolTransfer, ...]:
        """One transfer per side pool, its entries in enqueue order."""
        return tuple(
            PoolTransfer(
                pool,
                np.concatenate([t.src for t in parts]),
                np.concatenate([t.dst for t in parts]),
            )
            for pool, parts in self.side.items()
        )


@attrs.frozen
class Completion:
    direction: Direction
    op_ids: tuple[int, ...]
    ok: bool
    bytes_moved: int


class TransferController:
    """Queues, merges and runs page copies; reports completions in FIFO order per direction."""

    def __init__(
        self,
        copy: CopyFunction,
        executor: Executor | None = None,
        side_copy: SideCopyFunction | None = None,
    ) -> None:
        self._copy = copy
        self._side_copy = side_copy
        self._executor: Executor = executor if executor is not None else ThreadExecutor()
        self._pending = {direction: _Pending() for direction in Direction}
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self.batches_submitted = 0
        self._stream: CopyStream = CudaStream() if torch.cuda.is_available() else ImmediateStream()
        self._chunk_pages: int | None = None

    def use_stream(self, stream: CopyStream, chunk_pages: int | None = None) -> None:
        """Run later batches on ``stream``, issuing ``chunk_pages`` pages per copy (the whole batch
        when ``None``). Only before the first batch was submitted (tests use a :class:`DeferredStream`)."""
        if self.batches_submitted:
            raise MisuseError("use_stream: batches were already submitted on the current stream")
        if chunk_pages is not None and chunk_pages < 1:
            raise MisuseError(f"use_stream: chunk_pages must be positive, got {chunk_pages}")
        self._stream, self._chunk_pages = stream, chunk_pages

    @property
    def executor(self) -> Executor:
        return self._executor

    def enqueue(
        self,
        direction: Direction,
        op_id: int,
        src_pages: np.ndarray,
        dst_pages: np.ndarray,
        side: tuple[PoolTransfer, ...] = (),
    ) -> None:
        """Queue one copy op: its KV pages and, for a hybrid model, its side pools' entries."""
        if len(src_pages) != len(dst_pages):
            raise ValueError("source and destination page counts differ")
        if side and self._side_copy is None:
            raise ValueError("side-pool transfers need a controller built with side_copy")
        pending = self._pending[direction]
        pending.op_ids.append(op_id)
        pending.src.append(np.asarray(src_pages, dtype=np.int64))
        pending.dst.append(np.asarray(dst_pages, dtype=np.int64))
        for transfer in side:
            pending.side.setdefault(transfer.pool, []).append(transfer)

    def flush(self) -> int:
        """Submit one merged batch per direction with pending ops; returns batches submitted."""
        submitted = 0
        for direction in Direction:
            pending = self._pending[direction]
            if not pending.op_ids:
                continue
            self._pending[direction] = _Pending()
            op_ids = tuple(pending.op_ids)
            src = np.concatenate(pending.src)
            dst = np.concatenate(pending.dst)
            side = pending.merged_side()
            self._executor.submit(self._job(direction, op_ids, src, dst, side))
            submitted += 1
        self.batches_submitted += submitted
        return submitted

    def _job(
        self,
        direction: Direction,
        op_ids: tuple[int, ...],
        src: np.ndarray,
        dst: np.ndarray,
        side: tuple[PoolTransfer, ...] = (),
    ) -> CopyJob:
        return CopyJob(self._steps(direction, op_ids, src, dst, side))

    def _steps(
        self,
        direction: Direction,
        op_ids: tuple[int, ...],
        src: np.ndarray,
        dst: np.ndarray,
        side: tuple[PoolTransfer, ...],
    ) -> Iterator[None]:
        stream = self._stream
        chunk = self._chunk_pages or max(len(src), 1)
        try:
            for start in range(0, len(src), chunk):
                part = slice(start, start + chunk)
                stream.issue(functools.partial(self._copy, direction, src[part], dst[part]))
                yield
            for transfer in side:
                if len(transfer.src):
                    assert self._side_copy is not None  # enqueue refuses side transfers otherwise
                    stream.issue(functools.partial(self._side_copy, direction, transfer))
                    yield
            moved = stream.synchronize()
            yield
        except Exception:  # reported to the scheduler thread, never raised on the worker
            log.debug("kvstrata: a %s copy batch failed", direction.value, exc_info=True)
            try:  # a failed batch frees its pages: nothing it issued may land afterwards
                stream.synchronize()
            except Exception:
                log.debug("kvstrata: the copy stream failed again while settling", exc_info=True)
            self._done.put(Completion(direction, op_ids, False, 0))
            return
        self._done.put(Completion(direction, op_ids, True, moved))

    def completed(self) -> list[Completion]:
        """Every batch finished since the last call, in completion (= FIFO) order."""
        return drain(self._done)

    def close(self) -> None:
        self.flush()
        self._executor.close()
