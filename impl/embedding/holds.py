"""What the caller holds of the embedding cache between calls (SPEC §6), the implementation of
:mod:`kvstrata.model.embedding.holds`: reservations (new entries the caller writes in place, in
the registered pool) and loans (complete entries the caller reads in place).

* :class:`Reservation` (from ``EmbeddingCache.reserve``): the FILLING entries of a batch, each a
  ``[tokens, dim]`` view of the pool (:attr:`Reservation.views`) or, when the pool had to scatter
  its units, written with :meth:`Reservation.write`. An encoder writes its output there (a
  device-to-host copy lands straight in registered memory); ``commit`` pushes the batch from the
  same bytes, ``abort`` frees them. Nothing may be written after either.
* :class:`Loan` (from ``EmbeddingCache.borrow``): the READY entries of a batch as views of the pool
  (a scattered entry is gathered into a copy), kept from eviction until ``give_back`` (or the end
  of a ``with`` block). The views must not be written, nor used after the loan is given back.

Owned here: the open holds and the hold sequence. Entry states and reader counts change only
through :class:`~kvstrata.impl.embedding.entries.Entries`. Invariants (checked against the model
by the differential machine): an entry is FILLING exactly while one open reservation holds it, for
its current generation; an entry's ``readers`` is the number of open loans that name it; a hold is
closed once, and only by the cache that made it (a closed or unknown hold, or one another cache
made, is a :class:`MisuseError` that changes nothing: hold numbers start at 0 in every cache, so
the number alone would let one cache's reservation close another's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import attrs
import torch

from kvstrata.impl.embedding.entries import Entries, LiveEntry
from kvstrata.impl.embedding.pool import EmbeddingPool
from kvstrata.impl.errors import MisuseError
from kvstrata.model.keys import PageHash

__all__ = ["Holds", "Loan", "Reservation", "Reserved"]


@attrs.frozen
class Reserved:
    """An open reservation: the batch (media, tokens) in order, duplicates merged; the FILLING
    entries it allocated (their records: a FILLING entry is never evicted, so each is live until
    the reservation is closed); the batch's local hits when it was made; how many new items did
    not fit."""

    batch: tuple[tuple[PageHash, int], ...]
    fresh: tuple[LiveEntry, ...]
    hits: tuple[PageHash, ...]
    skipped_no_space: int


@attrs.define
class Reservation:
    """New entries to write in place before ``commit`` (see the module docstring)."""

    hold: int
    new: tuple[PageHash, ...]
    skipped_no_space: int
    _views: Mapping[PageHash, torch.Tensor | None] = attrs.field(alias="views", repr=False)
    places: Mapping[PageHash, tuple[tuple[int, ...], int]] = attrs.field(repr=False)
    """Each new entry's units and token count."""
    pool: EmbeddingPool = attrs.field(repr=False)
    owner: object = attrs.field(default=None, repr=False, eq=False)
    """The :class:`Holds` that made it: only that cache commits or aborts it."""
    closed: bool = False

    @property
    def views(self) -> Mapping[PageHash, torch.Tensor | None]:
        """Each new entry's ``[tokens, dim]`` view of the pool; ``None`` when its units are apart.
        Gone once the reservation is committed or aborted (:class:`MisuseError`): a view written
        then would change a READY entry, or one the store is being sent (keep no reference)."""
        if self.closed:
            raise MisuseError(f"reservation {self.hold} is closed: its views are gone")
        return self._views

    def write(self, media: PageHash, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (``[tokens, dim]``, the pool's dtype, any device) into ``media``'s
        units: the one copy an insert needs."""
        if self.closed or media not in self.places:
            raise MisuseError(f"{media!r} is not a new entry of open reservation {self.hold}")
        pieces = self.pool.segments(*self.places[media])
        tokens, dim = sum(p.shape[0] for p in pieces), pieces[0].shape[1]
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (tokens, dim):
            raise MisuseError(f"write: want a [{tokens}, {dim}] tensor for {media!r}")
        if tensor.dtype != pieces[0].dtype:
            raise MisuseError(f"write: dtype {tensor.dtype}, the pool holds {pieces[0].dtype}")
        at = 0
        for piece in pieces:
            piece.copy_(tensor[at : at + piece.shape[0]])
            at += piece.shape[0]


@attrs.define
class Loan:
    """Entries read in place until given back (see the module docstring); a context manager."""

    hold: int
    tensors: tuple[torch.Tensor | None, ...]
    """Per asked hash: the entry's ``[tokens, dim]`` bytes in the pool, ``None`` for a miss."""
    _give_back: Callable[[Loan], int] = attrs.field(repr=False)
    owner: object = attrs.field(default=None, repr=False, eq=False)
    """The :class:`Holds` that made it: only that cache takes it back."""

    def __enter__(self) -> Loan:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._give_back(self)


class Holds:
    """One node's open reservations and loans. See the module docstring for the rules."""

    def __init__(self, entries: Entries) -> None:
        self.entries = entries
        self._reserved: dict[int, Reserved] = {}
        self._loans: dict[int, tuple[LiveEntry, ...]] = {}
        self._next = 0

    def handles(self) -> tuple[int, ...]:
        return tuple(sorted([*self._reserved, *self._loans]))

    def reserve(self, reserved: Reserved) -> int:
        hold = self._take_seq()
        self._reserved[hold] = reserved
        return hold

    def close_reservation(self, reservation: Reservation) -> Reserved:
        """The open reservation ``reservation`` names, now closed; misuse for anything else."""
        if (
            not isinstance(reservation, Reservation)
            or reservation.owner is not self
            or reservation.closed
            or reservation.hold not in self._reserved
        ):
            raise MisuseError(f"no open reservation {reservation!r} of this cache")
        reservation.closed = True
        return self._reserved.pop(reservation.hold)

    def lend(self, lent: Sequence[LiveEntry]) -> int:
        """A loan of ``lent`` (each a READY entry, named once): one reader more on each (a
        borrowed entry is never forgotten, so its record is live until the loan is back)."""
        self.entries.lend(lent, 1)
        hold = self._take_seq()
        self._loans[hold] = tuple(lent)
        return hold

    def give_back(self, loan: Loan) -> int:
        """Close ``loan``: one reader less on each entry it names; how many."""
        if not isinstance(loan, Loan) or loan.owner is not self or loan.hold not in self._loans:
            raise MisuseError(f"no open loan {loan!r} of this cache")
        lent = self._loans.pop(loan.hold)
        self.entries.lend(lent, -1)
        return len(lent)

    def _take_seq(self) -> int:
        self._next += 1
        return self._next - 1
