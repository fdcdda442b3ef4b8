"""The model's two counters (SPEC §7): the step clock and the op-id sequence.

Invariants upheld here alone: ``now`` never runs backwards (it advances once per mutating public
operation and by ``tick``), and op ids are handed out strictly increasing, one sequence shared by
write-through, load-back, backup and prefetch ops, so the same calls give the same ids everywhere.
"""

from __future__ import annotations

import attrs

from kvstrata.model.errors import MisuseError

__all__ = ["Clock"]


@attrs.define
class Clock:
    """``now`` orders LRU (``Node.last_access``) and prefetch timeouts; ``last_op`` is the newest id."""

    now: int = 0
    last_op: int = 0

    def tick(self, steps: int = 1) -> None:
        if steps < 0:
            raise MisuseError("time does not run backwards")
        self.now += steps

    def op_id(self) -> int:
        self.last_op += 1
        return self.last_op
