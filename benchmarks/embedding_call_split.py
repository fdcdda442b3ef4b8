"""Where one embedding call spends its time next to a real store (issue 20, parts 25 and 26).

Setup as ``embedding_throughput.py`` (its ``Sides``: a local cluster, kvstrata's own native instance
for the raw calls, 128 KiB float16 embeddings by default, one unit each). The native store object
inside the kvstrata client is wrapped so that each native ``batch_put_from`` / ``batch_get_into``
made *through kvstrata* records its own seconds; the raw calls go to the unwrapped instance. Per
call, interleaved with a raw call of the same size, it times:

- the put side: ``reserve``, ``commit`` and ``flush`` (the native put subtracted from whichever of
  them ran it);
- the get side: ``prefetch(probe=False)``, ``wait``, ``borrow`` + give back, ``release`` (likewise);
- ``reserve`` + ``commit`` on a second cache over a store that answers at once (nothing moves),
  twice per call: right after a raw put and right after another of its own. The difference is what
  running right after a native call costs the same Python.

Prints the median microseconds of each over ``--repeats`` repetitions of ``--calls`` calls (the
first repetition is a warm-up). ``--inline`` gives the caches an InlineExecutor; without it they
use their default ThreadExecutor. ``--no-notify`` makes that executor's ``submit`` queue the job
without waking the worker thread. Only use it for this probe: the caller's ``wait`` / ``flush``
still runs the job, so it measures what waking the worker costs a caller that then waits.

Exit status: 0 when everything ran; 1 when a store call failed; 2 when the cluster cannot be
started here.

``--batch`` puts and gets that many embeddings per call (default 1; part 26). ``--wait-in-call``
makes ``commit`` and ``prefetch`` take ``wait=True`` (part 28): the store call runs inside them, so
``flush`` and ``wait`` have nothing left to do.

Usage: python benchmarks/embedding_call_split.py [--shape small] [--batch 1] [--calls 384] [--repeats 4]
       [--inline] [--no-notify] [--wait-in-call]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import embedding_overhead as overhead  # the sibling benchmark's store that answers at once
import embedding_throughput as bench  # the sibling benchmark: cells, sides
import l3_throughput as l3

from kvstrata.impl import executors
from kvstrata.impl.embedding import EmbeddingCache, EmbeddingPool, PoolShape
from kvstrata.impl.transfer import InlineExecutor
from kvstrata.model.keys import content_hash

PUT_SIDE = ("raw put", "reserve", "commit", "flush")
GET_SIDE = ("raw get", "prefetch", "wait", "borrow", "release")
IDLE_SIDE = (
    "reserve+commit, idle store, after another",
    "reserve+commit, idle store, after a raw put",
)
MOVES = ("batch_put_from", "batch_get_into")


class TimedNative:
    """The native store with its data calls timed: ``last`` is the latest one's seconds."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.last = 0.0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._native, name)
        if name not in MOVES:
            return found

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return found(*args)
            finally:
                self.last = time.perf_counter() - start

        return timed


