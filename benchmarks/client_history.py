"""How a Mooncake client's past calls change its speed on small objects (issue 20, part 23).

Found while checking the embedding benchmark's baseline: a native ``MooncakeDistributedStore`` that
once put a batch of large objects stays slower at putting small ones. ``l3_throughput.bench_store``
used to fill the storage node's segment (``prefault``) through the benchmark's raw client, so every
raw baseline of the benchmarks that share it was measured on a client in that state while
kvstrata's own client was not.

One :class:`~kvstrata.impl.storage.mooncake.LocalCluster` (a master and a storage node on
loopback). Several raw clients on it, set up alike (no segment, the same local buffer, TCP), each
given one history before anything is timed:

- ``fresh``: nothing;
- ``small_objects``: one batch put of ``--history-mib`` MiB in 64 KiB objects (the bytes of the
  big batch, in small objects);
- ``big_objects``: one batch put of the same bytes in ``--big-mib`` MiB objects;
- ``big_objects_removed``: the same, then every object removed (the store is emptied before every
  repetition anyway: this separates the client's state from the master's).

Timed: ``--batch`` objects of ``--kib`` KiB put (``batch_put_from``) and read back
(``batch_get_into``) from one registered buffer, the clients interleaved call by call (each first
in turn), fresh keys per repetition, the store emptied between repetitions. Reported: per client,
the median call's µs (median over ``--repeats`` repetitions of each repetition's median call) and
the ratio to ``fresh``. Timings are this script's to report (docs/benchmarks.md), never asserted.

Exit status: 0 when everything ran; 1 when a native call failed; 2 when the cluster cannot be
started here.

Usage: python benchmarks/client_history.py [--batch 8] [--kib 128] [--history-mib 64]
       [--big-mib 4] [--calls 48] [--repeats 5] [--json PATH]
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import l3_throughput as l3  # the sibling benchmark: cluster, raw client, store clearing

KIB, MIB = l3.KIB, l3.MIB
HISTORIES = ("fresh", "small_objects", "big_objects", "big_objects_removed")


def give_history(raw: l3.RawStore, history: str, total: int, big: int) -> None:
    """One batch put of ``total`` bytes in objects of 64 KiB (``small_objects``) or ``big`` bytes
    (``big_objects*``), from a buffer registered for that call only; nothing for ``fresh``."""
    if history == "fresh":
        return
    size = 64 * KIB if history == "small_objects" else big
    count = total // size
    buffer = torch.ones(count * size, dtype=torch.uint8)
    ptr = buffer.data_ptr()
    raw.register(ptr, buffer.numel())
    try:
        keys = [f"history/{history}/{i}" for i in range(count)]
        codes = raw.native.batch_put_from(
            keys, [ptr + i * size for i in range(count)], [size] * count
        )
        if any(code != 0 for code in codes):
            raise l3.BenchError(f"{history}: the history put returned {sorted(set(codes))}")
        if history == "big_objects_removed":
            removed = raw.native.batch_remove(keys, True)
            if any(code != 0 for code in removed):
                raise l3.BenchError(f"{history}: batch_remove returned {sorted(set(removed))}")
    finally:
        raw.unregister(ptr)


class Buffers:
    """The timed calls' memory: ``count`` objects of ``size`` bytes put from ``source`` and read
    back into ``target`` (both to be registered with every client)."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self.source = torch.randint(0, 255, (count * size,), dtype=torch.uint8)
        self.target = torch.zeros_like(self.source)
        self.ptrs = [self.source.data_ptr() + i * size for i in range(count)]
        self.into = [self.target.data_ptr() + i * size for i in range(count)]
        self.sizes = [size] * count

    def check(self, name: str) -> None:
        """The bytes read back are the bytes put; the target is zeroed for the next get."""
        if not torch.equal(self.source, self.target):
            raise l3.BenchError(f"{name}: other bytes than were put")
        self.target.zero_()


def timed_call(native: Any, verb: str, keys: list[str], moved: Buffers) -> float:
    """The seconds of one ``batch_put_from`` (``verb`` "put") or ``batch_get_into`` of ``keys``;
    :class:`~l3_throughput.BenchError` unless every object moved whole."""
    start = time.perf_counter()
    if verb == "put":
        codes = native.batch_put_from(keys, moved.ptrs, moved.sizes)
        ok = all(code == 0 for code in codes)
    else:
        codes = native.batch_get_into(keys, moved.into, moved.sizes)
        ok = all(code == moved.size for code in codes)
    seconds = time.perf_counter() - start
    if not ok:
        raise l3.BenchError(f"{verb} returned {list(codes)}")
    return seconds


