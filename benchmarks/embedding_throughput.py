"""Embedding cache throughput through kvstrata against the raw Mooncake client, in one run (issue 7).

Setup. One process starts a :class:`~kvstrata.impl.storage.mooncake.LocalCluster` (a ``mooncake_master``
plus a storage node that owns the only segment) and opens two clients on it, neither with a segment of
its own, so every byte crosses TCP loopback to the storage node on both sides of the comparison (the
cluster, the raw client, the prefault and the store clearing are ``l3_throughput.py``'s helpers):

- **raw**: ``mooncake.store.MooncakeDistributedStore`` called directly: ``batch_put_from`` of a batch
  of embeddings from one registered buffer, the batch copied into it right before each put (untimed,
  as the in-place path's views are written: a put of memory written just before it is 5-10% slower
  than one of memory written long ago), then ``batch_get_into`` into a second registered buffer, with
  key strings of the cache's own form computed before the clock starts.
  The headline raw calls run on the native instance inside kvstrata's own ``MooncakeClient``
  (``native_store``): a native client's past calls change its speed on small objects (one batch of
  4 MiB objects made later 128 KiB puts 1.2-1.7x slower: ``client_history.py``), so a baseline on
  another instance measures that instance's history too. The same calls on the benchmark's second raw
  client are timed beside them and reported for scale (``raw, second client ÷ raw``);
- **kvstrata**: two :class:`~kvstrata.impl.embedding.EmbeddingCache` nodes on one
  :class:`~kvstrata.impl.storage.mooncake.MooncakeClient`, each with its own pool and I/O thread.
  *insert_batch* is node A's ``insert_batch(hashes, tensors)`` until ``flush()`` has applied the batch
  put (copying the tensors into the pool, one ``batch_is_exist``, one ``batch_put_from``, applying the
  per-key results); *prefetch* is node B's ``prefetch`` + ``wait`` + ``get`` of the same hashes (one
  ``batch_is_exist``, one ``batch_get_into`` into the pool, then a copy of each tensor out of it).
  Since part 28 each verb takes ``wait=True`` (its store call made on the caller's thread, the I/O
  thread not woken); ``--no-wait-in-call`` gives the verb, then ``flush`` / ``wait``, as before.

The pool's unit is one whole embedding, so both sides move exactly one store object per embedding.
Shapes (float16): ``image`` 576 x 1024 (a ViT-L/14-336 image, 1.125 MiB) and ``small`` 64 x 1024
(128 KiB); batches of 1, 8 and 32 embeddings. A cell moves ``items`` embeddings per side per
repetition in ``items / batch`` calls: image 96 (108 MiB), small 384 (48 MiB); ``--quick`` moves a
third of that in 2 repetitions (a CI smoke run).

Method. Each repetition starts from an empty store (``remove_all(force=True)`` and a small primer
put, untimed). Calls are interleaved: for call ``i`` the raw and the kvstrata call run one after the
other, in an order that alternates with ``i``, so a burst of load from other processes on this shared
machine falls on both alike; first every put, then every get. Puts always use fresh keys (a re-put of
an existing key is a master-side no-op). One unrecorded warm-up repetition per cell checks bytes:
every tensor node B gets must equal what node A inserted, bit for bit, and the raw destination buffer
must equal the source. Reported per row: MB/s (1 MB = 1e6 bytes) from the median seconds over
``--repeats`` repetitions, and kvstrata / raw as the median over repetitions of that repetition's
``raw seconds / kvstrata seconds``. A second table takes the same ratios over each repetition's
median call instead of its total (a call caught in one of the store's multi-millisecond stalls,
which hit raw and kvstrata calls alike, then weighs as one call; docs/benchmarks.md), with the
median call's milliseconds.

Exit status: 0 when everything ran; 1 when a store call failed or bytes came back wrong (one line on
stderr); 2 when the cluster cannot be started here.

Usage: python benchmarks/embedding_throughput.py [--quick] [--repeats N] [--batches 1,8,32]
       [--shapes image,small] [--segment-mib M] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import l3_throughput as l3  # the sibling benchmark: cluster, raw client, store clearing

from kvstrata.impl.embedding import (
    EmbeddingCache,
    EmbeddingPool,
    MooncakeEmbeddingStore,
    PoolShape,
)
from kvstrata.impl.storage.mooncake import MooncakeClient
from kvstrata.impl.transfer import InlineExecutor
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, PageHash, Shard

MIB = 1 << 20
DTYPE = torch.float16
SHAPES = {"image": (576, 1024), "small": (64, 1024)}
ITEMS = {"image": 96, "small": 384}
BATCHES = (1, 8, 32)
WAIT_S = 120.0
NAMES = (
    "raw_put",
    "raw_put_second",
    "insert",
    "in_place",
    "raw_get",
    "raw_get_second",
    "prefetch",
    "borrow",
)
PUTS = ("raw_put", "raw_put_second", "insert", "in_place")
GETS = ("raw_get", "raw_get_second", "prefetch", "borrow")


@dataclass(frozen=True)
class Cell:
    """One shape and batch size: ``items`` embeddings per side per repetition."""

    shape: str
    tokens: int
    dim: int
    batch: int
    items: int

    @property
    def item_bytes(self) -> int:
        return self.tokens * self.dim * DTYPE.itemsize

    @property
    def calls(self) -> int:
        return self.items // self.batch

    @property
    def total(self) -> int:
        return self.calls * self.batch * self.item_bytes


def keyspace_of(cell: Cell) -> KeySpace:
    model = ModelIdentity(name="bench-emb", dtype="float16", kind=KVKind.EMBEDDING, dim=cell.dim)
    return KeySpace(model, shard=Shard.replicated(), tag="bench")


class Sides:
    """Both sides of one cell: the raw buffers and keys, and the two cache nodes."""

    def __init__(
        self,
        cell: Cell,
        client: MooncakeClient,
        raw: l3.RawStore,
        inline: bool = False,
        *,
        pool_units: int = 0,
        wait_in_call: bool = True,
    ) -> None:
        """``pool_units``: units per cache pool (0: one batch, one unit per embedding);
        ``wait_in_call``: the cache verbs take ``wait=True`` (the store call made on the caller's
        thread, no worker wake-up; part 28), else the verb, then ``flush`` / ``wait``."""
        self.cell, self.raw, self.client = cell, raw, client
        self.wait_in_call = wait_in_call
        self.native: Any = client.native_store  # the headline baseline: kvstrata's own instance
        gen = torch.Generator().manual_seed(cell.tokens * 7919 + cell.batch)
        self.tensors = [
            torch.randn((cell.tokens, cell.dim), generator=gen).to(DTYPE) for _ in range(cell.batch)
        ]
        self.src = torch.stack(self.tensors).contiguous()
        self.dst = torch.zeros_like(self.src)
        self.nbytes = self.src.numel() * self.src.element_size()
        for buffer in (self.src, self.dst):
            raw.register(buffer.data_ptr(), self.nbytes)
            client.register_buffer(buffer.data_ptr(), self.nbytes)
        size = cell.item_bytes
        self.src_ptrs = [self.src.data_ptr() + i * size for i in range(cell.batch)]
        self.dst_ptrs = [self.dst.data_ptr() + i * size for i in range(cell.batch)]
        self.sizes = [size] * cell.batch
        shape = PoolShape(pool_units or cell.batch, cell.tokens, cell.dim, DTYPE)  # unit: one item
        keyspace = keyspace_of(cell)
        self.a, self.b, self.a2, self.b2 = (
            EmbeddingCache(
                EmbeddingPool(shape),
                MooncakeEmbeddingStore(client),
                keyspace,
                executor=InlineExecutor() if inline else None,
            )
            for _ in range(4)
        )
        self.raw_keys: list[list[str]] = []
        self.second_keys: list[list[str]] = []
        self.media: list[list[PageHash]] = []
        self.media2: list[list[PageHash]] = []
        self.requests = 0
        self.verify = False

    def begin(self, label: str) -> None:
        """Fresh keys for one repetition (the raw ones have the cache's key form)."""
        cell = self.cell
        raw_media = l3.fresh_pages(f"{label}/raw", cell.calls * cell.batch)
        second_media = l3.fresh_pages(f"{label}/raw-second", cell.calls * cell.batch)
        media = l3.fresh_pages(f"{label}/emb", cell.calls * cell.batch)
        media2 = l3.fresh_pages(f"{label}/emb-in-place", cell.calls * cell.batch)
        self.raw_keys, self.second_keys = (
            [
                [self.a.object_keys(m, cell.tokens)[0].text for m in chunk]
                for chunk in l3.batches(pages, cell.batch)
            ]
            for pages in (raw_media, second_media)
        )
        self.media = [list(chunk) for chunk in l3.batches(media, cell.batch)]
        self.media2 = [list(chunk) for chunk in l3.batches(media2, cell.batch)]

    # ------------------------------------------------------------------------------ the four calls
    def raw_put(self, call: int) -> float:
        return self._put(self.native, self.raw_keys[call])

    def raw_put_second(self, call: int) -> float:
        return self._put(self.raw.native, self.second_keys[call])

    def raw_get(self, call: int) -> None:
        self._get(self.native, self.raw_keys[call])

    def raw_get_second(self, call: int) -> None:
        self._get(self.raw.native, self.second_keys[call])

    def _put(self, native: Any, keys: list[str]) -> float:
        """The batch written into the registered source (untimed: the seconds returned, as
        ``in_place`` writes its views), then one raw put of it. A put reads memory written just
        before it 5-10% slower than memory written long ago (a one-off probe of 2026-12-02, 128 KiB
        and 1.12 MiB items): both sides put what was just written, as an encoder's output is."""
        start = time.perf_counter()
        self.fill_source()
        untimed = time.perf_counter() - start
        codes = native.batch_put_from(keys, self.src_ptrs, self.sizes)
        if any(code != 0 for code in codes):
            raise l3.BenchError(f"raw batch_put_from returned {list(codes)}")
        return untimed

    def fill_source(self) -> None:
        """Each tensor copied into its place in the registered source buffer (one copy each, as
        ``in_place`` copies each into its view)."""
        for place, tensor in zip(self.src, self.tensors, strict=True):
            place.copy_(tensor)

    def _get(self, native: Any, keys: list[str]) -> None:
        codes = native.batch_get_into(keys, self.dst_ptrs, self.sizes)
        if any(code != self.cell.item_bytes for code in codes):
            raise l3.BenchError(f"raw batch_get_into returned {list(codes)}")
        if self.verify:  # the warm-up: every raw get's bytes, on either instance
            if not torch.equal(self.dst.view(torch.int16), self.src.view(torch.int16)):
                raise l3.BenchError("raw batch_get_into: other bytes than were put")
            self.dst.zero_()

    def insert(self, call: int) -> None:
        before = self.a.counters.pushed
        result = self.a.insert_batch(self.media[call], self.tensors, wait=self.wait_in_call)
        if not self.a.flush(WAIT_S):
            raise l3.BenchError("insert_batch: the batch put did not complete")
        if result.stored != self.cell.batch or self.a.counters.pushed - before != self.cell.batch:
            raise l3.BenchError(f"insert_batch: {result}, counters {self.a.counters}")

    def in_place(self, call: int) -> float:
        """reserve, the encoder's output written into the views (untimed: the seconds returned,
        as the raw put's source is written before its clock starts), commit, flush."""
        tokens = [self.cell.tokens] * self.cell.batch
        before = self.a2.counters.pushed
        reservation = self.a2.reserve(self.media2[call], tokens)
        start = time.perf_counter()
        for media, tensor in zip(self.media2[call], self.tensors, strict=True):
            view = reservation.views[media]
            if view is None:
                raise l3.BenchError("reserve: an entry of the bench pool is not one view")
            view.copy_(tensor)
        untimed = time.perf_counter() - start
        result = self.a2.commit(reservation, wait=self.wait_in_call)
        if not self.a2.flush(WAIT_S):
            raise l3.BenchError("commit: the batch put did not complete")
        if result.stored != self.cell.batch or self.a2.counters.pushed - before != self.cell.batch:
            raise l3.BenchError(f"commit: {result}, counters {self.a2.counters}")
        return untimed

    def _fetch(self, cache: EmbeddingCache, media: list[PageHash]) -> str:
        request = f"r{self.requests}"
        self.requests += 1
        tokens = [self.cell.tokens] * self.cell.batch
        result = cache.prefetch(request, media, tokens, probe=False, wait=self.wait_in_call)
        if not cache.wait(request, WAIT_S):
            raise l3.BenchError("prefetch: the batch get did not complete")
        if result.loading != self.cell.batch:
            raise l3.BenchError(f"prefetch: {result}, counters {cache.counters}")
        return request

    def prefetch(self, call: int) -> None:
        """prefetch (no probe) + wait + get (a copy of each tensor out of the pool)."""
        request = self._fetch(self.b, self.media[call])
        got = list(self.b.get(self.media[call]))
        self.b.release(request)
        self._check("prefetch", got)

    def borrow(self, call: int) -> None:
        """prefetch (no probe) + wait + borrow (the tensors read in place) + give back."""
        request = self._fetch(self.b2, self.media2[call])
        with self.b2.borrow(self.media2[call]) as loan:
            self._check("borrow", list(loan.tensors))
        self.b2.release(request)

    def _check(self, what: str, got: list[torch.Tensor | None]) -> None:
        if any(tensor is None for tensor in got):
            raise l3.BenchError(f"{what}: a miss after the get completed")
        if self.verify:
            for tensor, want in zip(got, self.tensors, strict=True):
                assert tensor is not None
                if not torch.equal(tensor.view(torch.int16), want.view(torch.int16)):
                    raise l3.BenchError(f"{what}: node B got other bytes than A inserted")

    def close(self) -> None:
        for cache in (self.a, self.b, self.a2, self.b2):
            cache.close()
        for buffer in (self.src, self.dst):
            self.raw.unregister(buffer.data_ptr())
            self.client.unregister_buffer(buffer.data_ptr())


def repetition(
    sides: Sides,
    client: MooncakeClient,
    label: str,
    verify: bool,
    calls: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """One repetition: every put (raw and insert_batch interleaved), then every get; each call's
    seconds are appended to ``calls[name]`` too when given."""
    l3.clear(client, sides.raw)
    sides.begin(label)
    sides.verify = verify
    seconds = dict.fromkeys(NAMES, 0.0)
    for phase in (PUTS, GETS):
        for call in range(sides.cell.calls):
            turn = call % len(phase)
            for name in phase[turn:] + phase[:turn]:  # each goes first in turn
                start = time.perf_counter()
                untimed = getattr(sides, name)(call)
                took = time.perf_counter() - start - (untimed or 0.0)
                seconds[name] += took
                if calls is not None:
                    calls[name].append(took)
    return seconds


def run_cell(
    cell: Cell,
    client: MooncakeClient,
    raw: l3.RawStore,
    repeats: int,
    inline: bool,
    *,
    wait_in_call: bool = True,
) -> dict[str, Any]:
    sides = Sides(cell, client, raw, inline, wait_in_call=wait_in_call)
    samples: dict[str, list[float]] = {name: [] for name in NAMES}
    call_medians: dict[str, list[float]] = {name: [] for name in NAMES}  # per repetition
    try:
        repetition(sides, client, f"{cell.shape}/{cell.batch}/warm", verify=True)
        for rep in range(repeats):
            calls: dict[str, list[float]] = {name: [] for name in NAMES}
            label = f"{cell.shape}/{cell.batch}/{rep}"
            seconds = repetition(sides, client, label, verify=False, calls=calls)
            for name, value in seconds.items():
                samples[name].append(value)
                call_medians[name].append(statistics.median(calls[name]))
        failed = sum(c.counters.failed for c in (sides.a, sides.b, sides.a2, sides.b2))
    finally:
        sides.close()
        l3.clear(client, raw)
    if failed:
        raise l3.BenchError(f"{failed} embeddings failed in the cache")

    def mbps(name: str) -> float:
        return cell.total / statistics.median(samples[name]) / 1e6

    def ratio(raw_name: str, name: str, of: dict[str, list[float]] = samples) -> float:
        return statistics.median(r / k for r, k in zip(of[raw_name], of[name], strict=True))

    def call_ratio(raw_name: str, name: str) -> float:
        """The same over each repetition's median call instead of its total: a call that lands in
        one of the store's multi-millisecond stalls (docs/benchmarks.md) then weighs as one call."""
        return ratio(raw_name, name, call_medians)

    return {
        "shape": cell.shape,
        "tokens": cell.tokens,
        "dim": cell.dim,
        "item_bytes": cell.item_bytes,
        "batch": cell.batch,
        "calls": cell.calls,
        "bytes": cell.total,
        "raw_put_mbps": mbps("raw_put"),
        "second_put_ratio": ratio("raw_put", "raw_put_second"),
        "second_get_ratio": ratio("raw_get", "raw_get_second"),
        "insert_mbps": mbps("insert"),
        "insert_ratio": ratio("raw_put", "insert"),
        "in_place_mbps": mbps("in_place"),
        "in_place_ratio": ratio("raw_put", "in_place"),
        "raw_get_mbps": mbps("raw_get"),
        "prefetch_mbps": mbps("prefetch"),
        "prefetch_ratio": ratio("raw_get", "prefetch"),
        "borrow_mbps": mbps("borrow"),
        "borrow_ratio": ratio("raw_get", "borrow"),
        "median_call_ratios": {
            "insert": call_ratio("raw_put", "insert"),
            "in_place": call_ratio("raw_put", "in_place"),
            "prefetch": call_ratio("raw_get", "prefetch"),
            "borrow": call_ratio("raw_get", "borrow"),
            "second_put": call_ratio("raw_put", "raw_put_second"),
            "second_get": call_ratio("raw_get", "raw_get_second"),
        },
        "median_call_ms": {name: statistics.median(v) * 1e3 for name, v in call_medians.items()},
        "samples": samples,
    }


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a third of the bytes (CI smoke)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="recorded repetitions (5; 2 quick)"
    )
    parser.add_argument("--batches", default="1,8,32", help="embeddings per batch call")
    parser.add_argument("--shapes", default="image,small", help=f"of {','.join(SHAPES)}")
    parser.add_argument("--segment-mib", type=int, default=512, help="storage node segment")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--inline",
        action="store_true",
        help="the caches run their store calls on the caller's thread (InlineExecutor)",
    )
    parser.add_argument(
        "--no-wait-in-call",
        dest="wait_in_call",
        action="store_false",
        help="the verb, then flush / wait (as before part 28) instead of the verb's wait=True",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    try:
        batches = [int(batch) for batch in args.batches.split(",")]
        shapes = args.shapes.split(",")
        if any(batch < 1 for batch in batches) or any(shape not in SHAPES for shape in shapes):
            raise ValueError
    except ValueError:
        parser.error(f"--batches: ints >= 1; --shapes: of {sorted(SHAPES)}")
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    args.cells = []
    for shape in shapes:
        tokens, dim = SHAPES[shape]
        items = ITEMS[shape] // (3 if args.quick else 1)
        for batch in batches:
            args.cells.append(Cell(shape, tokens, dim, batch, max(batch, items // batch * batch)))
    largest = max(len(PUTS) * cell.total for cell in args.cells) // MIB  # every put path's objects
    if args.segment_mib < largest * 10 // 9 + 16:
        parser.error(f"--segment-mib: at least {largest * 10 // 9 + 16} for these cells")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    started = time.perf_counter()
    load_start = os.getloadavg()
    result: dict[str, Any] = {
        "config": {
            "dtype": "float16",
            "repeats": args.repeats,
            "quick": args.quick,
            "segment_bytes": args.segment_mib * MIB,
            "threads": args.threads,
            "executor": "inline" if args.inline else "thread",
            "wait_in_call": args.wait_in_call,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "mooncake": l3._mooncake_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "cells": [],
    }
    with l3.bench_store(args.segment_mib * MIB) as (client, raw):
        for cell in args.cells:
            print(
                f"cell {cell.shape} batch {cell.batch}: {cell.calls} calls ...",
                file=sys.stderr,
                flush=True,
            )
            result["cells"].append(
                run_cell(
                    cell, client, raw, args.repeats, args.inline, wait_in_call=args.wait_in_call
                )
            )
            gc.collect()
    result["seconds"] = time.perf_counter() - started
    result["loadavg"] = {"start": load_start, "end": os.getloadavg()}
    return result


def print_table(result: dict[str, Any]) -> None:
    config = result["config"]
    print(
        f"float16 embeddings; {config['executor']} executor; median of {config['repeats']}; "
        f"{result['seconds']:.0f} s; "
        f"1-min load average {result['loadavg']['start'][0]:.2f} -> "
        f"{result['loadavg']['end'][0]:.2f}"
    )
    print()
    print(
        "| embedding | batch x calls | raw put MB/s | insert_batch ÷ raw | reserve+commit ÷ raw "
        "| raw get MB/s | prefetch+get ÷ raw | prefetch+borrow ÷ raw "
        "| raw, second client ÷ raw: put / get |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for cell in result["cells"]:
        size = cell["item_bytes"]
        label = f"{cell['shape']} {cell['tokens']}x{cell['dim']} ({size / MIB:.3g} MiB)"
        print(
            f"| {label} | {cell['batch']} x {cell['calls']} | {cell['raw_put_mbps']:.0f} "
            f"| {cell['insert_ratio']:.2f} | {cell['in_place_ratio']:.2f} "
            f"| {cell['raw_get_mbps']:.0f} | {cell['prefetch_ratio']:.2f} "
            f"| {cell['borrow_ratio']:.2f} "
            f"| {cell['second_put_ratio']:.2f} / {cell['second_get_ratio']:.2f} |"
        )
    print()
    print(
        "The same ratios over each repetition's median call (a call caught in a store stall "
        "weighs as one call), and the median call in ms, raw put / raw get:"
    )
    print()
    print(
        "| embedding | batch | insert_batch | reserve+commit | prefetch+get | prefetch+borrow "
        "| raw put / get ms | raw, second client ÷ raw |"
    )
    print("|---|---|---:|---:|---:|---:|---|---|")
    for cell in result["cells"]:
        by = cell["median_call_ratios"]
        ms = cell["median_call_ms"]
        print(
            f"| {cell['shape']} | {cell['batch']} | {by['insert']:.2f} | {by['in_place']:.2f} "
            f"| {by['prefetch']:.2f} | {by['borrow']:.2f} "
            f"| {ms['raw_put']:.3f} / {ms['raw_get']:.3f} "
            f"| {by['second_put']:.2f} / {by['second_get']:.2f} |"
        )
    print()
    for cell in result["cells"]:
        by = cell["median_call_ratios"]
        l3.drift(f"{cell['shape']}, batch {cell['batch']}", by["second_put"], by["second_get"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return l3.report("embedding_throughput", lambda: run(args), print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
