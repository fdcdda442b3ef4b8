"""The L1 device pool (SPEC §2): KV pages in a torch tensor on CUDA when present, on the CPU otherwise.

Buffer: ``[planes, L, num_pages, page_size, H, D]``, i.e. already the canonical shape. Per plane and
layer the pages of one layer are one contiguous run, so the attention kernel of layer ``l`` sees a flat
``[num_pages * page_size, H, D]`` token array (:meth:`DeviceKVPool.layer_view`; token slot
``page * page_size + offset``), and gathering ``n`` pages of every plane and layer is a single
``index_select`` along dimension 1 of the ``[planes * L, num_pages, page_size * H * D]`` view.
"""

from __future__ import annotations

import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.base import KVPool, check_pool_args
from kvstrata.impl.pools.shape import KVShape
from kvstrata.impl.pools.sizes import check_host_fits

__all__ = ["DeviceKVPool", "default_device", "resolve_device"]


def default_device() -> torch.device:
    """``cuda`` (the current CUDA device) when torch sees one, ``cpu`` otherwise."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` (``None``: :func:`default_device`); :class:`ConfigError` for
    an unknown name or a CUDA device when CUDA is not available."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"device: expected a torch device or its name, got {device!r}") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: {device!r} requested but torch.cuda.is_available() is False")
    return resolved


class DeviceKVPool(KVPool):
    """The L1 pool: ``num_pages`` pages of ``shape`` on ``device`` (see the module docstring).

    ``allocator`` is this pool's own :class:`PageAllocator` (named ``"device"``). :class:`ConfigError`
    if the buffer cannot be allocated (e.g. not enough device memory).
    """

    def __init__(
        self, shape: KVShape, num_pages: int, device: torch.device | str | None = None
    ) -> None:
        # refuse before anything is allocated (the allocator too holds a byte per page)
        check_pool_args(shape, num_pages, "device")
        target = resolve_device(device)
        _check_fits(shape.nbytes(num_pages) + num_pages, target, num_pages)
        super().__init__(shape, num_pages, "device")
        try:
            self.buffer = torch.empty(shape.canonical(num_pages), dtype=shape.dtype, device=target)
        except RuntimeError as error:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(
                f"DeviceKVPool: cannot allocate {self.nbytes} bytes ({num_pages} pages of "
                f"{shape.bytes_per_page} bytes) on {target}: {error}"
            ) from error

    def canonical(self) -> torch.Tensor:
        return self.buffer

    def layer_view(self, plane: int, layer: int) -> torch.Tensor:
        """The tokens of one plane (0: K or the MLA latent, 1: V) and layer as a
        ``[num_pages * page_size, H, D]`` view; token slot ``page * page_size + offset``."""
        if not 0 <= plane < self.shape.planes or not 0 <= layer < self.shape.layers:
            raise MisuseError(
                f"device: no plane {plane} / layer {layer} in a pool of {self.shape.planes} planes "
                f"and {self.shape.layers} layers"
            )
        return self.buffer[plane, layer].view(-1, self.shape.heads, self.shape.head_dim)


def _check_fits(nbytes: int, target: torch.device, num_pages: int) -> None:
    """:class:`ConfigError` unless ``nbytes`` fit: host memory for a CPU pool (with the host pool's
    reserve), the device's free memory for a CUDA one (issue 17: ``--l1 10T`` allocated 146 GiB of
    allocator state before failing with a numpy traceback)."""
    what = f"device pool of {num_pages} pages on {target}"
    if target.type == "cpu":
        check_host_fits(nbytes, what=what)
    elif target.type == "cuda":
        free, _total = torch.cuda.mem_get_info(target)
        if nbytes > free:
            raise ConfigError(
                f"{what}: {nbytes / 2**30:.2f} GiB do not fit in the {free / 2**30:.2f} GiB free on "
                "the device; choose a smaller size"
            )
