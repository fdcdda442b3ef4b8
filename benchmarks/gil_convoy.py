"""Store calls on a worker thread while the scheduler thread runs Python: the GIL convoy (issue 20).

kvstrata makes every L3 store call on a worker thread (the storage worker's lanes, the embedding
cache's I/O thread) so that the scheduler thread never waits for the store. The Mooncake binding
releases the GIL for the call; to return, the worker must take the GIL back. When the scheduler thread
is running Python at that moment, CPython makes the worker wait up to the interpreter's switch
interval (``sys.getswitchinterval()``, 5 ms by default) before it forces a switch. A 64 KiB page put
takes about 0.3 ms here, so every store call can take many times as long as it would with the
scheduler thread idle. Every other benchmark in ``benchmarks/`` waits on the main thread while the
store works, so none of them sees this.

Setup: the cluster and clients of ``l3_throughput.py`` (a ``LocalCluster`` whose storage node owns
the only segment; clients without a segment). A run moves ``--pages`` pages of ``--page-kib`` KiB in
calls of ``--batch`` pages, all puts then all gets, on one of four paths (the first two on a worker
thread):

- **raw**: the raw client's ``batch_put_from`` / ``batch_get_into`` of the pages' K and V objects;
- **kvstrata**: ``MooncakeBackend.put`` / ``get`` of the same pages (key schema 1, a
  ``page_first_direct`` host pool: two objects per page; the put's confirm included);
- **cache**: ``l3_throughput.py``'s ``cache`` row: cache A inserts one request per call's pages and
  backs them up (the write-through copy, then one backup op per request on its write lane); cache B
  prefetches them (a query, then a fetch, per request); ``--merge-pages`` is cache A's
  ``backup_merge_pages`` and cache B's ``prefetch_merge_pages`` (0: one store call per op);
- **cache_per_op**: the same with both at 0 (its own host pool and backend): every backup and
  every fetch is its own store call, as before issue 20's merged calls.

In the two cache rows the main thread *is* the scheduler: "put" is the backup and "get" the
prefetch, and the load below runs between two ``check_events`` calls (idle: a 0.5 ms sleep).

while the main thread (the stand-in for a scheduler) is one of

- **idle**: blocked in ``join`` (what the other benchmarks do);
- **busy**: running a pure-Python loop until the worker is done (the worst case: it never releases
  the GIL on its own);
- **duty**: the same loop for ``--busy-ms``, then ``time.sleep(--rest-ms)``, over and over (a
  scheduler that waits on its device now and then).

under each switch interval of ``--intervals`` (ms). Each repetition runs every (interval, load, path)
once in an order that rotates, the store cleared before each run, with no pause between runs. On
this VM, small transfers after 0.3 s or more without store calls stay 3-5x slower until a burst of
large ones (docs/benchmarks.md), so every repetition starts with one (``l3_throughput.py``'s
prefault of the segment), and the loop's speed alone is measured before the first repetition and
after the last (the median of four half-second samples per interval).
Reported: median MB/s of the puts and of the gets per cell, the busy ÷ idle ratio, and the main
loop's iterations per second while the store worked (against the loop alone at each interval: what
the switch interval costs the scheduler thread). Nothing is asserted; exit status 0 when
everything ran, 1 when a store call failed, 2 when the cluster cannot be started here.

Usage: python benchmarks/gil_convoy.py [--intervals 5,1,0.5,0.2] [--repeats 3] [--pages 256]
       [--batch 8] [--page-kib 64] [--busy-ms 4 --rest-ms 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import l3_throughput as l3  # cluster, raw client, paths, store clearing

from kvstrata.impl.pools import HostKVPool
from kvstrata.impl.pools.host import HostLayout
from kvstrata.impl.storage.mooncake import MooncakeBackend

LOADS = ("idle", "busy", "duty")
PATHS = ("raw", "kvstrata", "cache", "cache_per_op")


class Scheduler:
    """The cache row's main thread between two ``check_events``: ``idle`` sleeps 0.5 ms (as in
    ``l3_throughput.py``), ``busy`` runs the Python loop for ``busy_s``, ``duty`` runs it for
    ``busy_s`` and sleeps ``rest_s``. ``count``: loop iterations so far."""

    def __init__(self, load: str, busy_s: float, rest_s: float) -> None:
        self.load, self.busy_s, self.rest_s = load, busy_s, rest_s
        self.count = 0

    def __call__(self) -> None:
        if self.load == "idle":
            l3.poll_pause()
            return
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:
            for _ in range(200):
                self.count += 1
        if self.load == "duty":
            time.sleep(self.rest_s)


def cache_run(
    cache: l3.CachePath, load: str, args: argparse.Namespace
) -> tuple[float, float, float]:
    """Cache A's backup and cache B's prefetch of the cell (``l3_throughput.py``'s ``cache`` row)
    with the main thread as the scheduler under ``load``: seconds of each, and loop iterations per
    second (0 when idle)."""
    cache.pause = scheduler = Scheduler(load, args.busy_ms / 1e3, args.rest_ms / 1e3)
    start = time.perf_counter()
    backup_s, prefetch_s, _retries = cache.run()
    return backup_s, prefetch_s, scheduler.count / (time.perf_counter() - start)


def spin_until(done: threading.Event) -> int:
    """A pure-Python loop until ``done``: iterations (the scheduler's progress)."""
    count = 0
    while not done.is_set():
        for _ in range(200):
            count += 1
    return count


def duty_until(done: threading.Event, busy_s: float, rest_s: float) -> int:
    """The loop of :func:`spin_until` for ``busy_s``, then a sleep of ``rest_s``, until ``done``."""
    count = 0
    while not done.is_set():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            for _ in range(200):
                count += 1
        time.sleep(rest_s)
    return count


def loop_rate(seconds: float) -> float:
    """Iterations per second of the pure-Python loop with nothing else running."""
    done = threading.Event()
    timer = threading.Timer(seconds, done.set)
    start = time.perf_counter()
    timer.start()
    count = spin_until(done)
    return count / (time.perf_counter() - start)


def one_run(
    path: l3.MovePath, calls: int, load: str, label: str, args: argparse.Namespace
) -> tuple[float, float, float]:
    """The puts then the gets of ``path`` on a worker thread under ``load``: put seconds, get
    seconds, and the main loop's iterations per second while they ran (0 when idle)."""
    timing: dict[str, float] = {}
    failure: list[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            path.begin(label)
            start = time.perf_counter()
            puts = [path.put(call) for call in range(calls)]
            timing["put"] = time.perf_counter() - start
            start = time.perf_counter()
            gets = [path.get(call) for call in range(calls)]
            timing["get"] = time.perf_counter() - start
            path.check_put(puts)
            path.check_get(gets)
        except BaseException as error:  # reported on the main thread
            failure.append(error)
        finally:
            done.set()

    worker = threading.Thread(target=work, name="store-worker")
    start = time.perf_counter()
    worker.start()
    count = 0
    if load == "busy":
        count = spin_until(done)
    elif load == "duty":
        count = duty_until(done, args.busy_ms / 1e3, args.rest_ms / 1e3)
    worker.join()
    elapsed = time.perf_counter() - start
    if failure:
        raise failure[0]
    return timing["put"], timing["get"], count / elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    cell = l3.Cell(args.page_kib * 1024, args.batch, args.pages * args.page_kib * 1024)
    calls = cell.calls
    nbytes = cell.pages * cell.page_bytes
    keyspace = l3.keyspace_of(cell)
    samples: dict[str, list[tuple[float, float, float]]] = {}
    alone: dict[float, list[float]] = {}
    original = sys.getswitchinterval()
    started = time.perf_counter()
    with l3.bench_store(args.segment_mib * l3.MIB) as (client, raw):
        host = HostKVPool(l3.shape_of(cell), cell.pages, HostLayout.PAGE_FIRST_DIRECT)
        l3.fill(host, 1 << 40)
        backend = MooncakeBackend(client, keyspace)
        backend.attach(host)
        same = l3.SameInstance(client)  # the raw path's instance: kvstrata's own
        paths: dict[str, l3.MovePath] = {
            "raw": l3.RawPath(same, host, cell, keyspace),
            "kvstrata": l3.BackendPath(backend, host, cell),
        }
        host_c = HostKVPool(l3.shape_of(cell), cell.pages, HostLayout.PAGE_FIRST_DIRECT)
        l3.fill(host_c, 3 << 40)
        backend_c = MooncakeBackend(client, keyspace)
        backend_c.attach(host_c)
        caches = {
            "cache": l3.CachePath(client, cell, host, backend, merge_pages=args.merge_pages),
            "cache_per_op": l3.CachePath(client, cell, host_c, backend_c, merge_pages=0),
        }
        runs = list(itertools.product(args.intervals, LOADS, PATHS))
        try:
            for interval in args.intervals:  # the loop alone, before any store call
                sys.setswitchinterval(interval / 1e3)
                alone[interval] = [loop_rate(0.5) for _ in range(2)]
            with l3.registered(same, host):
                for rep in range(args.repeats + 1):  # the first is a warm-up
                    # a burst of 4 MiB puts: after an idle moment (the loop measured alone) the
                    # small transfers of this VM stay slow until one (docs/benchmarks.md); made on
                    # the instance every path of this benchmark times
                    l3.prefault(same, args.segment_mib * l3.MIB)
                    turn = rep * 5 % len(runs)
                    for interval, load, name in runs[turn:] + runs[:turn]:
                        sys.setswitchinterval(interval / 1e3)
                        l3.clear(client, raw)
                        label = f"{rep}/{interval}/{load}/{name}"
                        if name in caches:
                            result = cache_run(caches[name], load, args)
                        else:
                            result = one_run(paths[name], calls, load, label, args)
                        if rep:
                            samples.setdefault(f"{interval}/{load}/{name}", []).append(result)
            for interval in args.intervals:  # and after the last (the store idle again)
                sys.setswitchinterval(interval / 1e3)
                alone[interval] += [loop_rate(0.5) for _ in range(2)]
        finally:
            sys.setswitchinterval(original)
            for cache in caches.values():
                cache.close()  # closes its backends too
    cells = []
    for interval, load, name in itertools.product(args.intervals, LOADS, PATHS):
        rows = samples[f"{interval}/{load}/{name}"]
        puts, gets, rates = zip(*rows, strict=True)
        cells.append(
            {
                "interval_ms": interval,
                "load": load,
                "path": name,
                "put_mbps": nbytes / statistics.median(puts) / 1e6,
                "get_mbps": nbytes / statistics.median(gets) / 1e6,
                "main_rate": statistics.median(rates),
                "samples": rows,
            }
        )
    return {
        "config": {
            "page_kib": args.page_kib,
            "batch": args.batch,
            "pages": cell.pages,
            "calls": calls,
            "repeats": args.repeats,
            "busy_ms": args.busy_ms,
            "rest_ms": args.rest_ms,
            "merge_pages": args.merge_pages,
            "cpus": os.cpu_count(),
            "mooncake": l3._mooncake_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "loop_alone": {str(k): statistics.median(v) for k, v in alone.items()},
        "cells": cells,
        "seconds": time.perf_counter() - started,
    }


def print_table(result: dict[str, Any]) -> None:
    config = result["config"]
    alone = ", ".join(f"{k} ms: {v / 1e6:.1f}" for k, v in result["loop_alone"].items())
    print(
        f"{config['pages']} pages of {config['page_kib']} KiB in calls of {config['batch']}; "
        f"duty {config['busy_ms']} ms on / {config['rest_ms']} ms off; "
        f"backup/prefetch_merge_pages {config['merge_pages']}; median of "
        f"{config['repeats']}; {result['seconds']:.0f} s; the main loop alone, M iterations/s: "
        f"{alone}"
    )
    print()
    print(
        "| switch interval | main thread | path | put (backup) MB/s | get (prefetch) MB/s "
        "| put, get ÷ idle | main loop, M iterations/s |"
    )
    print("|---:|---|---|---:|---:|---|---:|")
    by_key = {(c["interval_ms"], c["load"], c["path"]): c for c in result["cells"]}
    for (interval, load, name), cell in by_key.items():
        idle = by_key[(interval, "idle", name)]
        main = f"{cell['main_rate'] / 1e6:.1f}" if load != "idle" else ""
        print(
            f"| {interval:g} ms | {load} | {name} | {cell['put_mbps']:.0f} "
            f"| {cell['get_mbps']:.0f} | {cell['put_mbps'] / idle['put_mbps']:.2f}, "
            f"{cell['get_mbps'] / idle['get_mbps']:.2f} | {main} |"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--intervals", default="5,1,0.5,0.2", help="switch intervals, ms")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="pages per store call")
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--busy-ms", type=float, default=4.0)
    parser.add_argument("--rest-ms", type=float, default=1.0)
    parser.add_argument(
        "--merge-pages",
        type=int,
        default=256,
        help="the cache's backup_merge_pages and prefetch_merge_pages (0: one store call per op)",
    )
    parser.add_argument("--segment-mib", type=int, default=512)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        args.intervals = [float(x) for x in args.intervals.split(",")]
    except ValueError:
        parser.error("--intervals: comma-separated milliseconds")
    if min(args.intervals) <= 0 or args.repeats < 1 or args.pages < args.batch or args.batch < 1:
        parser.error("intervals > 0, repeats >= 1, pages >= batch >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    return l3.report("gil_convoy", lambda: run(args), print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
