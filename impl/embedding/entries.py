"""The entry table of the embedding cache (SPEC §6), the implementation of
:mod:`kvstrata.model.embedding.entries`: the entry values and the per-entry lifecycle bookkeeping
over the :class:`~kvstrata.impl.embedding.pool.EmbeddingPool`.

Owned here: every live :class:`Entry` (by media hash), the LRU stamps and the generation counter;
the units come from the pool. The table is kept in stamp order (an entry whose stamp changes moves
to its end), so the LRU victims are found from its front without sorting: planning room costs
the victims it takes, not the size of the pool. This is the only module of the implementation that advances
:data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY`, with the model's guard sets (derived from that
table in :mod:`kvstrata.model.embedding.entries`).

Invariants upheld here alone:

* only READY entries are read or pushed, and LRU eviction takes READY entries only: an entry being
  pushed or loaded is pinned, never evicted, its units never reused until its op's result is
  applied; a FILLING entry (held by a reservation) and a borrowed one (``readers``) are never
  evicted either;
* every allocation gets a new generation, so an extent captured for an older one is stale;
* an entry leaves the table only through an event that frees it (eviction, or a failed get:
  ``LOAD_FAILED`` frees and forgets it), and :meth:`Entries.forget` is the only place its units
  are freed: the pool's allocated units are exactly the units of the live entries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import torch

from kvstrata.impl.embedding.pool import EmbeddingPool
from kvstrata.impl.errors import InvariantViolation
from kvstrata.model.embedding.entries import EVICTABLE
from kvstrata.model.keys import PageHash
from kvstrata.model.lifecycles import EMBEDDING_ENTRY, EntryEvent, EntryState

__all__ = ["Entries", "Entry"]


@attrs.frozen
class Entry:
    """One cached media item; ``generation`` is new for every allocation, ``stamp`` orders LRU,
    ``readers`` counts the open loans of its units (a borrowed entry is never evicted)."""

    media: PageHash
    tokens: int
    units: tuple[int, ...]
    state: EntryState
    generation: int
    stamp: int
    readers: int = 0


def _with(
    entry: Entry,
    *,
    state: EntryState | None = None,
    stamp: int | None = None,
    readers: int | None = None,
) -> Entry:
    """``entry`` with some fields replaced (``attrs.evolve`` without its introspection: this
    runs several times per item of every batch)."""
    return Entry(
        entry.media,
        entry.tokens,
        entry.units,
        entry.state if state is None else state,
        entry.generation,
        entry.stamp if stamp is None else stamp,
        entry.readers if readers is None else readers,
    )


class Entries:
    """One node's live entries over its pool. See the module docstring for the rules."""

    def __init__(self, pool: EmbeddingPool) -> None:
        self.pool = pool
        self._table: dict[PageHash, Entry] = {}
        self._clock = 0
        self._generation = 0

    # ----------------------------------------------------------------------------- queries

    def get(self, media: PageHash) -> Entry | None:
        return self._table.get(media)

    def __getitem__(self, media: PageHash) -> Entry:
        return self._table[media]

    def __contains__(self, media: object) -> bool:
        return media in self._table

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._table.values())

    def sorted(self) -> tuple[Entry, ...]:
        return tuple(sorted(self._table.values(), key=lambda entry: entry.media.digest))

    def read(self, entry: Entry) -> torch.Tensor:
        """A copy of ``entry``'s embedding."""
        return self.pool.read(entry.units, entry.tokens)

    def view(self, entry: Entry) -> torch.Tensor:
        """``entry``'s embedding in place (a copy only when its units are apart)."""
        view = self.pool.view(entry.units, entry.tokens)
        return view if view is not None else self.pool.read(entry.units, entry.tokens)

    def lru(self, protect: frozenset[PageHash]) -> list[Entry]:
        """Evictable entries (READY, unpinned, not borrowed, not protected), LRU first."""
        return list(self._evictable(protect))

    def _evictable(self, protect: frozenset[PageHash]) -> Iterator[Entry]:
        """:meth:`lru`, lazily: the table is in stamp order (see the module docstring)."""
        for entry in self._table.values():
            if entry.state in EVICTABLE and not entry.readers and entry.media not in protect:
                yield entry

    def plan_room(
        self, needs: Sequence[tuple[PageHash, int]], protect: frozenset[PageHash]
    ) -> tuple[list[Entry], list[tuple[PageHash, int]], int]:
        """The victims (LRU first), the needs (media, tokens) that fit (in order) and how many did
        not; changes nothing. A need fits when the free units and the evictable ones not yet taken
        hold it; its victims are then the next LRU candidates. Candidates are pulled from the
        front of the LRU order only as far as a need requires (all of them only when one does
        not fit)."""
        candidates = self._evictable(protect)
        # candidates seen so far, LRU first; the first ``taken`` of them are victims
        pulled: list[Entry] = []
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

    def begin_fill(self, media: PageHash, tokens: int) -> Entry:
        """A new FILLING entry of ``media`` (FREE -> FILLING): the caller writes its units (a
        reservation holds it until it is committed or aborted)."""
        entry = Entry(
            media=media,
            tokens=tokens,
            units=self.pool.alloc(self.pool.shape.units_for(tokens)),
            state=EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.FILL),
            generation=self._new_generation(),
            stamp=self._tick(),
        )
        self._table[media] = entry
        return entry

    def push_filled(self, entry: Entry) -> Entry:
        """The caller wrote a FILLING ``entry``: FILLED then PUSH (one value, touched for LRU),
        stored. One step of the table each, as :meth:`step` would take them."""
        ready = EMBEDDING_ENTRY.next(entry.state, EntryEvent.FILLED)
        pushing = EMBEDDING_ENTRY.next(ready, EntryEvent.PUSH)
        entry = _with(entry, state=pushing, stamp=self._tick())
        self.put(entry)
        return entry

    def lend(self, media: PageHash, delta: int) -> None:
        """One loan of ``media``'s units opened (``delta`` 1, touched for LRU) or closed (-1)."""
        entry = self._table[media]
        stamp = self._tick() if delta > 0 else None
        self.put(_with(entry, readers=entry.readers + delta, stamp=stamp))

    def load(self, media: PageHash, tokens: int) -> Entry:
        """A new LOADING (pinned) entry of ``media`` (FREE -> LOADING), its units unwritten."""
        entry = Entry(
            media=media,
            tokens=tokens,
            units=self.pool.alloc(self.pool.shape.units_for(tokens)),
            state=EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.LOAD),
            generation=self._new_generation(),
            stamp=self._tick(),
        )
        self._table[media] = entry
        return entry

    def stamp(self, entry: Entry) -> Entry:
        """``entry`` touched for LRU (not stored: :meth:`put` it before touching another entry, so
        the table stays in stamp order)."""
        return _with(entry, stamp=self._tick())

    def step(self, entry: Entry, event: EntryEvent) -> Entry:
        """``entry`` after ``event`` (not stored: :meth:`put` it); never to FREE (:meth:`forget`)."""
        return _with(entry, state=EMBEDDING_ENTRY.next(entry.state, event))

    def put(self, entry: Entry) -> None:
        """Store ``entry``; one whose stamp changed (always to the newest) moves to the end, which
        keeps the table in stamp order."""
        table = self._table
        old = table.get(entry.media)
        if old is not None and old.stamp != entry.stamp:
            del table[entry.media]
        table[entry.media] = entry

    def touch(self, media: PageHash) -> None:
        self.put(self.stamp(self._table[media]))

    def advance(self, entry: Entry, event: EntryEvent) -> None:
        """``entry`` (the stored value) after ``event``, stored in its place (no touch)."""
        self._table[entry.media] = _with(entry, state=EMBEDDING_ENTRY.next(entry.state, event))

    def forget(self, entry: Entry, event: EntryEvent) -> None:
        """Take ``entry`` to FREE through ``event``: forgotten, its units freed."""
        if EMBEDDING_ENTRY.next(entry.state, event) is not EntryState.FREE or entry.readers:
            raise InvariantViolation("I5", f"{event} does not free {entry!r}")
        del self._table[entry.media]
        self.pool.free(entry.units)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_generation(self) -> int:
        self._generation += 1
        return self._generation