def measure(args: argparse.Namespace) -> dict[str, Any]:
    size = args.kib * KIB
    # every history's objects, or every client's timed objects of one repetition, with room to
    # spare under the storage node's eviction watermark (the store is emptied between them)
    timed = len(HISTORIES) * args.calls * args.batch * size
    segment = max(64 * MIB, len(HISTORIES) * args.history_mib * MIB, timed) * 5 // 4 + 64 * MIB
    with l3.bench_store(segment) as (client, spare):
        clients: dict[str, l3.RawStore] = {}
        try:
            for history in HISTORIES:
                raw = l3.RawStore(client.config.master, client.config.local_buffer_size)
                clients[history] = raw
                give_history(raw, history, args.history_mib * MIB, args.big_mib * MIB)
            moved = Buffers(args.batch, size)
            for raw in clients.values():
                for buffer in (moved.source, moved.target):
                    raw.register(buffer.data_ptr(), buffer.numel())
            medians: dict[str, dict[str, list[float]]] = {
                name: {"put": [], "get": []} for name in HISTORIES
            }
            for rep in range(args.repeats + 1):  # the first one warms up, untimed
                l3.clear(client, spare)
                calls: dict[str, dict[str, list[float]]] = {
                    name: {"put": [], "get": []} for name in HISTORIES
                }
                keys = {
                    name: [
                        [f"timed/{rep}/{name}/{call}/{i}" for i in range(args.batch)]
                        for call in range(args.calls)
                    ]
                    for name in HISTORIES
                }
                for verb in ("put", "get"):
                    for call in range(args.calls):
                        turn = call % len(HISTORIES)
                        for name in HISTORIES[turn:] + HISTORIES[:turn]:
                            seconds = timed_call(
                                clients[name].native, verb, keys[name][call], moved
                            )
                            calls[name][verb].append(seconds)
                            if rep == 0 and verb == "get":  # the warm-up: every get's bytes
                                moved.check(name)
                if rep == 0:
                    continue
                for name in HISTORIES:
                    for verb in ("put", "get"):
                        medians[name][verb].append(statistics.median(calls[name][verb]))
        finally:
            for raw in clients.values():
                raw.close()
    result: dict[str, Any] = {"config": vars(args) | {"json": None}, "clients": {}}
    fresh = medians["fresh"]
    for name in HISTORIES:
        row: dict[str, float] = {}
        for verb in ("put", "get"):
            row[f"{verb}_us"] = statistics.median(medians[name][verb]) * 1e6
            row[f"{verb}_vs_fresh"] = statistics.median(
                mine / base for mine, base in zip(medians[name][verb], fresh[verb], strict=True)
            )
        result["clients"][name] = row
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="objects per timed call")
    parser.add_argument("--kib", type=int, default=128, help="KiB per timed object")
    parser.add_argument("--history-mib", type=int, default=64, help="MiB of the history put")
    parser.add_argument("--big-mib", type=int, default=4, help="MiB per big history object")
    parser.add_argument("--calls", type=int, default=48, help="timed calls per repetition")
    parser.add_argument("--repeats", type=int, default=5, help="recorded repetitions")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    if min(args.batch, args.kib, args.history_mib, args.big_mib, args.calls, args.repeats) < 1:
        parser.error("every count must be >= 1")
    if args.big_mib > args.history_mib:
        parser.error("--big-mib must not exceed --history-mib")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    torch.set_num_threads(1)
    try:
        result = measure(args)
    except l3.SetupError as error:
        print(f"client_history: {error}", file=sys.stderr)
        return 2
    except l3.BenchError as error:
        print(f"client_history: failed: {error}", file=sys.stderr)
        return 1
    print(
        f"{args.batch} x {args.kib} KiB a call; history: one put of {args.history_mib} MiB "
        f"(64 KiB or {args.big_mib} MiB objects); median of {args.repeats}\n"
    )
    print("| client's history | put µs | put ÷ fresh | get µs | get ÷ fresh |")
    print("|---|---:|---:|---:|---:|")
    for name, row in result["clients"].items():
        print(
            f"| {name} | {row['put_us']:.0f} | {row['put_vs_fresh']:.2f} | "
            f"{row['get_us']:.0f} | {row['get_vs_fresh']:.2f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
