"""Pipeline stages in one process: :class:`LocalStagePipes` gives each stage a
:class:`~kvstrata.integrations.connector_worker.StagePipe` over in-memory queues, with the real
pipe's contract (every stage sends each plan's loads to every later stage; a receive takes the
oldest message from each earlier stage and checks it is of the plan asked for)."""

from __future__ import annotations

import collections
from collections.abc import Sequence


class LocalStagePipes:
    """The queues between ``stages`` stages, and each stage's pipe."""

    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.queues: dict[tuple[int, int], collections.deque[tuple[int, list[int]]]] = {
            (src, dst): collections.deque()
            for src in range(stages)
            for dst in range(src + 1, stages)
        }
        self.sent = 0

    def pipe(self, stage: int) -> _StagePipe:
        return _StagePipe(self, stage)

    def empty(self) -> bool:
        return not any(self.queues.values())


class _StagePipe:
    def __init__(self, pipes: LocalStagePipes, stage: int) -> None:
        self.pipes, self.stage = pipes, stage

    def send(self, plan: int, cuts: Sequence[int]) -> None:
        for dst in range(self.stage + 1, self.pipes.stages):
            self.pipes.queues[self.stage, dst].append((plan, list(cuts)))
            self.pipes.sent += 1

    def receive(self, plan: int, count: int) -> list[list[int]]:
        out = []
        for src in range(self.stage):
            got, cuts = self.pipes.queues[src, self.stage].popleft()  # sent before: never empty
            assert (got, len(cuts)) == (plan, count), f"stage {self.stage}: {got} for {plan}"
            out.append(cuts)
        return out
