"""Vectorised page copies between pools: what the transfer controller runs on its worker.

``copy_pages(src_pool, src_pages, dst_pool, dst_pages)`` copies page ``src_pages[i]`` of ``src_pool`` to
page ``dst_pages[i]`` of ``dst_pool`` for every ``i``, between any two pools of the same
:class:`KVShape` (device→host, host→device, and same-tier copies), for every host layout. Python never
loops per token, and loops over runs of pages only when there are at most :data:`MAX_RUNS` of them or
each moves :data:`RUN_BYTES` on average (so a call costs far more in memcpy than in Python). The paths
(see :class:`KVPool` for the native and canonical views):

- **same device** (CPU↔CPU on a machine without CUDA, or two pools on one GPU), the cheapest of three:

  1. *joint runs* (``"runs"``): the pairs are cut into runs consecutive on both sides (one
     ``numpy.diff``); when the runs are few or long (at most :data:`MAX_RUNS`, or :data:`RUN_BYTES` per
     run on average: the common case, as both allocators hand out their lowest pages first) each run is
     one strided ``copy_`` between canonical slices, which reads and writes every byte once and changes
     the layout on the way;
  2. *destination runs* (``"dst_runs"``, pools with the same native order): the pairs are sorted by
     destination and each run of consecutive destination pages (few or long, as above: a freshly
     allocated destination is ascending) is one ``index_select`` of the source's native rows straight
     into the destination's rows, one pass and no scatter;
  3. otherwise (``"scatter"``), per chunk of at most :data:`SCRATCH_BYTES`: one ``index_select`` of the
     source's native rows into a reused scratch block (torch's row-copy fast path) and one
     ``index_copy_`` into the destination. The scratch is per thread and reused because a fresh large
     CPU tensor pays a page fault per 4 KiB on first touch, which costs more than the copy.
- **GPU → host**: the gather and the layout change run on the GPU (``index_select`` + one permuted
  copy into the host's native order), then one ``non_blocking`` copy into pinned staging, a wait on
  the current stream, and one contiguous ``index_copy_`` into the host pool. The pages are in place
  when the call returns.
- **host → GPU**: one ``index_select`` of the host's native rows straight into pinned staging, one
  ``non_blocking`` copy to the GPU, and the layout change and scatter there (``index_copy_``). The call
  returns once the work is enqueued on the current stream: the caller (the transfer controller) records
  a CUDA event after it and treats the destination pages as written only when that event has
  completed. Staging comes from torch's caching host allocator, which does not reuse it before the
  copy that reads it is done.

Validation (before anything is read or written; :class:`MisuseError`): the pools have equal shapes, both
page lists are 1-D integer indices in range and of equal length, and the destination repeats no page.
A pool copied onto itself gathers every source page into a fresh block before it writes any, so
overlapping pages are safe.

On CUDA, call it under a stream of its own (``with torch.cuda.stream(s)``): the GPU → host path waits
for that stream, and the caller's event marks completion on it.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.pools.allocator import PageIndices
from kvstrata.impl.pools.base import PAGE_DIM, KVPool

__all__ = ["MAX_RUNS", "RUN_BYTES", "SCRATCH_BYTES", "copy_pages", "gather_pages", "joint_runs"]

MAX_RUNS = 16
"""Up to this many joint runs are always copied run by run."""
RUN_BYTES = 64 * 1024
"""... and so are more, if a run moves at least this many bytes on average."""
SCRATCH_BYTES = 32 * 1024 * 1024
"""The gather/scatter path on one device moves at most this much per chunk (one page at least)."""

_local = threading.local()


def joint_runs(
    src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(src_starts, dst_starts, lengths)`` of the maximal runs over which both ``src`` and ``dst``
    go up by one page per entry (``src`` and ``dst`` have equal, non-zero length)."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
    ends = np.concatenate((breaks, np.array([src.size], dtype=np.int64)))
    return src[starts], dst[starts], ends - starts


def _scratch(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-thread reusable block of ``shape`` (contents unspecified)."""
    need = shape[0] * shape[1] * shape[2] * dtype.itemsize
    cache: dict[torch.device, torch.Tensor] = _local.__dict__.setdefault("scratch", {})
    raw = cache.get(device)
    if raw is None or raw.numel() < need:
        raw = torch.empty(need, dtype=torch.uint8, device=device)
        cache[device] = raw
    return raw[:need].view(dtype).view(shape)


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


def _few(runs: int, moved: int) -> bool:
    return runs <= MAX_RUNS or moved >= runs * RUN_BYTES


def _choose_path(
    src_pool: KVPool,
    src: npt.NDArray[np.int64],
    dst_pool: KVPool,
    dst: npt.NDArray[np.int64],
) -> str:
    """``"runs"``, ``"dst_runs"`` or ``"scatter"``: the cheapest same-device path for these pages."""
    if src_pool is dst_pool:
        return "scatter"
    moved = int(src.size) * src_pool.shape.bytes_per_page
    if _few(int(joint_runs(src, dst)[2].size), moved):
        return "runs"
    if src_pool.to_native == dst_pool.to_native:
        ordered = np.sort(dst)
        if _few(int(np.count_nonzero(np.diff(ordered) != 1)) + 1, moved):
            return "dst_runs"
    return "scatter"


