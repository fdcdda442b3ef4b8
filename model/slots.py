"""A pool of numbered slots (device pages, host pages, embedding units) with content identities.

The model never moves bytes. Instead every allocated slot holds a *content identity*: a hashable value
that names exactly what the bytes in that slot would be (for KV, the page hash of the prefix the page
ends: SPEC §7 "the KV written for a token is a deterministic function of its prefix"). Copying a page
copies its identity; reading a slot returns it. A read of a freed slot, a write to a freed slot, a read of
a slot that was never written, or a double free raises :class:`InvariantViolation` (I5 / I7) at once.

Freed slots are handed out again lowest-first, so a slot that is freed too early is reused as soon as
possible: stale-offset bugs show up within a few steps instead of hiding.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable

import attrs

from kvstrata.model.errors import CapacityError, InvariantViolation, MisuseError

__all__ = ["UNWRITTEN", "SlotPool"]


class _Unwritten:
    """A singleton, also through copy, deepcopy and pickle."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNWRITTEN"

    def __reduce__(self) -> str:
        return "UNWRITTEN"


#: The content of a slot that was allocated but not written yet.
UNWRITTEN: Hashable = _Unwritten()


@attrs.define
class SlotPool:
    """``capacity`` slots, each either free or allocated (with a content identity or ``UNWRITTEN``).

    Invariants: the free slots and the allocated slots partition ``range(capacity)``; a slot is freed
    at most once per allocation.
    """

    name: str
    capacity: int = attrs.field()
    _free: list[int] = attrs.field(init=False)
    _content: dict[int, Hashable] = attrs.field(init=False, factory=dict)

    @capacity.validator
    def _check_capacity(self, _attribute: object, value: int) -> None:
        if value < 0:
            raise MisuseError(f"{self.name}: capacity must be >= 0, got {value}")

    def __attrs_post_init__(self) -> None:
        self._free = list(range(self.capacity))

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._content)

    def allocated(self) -> frozenset[int]:
        return frozenset(self._content)

    def is_allocated(self, slot: int) -> bool:
        return slot in self._content

    def alloc(self, count: int) -> tuple[int, ...]:
        """``count`` slots, lowest numbers first; raises :class:`CapacityError` (no change) if short."""
        if count < 0:
            raise MisuseError(f"{self.name}: cannot allocate {count} slots")
        if count > len(self._free):
            raise CapacityError(f"{self.name}: {count} slots asked, {len(self._free)} free")
        slots = tuple(heapq.heappop(self._free) for _ in range(count))
        for slot in slots:
            self._content[slot] = UNWRITTEN
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Return ``slots`` to the pool. A slot that is not allocated is a double free (I5)."""
        slots = tuple(slots)
        seen: set[int] = set()
        for slot in slots:
            if slot not in self._content or slot in seen:
                raise InvariantViolation("I5", f"{self.name}: slot {slot} freed twice")
            seen.add(slot)
        for slot in slots:
            del self._content[slot]
            heapq.heappush(self._free, slot)

    def write(self, slot: int, content: Hashable) -> None:
        if slot not in self._content:
            raise InvariantViolation("I5", f"{self.name}: write to free slot {slot}")
        self._content[slot] = content

    def read(self, slot: int) -> Hashable:
        """The content of an allocated, written slot (I5: not freed; I7: fully written first)."""
        if slot not in self._content:
            raise InvariantViolation("I5", f"{self.name}: read of free slot {slot}")
        content = self._content[slot]
        if content is UNWRITTEN:
            raise InvariantViolation(
                "I7", f"{self.name}: read of slot {slot} before it was written"
            )
        return content

    def peek(self, slot: int) -> Hashable | None:
        """The content of ``slot`` if allocated (``UNWRITTEN`` included), else ``None``. Never raises."""
        return self._content.get(slot)
