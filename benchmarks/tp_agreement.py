"""What tensor parallelism costs the scheduler (SPEC §10, §12; issue 18).

Two measurements, each as a ratio against tp 1 measured in the same run (medians of ``--reps``
interleaved repetitions):

1. **One ``check_events``** with nothing finished: tp 1 (no group: the baseline) against tp 2 and
   tp 4, each rank a process joined by gloo on loopback, its cache over a host pool and an in-memory
   L3 with ``--pending`` write-through copies in flight (so the agreement carries that many facts).
   Every rank times ``--calls`` back-to-back calls after a warm-up (each waits for the agreement the
   previous one started: the collective's whole latency), then as many bare gloo all-reduces of a
   vector of the same length; the figures are the slowest rank's means (a collective finishes when
   its slowest member does).
2. **The scheduler path per request** on the trace replay (``kvstrata replay --sample --settle
   --limit N``, and the same with ``--overlap``; the embedded Mooncake default):
   ``scheduler_ns / requests`` at tp 1, at tp 2 with no agreement (the same two rank processes, each
   cache on its own: the CPU the ranks take from each other) and at tp 2 (every rank replays the
   whole trace; rank 0's figure). tp 2 against tp 2 with no agreement is the agreement's cost;
   against tp 1 it also holds what the two processes take from each other on a small machine.

Usage::

    .venv/bin/python benchmarks/tp_agreement.py [--calls 2000] [--reps 7] [--limit 60]
        [--replay-reps 3] [--json PATH]

Exit status 1 if tp 2's hits differ from tp 1's under ``--settle`` (where they must be equal).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.replay import sample_trace
from kvstrata.impl.replay.config import ReplayConfig
from kvstrata.impl.replay.runner import replay
from kvstrata.impl.replay.tp import replay_tp
from kvstrata.impl.replay.trace import read_trace
from kvstrata.impl.storage.memory import MemoryBackend
from kvstrata.impl.tp import TorchTpGroup
from kvstrata.impl.transfer import ManualExecutor
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Shard

PAGE = 4


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _check_events_rank(  # noqa: PLR0917 (a process target)
    rank: int, size: int, port: int, calls: int, pending: int, out: Any
) -> None:
    torch.set_num_threads(1)
    group = None
    if size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=60),
        )
        group = TorchTpGroup(timeout_s=60)
    shape = KVShape(KVKind.MHA, layers=1, heads=1, head_dim=8, dtype=torch.float16, page_size=PAGE)
    identity = ModelIdentity("bench", "float16", KVKind.MHA, page_size=PAGE)
    cache = HierarchicalRadixCache.build(
        RadixCacheConfig(page_size=PAGE, write_through_threshold=1),
        DeviceKVPool(shape, 4 * pending + 8),
        HostKVPool(shape, 4 * pending + 8, HostLayout.PAGE_FIRST),
        ManualExecutor(),  # the copies stay in flight: facts to report, nothing to apply
        storage=MemoryBackend(KeySpace(identity, shard=Shard(tp_rank=rank, tp_size=size))),
        storage_executor=ManualExecutor(),
        tp_group=group,
    )
    for request in range(pending):
        tokens = [request + 1] * PAGE * 2
        cache.insert(tokens, cache.alloc_device(2))
    for _ in range(200):
        cache.check_events()
    if group is not None:
        dist.barrier()
    start = time.perf_counter_ns()
    for _ in range(calls):
        cache.check_events()
    mean_us = (time.perf_counter_ns() - start) / calls / 1000
    raw_us = 0.0
    if group is not None:  # the collective alone: the same vector, no cache
        tensor = torch.zeros(4 + 2 * pending + 1, dtype=torch.int64)
        dist.barrier()
        start = time.perf_counter_ns()
        for _ in range(calls):
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        raw_us = (time.perf_counter_ns() - start) / calls / 1000
    out.put((rank, mean_us, raw_us, cache.pending().write))
    if group is not None:
        dist.barrier()
        dist.destroy_process_group()


def check_events_us(size: int, calls: int, pending: int) -> tuple[float, float]:
    """The slowest rank's mean ``check_events`` time and bare all-reduce time, in µs."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    ranks = [
        context.Process(target=_check_events_rank, args=(r, size, port, calls, pending, out))
        for r in range(size)
    ]
    for process in ranks:
        process.start()
    results = [out.get(timeout=300) for _ in ranks]
    for process in ranks:
        process.join()
    assert all(writes == pending for *_, writes in results), results
    return max(r[1] for r in results), max(r[2] for r in results)


def replay_scheduler_us(
    tp: int, limit: int, *, settle: bool, agree: bool = True
) -> tuple[float, dict[str, int]]:
    """Rank 0's scheduler path per request, and its hit tokens."""
    requests = read_trace(sample_trace(), limit)
    config = ReplayConfig(l1="64K", l2="256K", settle=settle, tp=tp)
    result = replay(config, requests) if tp == 1 else replay_tp(config, requests, agree=agree)
    hits = {"l1": result.hits.l1, "l2": result.hits.l2, "l3": result.hits.l3}
    return result.timings.scheduler_ns / result.requests / 1000, hits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--pending", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--replay-reps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()

    events: dict[int, list[float]] = {1: [], 2: [], 4: []}
    bare: dict[int, list[float]] = {2: [], 4: []}
    for _ in range(args.reps):
        for size, runs in events.items():
            call, collective = check_events_us(size, args.calls, args.pending)
            runs.append(call)
            if size > 1:
                bare[size].append(collective)
    median = {size: statistics.median(values) for size, values in events.items()}
    bare_median = {size: statistics.median(values) for size, values in bare.items()}
    print(f"check_events, {args.pending} copies in flight (median of {args.reps}, µs per call):")
    for size, value in median.items():
        line = f"  tp {size}: {value:8.1f} µs  (x{value / median[1]:.2f} of tp 1)"
        if size > 1:
            line += f"; a bare gloo all-reduce of the same vector: {bare_median[size]:.1f} µs"
        print(line)

    modes = {"tp 1": (1, True), "tp 2, no agreement": (2, False), "tp 2": (2, True)}
    paths: dict[str, dict[str, float]] = {}
    hits: dict[str, dict[str, int]] = {}
    for settle in (True, False):
        label = "settle" if settle else "overlap"
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.replay_reps):
            for mode, (tp, agree) in modes.items():
                value, hits[f"{label}/{mode}"] = replay_scheduler_us(
                    tp, args.limit, settle=settle, agree=agree
                )
                runs[mode].append(value)
        paths[label] = {mode: statistics.median(values) for mode, values in runs.items()}
        print(f"scheduler path per request, sample trace, {args.limit} requests, --{label}:")
        base, apart = paths[label]["tp 1"], paths[label]["tp 2, no agreement"]
        for mode, value in paths[label].items():
            print(
                f"  {mode:20s} {value:8.1f} µs  (x{value / base:.2f} of tp 1, "
                f"x{value / apart:.2f} of tp 2 apart)"
            )
    if hits["settle/tp 1"] != hits["settle/tp 2"]:
        print(f"hits differ: {hits}", file=sys.stderr)
        return 1
    if args.json:
        report = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "check_events_us": {"runs": events, "median": median},
            "bare_all_reduce_us": {"runs": bare, "median": bare_median},
            "scheduler_path_us": paths,
            "hits": hits,
            "args": vars(args),
        }
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