def _copy_same_device(
    src_pool: KVPool,
    src: npt.NDArray[np.int64],
    dst_pool: KVPool,
    dst: npt.NDArray[np.int64],
) -> None:
    path = _choose_path(src_pool, src, dst_pool, dst)
    if path == "runs" and src_pool is not dst_pool:
        source, target = src_pool.canonical(), dst_pool.canonical()
        src_starts, dst_starts, lengths = joint_runs(src, dst)
        for s, d, n in zip(src_starts.tolist(), dst_starts.tolist(), lengths.tolist(), strict=True):
            target[:, :, d : d + n].copy_(source[:, :, s : s + n])
        return
    rows, native = src_pool.native(), dst_pool.native()
    if path == "dst_runs" and src_pool is not dst_pool and src_pool.to_native == dst_pool.to_native:
        # scatter as gathers: sort the pairs by destination, then each run of consecutive destination
        # pages is one index_select straight into the destination's rows
        order = np.argsort(dst, kind="stable")
        src_sorted, dst_sorted = src[order], dst[order]
        starts = np.concatenate(([0], np.flatnonzero(np.diff(dst_sorted) != 1) + 1))
        ends = np.concatenate((starts[1:], [dst_sorted.size]))
        index = src_pool.page_index(src_sorted)
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            first = int(dst_sorted[a])
            torch.index_select(rows, 1, index[a:b], out=native[:, first : first + b - a])
        return
    if src_pool is dst_pool:
        # within one pool, every source page is read (into a fresh block) before any page is written
        block = rows.index_select(1, src_pool.page_index(src))
        native.index_copy_(1, dst_pool.page_index(dst), block)
        return
    # gather into the reused scratch block, scatter with index_copy_, chunk by chunk
    chunk = max(1, SCRATCH_BYTES // src_pool.shape.bytes_per_page)
    target = dst_pool.canonical()
    for start in range(0, int(src.size), chunk):
        part_src, part_dst = src[start : start + chunk], dst[start : start + chunk]
        block = _scratch(
            src_pool.block_shape(int(part_src.size)), src_pool.shape.dtype, src_pool.device
        )
        torch.index_select(rows, 1, src_pool.page_index(part_src), out=block)
        if src_pool.to_native == dst_pool.to_native:
            native.index_copy_(1, dst_pool.page_index(part_dst), block)
        else:
            target.index_copy_(
                PAGE_DIM, dst_pool.page_index(part_dst), src_pool.to_canonical(block)
            )


def copy_pages(
    src_pool: KVPool, src_pages: PageIndices, dst_pool: KVPool, dst_pages: PageIndices
) -> int:
    """Copy ``src_pool``'s ``src_pages`` onto ``dst_pool``'s ``dst_pages`` (pairwise, in order) and
    return the bytes moved (``len(pages) * bytes_per_page``). See the module docstring for how, when a
    copy to a GPU is complete, and what is validated."""
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
    if src_pool.device == dst_pool.device:
        _copy_same_device(src_pool, src, dst_pool, dst)
    elif src_pool.device.type == "cuda" and dst_pool.device.type == "cpu":
        gathered = src_pool.native().index_select(1, src_pool.page_index(src))
        block = dst_pool.to_block(src_pool.to_canonical(gathered))  # layout change on the GPU
        staging = _pinned(tuple(block.shape), block.dtype)
        staging.copy_(block, non_blocking=True)
        torch.cuda.current_stream(src_pool.device).synchronize()
        dst_pool.native().index_copy_(1, dst_pool.page_index(dst), staging)
    elif src_pool.device.type == "cpu" and dst_pool.device.type == "cuda":
        staging = _pinned(src_pool.block_shape(int(src.size)), src_pool.shape.dtype)
        torch.index_select(src_pool.native(), 1, src_pool.page_index(src), out=staging)
        on_device = staging.to(dst_pool.device, non_blocking=True)
        dst_pool.canonical().index_copy_(
            PAGE_DIM, dst_pool.page_index(dst), src_pool.to_canonical(on_device)
        )
    else:  # e.g. two different GPUs: let torch route it
        gathered = src_pool.native().index_select(1, src_pool.page_index(src))
        moved = src_pool.to_canonical(gathered).to(dst_pool.device)
        dst_pool.canonical().index_copy_(PAGE_DIM, dst_pool.page_index(dst), moved)
    return int(src.size) * src_pool.shape.bytes_per_page


def gather_pages(pool: KVPool, pages: PageIndices) -> torch.Tensor:
    """The given pages of ``pool`` as a new canonical tensor on the CPU (for tests and debugging)."""
    return pool.read_pages(pages).to("cpu")
