"""The L2 host pool (SPEC §2): KV pages in host memory, pinned when CUDA is present, in one of the
:class:`HostLayout` orders.

Whatever the layout, :meth:`HostKVPool.canonical` views the buffer in canonical dimension order
``[planes, L, P, page_size, H, D]`` (a permuted view, no copy), so reads, writes and page copies are
the same ``index_select`` / ``index_copy_`` / slice copies for every layout and round-trip to identical
bytes. :meth:`HostKVPool.page_slab` gives the physical, contiguous bytes of one page for layouts that have
them (the L3 backends register and move those).

Pinning: ``pin_memory=None`` pins iff ``torch.cuda.is_available()``. ``pin_memory=True`` without CUDA is
a :class:`ConfigError` rather than a silent fallback: pinned memory only matters for DMA to a GPU, and a
configuration that asks for it on a machine without one is a mistake worth reporting.
"""

from __future__ import annotations

import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.base import KVPool
from kvstrata.impl.pools.shape import HostLayout, KVShape
from kvstrata.impl.pools.sizes import check_host_fits

__all__ = ["HostKVPool"]


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
        super().__init__(shape, num_pages, "host")
        self.layout = HostLayout.parse(layout)
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
        check_host_fits(
            self.nbytes,
            what=f"host pool of {num_pages} pages",
            available=available,
            reserve=reserve,
        )
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
        self._canonical = self._canonical_view()

    def _physical_shape(self) -> tuple[int, ...]:
        s = self.shape
        tokens = self.num_pages * s.page_size
        if self.layout is HostLayout.LAYER_FIRST:
            return (s.planes, s.layers, tokens, s.heads, s.head_dim)
        if self.layout is HostLayout.PAGE_FIRST:
            return (s.planes, tokens, s.layers, s.heads, s.head_dim)
        return (s.planes, self.num_pages, s.layers, s.page_size, s.heads, s.head_dim)

    def _canonical_view(self) -> torch.Tensor:
        s = self.shape
        planes, layers, pages, size, heads, dim = s.canonical(self.num_pages)
        if self.layout is HostLayout.LAYER_FIRST:
            return self.buffer.view(planes, layers, pages, size, heads, dim)
        if self.layout is HostLayout.PAGE_FIRST:
            # [planes, P, page, L, H, D] -> [planes, L, P, page, H, D]
            return self.buffer.view(planes, pages, size, layers, heads, dim).permute(
                0, 3, 1, 2, 4, 5
            )
        # [planes, P, L, page, H, D] -> [planes, L, P, page, H, D]
        return self.buffer.permute(0, 2, 1, 3, 4, 5)

    def canonical(self) -> torch.Tensor:
        return self._canonical

    @property
    def page_contiguous(self) -> bool:
        """Whether one page of one plane is a contiguous run of bytes (``page_first`` and
        ``page_first_direct``)."""
        return self.layout is not HostLayout.LAYER_FIRST

    def page_slab(self, plane: int, page: int) -> torch.Tensor:
        """The physical bytes of one page of one plane as a contiguous 1-D view (all layers), for the
        page-first layouts; :class:`MisuseError` for ``layer_first``, where a page is ``L`` runs."""
        if not self.page_contiguous:
            raise MisuseError("host: a layer_first page is not contiguous; use read_pages")
        if not 0 <= plane < self.shape.planes or not 0 <= page < self.num_pages:
            raise MisuseError(f"host: no plane {plane} / page {page} in this pool")
        per_page = self.shape.bytes_per_page // self.shape.planes // self.shape.itemsize
        return self.buffer[plane].view(-1)[page * per_page : (page + 1) * per_page]
