"""Embedding cache throughput when the caller streams (issue 20, item 5): calls issued back to back,
one wait at the end, against the raw Mooncake client making the same calls one after the other.

``embedding_throughput.py`` times each call until its store call was applied (``flush`` / ``wait``
after every insert and prefetch), so the cache's Python per call adds to the store call's time. An
encoder that inserts what it computed, or a scheduler that prefetches the embeddings of the requests
in its queue, does not wait after each call: the cache's bookkeeping for call ``i + 1`` runs on the
caller's thread while call ``i``'s store call runs on the cache's I/O thread. This script measures that
use, with the same cluster, clients, shapes, batches and keys as ``embedding_throughput.py``:

- **raw put / raw get**: ``batch_put_from`` / ``batch_get_into`` for every call of the window,
  one after the other (the raw client's calls block; this is its throughput on one thread), on the
  native instance inside kvstrata's client (``embedding_throughput.py`` says why);
- **reserve+commit stream**: node A2 ``reserve`` + the tensors written into the views (untimed, as the
  raw source buffer is filled before its clock starts) + ``commit`` for every call of the window,
  then one ``flush``; every item must be stored;
- **insert_batch stream**: node A ``insert_batch`` (one copy of each tensor into the pool) for every
  call of the window, then one ``flush``;
- **prefetch+borrow stream**: node B2 ``prefetch(probe=False)`` for every call of the window (one
  request each), then per request in order ``wait`` + ``borrow`` + ``give_back`` + ``release``;
- **prefetch+get stream**: the same on node B with ``get`` (a copy of each tensor out).

A window is ``--window`` calls (8 by default; 0: a whole repetition), and each pool holds one: every
call of a window may be in flight at once. The paths run window by window, each path's window in
turn, the first path rotating from window to window; one unrecorded warm-up repetition per cell
checks every byte a reader borrows or gets against what was inserted. Reported: kvstrata ÷ raw as the
median over repetitions of ``raw seconds / kvstrata seconds``, and this process's CPU per item.

Exit status: 0 when everything ran; 1 when a store call failed or bytes came back wrong; 2 when the
cluster cannot be started here.

Usage: python benchmarks/embedding_stream.py [--window 8] [--switch-interval-ms MS] [--quick]
       [--repeats N] [--batches 1,8,32] [--shapes image,small] [--segment-mib M] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import embedding_throughput as et  # the per-call benchmark: cells, key space, argument checks
import l3_throughput as l3  # cluster, raw client, store clearing

from kvstrata.impl.embedding import EmbeddingCache
from kvstrata.impl.storage.mooncake import MooncakeClient
from kvstrata.model.keys import PageHash

PUTS = ("raw_put", "in_place", "insert")
GETS = ("raw_get", "borrow", "prefetch")
NAMES = PUTS + GETS


class Streams:
    """One cell's streamed paths over ``embedding_throughput.py``'s :class:`Sides` (its raw
    buffers and keys, its four cache nodes: ``a`` inserts what ``b`` gets, ``a2`` writes in place
    what ``b2`` borrows), each pool holding one window of calls."""

    def __init__(
        self, cell: et.Cell, client: MooncakeClient, raw: l3.RawStore, window: int
    ) -> None:
        self.cell, self.raw = cell, raw
        self.sides = et.Sides(cell, client, raw, pool_units=window * cell.batch)
        self.requests = 0

    def begin(self, label: str, verify: bool) -> None:
        """Fresh keys for one repetition (bytes checked when ``verify``)."""
        self.sides.begin(label)
        self.sides.verify = verify

    def close(self) -> None:
        self.sides.close()

    # ------------------------------------------------------------------------------------ the paths
    def raw_put(self, calls: range) -> float:
        """Each call's raw put, its source written first (untimed: the seconds returned), as
        :meth:`embedding_throughput.Sides.raw_put` makes it."""
        return sum(self.sides.raw_put(call) for call in calls)

    def raw_get(self, calls: range) -> float:
        """Each call's raw get (its bytes checked when verifying), as
        :meth:`embedding_throughput.Sides.raw_get` makes it."""
        for call in calls:
            self.sides.raw_get(call)
        return 0.0

    def in_place(self, calls: range) -> float:
        """Each call's reserve + write (untimed: the seconds returned) + commit, then one flush."""
        tokens = [self.cell.tokens] * self.cell.batch
        writer = self.sides.a2
        before, untimed = writer.counters.pushed, 0.0
        for call in calls:
            media = self.sides.media2[call]
            reservation = writer.reserve(media, tokens)
            start = time.perf_counter()
            for item, tensor in zip(media, self.sides.tensors, strict=True):
                view = reservation.views[item]
                if view is None:
                    raise l3.BenchError("reserve: an entry of the bench pool is not one view")
                view.copy_(tensor)
            untimed += time.perf_counter() - start
            if writer.commit(reservation).stored != self.cell.batch:
                raise l3.BenchError("commit: not every item was stored")
        self._flushed(writer, before, len(calls))
        return untimed

    def insert(self, calls: range) -> float:
        """Each call's insert_batch (one copy per tensor), then one flush."""
        writer = self.sides.a
        before = writer.counters.pushed
        for call in calls:
            if (
                writer.insert_batch(self.sides.media[call], self.sides.tensors).stored
                != self.cell.batch
            ):
                raise l3.BenchError("insert_batch: not every item was stored")
        self._flushed(writer, before, len(calls))
        return 0.0

    def _flushed(self, cache: EmbeddingCache, before: int, calls: int) -> None:
        if not cache.flush(et.WAIT_S):
            raise l3.BenchError("flush: the batch puts did not complete")
        if cache.counters.pushed - before != calls * self.cell.batch:
            raise l3.BenchError(f"not every item was pushed: counters {cache.counters}")

    def borrow(self, calls: range) -> float:
        """Every call's prefetch, then per request: wait, borrow, give back, release."""

        def take(media: list[PageHash]) -> list[torch.Tensor | None]:
            with self.sides.b2.borrow(media) as loan:
                got = list(loan.tensors)
                self.sides._check("borrow", got)
            return got

        self._stream(self.sides.b2, [self.sides.media2[call] for call in calls], take)
        return 0.0

    def prefetch(self, calls: range) -> float:
        """Every call's prefetch, then per request: wait, get (a copy out), release."""

        def take(media: list[PageHash]) -> list[torch.Tensor | None]:
            got = list(self.sides.b.get(media))
            self.sides._check("prefetch", got)
            return got

        self._stream(self.sides.b, [self.sides.media[call] for call in calls], take)
        return 0.0

    def _stream(
        self,
        cache: EmbeddingCache,
        calls: list[list[PageHash]],
        take: Callable[[list[PageHash]], list[torch.Tensor | None]],
    ) -> None:
        tokens = [self.cell.tokens] * self.cell.batch
        requests = []
        for media in calls:
            request = f"r{self.requests}"
            self.requests += 1
            if cache.prefetch(request, media, tokens, probe=False).loading != self.cell.batch:
                raise l3.BenchError(f"prefetch: not every item is loading: {cache.counters}")
            requests.append(request)
        for request, media in zip(requests, calls, strict=True):
            if not cache.wait(request, et.WAIT_S):
                raise l3.BenchError("prefetch: the batch get did not complete")
            take(media)
            cache.release(request)


