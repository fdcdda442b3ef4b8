"""N tensor-parallel ranks of the cache model, kept identical by agreement (SPEC §10; issue 18).

:class:`TpModel` holds one :class:`~kvstrata.model.cache.CacheModel` per rank, each with its own
store (its own shard of the key space). Scheduler verbs go to every rank (:meth:`TpModel.each`) and
must answer the same on every rank. What finishes in the background is *reported* per rank and
changes nothing until :meth:`TpModel.agree`, which every rank joins, applies the rules of
:mod:`kvstrata.model.tp` to every rank at once:

- write-through and load-back copies: ``CopyFact`` per pending op, FIFO per direction;
- backups: ``BackupFact`` per in-flight op (the model never gives up: it retries forever);
- prefetch reads: each rank's read delivers what its own store holds when it runs (``read``);
  the agreed minimum of those pages arrives on every rank, each rank's own bytes as read (its
  store may lose a page after the read: the bytes are in its host slots already), and the rest is
  a miss;
- prefetch queries: the minimum of the ranks' hits is what every rank reserves (the implementation
  agrees on it at the next ``check_events``; the model at once, as one agreement).

Invariants (:meth:`TpModel.check`): after every agreement every rank's tree, page records and slots,
locks, pending ops and prefetch reservations are identical (:func:`rank_view`), and every rank has
joined the same agreements, with the same layouts, in the same order.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import attrs

from kvstrata.model.cache.api import CacheModel
from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.lifecycles import BackupState, PrefetchState
from kvstrata.model.tp import (
    BackupFact,
    CopyFact,
    FactKind,
    agree,
    copy_failure_due,
    frame,
    unframe,
)

__all__ = ["RankReports", "TpModel", "rank_view"]


@attrs.define
class RankReports:
    """One rank's facts not agreed yet, by op id."""

    copies: dict[int, bool] = attrs.field(factory=dict)  # landed (True) or failed
    backups: dict[int, bool] = attrs.field(factory=dict)  # stored all of it, or must retry
    #: what each read delivered: the pages' contents, in order, as its store held them then
    reads: dict[int, tuple[Hashable, ...]] = attrs.field(factory=dict)


def rank_view(rank: CacheModel) -> Hashable:
    """Everything that must be equal on every rank after an agreement."""
    pages = tuple(
        sorted(
            (page.digest, info.residency.value, info.device_slot, info.host_slot)
            for page, info in rank.page_info.items()
        )
    )
    return (
        pages,
        tuple((op.op_id, op.state.value) for op in rank.write_ops),
        tuple((op.op_id, op.state.value) for op in rank.load_ops),
        tuple((op.op_id, op.state.value, op.pages) for op in rank.backup_ops),
        tuple((i, op.state.value, op.arrived) for i, op in sorted(rank.prefetch_ops.items())),
        rank.evictable_pages,
        rank.protected_pages,
        rank.device.free_count,
        rank.host.free_count,
    )


