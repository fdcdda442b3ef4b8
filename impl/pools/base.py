"""What the device and the host pool share: a torch buffer of whole pages, its allocator, and
validated page reads and writes in the canonical shape ``[planes, L, n, page_size, H, D]``.

A subclass only builds its buffer and says how to see it in canonical dimension order
(:meth:`KVPool.canonical`); reading and writing are one ``index_select`` / ``index_copy_`` along the
page dimension of that (possibly strided) view, so no layout has a Python loop over pages or tokens.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.pools.allocator import PageAllocator, PageIndices, as_page_array
from kvstrata.impl.pools.shape import KVShape

__all__ = ["PAGE_DIM", "KVPool"]

PAGE_DIM = 2
"""The page dimension of the canonical shape ``[planes, L, pages, page_size, H, D]``."""


class KVPool:
    """A pool of ``num_pages`` pages of ``shape``, with its own :class:`PageAllocator`.

    Invariants: the buffer never changes identity or size; ``read_pages``/``write_pages`` either
    complete or raise :class:`MisuseError` before touching the buffer. A page's bytes are unspecified
    until written. The allocator only tracks which pages are in use: reading or writing a page does not
    check that it is allocated (the cache owns that decision).
    """

    shape: KVShape
    num_pages: int
    allocator: PageAllocator
    buffer: torch.Tensor

    def __init__(self, shape: KVShape, num_pages: int, name: str) -> None:
        if not isinstance(shape, KVShape):
            raise MisuseError(f"{name}: expected a KVShape, got {shape!r}")
        self.shape = shape
        self.allocator = PageAllocator(num_pages, name)  # validates num_pages (ConfigError)
        self.num_pages = num_pages

    # ------------------------------------------------------------------------------ what subclasses give
    def canonical(self) -> torch.Tensor:
        """The whole buffer viewed as ``[planes, L, num_pages, page_size, H, D]`` (a view: writing
        through it writes the pool, without any validation)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ queries
    @property
    def device(self) -> torch.device:
        """Where the buffer lives."""
        return self.buffer.device

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer (``num_pages * shape.bytes_per_page``)."""
        return self.num_pages * self.shape.bytes_per_page

    def page_array(
        self, pages: PageIndices, *, what: str = "pages", unique: bool = False
    ) -> npt.NDArray[np.int64]:
        """``pages`` validated against this pool (1-D ints in range; no repeats with ``unique``)."""
        return as_page_array(
            pages, self.num_pages, what=f"{self.allocator.name}: {what}", unique=unique
        )

    def page_index(self, pages: npt.NDArray[np.int64]) -> torch.Tensor:
        """Validated page indices as an int64 tensor on this pool's device."""
        index = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
        if self.device.type != "cpu":
            index = index.to(self.device, non_blocking=True)
        return index

    # --------------------------------------------------------------------------------------- reads/writes
    def read_pages(self, pages: PageIndices) -> torch.Tensor:
        """A new contiguous tensor ``[planes, L, len(pages), page_size, H, D]`` on this pool's device
        holding the given pages in the given order (repeats allowed)."""
        index = self.page_index(self.page_array(pages))
        return self.canonical().index_select(PAGE_DIM, index)

    def write_pages(self, pages: PageIndices, kv: torch.Tensor) -> None:
        """Write ``kv`` (canonical shape for ``len(pages)`` pages, ``shape.dtype``, any device) into
        ``pages`` (no repeats). :class:`MisuseError` and no change on any mismatch."""
        array = self.page_array(pages, unique=True)
        self.check_kv(kv, int(array.size))
        if array.size == 0:
            return
        self.canonical().index_copy_(PAGE_DIM, self.page_index(array), kv.to(self.device))

    def check_kv(self, kv: torch.Tensor, pages: int) -> None:
        """:class:`MisuseError` unless ``kv`` is a canonical tensor of ``pages`` pages and the pool's
        dtype."""
        name = self.allocator.name
        if not isinstance(kv, torch.Tensor):
            raise MisuseError(f"{name}: kv must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dtype != self.shape.dtype:
            raise MisuseError(f"{name}: kv dtype must be {self.shape.dtype}, got {kv.dtype}")
        expected = self.shape.canonical(pages)
        if tuple(kv.shape) != expected:
            raise MisuseError(f"{name}: kv shape must be {expected}, got {tuple(kv.shape)}")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.shape!r}, num_pages={self.num_pages}, "
            f"device={self.device}, free={self.allocator.free_count})"
        )