def repetition(
    streams: Streams, client: MooncakeClient, label: str, window: int, verify: bool
) -> dict[str, tuple[float, float]]:
    """One repetition: the put paths window by window (each path's window in turn, the first
    path rotating with the window), then the get paths likewise. The reader nodes read what the
    writer nodes stored (B what A inserted, B2 what A2 wrote in place). Per path: (wall
    seconds, this process's CPU seconds), summed over the windows."""
    l3.clear(client, streams.raw)
    streams.begin(label, verify)
    spent = dict.fromkeys(NAMES, (0.0, 0.0))
    calls = streams.cell.calls
    for phase in (PUTS, GETS):
        for turn, first in enumerate(range(0, calls, window)):
            shift = turn % len(phase)
            for name in phase[shift:] + phase[:shift]:
                wall, cpu = time.perf_counter(), time.process_time()
                untimed = getattr(streams, name)(range(first, min(first + window, calls)))
                wall, cpu = (
                    time.perf_counter() - wall - untimed,
                    time.process_time() - cpu - untimed,
                )
                spent[name] = (spent[name][0] + wall, spent[name][1] + cpu)
    return spent


def run_cell(
    cell: et.Cell, client: MooncakeClient, raw: l3.RawStore, repeats: int, window: int
) -> dict[str, Any]:
    streams = Streams(cell, client, raw, window)
    samples: dict[str, list[float]] = {name: [] for name in NAMES}
    cpu: dict[str, list[float]] = {name: [] for name in NAMES}
    try:
        repetition(streams, client, f"{cell.shape}/{cell.batch}/warm", window, verify=True)
        for rep in range(repeats):
            spent = repetition(streams, client, f"{cell.shape}/{cell.batch}/{rep}", window, False)
            for name, (wall, used) in spent.items():
                samples[name].append(wall)
                cpu[name].append(used)
        sides = streams.sides
        caches = (sides.a, sides.b, sides.a2, sides.b2)
        failed = sum(cache.counters.failed for cache in caches)
    finally:
        streams.close()
        l3.clear(client, raw)
    if failed:
        raise l3.BenchError(f"{failed} embeddings failed in the cache")

    def ratio(raw_name: str, name: str) -> float:
        pairs = zip(samples[raw_name], samples[name], strict=True)
        return statistics.median(r / k for r, k in pairs)

    def cpu_us(name: str) -> float:
        """This process's CPU per embedding, µs (median over repetitions)."""
        return statistics.median(cpu[name]) / (cell.calls * cell.batch) * 1e6

    return {
        "shape": cell.shape,
        "tokens": cell.tokens,
        "dim": cell.dim,
        "item_bytes": cell.item_bytes,
        "batch": cell.batch,
        "calls": cell.calls,
        "window": window,
        "bytes": cell.total,
        "raw_put_mbps": cell.total / statistics.median(samples["raw_put"]) / 1e6,
        "raw_get_mbps": cell.total / statistics.median(samples["raw_get"]) / 1e6,
        "in_place_ratio": ratio("raw_put", "in_place"),
        "insert_ratio": ratio("raw_put", "insert"),
        "borrow_ratio": ratio("raw_get", "borrow"),
        "prefetch_ratio": ratio("raw_get", "prefetch"),
        "cpu_us": {name: cpu_us(name) for name in NAMES},
        "samples": samples,
        "cpu_samples": cpu,
    }


