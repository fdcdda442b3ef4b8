"""The pending L1 <-> L2 copy ops, one FIFO per direction (SPEC §3): the one resource this module owns.

Invariants: an op is acked only after every op queued before it in its direction (batches complete
in FIFO order; a completion out of order is an assertion, never applied); a failed batch fails every
op pending in its direction (a batch fails as a whole); a completion naming ops that already failed
with an earlier batch changes nothing. What an ack or a failure does to residency is
:mod:`.tiers`' (``ack`` / ``fail``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvstrata.impl.cache.clock import StepClock
from kvstrata.impl.cache.node import CacheEvent, CopyOp, Node
from kvstrata.impl.transfer import Completion, Direction

__all__ = ["CopyQueues"]


class CopyQueues:
    """See the module docstring."""

    __slots__ = ("_clock", "load", "write")

    def __init__(self, clock: StepClock) -> None:
        self._clock = clock
        self.write: deque[CopyOp] = deque()
        self.load: deque[CopyOp] = deque()

    def op_pins(self, node: Node) -> int:
        """Locks on ``node`` held by pending copy ops (not the scheduler's)."""
        if not self.write and not self.load:
            return 0
        return sum(1 for op in (*self.write, *self.load) if op.node is node)

    def apply(
        self,
        completion: Completion,
        ack: Callable[[CopyOp], None],
        fail: Callable[[CopyOp], None],
    ) -> CacheEvent:
        """Apply one finished copy batch: ``ack`` its ops in FIFO order, or ``fail`` every op
        pending in that direction."""
        queue = self.write if completion.direction is Direction.WRITE else self.load
        pending = [op for op in completion.op_ids if queue and any(o.op_id == op for o in queue)]
        if not pending:  # already failed together with an earlier batch
            return CacheEvent(completion.direction, (), completion.ok)
        if not completion.ok:
            self._clock.tick()
            failed = tuple(op.op_id for op in queue)
            while queue:
                fail(queue.popleft())
            return CacheEvent(completion.direction, failed, False)
        for op_id in pending:
            op = queue[0]
            assert op.op_id == op_id, "copy batches complete out of FIFO order"
            self._clock.tick()
            queue.popleft()
            ack(op)
        return CacheEvent(completion.direction, tuple(pending), True)
