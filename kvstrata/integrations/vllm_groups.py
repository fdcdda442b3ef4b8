"""vLLM's process groups as the vLLM connector's workers use them: which group, this worker's rank
in it, and the one collective the workers run (each failed load's first page, agreed over the
tensor-parallel group). vLLM is imported at call time: these run only inside a vLLM worker."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["agree_least", "group_rank", "process_group"]


def process_group(which: str) -> Any:
    """vLLM's tensor-parallel (``"tp"``) or pipeline (``"pp"``) group coordinator."""
    from vllm.distributed import parallel_state  # noqa: PLC0415

    return parallel_state.get_tp_group() if which == "tp" else parallel_state.get_pp_group()


def group_rank(which: str) -> int:
    """This worker's rank in vLLM's tensor-parallel (``"tp"``) or pipeline (``"pp"``) group."""
    return int(process_group(which).rank_in_group)


def agree_least(values: list[int]) -> list[int]:
    """Each value's least over this worker's tensor-parallel group: the same plan reaches every
    worker and the ranks of a stage run the step together, so each makes this call on the same
    steps with the same length."""
    import torch.distributed as dist  # noqa: PLC0415

    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=process_group("tp").cpu_group)
    return [int(value) for value in tensor.tolist()]
