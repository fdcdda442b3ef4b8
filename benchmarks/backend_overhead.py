"""MooncakeBackend's own cost per call, with the native store calls answered at once (issue 20).

A :class:`~kvstrata.impl.storage.mooncake.LocalCluster` is started only so that a real
:class:`~kvstrata.impl.storage.mooncake.MooncakeClient` can be set up; then the client's native
instance is swapped for a stand-in whose ``batch_is_exist`` / ``batch_put_from`` /
``batch_get_into`` answer success at once (every key present, every put accepted, every object read
whole), so what is timed is everything kvstrata does around a native call: argument checks, key
rendering, the client's gate and range checks, code checks, settling statuses, counting. The native
instance is put back before the client closes.

Cells: 64 KiB pages (schema 1: two objects per page, a ``page_first_direct`` host pool of 1,024
pages); ``exists`` of 1, 64 and 1,024 pages; ``put`` (put + confirm) and ``get`` of 64 pages; and the
key texts of 64 and 1,024 pages rendered in Python and through the C kernel. Reported: the lowest
of ``--rounds`` medians of ``--calls`` calls each, in µs per call. Compare two trees with
``benchmarks/against.py``.

Exit status: 0 when everything ran; 2 when the cluster cannot be started here.

Usage: python benchmarks/backend_overhead.py [--rounds 5] [--calls 400] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import l3_throughput as l3  # the sibling benchmark: cluster, cells, pages

from kvstrata.impl import kernels
from kvstrata.impl.pools import HostKVPool, HostLayout
from kvstrata.impl.storage.mooncake import MooncakeBackend

MIB = 1 << 20
PAGES = 1024


class AnswersAtOnce:
    """The native calls the backend makes, each answering success without doing anything."""

    def batch_is_exist(self, texts: list[str]) -> list[int]:
        return [1] * len(texts)

    def batch_put_from(self, texts: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return [0] * len(texts)

    def batch_get_into(self, texts: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return list(sizes)


def lowest_median_us(call: Callable[[], object], rounds: int, calls: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        best = min(best, statistics.median(times))
    return best * 1e6


def run(args: argparse.Namespace) -> dict[str, float]:
    cell = l3.Cell(64 * 1024, 64, 64 * PAGES * 1024)
    keyspace = l3.keyspace_of(cell)
    results: dict[str, float] = {}
    with l3.bench_store(64 * MIB) as (client, _raw):
        host = HostKVPool(l3.shape_of(cell), PAGES, HostLayout.PAGE_FIRST_DIRECT, pin_memory=False)
        backend = MooncakeBackend(client, keyspace)
        backend.attach(host)
        pages = l3.fresh_pages("overhead", PAGES)
        native = client._native  # the benchmark's own stand-in; restored below
        client._native = AnswersAtOnce()
        try:
            cases: list[tuple[str, Callable[[], object]]] = []
            for n in (1, 64, 1024):
                cases.append(
                    (f"exists, {n} pages", lambda s=pages[:n]: backend.exists(l3.NAMESPACE, s))
                )
            batch, slots = pages[:64], list(range(64))
            cases.append(
                ("put + confirm, 64 pages", lambda: backend.put(l3.NAMESPACE, batch, slots))
            )
            cases.append(("get, 64 pages", lambda: backend.get(l3.NAMESPACE, batch, slots)))
            for n in (64, 1024):
                some = pages[:n]
                cases.append(
                    (
                        f"keys of {n} pages, Python",
                        lambda s=some: keyspace.rendered(l3.NAMESPACE, s),
                    )
                )
                join = getattr(kernels, "join_keys", None)  # None: no C kernel (or an older tree)
                if join is not None:
                    cases.append(
                        (
                            f"keys of {n} pages, C kernel",
                            lambda s=some, j=join: keyspace.rendered(l3.NAMESPACE, s, join=j),
                        )
                    )
            for name, call in cases:
                results[name] = lowest_median_us(call, args.rounds, args.calls)
        finally:
            client._native = native
            backend.close()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the lowest median is kept")
    parser.add_argument("--calls", type=int, default=400, help="calls per round")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args(argv)
    try:
        results = run(args)
    except l3.SetupError as error:
        print(f"backend_overhead: {error}", file=sys.stderr)
        return 2
    print(f"module: {kernels.__file__}", file=sys.stderr)
    print("| call | µs |\n|---|---:|")
    for name, us in results.items():
        print(f"| {name} | {us:.1f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
