"""The L1 pages the scheduler holds: taken with ``alloc_device``, handed back with ``insert`` or
``free_device`` (SPEC §3; I5).

Owned here: one flag per L1 page (held by the scheduler) and the repeat marks the ownership check
uses. Invariant: a page is held by the scheduler or referenced by the tree or free in the pool, never
two of these; :meth:`HeldPages.claim` checks a whole hand-back (every page in range, none twice, each
held or the tree's own page at that position) before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstrata.impl.cache.node import Allocator, Pages
from kvstrata.impl.errors import CapacityError, MisuseError
from kvstrata.impl.kernels import check_pages

__all__ = ["EMPTY", "HeldPages"]

EMPTY: Pages = np.zeros(0, dtype=np.int64)


class HeldPages:
    """See the module docstring; ``num_pages`` is the L1 pool's size."""

    def __init__(self, num_pages: int) -> None:
        self.held = np.zeros(num_pages, dtype=bool)
        self._stamp = np.zeros(num_pages, dtype=np.uint32)  # check_pages' repeat marks
        self._generation = 0

    def take(
        self, pages: int, device: Allocator, evict: Callable[[int], int], evictable: int
    ) -> Pages:
        """``pages`` fresh L1 pages for the scheduler, evicting unlocked L1 leaves as needed.
        :class:`CapacityError` if L1 stays short; an ask that even evicting every one of the
        ``evictable`` pages could not meet is refused before anything is evicted."""
        if pages > device.free_count + evictable:
            raise CapacityError(
                f"{pages} L1 pages asked, {device.free_count} free + {evictable} evictable"
            )
        if pages > device.free_count:
            evict(pages - device.free_count)
        if pages > device.free_count:
            raise CapacityError(f"{pages} L1 pages asked, {device.free_count} free")
        out = np.asarray(device.alloc(pages), dtype=np.int64)
        self.held[out] = True
        return out

    def pages(self) -> Pages:
        return np.flatnonzero(self.held).astype(np.int64)

    @staticmethod
    def as_array(pages: object, what: str) -> Pages:
        """``pages`` as a 1-D C-contiguous int64 array; :class:`MisuseError` if it is no 1-D
        sequence of ints (range, repeats and ownership are :meth:`claim`'s)."""
        if (
            type(pages) is np.ndarray
            and pages.dtype == np.int64
            and pages.ndim == 1
            and pages.flags.c_contiguous
        ):
            return pages
        array = np.asarray(pages)
        if array.size == 0:
            return EMPTY
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise MisuseError(
                f"{what} must be a 1-D array of ints, got {array.dtype} {array.shape}"
            )
        if array.dtype.kind == "u" and int(array.max()) > np.iinfo(np.int64).max:
            raise MisuseError(f"{what}: page {int(array.max())} is out of range")
        return np.ascontiguousarray(array, dtype=np.int64)

    def claim(self, given: Pages, own: Pages, what: str) -> Pages:
        """Check ``given`` (one L1 page per position) and take it from the scheduler: every page in
        range, none twice, each held by the scheduler or, at a position of ``own``, the tree's own
        page there. Returns the given pages at ``own``'s positions that differ from it (spare);
        :class:`MisuseError` with nothing changed otherwise (:func:`kernels.check_pages`)."""
        generation = self._generation = (self._generation + 1) & 0xFFFFFFFF
        if not generation:  # the marks wrapped around: start them afresh
            self._stamp[:] = 0
            generation = self._generation = 1
        spare = np.empty(len(own), dtype=np.int64)
        try:
            count = check_pages(given, self.held, self._stamp, generation, own, spare, True)
        except ValueError as error:
            raise MisuseError(f"{what}: {error}") from None
        return spare[:count]
