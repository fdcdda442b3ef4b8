"""What the caller holds of the embedding cache model between calls (SPEC §6): reservations (new
entries the caller is writing) and loans (complete entries the caller is reading in place).

A **reservation** is the first half of an insert split in two, so that an encoder can write its
output straight into the pool: ``reserve`` allocates FILLING entries, the caller writes their
slots, ``commit`` makes them READY and pushes the batch (or ``abort`` frees them). A **loan** is a
``get`` without a copy: ``borrow`` hands out the slots of READY (or PUSHING) entries and counts a
reader on each until ``give_back``; a borrowed entry is never evicted, so its slots are never
reused under the reader.

Owned here: the open holds (by :class:`Hold`) and the hold sequence. Entry states and reader
counts change only through :class:`~kvstrata.model.embedding.entries.Entries`.

Invariants upheld here alone (I5):

* an entry is FILLING exactly while one open reservation holds it, for its current generation;
* an entry's ``readers`` is the number of open loans that name it;
* a hold is closed once: committing, aborting or giving back a closed (or unknown) hold is a
  :class:`MisuseError` that changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from kvstrata.model.embedding.entries import FILLING, Entries
from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.keys import PageHash

__all__ = ["Hold", "HoldKind", "Holds", "Reserved"]


class HoldKind(enum.Enum):
    RESERVE = "reserve"  # new entries being written by the caller
    LOAN = "loan"  # complete entries being read in place by the caller


@attrs.frozen
class Hold:
    """Names one open hold of one node."""

    node: str
    kind: HoldKind
    seq: int


@attrs.frozen
class Reserved:
    """An open reservation: the whole batch (media, size) in order, duplicates merged; the FILLING
    entries it allocated (media, generation); the batch's local hits when it was made; and how
    many new items did not fit."""

    batch: tuple[tuple[PageHash, int], ...]
    fresh: tuple[tuple[PageHash, int], ...]
    hits: tuple[PageHash, ...]
    skipped_no_space: int


@attrs.define
class Holds:
    """One node's open reservations and loans. See the module docstring for the rules."""

    name: str
    entries: Entries = attrs.field(repr=False)
    _reserved: dict[Hold, Reserved] = attrs.field(init=False, factory=dict)
    _loans: dict[Hold, tuple[PageHash, ...]] = attrs.field(init=False, factory=dict)
    _next: int = attrs.field(init=False, default=0)

    def reservation(self, hold: Hold) -> Reserved:
        """The open reservation ``hold``; :class:`MisuseError` if it is not one."""
        reserved = self._reserved.get(hold) if isinstance(hold, Hold) else None
        if reserved is None:
            raise MisuseError(f"{self.name}: no open reservation {hold!r}")
        return reserved

    def loan(self, hold: Hold) -> tuple[PageHash, ...]:
        """The media the open loan ``hold`` names; :class:`MisuseError` if it is not one."""
        media = self._loans.get(hold) if isinstance(hold, Hold) else None
        if media is None:
            raise MisuseError(f"{self.name}: no open loan {hold!r}")
        return media

    # ----------------------------------------------------------------------------- changes

    def reserve(self, reserved: Reserved) -> Hold:
        return self._open(HoldKind.RESERVE, reserved)

    def close_reservation(self, hold: Hold) -> Reserved:
        reserved = self.reservation(hold)
        del self._reserved[hold]
        return reserved

    def lend(self, media: Sequence[PageHash]) -> Hold:
        """A loan of ``media`` (each a complete entry, named once): one reader more on each."""
        for item in media:
            self.entries.lend(item, 1)
        return self._open(HoldKind.LOAN, tuple(media))

    def give_back(self, hold: Hold) -> int:
        """Close the loan ``hold``: one reader less on each entry it names; how many."""
        media = self.loan(hold)
        del self._loans[hold]
        for item in media:
            self.entries.lend(item, -1)
        return len(media)

    def _open(self, kind: HoldKind, value: Reserved | tuple[PageHash, ...]) -> Hold:
        hold = Hold(self.name, kind, self._next)
        self._next += 1
        if isinstance(value, Reserved):
            self._reserved[hold] = value
        else:
            self._loans[hold] = value
        return hold

    # ----------------------------------------------------------------------------- invariants

    def check(self) -> None:
        """I5: FILLING entries are exactly the open reservations' (current generation), and
        reader counts are exactly the open loans'."""
        filling = {
            media: generation
            for reserved in self._reserved.values()
            for media, generation in reserved.fresh
        }
        readers: dict[PageHash, int] = {}
        for media_list in self._loans.values():
            for media in media_list:
                readers[media] = readers.get(media, 0) + 1
        for entry in self.entries:
            held = filling.pop(entry.media, None)
            if (entry.state in FILLING) != (held == entry.generation):
                raise InvariantViolation("I5", f"{self.name}: {entry!r} vs reservation {held}")
            if entry.readers != readers.pop(entry.media, 0):
                raise InvariantViolation("I5", f"{self.name}: {entry!r} has wrong readers")
        if filling or readers:
            raise InvariantViolation("I5", f"{self.name}: holds name gone entries")
