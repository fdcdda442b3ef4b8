"""The L3 tier's part of a TP agreement (SPEC §10; rules: ``kvstrata.model.tp``).

Under tensor parallelism a store result changes nothing when it returns: :meth:`L3Reports.hold`
keeps it, by op id, until every rank has one. At each agreement :meth:`L3Reports.facts` lists the
facts due, in an order derived from agreed state only (the backup and prefetch ops, identical on
every rank), each encoded so that the minimum over ranks is the agreed fact; :meth:`L3Reports.apply`
then applies the agreed values through the same verbs as a single rank (``Backups.apply`` with the
agreed verdict, ``Prefetches.apply_query`` / ``apply_fetch`` with the agreed page counts).

Invariant: an op's pins and reserved slots change only when every rank has its result, so no rank
frees a page its own job still reads or writes (I5/I7), whatever another rank's result says.
"""

from __future__ import annotations

import attrs

from kvstrata.impl.l3.backup import BackupOp, Backups
from kvstrata.impl.l3.prefetch import Prefetches, PrefetchOp
from kvstrata.impl.storage.worker import BackupResult, FetchResult, QueryResult, StorageResult
from kvstrata.model.lifecycles import PrefetchState
from kvstrata.model.tp import BackupFact, FactKind, read_state_agreed

__all__ = ["L3Reports", "Layout"]

Layout = list[tuple[FactKind, int]]


@attrs.define
class L3Reports:
    """This rank's store results not agreed yet, and whether its store came back empty."""

    backups: dict[int, BackupResult] = attrs.field(factory=dict)
    queries: dict[int, QueryResult] = attrs.field(factory=dict)
    fetches: dict[int, FetchResult] = attrs.field(factory=dict)
    republish: bool = False

    def hold(self, result: StorageResult) -> None:
        if isinstance(result, BackupResult):
            self.backups[result.op_id] = result
        elif isinstance(result, QueryResult):
            self.queries[result.op_id] = result
        else:
            self.fetches[result.op_id] = result

    # ------------------------------------------------------------------ report
    def facts(self, backups: Backups, prefetches: Prefetches) -> tuple[Layout, list[int]]:
        """The facts due and this rank's values for them."""
        layout: Layout = [(FactKind.REPUBLISH, 0)]
        values = [0 if self.republish else 1]
        deferred = {id(op) for op in backups.deferred}
        waiting = backups.waiting()
        for backup in backups.ops.values():
            layout += [
                (FactKind.BACKUP, backup.op_id),
                (FactKind.PARKED, backup.op_id),
                (FactKind.QUIET, backup.op_id),
            ]
            # quiet: no job of it runs here or is due without an agreement (its result is
            # held, it was dropped, or it waits); a retry waiting for its back-off is not quiet:
            # it starts on this rank's clock
            quiet = backup.op_id in self.backups or backup.dropped or id(backup) in waiting
            values += [
                self._backup_fact(backups, backup),
                0 if id(backup) in deferred else 1,
                1 if quiet else 0,
            ]
        for op_id, prefetch in prefetches.ops.items():
            for kind, value in self._prefetch_facts(prefetches, prefetch):
                layout.append((kind, op_id))
                values.append(value)
        return layout, values

    def _backup_fact(self, backups: Backups, op: BackupOp) -> int:
        if op.dropped:
            return BackupFact.GIVE_UP
        result = self.backups.get(op.op_id)
        return BackupFact.PENDING if result is None else backups.verdict(result)

    def _prefetch_facts(self, prefetches: Prefetches, op: PrefetchOp) -> list[tuple[FactKind, int]]:
        facts: list[tuple[FactKind, int]] = []
        if op.state is None or op.state is PrefetchState.LOADING:
            facts.append((FactKind.OVERDUE, 0 if prefetches.overdue(op) else 1))
        if not op.in_flight:
            return facts
        if op.state is None:
            query = self.queries.get(op.op_id)
            facts.append((FactKind.QUERY, 0 if query is None else 1 + query.hit))
            return facts
        fetch = self.fetches.get(op.op_id)
        delivered = None if fetch is None else prefetches.delivered(op, fetch)
        facts.append((FactKind.READ, 0 if delivered is None else 1 + delivered))
        if op.state_slot is not None:  # the minimum of the negation is minus the maximum
            facts.append((FactKind.READ_MAX, 0 if delivered is None else -(1 + delivered)))
        return facts

    # ------------------------------------------------------------------ apply
    def apply(
        self, layout: Layout, agreed: list[int], backups: Backups, prefetches: Prefetches
    ) -> bool:
        """Apply the agreed values; returns whether L2 is to be re-published."""
        by_slot = dict(zip(layout, agreed, strict=True))
        reported = dict(backups.ops)  # a retry applied below replaces its op (same id)
        for (kind, op_id), value in zip(layout, agreed, strict=True):
            if kind in (FactKind.PARKED, FactKind.QUIET):
                op = backups.ops.get(op_id)
                if op is None or op is not reported.get(op_id):
                    continue  # the facts were about the op this agreement just ended
                if kind is FactKind.QUIET:
                    op.quiet = value == 1
                elif value == 0:
                    op.parked = True
                else:
                    backups.unpark(op)
            elif kind is FactKind.BACKUP and value != BackupFact.PENDING and op_id in backups.ops:
                self._apply_backup(backups, op_id, BackupFact(value))
            elif kind is FactKind.OVERDUE and op_id in prefetches.ops:
                prefetches.ops[op_id].overdue = value == 0
            elif kind is FactKind.QUERY and value:
                result = self.queries.pop(op_id)
                prefetches.apply_query(result, agreed=value - 1)
            elif kind is FactKind.READ and value:
                fetch = self.fetches.pop(op_id)
                most = -by_slot.get((FactKind.READ_MAX, op_id), -value)
                state = read_state_agreed(value - 1, most - 1)
                prefetches.apply_fetch(fetch, agreed=value - 1, state_agreed=state)
        republish = by_slot[(FactKind.REPUBLISH, 0)] == 0
        if republish:  # every rank re-publishes now: that covers every recovery seen so far
            self.republish = False
        # else keep a request made after this report (``hold_results`` runs before the previous
        # agreement is applied): clearing it here lost every re-publish under TP
        return republish

    def _apply_backup(self, backups: Backups, op_id: int, verdict: BackupFact) -> None:
        op = backups.ops[op_id]
        result = self.backups.pop(op_id, None)
        if op.dropped or result is None:  # dropped here; given up everywhere (GIVE_UP is least)
            backups.forget(op)
            return
        backups.apply(result, agreed=verdict)