@attrs.define
class TpModel:
    """See the module docstring. ``calls[r]`` lists the layout digests of the agreements rank
    ``r`` joined."""

    ranks: list[CacheModel]
    reports: list[RankReports] = attrs.field(init=False)
    calls: list[list[int]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not self.ranks:
            raise MisuseError("a TP group has at least one rank")
        self.reports = [RankReports() for _ in self.ranks]
        self.calls = [[] for _ in self.ranks]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def each(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """Scheduler verb ``verb`` on every rank; every rank must answer the same (else
        ``InvariantViolation``). A typed error raised by rank 0 is raised before any other rank
        runs the verb (a verb that raises changes nothing, so the ranks stay equal)."""
        results = [getattr(rank, verb)(*args, **kwargs) for rank in self.ranks]
        if any(result != results[0] for result in results[1:]):
            raise InvariantViolation("TP ranks agree", f"{verb}: the ranks answered {results}")
        return results[0]

    # ------------------------------------------------------------------ per-rank reports
    def _oldest_unreported(self, rank: int, ops: Any) -> int:
        for op in ops:
            if op.op_id not in self.reports[rank].copies:
                op_id: int = op.op_id
                return op_id
        raise MisuseError(f"rank {rank}: no copy op left to report")

    def copy_done(self, rank: int, *, write: bool, landed: bool) -> int:
        """Rank ``rank``'s oldest unreported copy op of a direction finished; returns its id."""
        model = self.ranks[rank]
        op_id = self._oldest_unreported(rank, model.write_ops if write else model.load_ops)
        self.reports[rank].copies[op_id] = landed
        return op_id

    def backup_done(self, rank: int, op_id: int, *, stored: bool) -> None:
        """Rank ``rank``'s job for in-flight backup ``op_id`` returned (``stored``: all of it)."""
        if not any(
            op.op_id == op_id and op.state is BackupState.IN_FLIGHT
            for op in self.ranks[rank].backup_ops
        ):
            raise MisuseError(f"no backup op {op_id} is in flight")
        self.reports[rank].backups[op_id] = stored

    def read_done(self, rank: int, op_id: int) -> int:
        """Rank ``rank``'s read of prefetch ``op_id`` finished: it delivers what its store holds."""
        model = self.ranks[rank]
        op = model.prefetch_ops.get(op_id)
        if op is None or op.state is not PrefetchState.LOADING:
            raise MisuseError(f"no prefetch op {op_id} is reading")
        delivered: tuple[Hashable, ...] = model.prefetches.read(op)
        self.reports[rank].reads[op_id] = delivered
        return len(delivered)

    # ------------------------------------------------------------------ agreements
    def prefetch(self, tokens: tuple[int, ...], namespace: Any) -> int | None:
        """Every rank queries its store; each reserves the minimum hit (one agreement)."""
        hits = [[rank.prefetches.local_hit(tokens, namespace)] for rank in self.ranks]
        agreed = self._reduce([(FactKind.QUERY, -1)], hits)
        result: int | None = self.each("prefetch", tokens, namespace, limit=agreed[0])
        return result

    def _reduce(self, layout: list[tuple[FactKind, int]], values: list[list[int]]) -> list[int]:
        reports = [frame(layout, rank_values) for rank_values in values]
        for log, report in zip(self.calls, reports, strict=True):
            log.append(report[2])
        return unframe(agree(reports))

    def layout(self) -> list[tuple[FactKind, int]]:
        """The facts due now, from agreed state (rank 0's; every rank's is the same)."""
        rank = self.ranks[0]
        return [
            *((FactKind.WRITE, op.op_id) for op in rank.write_ops),
            *((FactKind.LOAD, op.op_id) for op in rank.load_ops),
            *(
                (FactKind.BACKUP, op.op_id)
                for op in rank.backup_ops
                if op.state is BackupState.IN_FLIGHT
            ),
            *(
                (FactKind.READ, op_id)
                for op_id, op in rank.prefetch_ops.items()
                if op.state is PrefetchState.LOADING
            ),
        ]

    def _encode(self, reports: RankReports, kind: FactKind, op_id: int) -> int:
        if kind in (FactKind.WRITE, FactKind.LOAD):
            landed = reports.copies.get(op_id)
            if landed is None:
                return CopyFact.PENDING
            return CopyFact.LANDED if landed else CopyFact.FAILED
        if kind is FactKind.BACKUP:
            stored = reports.backups.get(op_id)
            if stored is None:
                return BackupFact.PENDING
            return BackupFact.STORED if stored else BackupFact.RETRY
        read = reports.reads.get(op_id)
        return 0 if read is None else 1 + len(read)

    def agree(self) -> list[int]:
        """Every rank reports, the minimum is applied to every rank; returns the agreed values."""
        layout = self.layout()
        values = [[self._encode(r, kind, op) for kind, op in layout] for r in self.reports]
        agreed = self._reduce(layout, values)
        stopped: set[FactKind] = set()
        for index, ((kind, op_id), value) in enumerate(zip(layout, agreed, strict=True)):
            if kind in stopped:
                continue
            if kind in (FactKind.WRITE, FactKind.LOAD):
                verb = _copy_verb(kind, value)
                later = [
                    v
                    for (k, _), v in zip(layout[index + 1 :], agreed[index + 1 :], strict=True)
                    if k is kind
                ]
                if verb is None or (value == CopyFact.FAILED and not copy_failure_due(later)):
                    stopped.add(kind)  # FIFO: nothing after a pending op of this direction
                    continue
                self._apply(verb)
                if value == CopyFact.FAILED:
                    stopped.add(kind)  # every pending op of the direction failed with it
            elif kind is FactKind.BACKUP and value != BackupFact.PENDING:
                if value == BackupFact.STORED:  # every rank's job saw all of it: not checked again
                    self._apply("ack_backup", op_id, agreed=True)
                else:
                    self._apply("fail_backup", op_id)
            elif kind is FactKind.READ and value:
                self._apply_read(op_id, value - 1)
        self._forget_settled()
        self.check()
        return agreed

    def _apply(self, verb: str, *args: int, **kwargs: bool) -> None:
        results = [getattr(rank, verb)(*args, **kwargs) for rank in self.ranks]
        if any(result != results[0] for result in results[1:]):
            raise InvariantViolation("TP ranks agree", f"an agreed fact gave {results}")

    def _apply_read(self, op_id: int, pages: int) -> None:
        """The agreed read: every rank takes ``pages`` pages out of what its own read delivered."""
        results = [
            rank.prefetch_finish(op_id, pages, reports.reads[op_id])
            for rank, reports in zip(self.ranks, self.reports, strict=True)
        ]
        if any(result != results[0] for result in results[1:]):
            raise InvariantViolation("TP ranks agree", f"an agreed read gave {results}")

    def _forget_settled(self) -> None:
        """Drop reports of ops that are no longer pending (applied, or failed with a batch)."""
        rank = self.ranks[0]
        copies = {op.op_id for op in (*rank.write_ops, *rank.load_ops)}
        backups = {op.op_id for op in rank.backup_ops if op.state is BackupState.IN_FLIGHT}
        reads = {i for i, op in rank.prefetch_ops.items() if op.state is PrefetchState.LOADING}
        for reports in self.reports:
            reports.copies = {k: v for k, v in reports.copies.items() if k in copies}
            reports.backups = {k: v for k, v in reports.backups.items() if k in backups}
            reports.reads = {k: v for k, v in reports.reads.items() if k in reads}

    def check(self) -> None:
        """Every rank's view is rank 0's, and every rank joined the same agreements."""
        first = rank_view(self.ranks[0])
        for index, rank in enumerate(self.ranks[1:], start=1):
            if rank_view(rank) != first:
                raise InvariantViolation(
                    "TP ranks agree", f"rank {index}'s tree differs from rank 0's"
                )
        if any(log != self.calls[0] for log in self.calls[1:]):
            raise InvariantViolation("TP ranks agree", "the ranks joined different agreements")


def _copy_verb(kind: FactKind, value: int) -> str | None:
    if value == CopyFact.PENDING:
        return None
    direction = "write" if kind is FactKind.WRITE else "load"
    return f"ack_{direction}" if value == CopyFact.LANDED else f"fail_{direction}"
