"""The vLLM connector's L1 <-> L2 page copies against a plain copy of the same bytes.

vLLM hands the connector one logical ``[B, H, N, C]`` view per layer over a physical layout its
attention backend picks (``KVCacheLayout``). The connector saves a step's blocks into its host pool
(``save``: blocks -> L2 pages) and loads planned pages back (``load``: L2 pages -> blocks), through
:class:`~kvstrata.integrations.vllm_blocks.BlockViews`. The baseline, measured in the same run and
interleaved call by call, is ``dst.copy_(src)`` of two contiguous tensors of the same byte count:
memcpy, what any copy of these bytes is bounded by. The views are built here the way vLLM's
``allocate_kv_cache`` builds them (one allocation in physical order, a logical view per layer), so
the script needs no vLLM; the tests check the connector on vLLM's own views.

Usage: python benchmarks/vllm_blocks.py [--layers 32 --heads 8 --head-dim 128 --block 16
       --pages 32 --repeats 7 --scattered --split cell|cpu_vec]
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
    order: tuple[int, ...], layers: int, blocks: int, spec: _Spec
) -> dict[str, torch.Tensor]:
    """One allocation in ``order``, viewed per layer as vLLM's logical ``[B, H, N, C]``."""
    logical = (layers, blocks, spec.num_heads, spec.block_size, 2 * spec.head_size)
    physical = torch.randn([logical[d] for d in order]).to(spec.dtype)
    view = physical.permute([order.index(d) for d in range(5)])  # back to logical order
    return {f"model.layers.{n}.self_attn.attn": view[n] for n in range(layers)}


def copies(
    views: BlockViews, host: HostKVPool, blocks: list[int], slots: list[int]
) -> dict[str, Callable[[], object]]:
    """The connector's save and load calls. A tree before issue 20 part 20's direct copies has
    ``read`` / ``write`` (a staging tensor, then the host pool's ``write_pages`` /
    ``read_pages``): those are timed there, so one script measures both trees."""
    if hasattr(views, "save"):
        return {
            "save": lambda: views.save(blocks, host, slots),
            "load": lambda: views.load(host, slots, blocks),
        }
    old: Any = views
    return {
        "save": lambda: host.write_pages(slots, old.read(blocks)),
        "load": lambda: old.write(blocks, host.read_pages(slots)),
    }


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
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
    src = torch.randn(nbytes // 2).to(torch.bfloat16)
    dst = torch.empty_like(src)
    print(
        f"{args.pages} pages of {shape.bytes_per_page / 2**20:.2f} MiB per call "
        f"({args.layers} layers, {args.heads} KV heads x {args.head_dim}, block {args.block}, "
        f"bfloat16, {'scattered' if args.scattered else 'ascending'} blocks and slots, "
        f"{args.split} split); "
        f"medians of {args.repeats}, ratio = memcpy seconds / connector seconds"
    )
    print("| layout | memcpy GB/s | save GB/s | save ÷ memcpy | load GB/s | load ÷ memcpy |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in SPLIT_LAYOUTS[args.split]:
        order = LAYOUTS[name]
        views = BlockViews(
            vllm_views(order, args.layers, blocks_total, spec),
            blocks_total,
            shape,
            heads,
            head_size,
            **({"split": args.split} if hasattr(BlockViews, "save") else {}),
        )
        host = HostKVPool(shape, 2 * args.pages, "page_first_direct")
        runs: dict[str, list[float]] = {"memcpy": [], "save": [], "load": []}
        calls = {"memcpy": lambda: dst.copy_(src), **copies(views, host, blocks, slots)}
        for what in calls.values():  # warm-up
            what()
        for repeat in range(args.repeats):
            names = list(calls)
            names = names[repeat % 3 :] + names[: repeat % 3]  # each first in turn
            for key in names:
                runs[key].append(timed(calls[key]))
        median = {key: statistics.median(times) for key, times in runs.items()}
        gbs = {key: nbytes / seconds / 1e9 for key, seconds in median.items()}
        print(
            f"| {name} | {gbs['memcpy']:.2f} | {gbs['save']:.2f} | "
            f"{median['memcpy'] / median['save']:.2f} | {gbs['load']:.2f} | "
            f"{median['memcpy'] / median['load']:.2f} |"
        )


if __name__ == "__main__":
    main()
