"""The cache's TP agreement: what ``check_events`` does in a tensor-parallel group (SPEC §10; rules
and encodings: ``kvstrata.model.tp``; the model of N ranks: ``kvstrata.model.cluster``).

Every rank mirrors the same tree, so nothing that finished in the background changes it until every
rank has it. :meth:`Agreement.run` (each ``check_events``, on every rank, unconditionally):

1. holds what finished here: copy batches (by op id: landed or failed) and store results
   (:class:`~kvstrata.impl.l3.agreed.L3Reports`);
2. lists the facts due (the pending copy ops, FIFO per direction; the backup and prefetch ops; a
   re-publish slot), identical on every rank because it derives from agreed state only, and encodes
   this rank's values for them;
3. starts **one** MIN all-reduce of the framed values (:mod:`kvstrata.impl.tp`) and returns;
4. at the next call, before step 2, waits for it (done by then, unless a rank lags: the wait is
   bounded) and applies the agreed values: copy ops acked in FIFO order while every rank's landed,
   and at the first that failed on any rank, every pending op of that direction fails (as a failed
   batch does on one rank) once no rank has a copy of that direction in flight (a failure frees the
   later ops' destination pages, which a running copy would write); store results through the L3
   tier's same verbs with the agreed counts.

Pipelined so that the collective's latency (about 1.3 ms for gloo on loopback on a 2-core machine:
docs/benchmarks.md) runs while the scheduler works, not on its path: a fact agreed at one call is
applied at the next. That is safe because a reported fact never changes (a copy that landed stays
landed), ops leave only by agreed application or by verbs every rank makes alike, and an agreed
fact about an op that is gone by then is skipped.

Invariants: the tree, its locks and every tier's page count change only by agreed facts; every rank
makes the same collective calls in the same order (exactly one per ``check_events``). A failed
agreement (:class:`~kvstrata.impl.errors.TpAgreementError`) closes the cache.
"""

from __future__ import annotations

import contextlib

import numpy as np

from kvstrata.impl.cache.clock import StepClock
from kvstrata.impl.cache.node import CacheEvent, CopyOp
from kvstrata.impl.cache.tiers import Tiers
from kvstrata.impl.errors import TpAgreementError
from kvstrata.impl.guard import Guard
from kvstrata.impl.l3 import L3Tier
from kvstrata.impl.tp import PendingReduce, TpGroup
from kvstrata.impl.transfer import Completion, Direction
from kvstrata.model.tp import CopyFact, Diverged, FactKind, copy_failure_due, frame, unframe

__all__ = ["Agreement"]

_KIND = {Direction.WRITE: FactKind.WRITE, Direction.LOAD: FactKind.LOAD}


class Agreement:
    """One rank's side of the agreement; ``copies`` holds this rank's copy outcomes by op id."""

    def __init__(self, group: TpGroup, tiers: Tiers, clock: StepClock, guard: Guard) -> None:
        self.group = group
        self._guard = guard
        self._tiers = tiers
        self._clock = clock
        self.l3: L3Tier | None = None
        self.copies: dict[int, bool] = {}
        self.agreements = 0  # collectives made (every rank's count is the same)
        self.failed = False  # an agreement failed: the cache is closed
        #: the agreement started by the previous call: its layout, copy slots and reduction
        self._inflight: tuple[list[tuple[FactKind, int]], int, PendingReduce] | None = None

    def attach_l3(self, tier: L3Tier) -> None:
        tier.agree_across_ranks()
        self.l3 = tier

    def _pending(self, direction: Direction) -> list[CopyOp]:
        copies = self._tiers.copies
        return list(copies.write if direction is Direction.WRITE else copies.load)

    def run(self) -> list[CacheEvent]:
        """Hold, report, agree, apply (the module docstring); the copy events applied. A failed
        agreement closes the cache (every mutating call then raises ``CacheClosed``)."""
        try:
            return self._run()
        except TpAgreementError:
            self._guard.closed = self.failed = True
            raise

    def _run(self) -> list[CacheEvent]:
        tiers = self._tiers
        if tiers.transfer is not None:
            for completion in tiers.transfer.completed():
                for op_id in completion.op_ids:
                    self.copies.setdefault(op_id, completion.ok)
        if self.l3 is not None:
            self.l3.hold_results()
        events: list[CacheEvent] = []
        if self._inflight is not None:  # the previous call's agreement: apply it now
            layout, copy_slots, pending = self._inflight
            self._inflight = None
            try:
                agreed = unframe([int(v) for v in pending.wait()])
            except Diverged as error:
                raise TpAgreementError(f"rank {self.group.rank}: {error}") from error
            events = self._apply_copies(layout[:copy_slots], agreed[:copy_slots])
            if self.l3 is not None:
                self._clock.tick()
                self.l3.apply_agreed(layout[copy_slots:], agreed[copy_slots:])
            tiers.flush()
            live = {op.op_id for d in Direction for op in self._pending(d)}
            self.copies = {op_id: ok for op_id, ok in self.copies.items() if op_id in live}
        layout, values = self._report()
        copy_slots = len(layout)
        if self.l3 is not None:
            l3_layout, l3_values = self.l3.reports_facts()
            layout += l3_layout
            values += l3_values
        report = np.asarray(frame(layout, values), dtype=np.int64)
        self.agreements += 1
        self._inflight = (layout, copy_slots, self.group.start_min(report))
        return events

    def _report(self) -> tuple[list[tuple[FactKind, int]], list[int]]:
        """This rank's copy facts: one per pending copy op, FIFO per direction."""
        layout: list[tuple[FactKind, int]] = []
        values: list[int] = []
        for direction in (Direction.WRITE, Direction.LOAD):
            for op in self._pending(direction):
                layout.append((_KIND[direction], op.op_id))
                outcome = self.copies.get(op.op_id)
                values.append(
                    CopyFact.PENDING
                    if outcome is None
                    else (CopyFact.LANDED if outcome else CopyFact.FAILED)
                )
        return layout, values

    def finish(self) -> None:
        """Wait (bounded) for the last agreement this rank started, so no collective is left
        half made when the cache closes; its facts are not applied. Nothing after a failed
        agreement (the group is broken: waiting would only run into the timeout again)."""
        if self._guard.closed and self.failed:
            self._inflight = None
        if self._inflight is not None:
            pending, self._inflight = self._inflight[2], None
            with contextlib.suppress(TpAgreementError):
                pending.wait()

    def _apply_copies(
        self, layout: list[tuple[FactKind, int]], agreed: list[int]
    ) -> list[CacheEvent]:
        tiers = self._tiers
        events: list[CacheEvent] = []
        stopped: set[FactKind] = set()
        for index, ((kind, op_id), value) in enumerate(zip(layout, agreed, strict=True)):
            if kind in stopped:
                continue
            later = [
                v
                for (k, _), v in zip(layout[index + 1 :], agreed[index + 1 :], strict=True)
                if k is kind
            ]
            if value == CopyFact.PENDING or (
                value == CopyFact.FAILED and not copy_failure_due(later)
            ):
                stopped.add(kind)  # FIFO; a failure waits until no rank copies this direction
                continue
            direction = Direction.WRITE if kind is FactKind.WRITE else Direction.LOAD
            if value == CopyFact.LANDED:
                completion = Completion(direction, (op_id,), True, 0)
                events.append(tiers.copies.apply(completion, tiers.ack, tiers.fail))
            else:  # due: no rank copies this direction any more
                events.append(tiers.copies.fail_all(direction, tiers.fail))
                stopped.add(kind)  # every pending op of the direction failed with it
        return events
