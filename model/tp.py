"""Tensor parallelism: the facts TP ranks agree on before a tree changes (SPEC §10; issue 18).

Every rank of a TP group runs the same scheduler over its own KV shard and mirrors the same tree.
What finishes in the background (copies, backups, prefetch queries and reads, a store coming back)
differs per rank, so the tree changes only by *agreed* facts: one elementwise minimum over every
rank's integer report, made at a fixed point of each step (``check_events``) by every rank, whatever
it has to report. The encodings below make the minimum the agreed fact:

- a copy op (:class:`CopyFact`) is acked when every rank's copy landed; when any rank's failed it
  fails, with every later op of its direction (as one rank's failed batch does), but only once no
  rank has a copy of that direction in flight (:func:`copy_failure_due`: a failure frees the later
  ops' destination pages, which a copy still running would write); it waits while any rank's copy is
  in flight;
- a backup op (:class:`BackupFact`) is stored when every rank stored all of it (an MLA non-writer
  counts its skip as stored: the single writer decides), retried when any rank must retry, given up
  when any rank gave up, and waits while any rank's job is in flight;
- a prefetch query hits the minimum of the ranks' hits; a read delivers the minimum of the ranks'
  pages (each rank releases its pages beyond it); a state read with it is used only if every rank
  read the same page's state (the minimum equals the maximum); the op is overdue once any rank's
  clock says so;
- a backup op is parked (nothing finishes it while a store is down) when any rank deferred it,
  and quiet when no rank runs a job of it or has one due without an agreement (each rank's job is
  deferred, holds its result for the agreement, or was dropped); the cache counts as idle when
  every backup op is parked and quiet. A rank whose store came back starts a deferred op's job
  only when the ranks agree that no rank defers it any more, so no job starts between the
  agreement that made the cache idle and the next one (``reset`` frees the pages such a job
  would read);
- L2 is re-published when any rank's store came back empty.

The layout of one agreement (which facts, in which order) derives from agreed state only (the
pending ops, identical on every rank), so it is identical on every rank. :func:`frame` prefixes the
values with the layout's length and digest, each also negated: after the minimum, a rank whose
layout differed shows as ``min != -min(-x)`` and :func:`unframe` raises :class:`Diverged` instead
of applying facts that name different ops. :class:`TpModel` runs N rank models by these rules.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence

from kvstrata.model.errors import InvariantViolation, KvStrataError

__all__ = [
    "HEADER",
    "BackupFact",
    "CopyFact",
    "Diverged",
    "FactKind",
    "agree",
    "copy_failure_due",
    "frame",
    "layout_digest",
    "unframe",
]


class Diverged(KvStrataError):
    """TP ranks reported facts about different ops, or a different number of facts: their trees
    already differ (a bug) and nothing of this agreement is applied."""


class FactKind(enum.IntEnum):
    """What one slot of an agreement reports (part of the layout digest)."""

    WRITE = 1  # a write-through copy op: CopyFact
    LOAD = 2  # a load-back copy op: CopyFact
    BACKUP = 3  # a backup op: BackupFact
    QUERY = 4  # a prefetch query: 0 pending, else 1 + hit pages
    READ = 5  # a prefetch read: 0 pending, else 1 + pages delivered
    READ_MAX = 6  # the same read, negated: the minimum of it is minus the maximum
    OVERDUE = 7  # a prefetch op: 0 overdue on this rank's clock, 1 not
    REPUBLISH = 8  # the store came back empty: 0 re-publish wanted, 1 not
    PARKED = 9  # a backup op: 0 deferred here (this rank's store is down), 1 not
    QUIET = 10  # a backup op: 1 no job of it runs here or is due here unagreed, 0 one does


class CopyFact(enum.IntEnum):
    PENDING = 0
    FAILED = 1
    LANDED = 2


class BackupFact(enum.IntEnum):
    PENDING = 0
    GIVE_UP = 1  # retries spent, or dropped while the store was down
    RETRY = 2
    STORED = 3


#: header slots before the values: length, -length, digest, -digest
HEADER = 4
_DIGEST_BITS = 62


def layout_digest(layout: Sequence[tuple[FactKind, int]]) -> int:
    """A digest of ``(kind, op id)`` pairs in order (62 bits: negatable in int64)."""
    blob = b"".join(
        kind.to_bytes(1, "little") + op.to_bytes(8, "little", signed=True) for kind, op in layout
    )
    raw = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")
    return raw >> (64 - _DIGEST_BITS)


def frame(layout: Sequence[tuple[FactKind, int]], values: Sequence[int]) -> list[int]:
    """One rank's report: the header, then ``values`` (one per layout slot)."""
    if len(layout) != len(values):
        raise InvariantViolation("TP report", f"{len(values)} values, {len(layout)} slots")
    digest = layout_digest(layout)
    return [len(values), -len(values), digest, -digest, *values]


def unframe(agreed: Sequence[int]) -> list[int]:
    """The agreed values after the minimum, or :class:`Diverged` if the ranks' layouts differed."""
    if len(agreed) < HEADER:
        raise Diverged(f"an agreement of {len(agreed)} integers has no header")
    shortest, longest, low, high = agreed[0], -agreed[1], agreed[2], -agreed[3]
    if shortest != longest or low != high or len(agreed) != HEADER + shortest:
        raise Diverged(
            f"ranks reported different facts: {shortest}..{longest} slots, "
            f"layout digests {low:#x}..{high:#x}"
        )
    return list(agreed[HEADER:])


def agree(reports: Sequence[Sequence[int]]) -> list[int]:
    """The elementwise minimum of every rank's report (what one MIN all-reduce computes)."""
    if not reports or len({len(report) for report in reports}) != 1:
        raise Diverged(f"reports of lengths {sorted({len(r) for r in reports})} cannot be reduced")
    return [min(column) for column in zip(*reports, strict=True)]


def read_state_agreed(delivered: int, delivered_max: int) -> bool:
    """Whether a prefetched state is used: every rank read the state of the same page."""
    return delivered > 0 and delivered == delivered_max


def copy_failure_due(later: Sequence[int]) -> bool:
    """Whether an agreed copy failure may be applied: every later op of its direction (their agreed
    ``CopyFact`` values) is done on every rank, so failing them frees no page a copy still writes."""
    return all(value != CopyFact.PENDING for value in later)
