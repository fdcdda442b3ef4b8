"""The L2 host pool (SPEC §2): KV pages in host memory, pinned when CUDA is present, in one of the
:class:`HostLayout` orders.

Whatever the layout, the pool is seen through the two views of :class:`KVPool`: ``native()``, contiguous
``[outer, P, inner]`` blocks (``[planes * L, P, page * H * D]`` for ``layer_first``, ``[planes, P, L *
page * H * D]`` for the page-first layouts) for gathers and scatters, and ``canonical()``, a permuted
view in canonical order. Reads, writes and page copies therefore run the same ``index_select`` /
``index_copy_`` / slice copies for every layout and round-trip to identical bytes.
:meth:`HostKVPool.page_slab` gives the contiguous bytes of one page of one plane for the page-first
layouts (what an L3 backend stores as one object).

Wrapping: :meth:`HostKVPool.wrap` adopts a buffer an engine already holds (sglang's host
``kv_buffer`` has exactly these physical shapes), zero-copy: every read and write of the pool is the
engine's memory. Its shape, dtype, device and contiguity are checked first (:class:`ConfigError`
naming what differs); an MLA buffer may omit the leading plane dimension (sglang's MLA host pools do).

Pinning: ``pin_memory=None`` pins iff ``torch.cuda.is_available()``. ``pin_memory=True`` without CUDA is
a :class:`ConfigError` rather than a silent fallback: pinned memory only matters for DMA to a GPU, and a
configuration that asks for it on a machine without one is a mistake worth reporting.
"""

from __future__ import annotations

import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.base import KVPool, check_pool_args
from kvstrata.impl.pools.shape import HostLayout, KVShape
from kvstrata.impl.pools.sizes import check_host_fits

__all__ = ["HostKVPool"]

_TO_NATIVE: dict[HostLayout, tuple[int, ...]] = {
    # canonical [planes, L, P, page, H, D] -> native order
    HostLayout.LAYER_FIRST: (0, 1, 2, 3, 4, 5),  # [planes, L, P, page, H, D] = [planes, L, N, H, D]
    HostLayout.PAGE_FIRST: (0, 2, 3, 1, 4, 5),  # [planes, P, page, L, H, D] = [planes, N, L, H, D]
    HostLayout.PAGE_FIRST_DIRECT: (0, 2, 1, 3, 4, 5),  # [planes, P, L, page, H, D]
    HostLayout.PAGE_MAJOR: (2, 0, 1, 3, 4, 5),  # [P, planes, L, page, H, D]
}