def print_table(result: dict[str, Any]) -> None:
    config = result["config"]
    print(
        f"streamed calls, windows of {config['window']} calls; switch interval "
        f"{config['switch_interval_ms']:g} ms; median of {config['repeats']}; "
        f"{result['seconds']:.0f} s"
    )
    print()
    print(
        "| embedding | batch x calls | raw put MB/s | reserve+commit ÷ raw | insert_batch ÷ raw "
        "| raw get MB/s | prefetch+borrow ÷ raw | prefetch+get ÷ raw "
        "| CPU µs/item: raw put, reserve+commit, raw get, prefetch+borrow |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for cell in result["cells"]:
        size = cell["item_bytes"] / et.MIB
        cpu = cell["cpu_us"]
        print(
            f"| {cell['shape']} {cell['tokens']}x{cell['dim']} ({size:.3g} MiB) "
            f"| {cell['batch']} x {cell['calls']} | {cell['raw_put_mbps']:.0f} "
            f"| {cell['in_place_ratio']:.2f} | {cell['insert_ratio']:.2f} "
            f"| {cell['raw_get_mbps']:.0f} | {cell['borrow_ratio']:.2f} "
            f"| {cell['prefetch_ratio']:.2f} "
            f"| {cpu['raw_put']:.0f}, {cpu['in_place']:.0f}, {cpu['raw_get']:.0f}, "
            f"{cpu['borrow']:.0f} |"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--window", type=int, default=8, help="calls in flight (0: a repetition)")
    parser.add_argument(
        "--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval (ms)"
    )
    own, rest = parser.parse_known_args(argv)
    args = et.parse_args(rest)
    if own.window < 0:
        print("embedding_stream: --window must be >= 0", file=sys.stderr)
        return 2
    return l3.report("embedding_stream", lambda: run(own, args), print_table, args.json)


def run(own: argparse.Namespace, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if own.switch_interval_ms is not None:
        sys.setswitchinterval(own.switch_interval_ms / 1e3)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "config": {
            "repeats": args.repeats,
            "quick": args.quick,
            "window": own.window,
            "switch_interval_ms": sys.getswitchinterval() * 1e3,
            "cpus": os.cpu_count(),
            "mooncake": l3._mooncake_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "cells": [],
    }
    with l3.bench_store(args.segment_mib * et.MIB) as (client, raw):
        for cell in args.cells:
            window = own.window or cell.calls
            print(f"cell {cell.shape} batch {cell.batch} ...", file=sys.stderr, flush=True)
            result["cells"].append(run_cell(cell, client, raw, args.repeats, window))
            gc.collect()
    result["seconds"] = time.perf_counter() - started
    return result


if __name__ == "__main__":
    sys.exit(main())
