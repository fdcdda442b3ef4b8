"""Page allocators with exact free accounting.

Invariants of a :class:`PageAllocator` (``check()`` verifies them; the unit tests hold it to a set
model):

- every page in ``range(num_pages)`` is either free or allocated, never both:
  ``free_count + used_count == num_pages``;
- ``alloc(n)`` returns the ``n`` **lowest** free pages in ascending order (deterministic: the same
  sequence of calls gives the same pages);
- every allocated page is freed exactly once; an ``alloc`` that cannot be satisfied raises
  :class:`CapacityError` and a ``free`` of a free, duplicated or out-of-range page raises
  :class:`MisuseError`, and neither changes anything.

Design. A free-mask (one bool per page) with a per-block free count (blocks of ``_BLOCK`` pages) on top,
and a hint, ``_first``: the lowest block that may hold a free page (every block below it is full).
When that block alone holds ``n`` free pages (the common case) ``alloc(n)`` scans just it; otherwise
it finds the lowest blocks that hold ``n`` free pages with one cumulative sum over the block counts from
``_first`` on, gathers the free-mask of only the non-empty ones among them and takes the first ``n`` set
bits. ``free(pages)`` sets bits, adds a ``bincount`` to the block counts and lowers the hint. Before all
that, a *run* ``[_run_start, _run_end)`` of free pages with no free page below it (the whole pool after
``reset``, until a page below the run is freed) serves ``alloc`` with an ``arange`` and a slice: the
common case of a pool that is filling up. Everything is a numpy call over ``k`` pages plus
``num_pages / _BLOCK`` block counters: no Python work per page. With the C kernels
(:mod:`kvstrata.impl.kernels`) ``alloc`` past the run and ``free`` are one C loop each over the same
mask and counts (``take_lowest`` / ``give_back``), with the same results and the same errors.
Alternatives: a heap (``heapq``) pops one page per Python call (~0.3 µs each, 1000 pages per request at
page size 1); a sorted free array is vectorised but merging freed pages back costs ``O(free pages)`` per
``free``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.errors import CapacityError, ConfigError, MisuseError
from kvstrata.impl.kernels import give_back, take_lowest

__all__ = ["PageAllocator", "PageIndices", "as_page_array"]

PageIndices: TypeAlias = "npt.NDArray[np.integer] | Sequence[int] | torch.Tensor"
"""Page indices as a caller may pass them: a 1-D integer numpy array, a sequence of ints, or a 1-D
integer torch tensor (on any device)."""

_SHIFT = 10
_BLOCK = 1 << _SHIFT


def as_page_array(
    pages: PageIndices, num_pages: int, *, what: str = "pages", unique: bool = False
) -> npt.NDArray[np.int64]:
    """``pages`` as a 1-D int64 numpy array, checked to lie in ``range(num_pages)`` (and, with
    ``unique``, to hold no index twice). :class:`MisuseError` naming ``what`` otherwise.

    The result may share memory with ``pages``; callers must not write to it.
    """
    if isinstance(pages, torch.Tensor):
        if pages.dtype.is_floating_point or pages.dtype.is_complex or pages.dtype == torch.bool:
            raise MisuseError(f"{what}: expected integer page indices, got a {pages.dtype} tensor")
        array = pages.detach().to("cpu").numpy()
    else:
        array = np.asarray(pages)
        if array.size == 0:
            array = array.astype(np.int64)
    if array.ndim != 1:
        raise MisuseError(
            f"{what}: expected a 1-D sequence of page indices, got shape {array.shape}"
        )
    if array.dtype.kind not in "iu":
        raise MisuseError(f"{what}: expected integer page indices, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= num_pages:
            bad = low if low < 0 else high
            raise MisuseError(f"{what}: page {bad} is out of range [0, {num_pages})")
        if unique and array.size > 1:
            ordered = np.sort(array)
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            if repeated.size:
                raise MisuseError(f"{what}: page {int(repeated[0])} is given more than once")
    return array


class PageAllocator:
    """Hands out page indices ``0 .. num_pages - 1``, lowest free first (see the module docstring).

    Not thread-safe: the scheduler thread owns it (the transfer worker never allocates or frees).
    """

    __slots__ = (
        "_block_free",
        "_blocks",
        "_first",
        "_free",
        "_free_count",
        "_name",
        "_num_pages",
        "_run_end",
        "_run_start",
    )

    def __init__(self, num_pages: int, name: str = "pages") -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(
                f"PageAllocator.num_pages: expected a positive int, got {num_pages!r}"
            )
        if not isinstance(name, str) or not name:
            raise ConfigError(f"PageAllocator.name: expected a non-empty str, got {name!r}")
        self._name = name
        self._num_pages = num_pages
        self._blocks = -(-num_pages // _BLOCK)
        # padded to whole blocks; padding pages are never free
        self._free = np.zeros(self._blocks * _BLOCK, dtype=np.bool_)
        self._block_free = np.zeros(self._blocks, dtype=np.int64)
        self._first = 0  # every block below it has no free page
        self._run_start = self._run_end = 0  # free pages, and no free page below them
        self.reset()

    # ----------------------------------------------------------------------------------------- queries
    @property
    def name(self) -> str:
        """The pool this allocator serves, for error messages and metrics."""
        return self._name

    @property
    def num_pages(self) -> int:
        """Total pages, free and allocated."""
        return self._num_pages

    @property
    def free_count(self) -> int:
        """Pages that ``alloc`` can hand out now."""
        return self._free_count

    @property
    def used_count(self) -> int:
        """Pages allocated and not yet freed (``num_pages - free_count``)."""
        return self._num_pages - self._free_count

    def is_allocated(self, page: int) -> bool:
        """Whether ``page`` is allocated; :class:`MisuseError` if it is not a page of this pool."""
        if isinstance(page, bool) or not isinstance(page, int | np.integer):
            raise MisuseError(f"{self._name}: expected a page index (int), got {page!r}")
        if not 0 <= page < self._num_pages:
            raise MisuseError(f"{self._name}: page {page} is out of range [0, {self._num_pages})")
        return not bool(self._free[page])

    def allocated(self) -> frozenset[int]:
        """Every allocated page (O(num_pages); for tests and diagnostics)."""
        return frozenset(np.flatnonzero(~self._free[: self._num_pages]).tolist())

    # -------------------------------------------------------------------------------------- mutations
    def alloc(self, n: int) -> npt.NDArray[np.int64]:
        """The ``n`` lowest free pages, ascending (int64), now allocated.

        :class:`CapacityError` (nothing allocated) if fewer than ``n`` are free; :class:`MisuseError`
        if ``n`` is not a non-negative int.
        """
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise MisuseError(f"{self._name}: alloc expects a non-negative int, got {n!r}")
        n = int(n)
        if n > self._free_count:
            raise CapacityError(
                f"{self._name}: cannot allocate {n} pages, {self._free_count} of "
                f"{self._num_pages} are free"
            )
        if n == 0:
            return np.empty(0, dtype=np.int64)
        if take_lowest is not None:  # one C loop over the mask instead of a dozen numpy calls
            self._run_start = self._run_end = 0  # (the run only serves the numpy path)
            out = np.empty(n, dtype=np.int64)
            self._first = take_lowest(self._free, self._block_free, out, _SHIFT, self._first)
            self._free_count -= n
            return out
        if n <= self._run_end - self._run_start:
            return self._take_run(n)
        self._run_start = self._run_end = 0  # the n lowest free pages use up the run
        counts = self._block_free
        first = self._first
        if counts[first] >= n:
            # the lowest block with free pages holds them all (the common case): scan just that block
            base = first << _SHIFT
            pages = np.flatnonzero(self._free[base : base + _BLOCK])[:n] + base
            counts[first] -= n
        else:
            # the lowest blocks that together hold n free pages; only the non-empty ones are scanned
            tail = counts[first:]
            last = int(np.searchsorted(np.cumsum(tail), n))
            blocks = np.flatnonzero(tail[: last + 1]) + first
            found = np.flatnonzero(self._free.reshape(self._blocks, _BLOCK)[blocks])[:n]
            pages = (blocks[found >> _SHIFT] << _SHIFT) + (found & (_BLOCK - 1))
            counts -= np.bincount(pages >> _SHIFT, minlength=self._blocks)
        self._free[pages] = False
        self._free_count -= n
        if not counts[first] and self._free_count:
            self._first = first + int(np.argmax(counts[first:] > 0))
        return pages.astype(np.int64)

    def _take_run(self, n: int) -> npt.NDArray[np.int64]:
        """The first ``n`` pages of the run (the ``n`` lowest free pages), now allocated."""
        start = self._run_start
        stop = start + n
        pages = np.arange(start, stop, dtype=np.int64)
        self._free[start:stop] = False
        if start >> _SHIFT == (stop - 1) >> _SHIFT:
            self._block_free[start >> _SHIFT] -= n
        else:
            self._block_free -= np.bincount(pages >> _SHIFT, minlength=self._blocks)
        self._free_count -= n
        self._run_start = stop
        self._first = max(self._first, min(stop >> _SHIFT, self._blocks - 1))
        return pages

    def free(self, pages: PageIndices) -> None:
        """Return ``pages`` to the free set.

        :class:`MisuseError` (nothing freed) if a page is out of range, given twice, or not allocated.
        """
        if give_back is not None:
            if not (
                type(pages) is np.ndarray
                and pages.dtype == np.int64
                and pages.ndim == 1
                and pages.flags.c_contiguous
            ):
                pages = as_page_array(pages, self._num_pages, what=f"{self._name}: free")
                pages = np.ascontiguousarray(pages, dtype=np.int64)
            if not pages.size:
                return
            try:  # checks range, repeats and double frees before changing anything
                low = give_back(self._free, self._block_free, pages, _SHIFT, self._num_pages)
            except ValueError as error:
                raise MisuseError(f"{self._name}: free: {error}") from None
            self._free_count += int(pages.size)
            self._note_freed(low)
            return
        array = as_page_array(pages, self._num_pages, what=f"{self._name}: free", unique=True)
        if array.size == 0:
            return
        already = self._free[array]
        if already.any():
            page = int(array[np.argmax(already)])
            raise MisuseError(f"{self._name}: page {page} is not allocated (double free?)")
        self._free[array] = True
        self._block_free += np.bincount(array >> _SHIFT, minlength=self._blocks)
        self._free_count += int(array.size)
        self._note_freed(int(array.min()))

    def _note_freed(self, low: int) -> None:
        """Pages down to ``low`` became free: lower the first-free hint, end the run if below it."""
        self._first = min(self._first, low >> _SHIFT)
        if low < self._run_start:
            self._run_start = self._run_end = 0  # a free page below the run: it is no run any more

    def reset(self) -> None:
        """Free every page (for a cache ``reset()``)."""
        self._free[:] = False
        self._free[: self._num_pages] = True
        self._block_free[:] = _BLOCK
        self._block_free[-1] = self._num_pages - (self._blocks - 1) * _BLOCK
        self._free_count = self._num_pages
        self._first = 0
        self._run_start, self._run_end = 0, self._num_pages

    def check(self) -> None:
        """Raise ``AssertionError`` unless the internal counters agree with the free-mask."""
        counts = self._free.reshape(self._blocks, _BLOCK).sum(axis=1)
        assert np.array_equal(counts, self._block_free), "block counts disagree with the free-mask"
        assert int(counts.sum()) == self._free_count, "free_count disagrees with the free-mask"
        assert not self._free[self._num_pages :].any(), "a padding page is marked free"
        assert not counts[: self._first].any(), "a block below the first-free hint has free pages"
        start, end = self._run_start, self._run_end
        assert self._free[start:end].all(), "the run holds an allocated page"
        assert not self._free[:start].any(), "a page below the run is free"
        assert 0 <= self._free_count <= self._num_pages

    def __repr__(self) -> str:
        return (
            f"PageAllocator(name={self._name!r}, num_pages={self._num_pages}, "
            f"free={self._free_count})"
        )
