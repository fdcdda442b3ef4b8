"""The pending L1 <-> L2 copy ops, one FIFO per direction (SPEC §3): the one resource this module owns.

Invariants: an op is acked only after every op queued before it in its direction (batches complete
in FIFO order; a completion out of order is an assertion, never applied); a failed batch fails every
op pending in its direction (a batch fails as a whole, and a later op may depend on an earlier one:
a child's write-through on its parent's), but **only once no copy of that direction is in flight**:
failing an op frees its destination pages, which a later batch still running would write (a stale
offset). Until then the failure waits (the direction is *doomed*: later completions, landed or not,
are noted, none applied), and the ops stay pinned; every op queued is handed to the worker by the
call that queued it (``Tiers.flush``), so an op is in flight until its completion arrives. What an
ack or a failure does to residency is :mod:`.tiers`' (``ack`` / ``fail``). A TP group applies its
agreed failures with :meth:`CopyQueues.fail_all` once every rank's copies landed (:mod:`.agreement`).
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

    __slots__ = ("_clock", "_landed", "load", "write")

    def __init__(self, clock: StepClock) -> None:
        self._clock = clock
        self.write: deque[CopyOp] = deque()
        self.load: deque[CopyOp] = deque()
        #: Per doomed direction (a batch of it failed): the pending ops whose batch has come back.
        self._landed: dict[Direction, set[int]] = {}

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
        """Apply one finished copy batch: ``ack`` its ops in FIFO order; or, for a failed batch,
        ``fail`` every op pending in that direction once none of them is in flight (an empty
        event until then)."""
        direction = completion.direction
        queue = self.write if direction is Direction.WRITE else self.load
        pending = [op for op in completion.op_ids if queue and any(o.op_id == op for o in queue)]
        if not pending:  # already failed together with an earlier batch
            return CacheEvent(direction, (), completion.ok)
        landed = self._landed.get(direction)
        if not completion.ok or landed is not None:
            landed = self._landed.setdefault(direction, set())
            landed.update(pending)
            if any(op.op_id not in landed for op in queue):
                return CacheEvent(direction, (), False)  # a later copy may still write
            return self.fail_all(direction, fail)
        for op_id in pending:
            op = queue[0]
            assert op.op_id == op_id, "copy batches complete out of FIFO order"
            self._clock.tick()
            queue.popleft()
            ack(op)
        return CacheEvent(completion.direction, tuple(pending), True)

    def fail_all(self, direction: Direction, fail: Callable[[CopyOp], None]) -> CacheEvent:
        """``fail`` every op pending in ``direction``, oldest first; the caller knows that none
        of them has a copy in flight."""
        queue = self.write if direction is Direction.WRITE else self.load
        self._landed.pop(direction, None)
        self._clock.tick()
        failed = tuple(op.op_id for op in queue)
        while queue:
            fail(queue.popleft())
        return CacheEvent(direction, failed, False)
