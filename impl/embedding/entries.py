"""The entry table of the embedding cache (SPEC §6), the implementation of
:mod:`kvstrata.model.embedding.entries`: the entry records and the per-entry lifecycle bookkeeping
over the :class:`~kvstrata.impl.embedding.pool.EmbeddingPool`.

Owned here: every live entry (a :class:`LiveEntry` record by media hash, changed in place and only
by :class:`Entries`), the LRU stamps and the generation counter; the units come from the pool.
Callers read the records; what leaves the cache is an :class:`Entry` value (a snapshot). The
table is kept in stamp order (an entry touched moves to its end), so the LRU victims are found
from its front without sorting: planning room costs the victims it takes, not the size of the
pool. This is the only module of the implementation that advances
:data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY`, with the model's guard sets (derived from that
table in :mod:`kvstrata.model.embedding.entries`); every change of state is one step of the table.

Why records and not a new value per change (issue 20): a batch of 128 KiB embeddings spent more
on building values than a raw store call of its items spends on Python; a record changed in place
costs an attribute store per step, and every step still goes through ``EMBEDDING_ENTRY.next``.

Invariants upheld here alone:

* only READY entries are read or pushed, and LRU eviction takes READY entries only: an entry being
  pushed or loaded is pinned, never evicted, its units never reused until its op's result is
  applied; a FILLING entry (held by a reservation) and a borrowed one (``readers``) are never
  evicted either;
* every allocation gets a new generation (and a new record), so an extent captured for an older
  one is stale;
* the table's order is its stamps' order: a stamp changes only to the newest, and the entry moves
  to the end with it;
* an entry leaves the table only through an event that frees it (eviction, or a failed get:
  ``LOAD_FAILED`` frees and forgets it), and :meth:`Entries.forget_all` is the only place its
  units are freed: the pool's allocated units are exactly the units of the live entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import attrs
import torch

from kvstrata.impl.embedding.pool import EmbeddingPool
from kvstrata.impl.errors import InvariantViolation
from kvstrata.model.embedding.entries import EVICTABLE
from kvstrata.model.keys import PageHash
from kvstrata.model.lifecycles import EMBEDDING_ENTRY, EntryEvent, EntryState

__all__ = ["Entries", "Entry", "LiveEntry"]


@attrs.frozen
class Entry:
    """One cached media item as it was when asked; ``generation`` is new for every allocation,
    ``stamp`` orders LRU, ``readers`` counts the open loans of its units (a borrowed entry is
    never evicted)."""

    media: PageHash
    tokens: int
    units: tuple[int, ...]
    state: EntryState
    generation: int
    stamp: int
    readers: int = 0


@attrs.define(eq=False, repr=False)
class LiveEntry:
    """The table's record of one entry: the fields of :class:`Entry`, changed in place by
    :class:`Entries` only (``media``, ``tokens``, ``units`` and ``generation`` never change: a new
    allocation is a new record)."""

    media: PageHash
    tokens: int
    units: tuple[int, ...]
    state: EntryState
    generation: int
    stamp: int
    readers: int = 0

    def snapshot(self) -> Entry:
        return Entry(
            self.media,
            self.tokens,
            self.units,
            self.state,
            self.generation,
            self.stamp,
            self.readers,
        )

    def __repr__(self) -> str:
        return f"Live{self.snapshot()!r}"


_FILLING = EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.FILL)
_LOADING = EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.LOAD)


class Entries:
    """One node's live entries over its pool. See the module docstring for the rules."""

    def __init__(self, pool: EmbeddingPool) -> None:
        self.pool = pool
        self._table: dict[PageHash, LiveEntry] = {}
        self._clock = 0
        self._generation = 0

    # ----------------------------------------------------------------------------- queries

    def get(self, media: PageHash) -> LiveEntry | None:
        return self._table.get(media)

    def __getitem__(self, media: PageHash) -> LiveEntry:
        return self._table[media]

    def __contains__(self, media: object) -> bool:
        return media in self._table

    def __iter__(self) -> Iterator[LiveEntry]:
        return iter(self._table.values())

    def partition(
        self, batch: Sequence[tuple[PageHash, int]]
    ) -> tuple[list[LiveEntry], list[tuple[PageHash, int]]]:
        """The live entries of ``batch``'s media and the (media, tokens) pairs without one, each
        in batch order."""
        table = self._table
        found: list[LiveEntry] = []
        misses: list[tuple[PageHash, int]] = []
        for pair in batch:
            entry = table.get(pair[0])
            if entry is None:
                misses.append(pair)
            else:
                found.append(entry)
        return found, misses

    def snapshot(self, media: PageHash) -> Entry | None:
        entry = self._table.get(media)
        return None if entry is None else entry.snapshot()

    def sorted(self) -> tuple[Entry, ...]:
        """Every entry's snapshot, by media digest."""
        return tuple(
            entry.snapshot()
            for entry in sorted(self._table.values(), key=lambda entry: entry.media.digest)
        )

    def read(self, entry: LiveEntry) -> torch.Tensor:
        """A copy of ``entry``'s embedding."""
        return self.pool.read(entry.units, entry.tokens)

    def view(self, entry: LiveEntry) -> torch.Tensor:
        """``entry``'s embedding in place (a copy only when its units are apart)."""
        view = self.pool.view(entry.units, entry.tokens)
        return view if view is not None else self.pool.read(entry.units, entry.tokens)

    def lru(self, protect: frozenset[PageHash]) -> list[LiveEntry]:
        """Evictable entries (READY, unpinned, not borrowed, not protected), LRU first."""
        return list(self._evictable(protect))

    def _evictable(self, protect: frozenset[PageHash]) -> Iterator[LiveEntry]:
        """:meth:`lru`, lazily: the table is in stamp order (see the module docstring)."""
        for entry in self._table.values():
            if entry.state in EVICTABLE and not entry.readers and entry.media not in protect:
                yield entry

    def plan_room(
        self, needs: Sequence[tuple[PageHash, int]], protect: frozenset[PageHash]
    ) -> tuple[list[LiveEntry], list[tuple[PageHash, int]], int]:
        """The victims (LRU first), the needs (media, tokens) that fit (in order) and how many did
        not; changes nothing. A need fits when the free units and the evictable ones not yet taken
        hold it; its victims are then the next LRU candidates. Candidates are pulled from the
        front of the LRU order only as far as a need requires (all of them only when one does
        not fit)."""
        candidates = self._evictable(protect)
        # candidates seen so far, LRU first; the first ``taken`` of them are victims
        pulled: list[LiveEntry] = []
        taken = 0
        spare = 0  # units of pulled[taken:]
        free = self.pool.free_count
        fits: list[tuple[PageHash, int]] = []
        units_for = self.pool.shape.units_for
        for media, tokens in needs:
            size = units_for(tokens)
            while free + spare < size:
                more = next(candidates, None)
                if more is None:
                    break
                pulled.append(more)
                spare += len(more.units)
            if free + spare < size:
                continue
            while free < size:
                victim = pulled[taken]
                taken += 1
                free += len(victim.units)
                spare -= len(victim.units)
            free -= size
            fits.append((media, tokens))
        return pulled[:taken], fits, len(needs) - len(fits)

    # ----------------------------------------------------------------------------- lifecycle

    def begin_fills(self, needs: Sequence[tuple[PageHash, int]]) -> list[LiveEntry]:
        """A new FILLING entry for each (media, tokens) of ``needs`` (FREE -> FILLING; room was
        planned): the caller writes its units (a reservation holds it until it is committed or
        aborted)."""
        return self._allocate(needs, _FILLING)

    def loads(self, needs: Sequence[tuple[PageHash, int]]) -> list[LiveEntry]:
        """A new LOADING (pinned) entry for each (media, tokens) of ``needs`` (FREE -> LOADING;
        room was planned), its units unwritten."""
        return self._allocate(needs, _LOADING)

    def _allocate(
        self, needs: Sequence[tuple[PageHash, int]], state: EntryState
    ) -> list[LiveEntry]:
        table, alloc, units_for = self._table, self.pool.alloc, self.pool.shape.units_for
        one = self.pool.shape.unit_tokens  # an embedding of at most this many rows is one unit
        generation, clock = self._generation, self._clock
        made = []
        for media, tokens in needs:
            generation += 1
            clock += 1
            units = alloc(1 if tokens <= one else units_for(tokens))
            entry = LiveEntry(media, tokens, units, state, generation, clock)
            table[media] = entry  # a new key: at the end (media are not in the table, planned)
            made.append(entry)
        self._generation, self._clock = generation, clock
        return made

    def push_filled(self, entries: Sequence[LiveEntry]) -> None:
        """The caller wrote each FILLING entry of ``entries``: FILLED then PUSH, touched for LRU
        in order (each moves to the end of the table with the newest stamp)."""
        step, filled, push = EMBEDDING_ENTRY.next, EntryEvent.FILLED, EntryEvent.PUSH
        for entry in entries:
            entry.state = step(step(entry.state, filled), push)
        self.touch_all(entries)

    def lend(self, entries: Sequence[LiveEntry], delta: int) -> None:
        """One loan of each entry's units opened (``delta`` 1: touched for LRU, in order) or
        closed (-1)."""
        for entry in entries:
            entry.readers += delta
        if delta > 0:
            self.touch_all(entries)

    def touch(self, entry: LiveEntry) -> None:
        """``entry`` is the most recently used: the newest stamp, at the end of the table."""
        self.touch_all((entry,))

    def touch_all(self, entries: Iterable[LiveEntry]) -> None:
        """:meth:`touch` each of ``entries``, in order (the last is the most recently used)."""
        table, clock = self._table, self._clock
        for entry in entries:
            del table[entry.media]
            table[entry.media] = entry
            clock += 1
            entry.stamp = clock
        self._clock = clock

    def advance(self, entry: LiveEntry, event: EntryEvent) -> None:
        """``entry`` after ``event``, in its place (no touch); never to FREE (:meth:`forget`)."""
        entry.state = EMBEDDING_ENTRY.next(entry.state, event)

    def forget(self, entry: LiveEntry, event: EntryEvent) -> None:
        """Take ``entry`` to FREE through ``event``: forgotten, its units freed."""
        self.forget_all((entry,), event)

    def forget_all(self, entries: Iterable[LiveEntry], event: EntryEvent) -> int:
        """:meth:`forget` each of ``entries`` through ``event``, in order; how many. Each is
        checked before it changes (an entry that ``event`` does not free raises there, the ones
        before it stay forgotten)."""
        table, free, step, gone = self._table, self.pool.free, EMBEDDING_ENTRY.next, EntryState.FREE
        count = 0
        for entry in entries:
            freed = step(entry.state, event)
            if freed is not gone or entry.readers:
                raise InvariantViolation("I5", f"{event} does not free {entry!r}")
            if table.get(entry.media) is not entry:
                raise InvariantViolation("I5", f"{entry!r} is not the live entry of its media")
            del table[entry.media]
            entry.state = freed
            free(entry.units)
            count += 1
        return count
