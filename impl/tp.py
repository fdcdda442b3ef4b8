"""Tensor-parallel groups: the one collective a cache makes per step (SPEC §10; issue 18).

A cache built with a ``tp_group`` agrees with the other ranks of its TP group at every
``check_events``: it starts one MIN reduction of a small int64 vector (the facts of
``kvstrata.model.tp``, framed with their layout's length and digest) through
:meth:`TpGroup.start_min`, and applies its result at the next call.
Every rank makes that call at every ``check_events``, whatever it has to report: a collective made
only by some ranks is the classic TP deadlock.

:class:`TorchTpGroup` runs it as a ``torch.distributed`` MIN all-reduce on a process group (gloo on
CPU; any backend that reduces int64 tensors on the group's device). Every call is bounded: when the
other ranks do not answer within ``timeout_s`` (a rank died or hangs), or answer with a different
layout, it raises :class:`~kvstrata.impl.errors.TpAgreementError`.
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvstrata.impl.errors import ConfigError, TpAgreementError

__all__ = ["PendingReduce", "TorchTpGroup", "TpGroup"]

Report = npt.NDArray[np.int64]


class PendingReduce(Protocol):
    def wait(self) -> Report:
        """The elementwise minimum of every rank's report; :class:`TpAgreementError` if it cannot
        be had within the group's timeout."""


class TpGroup(Protocol):
    """The ranks of one TP group, seen from one of them."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def start_min(self, report: Report) -> PendingReduce:
        """Start the elementwise minimum of every rank's ``report`` (same length on every rank);
        returns at once."""


class TorchTpGroup:
    """A :class:`TpGroup` over a ``torch.distributed`` process group (``None``: the default group).

    ``timeout_s`` bounds each agreement; the process group's own timeout (``init_process_group(...,
    timeout=...)``) should not be shorter, or it answers first. ``device`` is where the report
    tensor lives (``"cpu"`` for gloo; a CUDA device for NCCL)."""

    def __init__(self, group: Any = None, *, timeout_s: float = 60.0, device: str = "cpu") -> None:
        import torch.distributed as dist  # noqa: PLC0415 (only a TP cache needs it)

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("tp_group: torch.distributed is not initialized on this process")
        if not timeout_s > 0:
            raise ConfigError(f"tp_group timeout_s must be > 0, got {timeout_s!r}")
        self._dist = dist
        self.group = group
        self.timeout_s = float(timeout_s)
        self.device = device
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def start_min(self, report: Report) -> PendingReduce:
        import torch  # noqa: PLC0415

        tensor = torch.from_numpy(np.ascontiguousarray(report, dtype=np.int64)).to(self.device)
        try:
            work = self._dist.all_reduce(
                tensor, op=self._dist.ReduceOp.MIN, group=self.group, async_op=True
            )
        except Exception as error:  # gloo: a peer closed the connection
            raise self._failed(error) from error
        return _TorchReduce(self, tensor, work)

    def _failed(self, error: object) -> TpAgreementError:
        return TpAgreementError(
            f"rank {self._rank} of {self._size}: the TP agreement failed ({error}); "
            "another rank is gone or hung"
        )


class _TorchReduce:
    """One all-reduce in flight (``wait`` is bounded by the group's ``timeout_s``)."""

    def __init__(self, group: TorchTpGroup, tensor: Any, work: Any) -> None:
        self._group, self._tensor, self._work = group, tensor, work

    def wait(self) -> Report:
        timeout = datetime.timedelta(seconds=self._group.timeout_s)
        try:
            if self._work is not None and not self._work.wait(timeout=timeout):
                raise self._group._failed(f"not done in {timeout}")
        except TpAgreementError:
            raise
        except Exception as error:  # gloo: a peer closed the connection, or the wait timed out
            raise self._group._failed(error) from error
        result: Report = self._tensor.cpu().numpy()
        return result
