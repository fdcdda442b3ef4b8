"""The entry table of the embedding cache model (SPEC §6): the entry values, the local slot pool and
the per-entry lifecycle bookkeeping.

Owned here: every live :class:`Entry` (by media hash), the :class:`~kvstrata.model.slots.SlotPool`
its slots come from, the LRU stamps and the generation counter. This is the only module of the
model that advances :data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY`; the guard sets below are
derived from that table, never spelled out by hand.

Invariants upheld here alone:

* only READY entries are read or pushed (:data:`READABLE`, :data:`PUSHABLE`) or evicted
  (:data:`EVICTABLE`): an entry being pushed or loaded (:data:`PINNED`) is never an LRU victim, so
  its slots are never freed or reused while an op holds its offset;
* every allocation gets a new generation, so an offset captured for an older one is stale;
* an entry leaves the table only through an event that frees it (eviction, or a failed GET:
  ``LOAD_FAILED`` frees and forgets it), and :meth:`Entries.forget` is the only place its slots
  are freed;
* I5 accounting: the pool's allocated slots are exactly the slots of live entries, no slot
  belongs to two entries, no entry outlives a call in FREE (a FILLING one is held by a
  reservation, :mod:`.holds`); I7: a complete entry's slots hold its own units, a loading or
  filling entry's are unwritten; a borrowed entry (``readers``) is complete and never evicted.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence

import attrs

from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.keys import PageHash
from kvstrata.model.lifecycles import EMBEDDING_ENTRY, EntryEvent, EntryState
from kvstrata.model.slots import UNWRITTEN, SlotPool

__all__ = [
    "COMPLETE",
    "EVICTABLE",
    "FILLING",
    "HELD_BY_GET",
    "HELD_BY_PUSH",
    "PINNED",
    "PUSHABLE",
    "READABLE",
    "Entries",
    "Entry",
    "Unit",
    "check_hash",
    "check_hashes",
    "embedding_content",
]

#: Where a push may start: READY only (SPEC §6: only ready entries are pushed).
PUSHABLE = EMBEDDING_ENTRY.sources(EntryEvent.PUSH)
#: Where ``get`` returns content: the same READY entries (only ready entries are read).
READABLE = PUSHABLE
#: LRU victims (explicit eviction or making room): where EVICT is legal.
EVICTABLE = EMBEDDING_ENTRY.sources(EntryEvent.EVICT)
#: Held by a pending push (GET): where the push's (GET's) completion events leave from.
HELD_BY_PUSH = EMBEDDING_ENTRY.sources(EntryEvent.PUSH_ACK, EntryEvent.PUSH_FAILED)
HELD_BY_GET = EMBEDDING_ENTRY.sources(EntryEvent.LOADED, EntryEvent.LOAD_FAILED)
#: An op holds the entry's offset until a push or GET result completes it.
PINNED = HELD_BY_PUSH | HELD_BY_GET
#: The slots hold the entry's own units: a push may start, or one is running.
COMPLETE = EMBEDDING_ENTRY.sources(EntryEvent.PUSH, EntryEvent.PUSH_ACK)
#: Being written by the caller (held by a reservation until it is committed or aborted).
FILLING = EMBEDDING_ENTRY.sources(EntryEvent.FILLED, EntryEvent.FILL_FAILED)


@attrs.frozen
class Unit:
    """The content identity of unit ``index`` of the embedding of ``media``."""

    media: PageHash
    index: int


def embedding_content(media: PageHash, size: int) -> tuple[Unit, ...]:
    """The embedding of ``media``, unit by unit: the object the store holds under its key."""
    return tuple(Unit(media, index) for index in range(size))


@attrs.frozen
class Entry:
    """One cached media item. ``generation`` is new for every allocation; ``stamp`` orders LRU;
    ``readers`` counts the open loans of its slots (a borrowed entry is never evicted)."""

    media: PageHash
    size: int
    state: EntryState
    slots: tuple[int, ...]
    generation: int
    stamp: int
    readers: int = 0


def check_hash(media: PageHash) -> PageHash:
    if not isinstance(media, PageHash):
        raise MisuseError(f"a media hash is a PageHash, got {type(media).__name__}")
    return media


def check_hashes(hashes: Iterable[PageHash]) -> tuple[PageHash, ...]:
    if isinstance(hashes, PageHash | str | bytes):
        raise MisuseError(f"expected an iterable of PageHash, got {type(hashes).__name__}")
    return tuple(check_hash(media) for media in hashes)


@attrs.define
class Entries:
    """One node's live entries over its slot pool. See the module docstring for the rules."""

    name: str
    pool: SlotPool = attrs.field(repr=False)
    _table: dict[PageHash, Entry] = attrs.field(init=False, factory=dict)
    _clock: int = attrs.field(init=False, default=0)
    _generation: int = attrs.field(init=False, default=0)

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

    def read(self, slots: Iterable[int]) -> tuple[Hashable, ...]:
        """What ``slots`` hold (an entry's, or an offset's: the store reads what it was handed)."""
        return tuple(self.pool.read(slot) for slot in slots)

    def lru(self, protect: frozenset[PageHash]) -> list[Entry]:
        """Evictable entries (READY, unpinned, not borrowed, not protected), least recently used
        first."""
        return sorted(
            (
                entry
                for entry in self._table.values()
                if entry.state in EVICTABLE and not entry.readers and entry.media not in protect
            ),
            key=lambda entry: entry.stamp,
        )

    def plan_room(
        self, needs: Sequence[tuple[PageHash, int]], protect: frozenset[PageHash]
    ) -> tuple[list[Entry], list[tuple[PageHash, int]], int]:
        """Which entries to evict (LRU first) so that the needs that can fit do; changes nothing.

        Returns the victims, the needs that fit (in order) and how many did not."""
        candidates = self.lru(protect)
        spare = sum(entry.size for entry in candidates)
        free = self.pool.free_count
        victims: list[Entry] = []
        fits: list[tuple[PageHash, int]] = []
        for media, size in needs:
            if size > free + spare:
                continue
            while free < size:
                victim = candidates[len(victims)]
                victims.append(victim)
                free += victim.size
                spare -= victim.size
            free -= size
            fits.append((media, size))
        return victims, fits, len(needs) - len(fits)

    # ----------------------------------------------------------------------------- lifecycle

    def begin_fill(self, media: PageHash, size: int) -> Entry:
        """A new FILLING entry of ``media`` (FREE -> FILLING), its slots unwritten: the caller
        writes them (a reservation holds the entry until it is committed or aborted)."""
        state = EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.FILL)
        return self._new(media, size, state, self.pool.alloc(size))

    def end_fill(self, media: PageHash) -> Entry:
        """The caller wrote ``media``'s units into its slots: READY (FILLED)."""
        entry = self._table[media]
        for slot, unit in zip(entry.slots, embedding_content(media, entry.size), strict=True):
            self.pool.write(slot, unit)
        self.advance(media, EntryEvent.FILLED)
        return self._table[media]

    def lend(self, media: PageHash, delta: int) -> None:
        """One loan of ``media``'s slots opened (``delta`` 1) or closed (-1)."""
        entry = self._table[media]
        self.put(attrs.evolve(entry, readers=entry.readers + delta))

    def load(self, media: PageHash, size: int) -> Entry:
        """A new LOADING (pinned) entry of ``media`` (FREE -> LOADING), its slots unwritten."""
        state = EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.LOAD)
        return self._new(media, size, state, self.pool.alloc(size))

    def loaded(self, media: PageHash, slots: Sequence[int], content: Sequence[Hashable]) -> None:
        """A GET wrote ``content`` into the ``slots`` it was handed; ``media`` is READY (LOADED)."""
        for slot, unit in zip(slots, content, strict=True):
            self.pool.write(slot, unit)
        self.advance(media, EntryEvent.LOADED)

    def stamp(self, entry: Entry) -> Entry:
        """``entry`` touched for LRU (not stored: :meth:`put` it)."""
        self._clock += 1
        return attrs.evolve(entry, stamp=self._clock)

    def step(self, entry: Entry, event: EntryEvent) -> Entry:
        """``entry`` after ``event`` (not stored: :meth:`put` it); never to FREE (:meth:`forget`)."""
        return attrs.evolve(entry, state=EMBEDDING_ENTRY.next(entry.state, event))

    def put(self, entry: Entry) -> None:
        self._table[entry.media] = entry

    def touch(self, media: PageHash) -> None:
        self.put(self.stamp(self._table[media]))

    def advance(self, media: PageHash, event: EntryEvent) -> None:
        self.put(self.step(self._table[media], event))

    def forget(self, entry: Entry, event: EntryEvent) -> None:
        """Take ``entry`` to FREE through ``event``: it is forgotten and its slots are freed."""
        if EMBEDDING_ENTRY.next(entry.state, event) is not EntryState.FREE or entry.readers:
            raise InvariantViolation("I5", f"{self.name}: {event} does not free {entry!r}")
        del self._table[entry.media]
        self.pool.free(entry.slots)

    def _new(self, media: PageHash, size: int, state: EntryState, slots: tuple[int, ...]) -> Entry:
        self._generation += 1
        self._clock += 1
        entry = Entry(media, size, state, slots, generation=self._generation, stamp=self._clock)
        self._table[media] = entry
        return entry

    # ----------------------------------------------------------------------------- invariants

    def check_accounting(self) -> None:
        """I5: live entries only, each slot owned once, the pool's allocation = the entries'."""
        owner: dict[int, PageHash] = {}
        for media, entry in self._table.items():
            if media != entry.media or entry.state not in PINNED | COMPLETE | FILLING:
                raise InvariantViolation("I5", f"{self.name}: bad live entry {entry!r}")
            if len(entry.slots) != entry.size:
                raise InvariantViolation("I5", f"{self.name}: {entry!r} has the wrong slot count")
            for slot in entry.slots:
                if slot in owner:
                    raise InvariantViolation(
                        "I5", f"{self.name}: slot {slot} belongs to {owner[slot]} and {media}"
                    )
                owner[slot] = media
        if frozenset(owner) != self.pool.allocated():
            raise InvariantViolation(
                "I5",
                f"{self.name}: allocated slots {sorted(self.pool.allocated())} "
                f"!= entry slots {sorted(owner)}",
            )

    def check_contents(self) -> None:
        """I7: a complete entry holds its own units; a loading or filling one's slots are
        unwritten (its bytes are not the entry's until it is complete); only a complete entry is
        lent."""
        for entry in self._table.values():
            contents = [self.pool.peek(slot) for slot in entry.slots]
            if entry.readers and entry.state not in COMPLETE:
                raise InvariantViolation("I7", f"{self.name}: {entry!r} is lent incomplete")
            if entry.state in COMPLETE:
                if contents != list(embedding_content(entry.media, entry.size)):
                    raise InvariantViolation("I7", f"{self.name}: {entry!r} holds {contents}")
            elif any(content is not UNWRITTEN for content in contents):
                raise InvariantViolation("I7", f"{self.name}: loading {entry!r} holds {contents}")
