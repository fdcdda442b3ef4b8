"""What double-buffering would give the staged (``page_first``) L3 path on this machine (issue 20,
item 4): a what-if, not library code.

The library's :class:`~kvstrata.impl.storage.mooncake.slabs.StagedSlabs` makes one gather copy into
its registered staging buffer and one native call per batch (a scatter after a get). Item 4 asked
for that copy double-buffered against the transfer, or for ``page_first`` to be refused for L3. This
script builds the double-buffered variant here (:class:`PipelinedSlabs`: a call cut into pieces
that alternate between the two halves of the staging buffer, a helper thread making each piece's
native call while this thread copies the next piece in, or the previous one out) and times, call by
call against a real store, interleaved with each path first in turn:

- ``staged``: the library's one copy, one call;
- ``split N``: the same cut into N pieces, one after the other on this thread (what the extra
  native calls cost by themselves);
- ``pipelined N``: the N pieces double-buffered on the helper thread.

One ``LocalCluster`` as in ``l3_throughput.py`` (every byte crosses TCP loopback). Prints per page
size the median ms per call of each path and its ratio to ``staged`` (median over calls of
``staged / path`` seconds; > 1 is faster). Bytes are checked after each get of the warm-up.

Usage: python benchmarks/staged_pipeline.py [--sizes 64,1024] [--calls 40]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import l3_throughput as l3  # the cluster, cells, shapes, key spaces, store clearing

from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import HostLayout
from kvstrata.impl.storage.base import page_objects
from kvstrata.impl.storage.mooncake.client import Keys
from kvstrata.impl.storage.mooncake.slabs import RPC_FAIL, StagedSlabs
from kvstrata.model.keys import PageHash

Obj = tuple[int, int]


class PipelinedSlabs(StagedSlabs):
    """:class:`StagedSlabs` with a call cut into ``pieces`` that alternate between the two halves of
    the direction's staging area; with ``threaded``, a helper thread makes each piece's native call while
    this thread copies. A half is written only after the call that last read it returned (put),
    and a get writes into a half only after the copy out of it finished."""

    def __init__(self, *args: object, pieces: int, threaded: bool) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.pieces, self.threaded = pieces, threaded
        self.half = self.capacity // 2
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="what-if-staging")

    def _run(self, call: Callable[[], list[int]]) -> Callable[[], list[int]]:
        if not self.threaded:
            done = call()
            return lambda: done
        future: Future[list[int]] = self.helper.submit(call)
        return future.result

    def _native(self, put: bool, keys: Keys, ptrs: list[int]) -> list[int]:
        move = self.client.batch_put_from if put else self.client.batch_get_into
        return move(keys, ptrs, [self.size] * len(ptrs))

    def _piece(self, count: int, unit: int) -> int:
        piece = -(-count // self.pieces)
        return min(-(-piece // unit) * unit, self.half // unit * unit)

    def put(self, keys: Keys, objects: Sequence[Obj]) -> list[int]:
        piece = self._piece(len(objects), 1)
        codes: list[int] = []
        waiting: Callable[[], list[int]] | None = None
        area = self._put_area
        for turn, start in enumerate(range(0, len(objects), piece)):
            chunk = objects[start : start + piece]
            ptrs, runs = self._slots(area, chunk)
            at = (turn % 2) * self.half
            ptrs = [ptr + at * self.size for ptr in ptrs]
            for number, first, positions in runs:  # the copy in, while the previous piece moves
                pages = torch.tensor([chunk[p][0] for p in positions])
                out = area.slots[at + first : at + first + len(positions)]
                torch.index_select(self._pool(number), 0, pages, out=out)
            if waiting is not None:
                codes += waiting()
            waiting = self._run(
                functools.partial(self._native, True, keys[start : start + len(chunk)], ptrs)
            )
        if waiting is not None:
            codes += waiting()
        return codes + [RPC_FAIL] * (len(objects) - len(codes))

    def get(self, keys: Keys, objects: Sequence[Obj], width: int) -> list[int]:
        piece = self._piece(len(objects), width)
        starts = range(0, len(objects), piece)
        area = self._get_area

        def begin(turn: int) -> tuple[Sequence[Obj], int, list, Callable[[], list[int]]]:
            start = starts[turn]
            chunk = objects[start : start + piece]
            ptrs, runs = self._slots(area, chunk)
            at = (turn % 2) * self.half
            ptrs = [ptr + at * self.size for ptr in ptrs]
            call = functools.partial(self._native, False, keys[start : start + len(chunk)], ptrs)
            return chunk, at, runs, self._run(call)

        codes: list[int] = []
        current = begin(0)
        for turn in range(len(starts)):
            chunk, at, runs, waiting = current
            got = waiting()
            if turn + 1 < len(starts):
                current = begin(turn + 1)  # the next piece moves while this one is copied out
            for number, first, positions in runs:
                pages = torch.tensor([chunk[p][0] for p in positions])
                staged = area.slots[at + first : at + first + len(positions)]
                self._pool(number).index_copy_(0, pages, staged)
            codes += got
        return codes

    def release(self) -> None:
        super().release()
        self.helper.shutdown(wait=False)


def measure(cell: l3.Cell, calls: int, pieces: Sequence[int]) -> dict[str, dict[str, list[float]]]:
    """Seconds per put and per get call of every path, interleaved call by call."""
    shape, keyspace = l3.shape_of(cell), l3.keyspace_of(cell)
    objects = page_objects(keyspace)
    width = len(objects)
    host = HostKVPool(shape, cell.batch * 2, HostLayout.PAGE_FIRST, pin_memory=False)
    l3.fill(host, 7 << 40)
    want = host.buffer.clone()
    tokens = cell.batch * shape.page_size  # the batch's pages: slots 0 .. batch - 1
    # each direction's staging area (half the budget) holds two batches: a whole batch in each
    # of the what-if's halves, and the library's path moves a batch in one call
    staging = 4 * cell.batch * shape.bytes_per_page
    with l3.bench_store(max(512 << 20, 6 * cell.batch * shape.bytes_per_page)) as (client, raw):
        paths: dict[str, StagedSlabs] = {"staged": StagedSlabs(host, client, staging, objects)}
        for n in pieces:
            for threaded, label in ((False, "split"), (True, "pipelined")):
                paths[f"{label} {n}"] = PipelinedSlabs(
                    host, client, staging, objects, pieces=n, threaded=threaded
                )
        seconds = {name: {"put": [], "get": []} for name in paths}
        try:
            for call in range(-2, calls):  # two warm-up calls, bytes checked, not recorded
                turn = call % len(paths)
                order = list(paths)[turn:] + list(paths)[:turn]
                batch: dict[str, tuple[Keys, list[Obj]]] = {}
                for name in order:
                    pages: list[PageHash] = l3.fresh_pages(
                        f"{cell.page_bytes}/{call}/{name}", cell.batch
                    )
                    slots = list(range(cell.batch))
                    batch[name] = (
                        keyspace.rendered(l3.NAMESPACE, pages),
                        [(slot, c) for slot in slots for c in range(width)],
                    )
                for kind in ("put", "get"):
                    for name in order:
                        keys, objs = batch[name]
                        start = time.perf_counter()
                        if kind == "put":
                            codes = paths[name].put(keys, objs)
                            bad = [code for code in codes if code != 0]
                        else:
                            if call < 0:
                                host.buffer.zero_()
                            codes = paths[name].get(keys, objs, width)
                            bad = [code for code in codes if code != paths[name].size]
                        elapsed = time.perf_counter() - start
                        if bad:
                            raise l3.BenchError(
                                f"{name} {kind}: {len(bad)} objects failed ({bad[0]})"
                            )
                        if call < 0 and kind == "get":
                            got, sent = host.buffer.view(torch.int16), want.view(torch.int16)
                            if not torch.equal(got[:, :tokens], sent[:, :tokens]):
                                raise l3.BenchError(f"{name} get: the bytes differ")
                        elif call >= 0:
                            seconds[name][kind].append(elapsed)
                l3.clear(client, raw)  # untimed: every call starts on an empty store
        finally:
            for slabs in paths.values():
                slabs.release()
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="64,1024", help="page sizes in KiB (of l3_throughput)")
    parser.add_argument("--calls", type=int, default=40, help="timed calls per path")
    parser.add_argument("--pieces", default="2,4", help="pieces per call of the what-if")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    pieces = [int(n) for n in args.pieces.split(",")]
    for size in (int(s) for s in args.sizes.split(",")):
        cell = l3.FULL[size]
        try:
            seconds = measure(cell, args.calls, pieces)
        except l3.SetupError as error:
            print(f"staged_pipeline: {error}", file=sys.stderr)
            return 2
        except l3.BenchError as error:
            print(f"staged_pipeline: failed: {error}", file=sys.stderr)
            return 1
        mib = cell.batch * cell.page_bytes / (1 << 20)
        print(f"\n{cell.label} pages, {cell.batch} a call ({mib:.0f} MiB), {args.calls} calls")
        print("| path | put ms | put ÷ staged | get ms | get ÷ staged |")
        print("|---|---:|---:|---:|---:|")
        base = seconds["staged"]
        for name, times in seconds.items():
            ratio = {
                kind: statistics.median(b / t for b, t in zip(base[kind], times[kind], strict=True))
                for kind in ("put", "get")
            }
            print(
                f"| {name} | {statistics.median(times['put']) * 1e3:.2f} | {ratio['put']:.2f} "
                f"| {statistics.median(times['get']) * 1e3:.2f} | {ratio['get']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
