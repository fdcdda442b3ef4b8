"""The vLLM connector's L1 <-> L2 page copies against a plain copy of the same bytes.

vLLM hands the connector one logical ``[B, H, N, C]`` view per layer over a physical layout its
attention backend picks (``KVCacheLayout``). The connector saves a step's blocks into its host pool
(``save``: blocks -> L2 pages) and loads planned pages back (``load``: L2 pages -> blocks), through
:class:`~kvstrata.integrations.vllm_blocks.BlockViews`. The baseline, measured in the same run and
interleaved call by call, is ``dst.copy_(src)`` of two contiguous tensors of the same byte count:
memcpy, what any copy of these bytes is bounded by. The views are built here the way vLLM's
``allocate_kv_cache`` builds them (one allocation in physical order, a logical view per layer), so
the script needs no vLLM; the tests check the connector on vLLM's own views.

With ``--device cuda`` the views live on the GPU, the host pool is pinned, the baseline is one
contiguous device-to-host copy of the same bytes, and the connector's default on a device (pages
staged on the device, one transfer per run of slots: ``STAGE_BYTES``) is measured against its
view-to-view copies in the same run. ``--stage-mib N`` stages through N MiB on the CPU too (what
the staged path costs where it brings nothing: an extra copy).

Usage: python benchmarks/vllm_blocks.py [--layers 32 --heads 8 --head-dim 128 --block 16
       --pages 32 --repeats 7 --scattered --split cell|cpu_vec --device cpu|cuda --stage-mib N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvstrata.impl.pools import HostKVPool
from kvstrata.integrations.vllm_blocks import BlockViews, page_shape

#: physical orders of [L, B, H, N, C] (vLLM's KVCacheLayout members this script builds)
LAYOUTS = {
    "LBNHC": (0, 1, 3, 2, 4),  # FlashAttention's NHD
    "LBHNC": (0, 1, 2, 3, 4),  # FlashInfer's HND, the CPU backend's
    "BLNHC": (1, 0, 3, 2, 4),  # block-outer: a block's layers side by side
    "BLHNC": (1, 0, 2, 3, 4),
}
#: the layouts each K/V split is measured in (the CPU split needs a head's [N, C] contiguous)
SPLIT_LAYOUTS = {"cell": ["LBNHC", "LBHNC", "BLNHC"], "cpu_vec": ["LBHNC", "BLHNC"]}


class _Spec:
    """The fields of vLLM's FullAttentionSpec that the connector reads."""

    def __init__(self, block: int, heads: int, head_size: int, dtype: torch.dtype) -> None:
        self.block_size, self.num_heads, self.head_size, self.head_size_v = (
            block,
            heads,
            head_size,
            head_size,
        )
        self.dtype, self.tokens_per_state = dtype, 1
        self.state_content_size_bytes = 2 * head_size * dtype.itemsize


