"""Hybrid page sets (KV + indexer + Mamba state) through kvstrata against the raw Mooncake client, in
one run (issue 6).

Setup. One process starts a :class:`~kvstrata.impl.storage.mooncake.LocalCluster` (a
``mooncake_master`` and a storage node owning the only segment) and opens two segment-less clients, so
every byte crosses TCP loopback on both sides: **raw** (``MooncakeDistributedStore`` called directly,
on the native instance inside kvstrata's client, key strings computed before the clock starts) and
**kvstrata**
(:class:`~kvstrata.impl.storage.hybrid.HybridStorage` over :class:`MooncakeBackend`, zero-copy from a
``page_first_direct`` KV host pool and the side pools' registered buffers).

The page set models a hybrid model's cache per request: ``--pages`` KV pages (MHA, 8 attention
layers, 2 KV heads, head dim 128, bf16, 32 tokens: 256 KiB per page, K and V objects), one indexer
object per page (8 layers x 32 tokens x 128, bf16: 64 KiB) and one Mamba state for the last page
(24 state layers: conv ``[3, 2048]`` fp16 = 288 KiB, temporal ``[8, 64, 64]`` fp32 = 3 MiB). Both
sides move exactly the same objects under the same keys: raw puts all of them in one
``batch_put_from`` per call and reads them back with one ``batch_get_into``; kvstrata runs
``HybridStorage.put`` (KV exists-then-put-then-confirm, then the indexer objects the same way, then
the state) and ``HybridStorage.get`` (KV, indexer, then the state).

Rows. *put* and *get*: median GB/s over ``--repeats`` repetitions of ``--calls`` calls each, and
kvstrata / raw as the median of the per-repetition ratios ``raw seconds / kvstrata seconds`` (the two
paths alternate call by call, so load from other processes falls on both). Bytes are checked once per
cell: sampled host slots are zeroed before the get and must come back bit for bit.
*exists*: ``HybridStorage.exists`` of stored page sets of 1, 32 and 256 pages, against
``MooncakeBackend.exists`` of the KV alone (what the side pools add) and the raw ``batch_is_exist``
of every key of the set; median microseconds.

Exit status 0 when everything ran, 1 when a call failed or bytes came back wrong, 2 when the cluster
cannot be started here.

Usage: python benchmarks/hybrid_throughput.py [--quick] [--repeats N] [--pages 8,32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from l3_throughput import (
    BenchError,
    RawStore,
    SetupError,
    bench_store,
    clear,
    fresh_pages,
    median_us,
)

from kvstrata.impl.errors import KvStrataError
from kvstrata.impl.pools import HostKVPool, HostLayout, KVShape
from kvstrata.impl.pools.side import SideBuffer, indexer_spec, mamba_spec
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.hybrid import HybridStorage
from kvstrata.impl.storage.mooncake import (
    MooncakeBackend,
    MooncakeClient,
)
from kvstrata.model.hybrid import side_page_keys
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, PageHash

MIB = 1 << 20
TOKENS = 32
SHAPE = KVShape(KVKind.MHA, layers=8, heads=2, head_dim=128, dtype=torch.bfloat16, page_size=TOKENS)
INDEXER = indexer_spec(layers=8, page_size=TOKENS, dim=128, dtype=torch.bfloat16)
MAMBA = mamba_spec(
    layers=24, conv=[(3, 2048)], temporal=(8, 64, 64), dtype=[torch.float16, torch.float32]
)
SPACE = KeySpace(
    ModelIdentity(name="bench-hybrid", dtype="bfloat16", kind=KVKind.MHA, page_size=TOKENS),
    tag="bench",
)
NS = Namespace()
EXISTS_SIZES = (1, 32, 256)


class Node:
    """kvstrata's side: the KV host pool, the side buffers and their HybridStorage, in ``space``
    (key schema 1: one object per KV plane and per side-pool component; 2: one per KV page and per
    side-pool entry)."""

    def __init__(self, client: MooncakeClient, pages: int, space: KeySpace = SPACE) -> None:
        self.host = HostKVPool(SHAPE, pages, HostLayout.PAGE_FIRST_DIRECT, pin_memory=False)
        self.indexer = SideBuffer(INDEXER, pages, host=True)
        self.mamba = SideBuffer(MAMBA, 1, host=True)
        self.space = space
        self.storage = HybridStorage(MooncakeBackend(client, space), [self.indexer, self.mamba])
        self.storage.attach(self.host)
        start = 1
        for tensor in (self.host.buffer, *self.indexer.tensors, *self.mamba.tensors):
            flat = tensor.view(-1).view(torch.uint8)
            flat.copy_(torch.arange(start, start + flat.numel(), dtype=torch.int64).to(torch.uint8))
            start += 7

    def objects(self, pages: Sequence[PageHash]) -> tuple[list[str], list[int], list[int]]:
        """Every object of a page set under key schema 1 (one per KV plane and per side-pool
        component), as raw ``(keys, pointers, sizes)``: the memory kvstrata moves, and under schema 1
        the same strings."""
        keys: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        for slot, page in enumerate(pages):
            for plane, key in enumerate(SPACE.page_keys(NS, page)):
                slab = self.host.page_slab(plane, slot)
                keys.append(key.text)
                ptrs.append(slab.data_ptr())
                sizes.append(slab.numel() * slab.element_size())
            for key, region in zip(
                side_page_keys(SPACE, NS, INDEXER.pool, page),
                self.indexer.describe([slot])[0],
                strict=True,
            ):
                keys.append(key.text)
                ptrs.append(region.ptr)
                sizes.append(region.nbytes)
        for key, region in zip(
            side_page_keys(SPACE, NS, MAMBA.pool, pages[-1]),
            self.mamba.describe([0])[0],
            strict=True,
        ):
            keys.append(key.text)
            ptrs.append(region.ptr)
            sizes.append(region.nbytes)
        return keys, ptrs, sizes

    def keys(self, pages: Sequence[PageHash]) -> list[str]:
        """Every store key kvstrata holds for a page set in its own key space (the state's for the
        last page)."""
        texts = [
            key.text
            for page in pages
            for key in (
                *self.space.page_keys(NS, page),
                *side_page_keys(self.space, NS, INDEXER.pool, page),
            )
        ]
        return texts + [key.text for key in side_page_keys(self.space, NS, MAMBA.pool, pages[-1])]

    def snapshot(self) -> list[bytes]:
        return [
            t.view(-1).view(torch.uint8).numpy().tobytes()
            for t in (self.host.buffer, *self.indexer.tensors, *self.mamba.tensors)
        ]

    def zero(self) -> None:
        for t in (self.host.buffer, *self.indexer.tensors, *self.mamba.tensors):
            t.zero_()

    def close(self) -> None:
        self.storage.close()


def run_cell(
    pages: int,
    calls: int,
    repeats: int,
    client: MooncakeClient,
    raw: RawStore,
    *,
    schema: int = 1,
) -> dict[str, Any]:
    node = Node(client, pages, attrs.evolve(SPACE, schema=schema))
    buffers = [node.host.buffer, *node.indexer.tensors, *node.mamba.tensors]
    for tensor in buffers:
        raw.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    slots = list(range(pages))
    states = {"mamba": {pages - 1: 0}}
    ratios: dict[str, list[float]] = {"put": [], "get": []}
    seconds: dict[str, dict[str, list[float]]] = {
        side: {"put": [], "get": []} for side in ("raw", "kvstrata")
    }
    nbytes = 0
    try:
        for repetition in range(repeats + 1):  # the first is a warm-up that checks bytes
            sets = {
                side: [
                    fresh_pages(f"{side}/{schema}/{pages}/{repetition}/{c}", pages)
                    for c in range(calls)
                ]
                for side in ("raw", "kvstrata")
            }
            texts = [node.objects(s) for s in sets["raw"]]
            nbytes = sum(texts[0][2])
            took: dict[str, dict[str, float]] = {
                side: {"put": 0.0, "get": 0.0} for side in ("raw", "kvstrata")
            }
            for op in ("put", "get"):
                if op == "get" and repetition == 0:
                    expected = node.snapshot()
                    node.zero()
                for call in range(calls):
                    order = ("raw", "kvstrata") if call % 2 == 0 else ("kvstrata", "raw")
                    for side in order:
                        start = time.perf_counter()
                        if side == "raw":
                            keys, ptrs, sizes = texts[call]
                            native = client.native_store  # kvstrata's own instance
                            codes = (
                                native.batch_put_from(keys, ptrs, sizes)
                                if op == "put"
                                else native.batch_get_into(keys, ptrs, sizes)
                            )
                            took[side][op] += time.perf_counter() - start
                            good = 0 if op == "put" else None
                            if any(
                                (code != good) if good is not None else (code != size)
                                for code, size in zip(codes, sizes, strict=True)
                            ):
                                raise BenchError(f"raw {op} of {pages} pages: {sorted(set(codes))}")
                        elif op == "put":
                            result = node.storage.put(NS, sets[side][call], slots, states)
                            took[side][op] += time.perf_counter() - start
                            if any(s is not PutStatus.STORED for s in result.pages) or any(
                                s is not PutStatus.STORED for s in result.states["mamba"].values()
                            ):
                                raise BenchError(f"kvstrata put of {pages} pages: {result}")
                        else:
                            got = node.storage.get(NS, sets[side][call], slots, states)
                            took[side][op] += time.perf_counter() - start
                            if got.usable != pages or any(
                                s is not GetStatus.LOADED for s in got.pages
                            ):
                                raise BenchError(f"kvstrata get of {pages} pages: {got.usable}")
                if op == "get" and repetition == 0 and node.snapshot() != expected:
                    raise BenchError("bytes read back differ from the bytes written")
            clear(client, raw)
            if repetition == 0:
                continue
            for side in took:
                for op in ("put", "get"):
                    seconds[side][op].append(took[side][op])
            for op in ("put", "get"):
                ratios[op].append(took["raw"][op] / took["kvstrata"][op])
    finally:
        for tensor in buffers:
            raw.unregister(tensor.data_ptr())
        node.close()
    moved = nbytes * calls
    return {
        "schema": schema,
        "pages": pages,
        "calls": calls,
        "bytes_per_call": nbytes,
        "raw_objects_per_call": 3 * pages + len(MAMBA.components),
        "kvstrata_objects_per_call": 3 * pages + len(MAMBA.components)
        if schema == 1
        else 2 * pages + 1,
        **{
            f"{side}_{op}_gbps": moved / statistics.median(seconds[side][op]) / 1e9
            for side in seconds
            for op in ("put", "get")
        },
        "ratio_put": statistics.median(ratios["put"]),
        "ratio_get": statistics.median(ratios["get"]),
        "samples": seconds,
    }


def run_exists(
    client: MooncakeClient, raw: RawStore, quick: bool, *, schema: int = 1
) -> list[dict[str, Any]]:
    space = attrs.evolve(SPACE, schema=schema)
    count = max(EXISTS_SIZES)
    node = Node(client, count, space)
    kv_only = MooncakeBackend(client, space)
    kv_only.attach(node.host)
    rows = []
    try:
        pages = fresh_pages(f"exists/{schema}", count)
        stored = node.storage.put(NS, pages, list(range(count)), {"mamba": {count - 1: 0}})
        if not all(s is PutStatus.STORED for s in stored.pages):
            raise BenchError("exists: could not store the pages to query")
        for n in EXISTS_SIZES:
            subset = pages[:n]
            # the state of the set's last page, so the whole set is usable
            node.storage.put(NS, subset, list(range(n)), {"mamba": {n - 1: 0}})
            texts = node.keys(subset)  # the objects kvstrata holds: raw asks the same keys
            reps = 20 if quick else 200
            times: dict[str, list[float]] = {"raw": [], "kv": [], "hybrid": []}
            for _ in range(reps):
                start = time.perf_counter()
                codes = client.native_store.batch_is_exist(texts)
                times["raw"].append(time.perf_counter() - start)
                start = time.perf_counter()
                kv = kv_only.exists(NS, subset)
                times["kv"].append(time.perf_counter() - start)
                start = time.perf_counter()
                hit = node.storage.exists(NS, subset)
                times["hybrid"].append(time.perf_counter() - start)
                if set(codes) != {1} or kv != n or hit.usable != n:
                    raise BenchError(f"exists of {n}: raw {set(codes)}, kv {kv}, hybrid {hit}")
            rows.append(
                {
                    "schema": schema,
                    "pages": n,
                    "keys": len(texts),
                    "raw_us": median_us(times["raw"]),
                    "kv_us": median_us(times["kv"]),
                    "hybrid_us": median_us(times["hybrid"]),
                }
            )
    finally:
        kv_only.close()
        node.close()
        clear(client, raw)
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 calls, 2 repetitions (CI smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (7; 2 quick)")
    parser.add_argument("--pages", default="8,32", help="pages per call, comma-separated")
    parser.add_argument("--calls", type=int, default=None, help="calls per repetition (8; 2 quick)")
    parser.add_argument(
        "--schemas", default="1,2", help="kvstrata's key schema versions, comma-separated"
    )
    parser.add_argument("--segment-mib", type=int, default=1024, help="storage node segment")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.calls = args.calls or (2 if args.quick else 8)
    args.page_counts = [int(p) for p in args.pages.split(",")]
    args.schema_list = [int(v) for v in args.schemas.split(",")]
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    started = time.perf_counter()
    result: dict[str, Any] = {
        "config": {
            "kv_page_bytes": SHAPE.bytes_per_page,
            "indexer_page_bytes": INDEXER.bytes_per_entry,
            "state_bytes": MAMBA.bytes_per_entry,
            "repeats": args.repeats,
            "calls": args.calls,
            "quick": args.quick,
            "date": time.strftime("%Y-%m-%d"),
        },
        "cells": [],
    }
    with bench_store(args.segment_mib * MIB) as (client, raw):
        for schema in args.schema_list:
            for pages in args.page_counts:
                print(
                    f"cell schema {schema}, {pages} pages x {args.calls} calls ...",
                    file=sys.stderr,
                    flush=True,
                )
                result["cells"].append(
                    run_cell(pages, args.calls, args.repeats, client, raw, schema=schema)
                )
        result["exists"] = []
        for schema in args.schema_list:
            print(f"exists latency, schema {schema} ...", file=sys.stderr, flush=True)
            result["exists"] += run_exists(client, raw, args.quick, schema=schema)
    result["seconds"] = time.perf_counter() - started
    return result


def print_tables(result: dict[str, Any]) -> None:
    print(
        "| schema | pages/call | MiB/call | objects raw / kvstrata | raw put GB/s "
        "| kvstrata put GB/s | put ratio | raw get GB/s | kvstrata get GB/s | get ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in result["cells"]:
        print(
            f"| {c['schema']} | {c['pages']} | {c['bytes_per_call'] / MIB:.1f} "
            f"| {c['raw_objects_per_call']} / {c['kvstrata_objects_per_call']} "
            f"| {c['raw_put_gbps']:.2f} "
            f"| {c['kvstrata_put_gbps']:.2f} | **{c['ratio_put']:.2f}** | {c['raw_get_gbps']:.2f} "
            f"| {c['kvstrata_get_gbps']:.2f} | **{c['ratio_get']:.2f}** |"
        )
    print()
    print(
        "| schema | pages | raw keys | raw batch_is_exist µs | KV-only exists µs "
        "| hybrid exists µs | side pools add |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["exists"]:
        print(
            f"| {row['schema']} | {row['pages']} | {row['keys']} | {row['raw_us']:.0f} "
            f"| {row['kv_us']:.0f} | {row['hybrid_us']:.0f} "
            f"| {row['hybrid_us'] / row['kv_us']:.2f}x |"
        )
    print(f"\n{result['seconds']:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except SetupError as error:
        print(f"hybrid_throughput: {error}", file=sys.stderr)
        return 2
    except (BenchError, KvStrataError) as error:
        print(f"hybrid_throughput: {error}", file=sys.stderr)
        return 1
    print_tables(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
