"""What the device and the host pool share: a torch buffer of whole pages, its allocator, and
validated page reads and writes in the canonical shape ``[planes, L, n, page_size, H, D]``.

Every pool stores its buffer in a **native** order: a permutation of the canonical dimensions
(:attr:`KVPool.to_native`; the identity for the device pool and ``layer_first``, page-major for the
page-first host layouts). Two views of the same memory serve everything:

- :meth:`KVPool.native` ``[outer, P, inner]``, contiguous: gathering pages is one ``index_select`` along
  dimension 1 (torch's row-copy fast path) and scattering is one ``index_copy_``;
- :meth:`KVPool.canonical` ``[planes, L, P, page, H, D]``, a (possibly strided) view in canonical order:
  a run of pages of any layout is the slice ``[:, :, a:b]``, and :meth:`KVPool.to_canonical` turns a
  gathered native block into canonical order without a copy.

So no layout needs a Python loop over pages or tokens.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.allocator import PageAllocator, PageIndices, as_page_array
from kvstrata.impl.pools.shape import KVShape

__all__ = ["PAGE_DIM", "KVPool", "check_pool_args"]

PAGE_DIM = 2
"""The page dimension of the canonical shape ``[planes, L, pages, page_size, H, D]``."""

IDENTITY = (0, 1, 2, 3, 4, 5)


def check_pool_args(shape: KVShape, num_pages: int, name: str) -> None:
    """:class:`MisuseError` unless ``shape`` is a :class:`KVShape`; :class:`ConfigError` unless
    ``num_pages`` is a positive int."""
    if not isinstance(shape, KVShape):
        raise MisuseError(f"{name}: expected a KVShape, got {shape!r}")
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise ConfigError(f"{name}: num_pages: expected a positive int, got {num_pages!r}")


class KVPool:
    """A pool of ``num_pages`` pages of ``shape``, with its own :class:`PageAllocator`.

    Invariants: the buffer never changes identity or size; ``read_pages``/``write_pages`` either
    complete or raise :class:`MisuseError` before touching the buffer. A page's bytes are unspecified
    until written. The allocator only tracks which pages are in use: reading or writing a page does not
    check that it is allocated (the cache owns that decision).

    Subclasses set ``buffer`` to a contiguous tensor of :meth:`native_shape` ``(num_pages)`` (or any
    tensor that views as it) and ``to_native`` to the permutation of canonical dimensions it uses.
    """

    shape: KVShape
    num_pages: int
    allocator: PageAllocator
    buffer: torch.Tensor
    to_native: tuple[int, ...] = IDENTITY
    """The permutation of canonical dimensions the buffer is stored in:
    ``native6 = canonical.permute(to_native)``."""

    def __init__(self, shape: KVShape, num_pages: int, name: str) -> None:
        check_pool_args(shape, num_pages, name)
        self.shape = shape
        self.allocator = PageAllocator(num_pages, name)
        self.num_pages = num_pages

    # ---------------------------------------------------------------------------------- layout algebra
    def native_shape(self, pages: int) -> tuple[int, ...]:
        """The 6-D shape of ``pages`` pages in native order."""
        canonical = self.shape.canonical(pages)
        return tuple(canonical[d] for d in self.to_native)

    def block_shape(self, pages: int) -> tuple[int, int, int]:
        """The 3-D shape ``(outer, pages, inner)`` of ``pages`` pages in native order."""
        native = self.native_shape(pages)
        split = self.to_native.index(PAGE_DIM)
        return (math.prod(native[:split]), pages, math.prod(native[split + 1 :]))

    def native(self) -> torch.Tensor:
        """The whole buffer as a contiguous ``[outer, num_pages, inner]`` view."""
        return self.buffer.view(self.block_shape(self.num_pages))

    def to_canonical(self, block: torch.Tensor) -> torch.Tensor:
        """A view of a native block (``[outer, n, inner]`` or its 6-D form) in canonical order."""
        pages = block.shape[1] if block.dim() == 3 else block.shape[self.to_native.index(PAGE_DIM)]
        inverse = tuple(self.to_native.index(d) for d in range(6))
        return block.view(self.native_shape(pages)).permute(inverse)

    def to_block(self, canonical: torch.Tensor) -> torch.Tensor:
        """A canonical tensor of ``n`` pages as a contiguous native ``[outer, n, inner]`` block
        (a view when it already is one, a copy otherwise)."""
        return canonical.permute(self.to_native).reshape(
            self.block_shape(canonical.shape[PAGE_DIM])
        )

    def canonical(self) -> torch.Tensor:
        """The whole buffer viewed as ``[planes, L, num_pages, page_size, H, D]`` (a view: writing
        through it writes the pool, without any validation)."""
        return self.to_canonical(self.native())

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
        block = self.native().index_select(1, index)
        return self.to_canonical(block).contiguous()

    def write_pages(self, pages: PageIndices, kv: torch.Tensor) -> None:
        """Write ``kv`` (canonical shape for ``len(pages)`` pages, ``shape.dtype``, any device) into
        ``pages`` (no repeats). :class:`MisuseError` and no change on any mismatch."""
        array = self.page_array(pages, unique=True)
        self.check_kv(kv, int(array.size))
        if array.size == 0:
            return
        block = self.to_block(kv.to(self.device))
        self.native().index_copy_(1, self.page_index(array), block)

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