def queue_without_waking(self: executors.ThreadExecutor, job: Callable[[], None]) -> None:
    """``ThreadExecutor.submit`` without the worker's wake-up (``--no-notify``, probe only)."""
    with self._lock:
        self._unfinished += 1
        self._queue.append(job)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokens, dim = bench.SHAPES[args.shape]
    batch = args.batch
    cell = bench.Cell(args.shape, tokens, dim, batch, args.calls * batch)
    sizes = [tokens] * batch
    split: dict[str, list[float]] = {name: [] for name in PUT_SIDE + GET_SIDE + IDLE_SIDE}
    now = time.perf_counter
    with l3.bench_store(512 * bench.MIB) as (client, raw):
        sides = bench.Sides(cell, client, raw, args.inline)
        idle = EmbeddingCache(
            EmbeddingPool(PoolShape(batch, tokens, dim, bench.DTYPE)),
            overhead.NullStore(False),
            bench.keyspace_of(cell),
            executor=InlineExecutor(),
        )
        timed = TimedNative(client._native)
        client._native = timed  # kvstrata's calls only: sides.native is the unwrapped instance
        writer, reader, wait = sides.a2, sides.b2, args.wait_in_call
        inline = args.inline or wait  # where the native call runs: in the verb itself
        try:
            for rep in range(args.repeats + 1):
                l3.clear(client, raw)
                sides.begin(f"split/{rep}")
                keep = rep > 0
                for call in range(cell.calls):
                    media = sides.media2[call]
                    t0 = now()
                    sides.raw_put(call)
                    t1 = now()
                    reservation = writer.reserve(media, sizes)
                    t2 = now()
                    for index, item in enumerate(media):
                        view = reservation.views[item]
                        assert view is not None
                        view.copy_(sides.tensors[index])
                    t3 = now()
                    writer.commit(reservation, wait=wait)
                    t4 = now()
                    if not writer.flush(bench.WAIT_S):
                        raise l3.BenchError("flush: the put did not complete")
                    t5 = now()
                    native = timed.last
                    fresh = [
                        [content_hash(f"idle/{rep}/{call}/{n}/{i}".encode()) for i in range(batch)]
                        for n in range(3)
                    ]
                    idle.commit(idle.reserve(fresh[0], sizes))
                    t6 = now()
                    idle.commit(idle.reserve(fresh[1], sizes))
                    t7 = now()
                    sides.raw_put(call)
                    t8 = now()
                    idle.commit(idle.reserve(fresh[2], sizes))
                    t9 = now()
                    if keep:
                        split["raw put"].append(t1 - t0)
                        split["reserve"].append(t2 - t1)
                        split["commit"].append(t4 - t3 - (native if inline else 0.0))
                        split["flush"].append(t5 - t4 - (0.0 if inline else native))
                        split[IDLE_SIDE[0]].append(t7 - t6)
                        split[IDLE_SIDE[1]].append(t9 - t8)
                for call in range(cell.calls):
                    media = sides.media2[call]
                    request = f"split/{rep}/{call}"
                    t0 = now()
                    sides.raw_get(call)
                    t1 = now()
                    reader.prefetch(request, media, sizes, probe=False, wait=wait)
                    t2 = now()
                    if not reader.wait(request, bench.WAIT_S):
                        raise l3.BenchError("wait: the get did not complete")
                    t3 = now()
                    with reader.borrow(media) as loan:
                        if any(tensor is None for tensor in loan.tensors):
                            raise l3.BenchError("borrow: a miss after the get completed")
                    t4 = now()
                    reader.release(request)
                    t5 = now()
                    native = timed.last
                    if keep:
                        split["raw get"].append(t1 - t0)
                        split["prefetch"].append(t2 - t1 - (native if inline else 0.0))
                        split["wait"].append(t3 - t2 - (0.0 if inline else native))
                        split["borrow"].append(t4 - t3)
                        split["release"].append(t5 - t4)
        finally:
            client._native = timed._native
            idle.close()
            sides.close()
    return {name: statistics.median(values) * 1e6 for name, values in split.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(bench.SHAPES))
    parser.add_argument("--batch", type=int, default=1, help="embeddings per call")
    parser.add_argument("--calls", type=int, default=384, help="calls per repetition")
    parser.add_argument("--repeats", type=int, default=4, help="recorded repetitions")
    parser.add_argument("--inline", action="store_true", help="InlineExecutor caches")
    parser.add_argument("--no-notify", action="store_true", help="submit without a wake-up")
    parser.add_argument(
        "--wait-in-call", action="store_true", help="commit / prefetch with wait=True (part 28)"
    )
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1 or args.batch < 1:
        parser.error("--batch, --calls and --repeats must be >= 1")
    torch.set_num_threads(1)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if args.no_notify:
        executors.ThreadExecutor.submit = queue_without_waking  # type: ignore[method-assign]
    executor = "inline" if args.inline else "thread" + (", no wake-up" if args.no_notify else "")
    executor += ", wait=True" if args.wait_in_call else ""

    def table(split: dict[str, float]) -> None:
        print(
            f"{args.shape}, batch {args.batch}, {args.calls} calls x {args.repeats}; {executor} executor"
        )
        print("| part | median µs (the native call subtracted) |\n|---|---:|")
        for name, micros in split.items():
            print(f"| {name} | {micros:.1f} |")

    return l3.report("embedding_call_split", lambda: run(args), table, None)


if __name__ == "__main__":
    raise SystemExit(main())