class HostKVPool(KVPool):
    """The L2 pool: ``num_pages`` pages of ``shape`` in host memory laid out as ``layout``.

    ``allocator`` is this pool's own :class:`PageAllocator` (named ``"host"``). The constructor
    refuses (:class:`ConfigError`) a pool the machine cannot hold (:func:`check_host_fits`, with
    ``available`` and ``reserve`` passed through for tests and operators).
    """

    layout: HostLayout
    pinned: bool

    def __init__(
        self,
        shape: KVShape,
        num_pages: int,
        layout: HostLayout | str = HostLayout.LAYER_FIRST,
        pin_memory: bool | None = None,
        *,
        available: int | None = None,
        reserve: int | str | None = None,
    ) -> None:
        # refuse before anything is allocated (the allocator too holds a byte per page)
        check_pool_args(shape, num_pages, "host")
        check_host_fits(
            shape.nbytes(num_pages),
            what=f"host pool of {num_pages} pages",
            available=available,
            reserve=reserve,
        )
        layout = HostLayout.parse(layout)
        cuda = torch.cuda.is_available()
        if pin_memory is None:
            pin_memory = cuda
        elif not isinstance(pin_memory, bool):
            raise ConfigError(f"HostKVPool.pin_memory: expected a bool or None, got {pin_memory!r}")
        elif pin_memory and not cuda:
            raise ConfigError(
                "HostKVPool.pin_memory: True requested but torch.cuda.is_available() is False "
                "(pinned memory only serves DMA to a GPU; pass None or False)"
            )
        super().__init__(shape, num_pages, "host")
        self.layout = layout
        self.to_native = _TO_NATIVE[layout]
        try:
            self.buffer = torch.empty(
                self._physical_shape(), dtype=shape.dtype, device="cpu", pin_memory=pin_memory
            )
        except RuntimeError as error:
            raise ConfigError(
                f"HostKVPool: cannot allocate {self.nbytes} bytes of "
                f"{'pinned ' if pin_memory else ''}host memory: {error}"
            ) from error
        self.pinned = bool(pin_memory)

    @classmethod
    def wrap(cls, buffer: torch.Tensor, shape: KVShape, layout: HostLayout | str) -> HostKVPool:
        """A pool over ``buffer`` (no copy, no allocation): a contiguous CPU tensor of
        ``shape.dtype`` in ``layout``'s physical shape for some number of pages, ``[planes, L, N, H,
        D]`` (``layer_first``), ``[planes, N, L, H, D]`` (``page_first``), ``[planes, P, L, page,
        H, D]`` (``page_first_direct``) or ``[P, planes, L, page, H, D]`` (``page_major``), ``N`` a
        multiple of the page size; MLA may drop its ``planes`` dimension (= 1). :class:`ConfigError`,
        nothing adopted, on any mismatch. The pool's allocator starts with every page free: the
        caller decides which pages the pool hands out."""
        layout = HostLayout.parse(layout)
        view = _checked_view(buffer, shape, layout)
        per_page = {
            HostLayout.PAGE_FIRST_DIRECT: view.shape[1],
            HostLayout.PAGE_MAJOR: view.shape[0],
        }
        pages = per_page.get(layout, 0)
        if layout not in per_page:
            tokens = view.shape[2] if layout is HostLayout.LAYER_FIRST else view.shape[1]
            pages = tokens // shape.page_size
        check_pool_args(shape, pages, "host")
        pool = cls.__new__(cls)
        KVPool.__init__(pool, shape, pages, "host")
        pool.layout = layout
        pool.to_native = _TO_NATIVE[layout]
        pool.buffer = view
        pool.pinned = bool(view.is_pinned())
        return pool

    def _physical_shape(self) -> tuple[int, ...]:
        s, tokens = self.shape, self.num_pages * self.shape.page_size
        if self.layout is HostLayout.LAYER_FIRST:
            return (s.planes, s.layers, tokens, s.heads, s.head_dim)
        if self.layout is HostLayout.PAGE_FIRST:
            return (s.planes, tokens, s.layers, s.heads, s.head_dim)
        if self.layout is HostLayout.PAGE_MAJOR:
            return (self.num_pages, s.planes, s.layers, s.page_size, s.heads, s.head_dim)
        return (s.planes, self.num_pages, s.layers, s.page_size, s.heads, s.head_dim)

    @property
    def page_contiguous(self) -> bool:
        """Whether one page of one plane is a contiguous run of bytes (``page_first``,
        ``page_first_direct`` and ``page_major``)."""
        return self.layout is not HostLayout.LAYER_FIRST

    def page_slab(self, plane: int, page: int) -> torch.Tensor:
        """The physical bytes of one page of one plane as a contiguous 1-D view (all layers), for the
        page-first layouts; :class:`MisuseError` for ``layer_first``, where a page is ``L`` runs."""
        if not self.page_contiguous:
            raise MisuseError("host: a layer_first page is not contiguous; use read_pages")
        if not 0 <= plane < self.shape.planes or not 0 <= page < self.num_pages:
            raise MisuseError(f"host: no plane {plane} / page {page} in this pool")
        if self.layout is HostLayout.PAGE_MAJOR:
            return self.native()[0, page].view(self.shape.planes, -1)[plane]
        return self.native()[plane, page]


def _checked_view(buffer: object, shape: KVShape, layout: HostLayout) -> torch.Tensor:
    """``buffer`` as a 5-D (6-D for ``page_first_direct`` and ``page_major``) view with the plane
    dimension, after every check :meth:`HostKVPool.wrap` promises."""
    where = f"HostKVPool.wrap({layout.value})"
    if not isinstance(buffer, torch.Tensor):
        raise ConfigError(f"{where}: buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.device.type != "cpu":
        raise ConfigError(f"{where}: buffer must live in host memory, got device {buffer.device}")
    if buffer.dtype != shape.dtype:
        raise ConfigError(f"{where}: buffer dtype must be {shape.dtype}, got {buffer.dtype}")
    if not buffer.is_contiguous():
        raise ConfigError(f"{where}: buffer must be contiguous (strides {buffer.stride()})")
    s = shape
    if layout is HostLayout.LAYER_FIRST:
        want: tuple[object, ...] = (s.planes, s.layers, "N", s.heads, s.head_dim)
    elif layout is HostLayout.PAGE_FIRST:
        want = (s.planes, "N", s.layers, s.heads, s.head_dim)
    elif layout is HostLayout.PAGE_FIRST_DIRECT:
        want = (s.planes, "P", s.layers, s.page_size, s.heads, s.head_dim)
    else:
        want = ("P", s.planes, s.layers, s.page_size, s.heads, s.head_dim)
    view = buffer
    if s.planes == 1 and buffer.dim() == len(want) - 1:  # MLA without the plane dimension
        view = buffer.unsqueeze(1 if layout is HostLayout.PAGE_MAJOR else 0)
    got = tuple(view.shape)
    fits = len(got) == len(want) and all(
        isinstance(w, str) or g == w for g, w in zip(got, want, strict=True)
    )
    if not fits:
        raise ConfigError(
            f"{where}: buffer shape must be {want} for {s!r}, got {tuple(buffer.shape)}"
        )
    free = got[want.index("N")] if "N" in want else got[want.index("P")] * s.page_size
    if free == 0 or free % s.page_size:
        raise ConfigError(
            f"{where}: the token dimension ({free}) must be a positive multiple of page_size "
            f"({s.page_size})"
        )
    return view
