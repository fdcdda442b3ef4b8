"""The cache's step clock and id counters (one instance per cache, scheduler thread only).

``now`` is a step counter, not wall time: one tick per public call, so LRU order is deterministic and
equal to the model's. ``version`` changes with every change to the tree's shape or to a node's
residency: a match memo is valid only while it is unchanged. Node ids and op ids are handed out in
increasing order, as the model's (the differential tests compare them).
"""

from __future__ import annotations

__all__ = ["StepClock"]


class StepClock:
    """Invariants: ``now`` and ``version`` never decrease; ids are unique and increasing."""

    __slots__ = ("_next_id", "_next_op", "now", "version")

    def __init__(self) -> None:
        self.now = 0
        self.version = 0
        self._next_id = 0
        self._next_op = 0

    def tick(self) -> None:
        self.now += 1

    def new_id(self) -> int:
        """A fresh node id."""
        self._next_id += 1
        return self._next_id

    def new_op(self) -> int:
        """A fresh op id (copies, backups and prefetches share one counter, as in the model)."""
        self._next_op += 1
        return self._next_op
