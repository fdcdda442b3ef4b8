"""L1 <-> L2 page-copy throughput of kvstrata's pools against a plain torch copy of the same bytes.

For every host layout and page pattern, ``copy_pages`` moves ``--total-mib`` of KV from the device pool
to the host pool (d2h) and back (h2d). The baseline, measured in the same run and interleaved with the
pool copies, is ``dst.copy_(src)`` of two contiguous tensors of the same byte count on the same two
devices (pinned host memory when CUDA is present). The physical limit is memcpy (CPU) or the PCIe / NVLink
copy engine (CUDA), so the ratio (pool GB/s / baseline GB/s) says how close the pools come to it.

Page patterns: ``contiguous`` (source and destination pages both ascending runs: what lowest-first
allocators produce) and ``scattered`` (destination pages a random permutation: every page its own run).

Usage: python benchmarks/copy_throughput.py [--layers 32 --heads 2 --head-dim 128 --page-size 16
       --dtype bfloat16 --kind mha --total-mib 256 --repeats 5 --threads N --json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape, copy_pages
from kvstrata.model.keys import KVKind

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["mha", "mla"], default="mha")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2, help="KV heads (1 for MLA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--total-mib", type=float, default=256.0, help="bytes moved per copy")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", default=None, help="device pool device (default: cuda if any)")
    parser.add_argument(
        "--layouts", default=",".join(layout.value for layout in HostLayout), help="comma list"
    )
    parser.add_argument("--patterns", default="contiguous,scattered", help="comma list")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    kind = KVKind(args.kind)
    shape = KVShape(
        kind=kind,
        layers=args.layers,
        heads=1 if kind is KVKind.MLA else args.heads,
        head_dim=args.head_dim,
        dtype=DTYPES[args.dtype],
        page_size=args.page_size,
    )
    pages = max(1, int(args.total_mib * 2**20) // shape.bytes_per_page)
    nbytes = pages * shape.bytes_per_page
    device = DeviceKVPool(shape, pages, args.device)
    dev = device.device
    pinned = dev.type == "cuda"
    generator = torch.Generator().manual_seed(0)
    for start in range(0, pages, 64):  # fill in chunks: random bits, bounded temporary memory
        chunk = np.arange(start, min(pages, start + 64))
        noise = torch.randint(-(2**15), 2**15 - 1, shape.canonical(chunk.size), generator=generator)
        device.write_pages(chunk, _bits_as(noise, shape.dtype))

    # the baseline: one contiguous copy of the same bytes between the same devices
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_dev.fill_(1)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    flat_host.fill_(2)

    rng = np.random.default_rng(0)
    patterns = {
        "contiguous": (np.arange(pages), np.arange(pages)),
        "scattered": (np.arange(pages), rng.permutation(pages)),
    }
    rows: list[dict[str, Any]] = []
    for layout_name in args.layouts.split(","):
        host = HostKVPool(shape, pages, HostLayout.parse(layout_name))
        for pattern in args.patterns.split(","):
            device_pages, host_pages = patterns[pattern]
            rows.extend(
                _measure(
                    device,
                    host,
                    pattern=pattern,
                    device_pages=device_pages,
                    host_pages=host_pages,
                    flat_dev=flat_dev,
                    flat_host=flat_host,
                    repeats=args.repeats,
                )
            )
    return {
        "config": {
            "shape": {
                "kind": kind.value,
                "layers": shape.layers,
                "heads": shape.heads,
                "head_dim": shape.head_dim,
                "dtype": args.dtype,
                "page_size": shape.page_size,
                "bytes_per_page": shape.bytes_per_page,
            },
            "pages": pages,
            "bytes": nbytes,
            "repeats": args.repeats,
            "device": str(dev),
            "pinned": pinned,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "rows": rows,
    }


def _measure(
    device: DeviceKVPool,
    host: HostKVPool,
    *,
    pattern: str,
    device_pages: np.ndarray,
    host_pages: np.ndarray,
    flat_dev: torch.Tensor,
    flat_host: torch.Tensor,
    repeats: int,
) -> list[dict[str, Any]]:
    """Median d2h and h2d times of the pools and of the baseline, interleaved, plus a bit-exact check
    of a few copied pages."""
    dev, pinned, nbytes = device.device, flat_host.is_pinned(), flat_host.numel()
    runs = {
        "base_d2h": lambda: flat_host.copy_(flat_dev, non_blocking=pinned),
        "d2h": lambda: copy_pages(device, device_pages, host, host_pages),
        "base_h2d": lambda: flat_dev.copy_(flat_host, non_blocking=pinned),
        "h2d": lambda: copy_pages(host, host_pages, device, device_pages),
    }
    times: dict[str, list[float]] = {key: [] for key in runs}
    for repeat in range(repeats + 1):  # the first round warms up
        for key, fn in runs.items():
            elapsed = _timed(fn, dev)
            if repeat:
                times[key].append(elapsed)
    check = np.random.default_rng(1).choice(device_pages.size, size=min(8, device_pages.size))
    same = torch.equal(
        host.read_pages(host_pages[check]).view(torch.uint8).cpu(),
        device.read_pages(device_pages[check]).view(torch.uint8).cpu(),
    )
    rows = []
    for direction in ("d2h", "h2d"):
        pool_s = statistics.median(times[direction])
        base_s = statistics.median(times[f"base_{direction}"])
        rows.append(
            {
                "layout": host.layout.value,
                "pattern": pattern,
                "direction": direction,
                "pool_gbps": nbytes / pool_s / 1e9,
                "baseline_gbps": nbytes / base_s / 1e9,
                "ratio": base_s / pool_s,
                "bit_exact": same,
            }
        )
    return rows


def _bits_as(noise: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    return noise.to(width).view(dtype)


def print_table(result: dict[str, Any]) -> None:
    config = result["config"]
    print(
        f"{config['bytes'] / 2**20:.0f} MiB per copy = {config['pages']} pages of "
        f"{config['shape']['bytes_per_page'] / 1024:.0f} KiB; device {config['device']}, "
        f"pinned host {config['pinned']}, torch {config['torch']}, {config['threads']} threads; "
        f"median of {config['repeats']}"
    )
    header = f"{'layout':<18} {'pattern':<11} {'dir':<4} {'pool GB/s':>10} {'torch GB/s':>11} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        flag = "" if row["bit_exact"] else "  MISMATCH"
        print(
            f"{row['layout']:<18} {row['pattern']:<11} {row['direction']:<4} "
            f"{row['pool_gbps']:>10.2f} {row['baseline_gbps']:>11.2f} {row['ratio']:>6.2f}{flag}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0 if all(row["bit_exact"] for row in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
