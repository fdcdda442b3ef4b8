"""Vectorised page copies between pools: what the transfer controller runs on its worker.

``copy_pages(src_pool, src_pages, dst_pool, dst_pages)`` copies page ``src_pages[i]`` of ``src_pool`` to
page ``dst_pages[i]`` of ``dst_pool`` for every ``i``, between any two pools of the same
:class:`KVShape` (device→host, host→device, and same-tier copies), for every host layout. All pools are
seen through their canonical view ``[planes, L, P, page, H, D]`` (a strided view for the page-first
host layouts), so one code path serves every layout and no Python loop runs per token or per page:

- **same device** (CPU↔CPU on a machine without CUDA, or two pools on one GPU): the page pairs are
  cut into *joint runs* (consecutive on both sides, found with one ``numpy.diff``). Few runs (the
  common case: both allocators hand out lowest pages first) are copied run by run with one strided
  ``copy_`` each, which reads and writes every byte once; many runs fall back to one ``index_select``
  into a temporary and one ``index_copy_`` out of it (two passes, but two calls).
- **GPU → host**: one ``index_select`` on the GPU, one ``non_blocking`` copy into a pinned staging tensor,
  a wait on the stream, then one ``index_copy_`` into the host pool's (possibly permuted) view.
- **host → GPU**: one ``index_select`` on the CPU straight into a pinned staging tensor, one
  ``non_blocking`` copy to the GPU and one ``index_copy_`` there; the call returns once the work is
  enqueued on the current stream. The caller (the transfer controller) records a CUDA event after the
  call and treats the destination pages as written only when it has completed. Pinned staging comes from
  torch's caching host allocator, which keeps it alive until the copy that reads it is done.

Validation (before anything is read or written; :class:`MisuseError`): the pools have equal shapes, both
page lists are 1-D integer indices in range, have equal lengths, and the destination has no repeats.
Pages of one pool copied onto itself are gathered before they are written, so overlapping source and
destination pages are safe.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.pools.allocator import PageIndices
from kvstrata.impl.pools.base import PAGE_DIM, KVPool

__all__ = ["MAX_RUNS", "copy_pages", "gather_pages", "joint_runs"]

MAX_RUNS = 16
"""Up to this many joint runs are copied run by run; more take the gather/scatter path."""


def joint_runs(
    src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(src_starts, dst_starts, lengths)`` of the maximal runs over which both ``src`` and ``dst``
    go up by one page per entry (``src`` and ``dst`` have equal, non-zero length)."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
    ends = np.concatenate((breaks, np.array([src.size], dtype=np.int64)))
    return src[starts], dst[starts], ends - starts


def _pinned_like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


def copy_pages(
    src_pool: KVPool, src_pages: PageIndices, dst_pool: KVPool, dst_pages: PageIndices
) -> int:
    """Copy ``src_pool``'s ``src_pages`` onto ``dst_pool``'s ``dst_pages`` (pairwise, in order) and
    return the bytes moved (``len(pages) * bytes_per_page``). See the module docstring for how, when
    the copy is complete on CUDA, and what is validated."""
    if not isinstance(src_pool, KVPool) or not isinstance(dst_pool, KVPool):
        raise MisuseError(
            f"copy_pages: expected two KV pools, got {type(src_pool).__name__} and "
            f"{type(dst_pool).__name__}"
        )
    if src_pool.shape != dst_pool.shape:
        raise MisuseError(
            f"copy_pages: pool shapes differ: {src_pool.shape!r} vs {dst_pool.shape!r}"
        )
    src = src_pool.page_array(src_pages, what="copy source")
    dst = dst_pool.page_array(dst_pages, what="copy destination", unique=True)
    if src.size != dst.size:
        raise MisuseError(f"copy_pages: {src.size} source pages but {dst.size} destination pages")
    if src.size == 0:
        return 0
    source, target = src_pool.canonical(), dst_pool.canonical()
    if src_pool.device == dst_pool.device:
        src_starts, dst_starts, lengths = joint_runs(src, dst)
        if src_pool is not dst_pool and lengths.size <= MAX_RUNS:
            for s, d, n in zip(
                src_starts.tolist(), dst_starts.tolist(), lengths.tolist(), strict=True
            ):
                target[:, :, d : d + n].copy_(source[:, :, s : s + n])
        else:
            gathered = source.index_select(PAGE_DIM, src_pool.page_index(src))
            target.index_copy_(PAGE_DIM, dst_pool.page_index(dst), gathered)
    elif src_pool.device.type == "cuda" and dst_pool.device.type == "cpu":
        gathered = source.index_select(PAGE_DIM, src_pool.page_index(src))
        staging = _pinned_like(tuple(gathered.shape), gathered.dtype)
        staging.copy_(gathered, non_blocking=True)
        torch.cuda.current_stream(src_pool.device).synchronize()
        target.index_copy_(PAGE_DIM, dst_pool.page_index(dst), staging)
    elif src_pool.device.type == "cpu" and dst_pool.device.type == "cuda":
        staging = _pinned_like(src_pool.shape.canonical(int(src.size)), src_pool.shape.dtype)
        torch.index_select(source, PAGE_DIM, src_pool.page_index(src), out=staging)
        on_device = staging.to(dst_pool.device, non_blocking=True)
        target.index_copy_(PAGE_DIM, dst_pool.page_index(dst), on_device)
    else:
        # e.g. two different GPUs: let torch route it (synchronously)
        gathered = source.index_select(PAGE_DIM, src_pool.page_index(src)).to(dst_pool.device)
        target.index_copy_(PAGE_DIM, dst_pool.page_index(dst), gathered)
    return int(src.size) * src_pool.shape.bytes_per_page


def gather_pages(pool: KVPool, pages: PageIndices) -> torch.Tensor:
    """The given pages of ``pool`` as a new canonical tensor on the CPU (for tests and debugging)."""
    return pool.read_pages(pages).to("cpu")
