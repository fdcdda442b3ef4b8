"""One tier's pools as a group: the KV anchor pool and its side pools (SPEC §5).

The anchor (the KV pool) owns page indices and token accounting. ``ALL_PAGES`` side pools (indexer
keys) ride on those page indices; ``TRAILING_PAGES`` side pools (Mamba states) have slot allocators
of their own. A cache that moves a node to or from this tier needs pages *and* state slots at once,
so allocation is one call:

- :meth:`PoolGroup.alloc` is **atomic**: it takes every page and slot asked for or, when any pool
  is short, gives back what it already took and raises :class:`CapacityError` naming that pool,
  leaving every allocator exactly as it was;
- :meth:`PoolGroup.free` is **all or nothing, exactly once**: it checks every index of every pool
  first (in range, not repeated, allocated) and only then frees them, so a double free in one pool
  never half-frees the others (I5).

Invariant: ``free_counts()`` of the group are the free counts of its allocators; after any call
that raised, they are what they were before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.errors import CapacityError, ConfigError, MisuseError
from kvstrata.impl.pools.allocator import PageAllocator, PageIndices, as_page_array
from kvstrata.impl.pools.base import KVPool
from kvstrata.impl.pools.copy import copy_pages
from kvstrata.impl.pools.side import Region, SideBuffer, copy_entries
from kvstrata.model.hybrid import KV_POOL, HitPolicy

__all__ = ["GroupAllocation", "PoolGroup", "copy_between"]

_EMPTY = np.empty(0, dtype=np.int64)


@attrs.frozen
class GroupAllocation:
    """What one :meth:`PoolGroup.alloc` handed out: KV pages (shared by ``ALL_PAGES`` pools) and
    the slots of each ``TRAILING_PAGES`` pool by name."""

    pages: npt.NDArray[np.int64]
    states: Mapping[str, npt.NDArray[np.int64]] = attrs.field(factory=dict)


class PoolGroup:
    """The KV pool ``kv`` of one tier with its side pools ``side`` (same tier, distinct names).

    Invariants (checked on construction, :class:`ConfigError` otherwise): every ``ALL_PAGES`` side
    buffer has exactly ``kv.num_pages`` entries (entry ``i`` belongs to KV page ``i``); every
    ``TRAILING_PAGES`` one has an allocator of its own; names are distinct and none is ``"kv"``.
    """

    def __init__(self, kv: KVPool, side: Sequence[SideBuffer] = ()) -> None:
        if not isinstance(kv, KVPool):
            raise MisuseError(f"PoolGroup: expected a KV pool, got {kv!r}")
        self.kv = kv
        self.side: dict[str, SideBuffer] = {}
        for buffer in side:
            if not isinstance(buffer, SideBuffer):
                raise MisuseError(f"PoolGroup: expected SideBuffer values, got {buffer!r}")
            if buffer.name in self.side or buffer.name == KV_POOL:
                raise ConfigError(f"PoolGroup: side pool name {buffer.name!r} is taken")
            if buffer.spec.policy is HitPolicy.ALL_PAGES and buffer.entries != kv.num_pages:
                raise ConfigError(
                    f"PoolGroup: ALL_PAGES pool {buffer.name!r} has {buffer.entries} entries, "
                    f"its KV pool {kv.num_pages} pages (one entry per KV page)"
                )
            self.side[buffer.name] = buffer

    # ----------------------------------------------------------------------------------- queries
    @property
    def paged(self) -> tuple[SideBuffer, ...]:
        """The ``ALL_PAGES`` side pools (indexed by KV page)."""
        return tuple(b for b in self.side.values() if b.spec.policy is HitPolicy.ALL_PAGES)

    @property
    def stateful(self) -> tuple[SideBuffer, ...]:
        """The ``TRAILING_PAGES`` side pools (own slots)."""
        return tuple(b for b in self.side.values() if b.spec.policy is HitPolicy.TRAILING_PAGES)

    def allocator(self, pool: str) -> PageAllocator:
        """The allocator serving ``pool`` (``"kv"`` and ``ALL_PAGES`` pools share the KV one)."""
        if pool == KV_POOL:
            return self.kv.allocator
        buffer = self._buffer(pool)
        return buffer.allocator if buffer.allocator is not None else self.kv.allocator

    def free_counts(self) -> dict[str, int]:
        """Free pages of the KV pool and free slots of each state pool, by pool name."""
        counts = {KV_POOL: self.kv.allocator.free_count}
        for buffer in self.stateful:
            assert buffer.allocator is not None
            counts[buffer.name] = buffer.allocator.free_count
        return counts

    def describe(self, pool: str, entries: PageIndices) -> list[tuple[Region, ...]]:
        """The store regions of ``entries`` of side pool ``pool``, components in key order."""
        return self._buffer(pool).describe(entries)

    def _buffer(self, pool: str) -> SideBuffer:
        try:
            return self.side[pool]
        except (KeyError, TypeError):
            raise MisuseError(
                f"PoolGroup: no side pool {pool!r} (has {sorted(self.side)})"
            ) from None

    def _state_counts(self, states: Mapping[str, int] | int) -> dict[str, int]:
        """``states`` as a count per state pool (an int means that many in every state pool)."""
        if isinstance(states, int) and not isinstance(states, bool):
            wanted = {buffer.name: states for buffer in self.stateful}
        elif isinstance(states, Mapping):
            wanted = dict(states)
        else:
            raise MisuseError(f"PoolGroup.alloc: states is an int or a mapping, got {states!r}")
        for name, count in wanted.items():
            buffer = self._buffer(name)
            if buffer.allocator is None:
                raise MisuseError(f"PoolGroup.alloc: {name!r} shares the KV pages, no slots")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise MisuseError(f"PoolGroup.alloc: {name!r}: expected an int >= 0, got {count!r}")
        return wanted

    # --------------------------------------------------------------------------------- mutations
    def alloc(self, pages: int, states: Mapping[str, int] | int = 0) -> GroupAllocation:
        """``pages`` KV pages and, per state pool, ``states`` slots: all of them, or nothing
        (:class:`CapacityError` naming the short pool, every allocator as before)."""
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
            raise MisuseError(f"PoolGroup.alloc: pages: expected an int >= 0, got {pages!r}")
        wanted = self._state_counts(states)
        taken: list[tuple[PageAllocator, npt.NDArray[np.int64]]] = []
        try:
            kv_pages = self.kv.allocator.alloc(pages)
            taken.append((self.kv.allocator, kv_pages))
            slots: dict[str, npt.NDArray[np.int64]] = {}
            for name, count in wanted.items():
                allocator = self.allocator(name)
                slots[name] = allocator.alloc(count)
                taken.append((allocator, slots[name]))
        except CapacityError as error:
            for allocator, indices in reversed(taken):
                allocator.free(indices)
            raise CapacityError(f"PoolGroup.alloc: nothing allocated: {error}") from error
        return GroupAllocation(kv_pages, slots)

    def free(
        self,
        pages: PageIndices = _EMPTY,
        states: Mapping[str, PageIndices] | None = None,
    ) -> None:
        """Free KV ``pages`` and, per state pool, ``states`` slots; every index of every pool is
        checked first, so a bad one (:class:`MisuseError`) frees nothing anywhere."""
        plan: list[tuple[PageAllocator, npt.NDArray[np.int64]]] = [
            (self.kv.allocator, self._checked(self.kv.allocator, pages))
        ]
        for name, indices in (states or {}).items():
            allocator = self.allocator(name)
            if allocator is self.kv.allocator:
                raise MisuseError(f"PoolGroup.free: {name!r} shares the KV pages, no slots")
            plan.append((allocator, self._checked(allocator, indices)))
        for allocator, array in plan:
            allocator.free(array)

    def free_allocation(self, allocation: GroupAllocation) -> None:
        """Free everything one :meth:`alloc` handed out (all or nothing)."""
        self.free(allocation.pages, allocation.states)

    @staticmethod
    def _checked(allocator: PageAllocator, indices: PageIndices) -> npt.NDArray[np.int64]:
        array = as_page_array(
            indices, allocator.num_pages, what=f"{allocator.name}: free", unique=True
        )
        for index in array.tolist():
            if not allocator.is_allocated(index):
                raise MisuseError(f"{allocator.name}: page {index} is not allocated (double free?)")
        return array


def copy_between(
    src: PoolGroup,
    dst: PoolGroup,
    src_pages: PageIndices,
    dst_pages: PageIndices,
    states: Mapping[str, tuple[PageIndices, PageIndices]] | None = None,
) -> int:
    """Copy KV pages ``src_pages`` of ``src`` to ``dst_pages`` of ``dst`` together with the same
    entries of every ``ALL_PAGES`` side pool, and, per ``TRAILING_PAGES`` pool in ``states``, its
    ``(source slots, target slots)``; returns the bytes moved. The groups must hold the same side
    pools (by name and spec). One vectorised copy per pool and component."""
    if set(src.side) != set(dst.side):
        raise MisuseError(f"copy_between: side pools {sorted(src.side)} vs {sorted(dst.side)}")
    moved = copy_pages(src.kv, src_pages, dst.kv, dst_pages) if len(src_pages) else 0
    for buffer in src.paged:
        if len(src_pages):
            copy_entries(buffer, src_pages, dst.side[buffer.name], dst_pages)
            moved += buffer.spec.bytes_per_entry * len(src_pages)
    for name, (source, target) in (states or {}).items():
        buffer = src._buffer(name)
        if buffer.allocator is None:
            raise MisuseError(f"copy_between: {name!r} rides on the KV pages, no own slots")
        copy_entries(buffer, source, dst._buffer(name), target)
        moved += buffer.spec.bytes_per_entry * len(source)
    return moved