def vllm_views(
    order: tuple[int, ...], layers: int, blocks: int, spec: _Spec, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """One allocation in ``order``, viewed per layer as vLLM's logical ``[B, H, N, C]``."""
    logical = (layers, blocks, spec.num_heads, spec.block_size, 2 * spec.head_size)
    physical = torch.randn([logical[d] for d in order], device=device).to(spec.dtype)
    view = physical.permute([order.index(d) for d in range(5)])  # back to logical order
    return {f"model.layers.{n}.self_attn.attn": view[n] for n in range(layers)}


def copies(
    views: BlockViews, host: HostKVPool, blocks: list[int], slots: list[int], suffix: str = ""
) -> dict[str, Callable[[], object]]:
    """The connector's save and load calls. A tree before issue 20 part 20's direct copies has
    ``read`` / ``write`` (a staging tensor, then the host pool's ``write_pages`` /
    ``read_pages``): those are timed there, so one script measures both trees."""
    if hasattr(views, "save"):
        return {
            "save" + suffix: lambda: views.save(blocks, host, slots),
            "load" + suffix: lambda: views.load(host, slots, blocks),
        }
    old: Any = views
    return {
        "save": lambda: host.write_pages(slots, old.read(blocks)),
        "load": lambda: old.write(blocks, host.read_pages(slots)),
    }


def timed(fn: object, device: str) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    if device != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--pages", type=int, default=32, help="pages per call")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--scattered", action="store_true", help="random blocks and slots")
    parser.add_argument(
        "--split",
        choices=sorted(SPLIT_LAYOUTS),
        default="cell",
        help="where K and V lie in a block: the GPU backends' (cell) or the CPU vec kernels'",
    )
    parser.add_argument("--device", default="cpu", help="where vLLM's views live (cpu, cuda)")
    parser.add_argument(
        "--stage-mib", type=int, default=None, help="staging budget (default: the connector's)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = _Spec(args.block, args.heads, args.head_dim, torch.bfloat16)
    shape, heads, head_size = page_shape(spec, args.layers, False, "benchmark")
    blocks_total = 4 * args.pages
    if args.scattered:
        blocks = torch.randperm(blocks_total)[: args.pages].tolist()
        slots = torch.randperm(2 * args.pages)[: args.pages].tolist()
    else:
        blocks, slots = list(range(args.pages)), list(range(args.pages))
    nbytes = args.pages * shape.bytes_per_page
    src = torch.randn(nbytes // 2, device=args.device).to(torch.bfloat16)
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=args.device != "cpu")
    stage = None if args.stage_mib is None else args.stage_mib << 20
    print(
        f"{args.pages} pages of {shape.bytes_per_page / 2**20:.2f} MiB per call "
        f"({args.layers} layers, {args.heads} KV heads x {args.head_dim}, block {args.block}, "
        f"bfloat16, {'scattered' if args.scattered else 'ascending'} blocks and slots, "
        f"{args.split} split, views on {args.device}); "
        f"medians of {args.repeats}, ratio = memcpy seconds / connector seconds"
    )
    staged = hasattr(BlockViews, "save") and (stage or 0) + (args.device != "cpu") > 0
    extra = " save, view to view | load, view to view |" if staged else ""
    print(
        f"| layout | memcpy GB/s | save GB/s | save ÷ memcpy | load GB/s | load ÷ memcpy |{extra}"
    )
    print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if staged else ""))
    for name in SPLIT_LAYOUTS[args.split]:
        caches = vllm_views(LAYOUTS[name], args.layers, blocks_total, spec, args.device)
        host = HostKVPool(shape, 2 * args.pages, "page_first_direct")

        def views(stage_bytes: int | None) -> BlockViews:
            options: dict[str, Any] = {"split": args.split}
            if stage_bytes is not None:
                options["stage_bytes"] = stage_bytes
            if not hasattr(BlockViews, "save"):
                options = {}
            return BlockViews(caches, blocks_total, shape, heads, head_size, **options)  # noqa: B023

        calls = {"memcpy": lambda: dst.copy_(src), **copies(views(stage), host, blocks, slots)}
        if staged:
            calls.update(copies(views(0), host, blocks, slots, " direct"))
        runs: dict[str, list[float]] = {key: [] for key in calls}
        for what in calls.values():  # warm-up
            what()
        for repeat in range(args.repeats):
            names = list(calls)
            names = (
                names[repeat % len(names) :] + names[: repeat % len(names)]
            )  # each first in turn
            for key in names:
                runs[key].append(timed(calls[key], args.device))
        median = {key: statistics.median(times) for key, times in runs.items()}
        gbs = {key: nbytes / seconds / 1e9 for key, seconds in median.items()}
        cells = [f"{gbs['memcpy']:.2f}"]
        for key in ("save", "load"):
            cells += [f"{gbs[key]:.2f}", f"{median['memcpy'] / median[key]:.2f}"]
        if staged:
            cells += [
                f"{median['memcpy'] / median[key + ' direct']:.2f}" for key in ("save", "load")
            ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
