"""Where the time of one embedding insert goes, layer by layer, against a real store (issue 20).

One ``LocalCluster`` (``embedding_throughput.py``'s setup, so every byte crosses TCP loopback), 128 KiB
float16 embeddings ([64, 1024]). For each call, one after the other on fresh keys (each way first in turn,
so a burst of load from the rest of the machine falls on all alike), the same batch is put seven
ways, each adding one layer to the one before:

- ``raw``: the native ``batch_put_from`` from a registered buffer that holds the batch, on the native
  instance inside kvstrata's client (as every raw baseline since part 23 of issue 20:
  ``client_history.py``);
- ``client``: :class:`~kvstrata.impl.storage.mooncake.MooncakeClient.batch_put_from` (the gate, the key
  and range checks, the per-key codes);
- ``adapter``: :class:`~kvstrata.impl.embedding.MooncakeEmbeddingStore.put` of ``Extents`` (columns);
- ``adapter_pool``: the same from the pool of an embedding cache instead of the source buffer;
- ``copy``: the copies ``insert_batch`` makes into that pool, alone (no store call);
- ``cache_inline``: ``EmbeddingCache.insert_batch`` + ``flush`` with an ``InlineExecutor``;
- ``cache_thread``: the same with the default I/O thread.

Prints the median and the 10th percentile in µs per call over ``--calls`` calls in each of 3 rounds
(the store is emptied between rounds). ``cache_inline`` minus ``adapter_pool`` minus ``copy`` is the
cache's own Python *next to a running transfer*, to compare with ``embedding_overhead.py`` (the same
Python on an idle core).

Usage: python benchmarks/embedding_split.py [--batch 1] [--calls 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import embedding_throughput as et  # the sibling benchmark: cells, keyspace, both sides
import l3_throughput as l3  # the cluster, the raw client, store clearing

from kvstrata.impl.embedding import (
    EmbeddingCache,
    EmbeddingPool,
    Extent,
    Extents,
    MooncakeEmbeddingStore,
    PoolShape,
)
from kvstrata.impl.storage.mooncake import MooncakeClient
from kvstrata.impl.transfer import InlineExecutor
from kvstrata.model.keys import PageHash, StoreKey

LAYERS = (
    "raw",
    "client",
    "adapter",
    "adapter_pool",
    "copy",
    "cache_inline",
    "cache_thread",
)


def split(batch: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of every layer (see the module docstring), interleaved call by call."""
    cell = et.Cell("small", 64, 1024, batch, calls * batch)
    seconds: dict[str, list[float]] = {name: [] for name in LAYERS}
    with l3.bench_store(512 << 20) as (client, raw):
        sides = et.Sides(cell, client, raw)
        shape = PoolShape(batch, cell.tokens, cell.dim, et.DTYPE)
        inline = EmbeddingCache(
            EmbeddingPool(shape),
            MooncakeEmbeddingStore(client),
            et.keyspace_of(cell),
            executor=InlineExecutor(),
        )
        adapter = MooncakeEmbeddingStore(client)
        try:
            for round_ in range(3):
                l3.clear(client, raw)
                media = l3.fresh_pages(f"split/{round_}", len(LAYERS) * calls * batch)
                groups = [media[i : i + batch] for i in range(0, len(media), batch)]
                for call in range(calls):
                    mine = groups[call * len(LAYERS) : (call + 1) * len(LAYERS)]
                    steps = list(
                        zip(LAYERS, _steps(sides, inline, adapter, client, mine), strict=True)
                    )
                    turn = call % len(steps)  # each layer goes first in turn
                    for name, step in steps[turn:] + steps[:turn]:
                        start = time.perf_counter()
                        step()
                        seconds[name].append(time.perf_counter() - start)
            if inline.counters.failed or sides.a.counters.failed:
                raise l3.BenchError("an embedding put failed")
        finally:
            inline.close()
            sides.close()
    return seconds


def _steps(
    sides: et.Sides,
    inline: EmbeddingCache,
    adapter: MooncakeEmbeddingStore,
    client: MooncakeClient,
    groups: list[list[PageHash]],
) -> list[Callable[[], object]]:
    """One call of every layer, each on its own fresh keys."""
    keys: list[list[StoreKey]] = [
        [inline.object_keys(media, sides.cell.tokens)[0] for media in group] for group in groups
    ]
    pool = inline.pool

    def raw() -> None:
        sides.native.batch_put_from([k.text for k in keys[0]], sides.src_ptrs, sides.sizes)

    def wrapped() -> None:
        client.batch_put_from(keys[1], sides.src_ptrs, sides.sizes)

    def extents(group: int, ptrs: Sequence[int]) -> Extents:
        """The adapter's columns, made before the clock starts (the cache renders them as one
        batch while it plans the call: ``capture``, timed in the layers above)."""
        rows = zip(keys[group], ptrs, sides.sizes, strict=True)
        return Extents.of(Extent(k, p, s) for k, p, s in rows)

    pool_ptrs = [pool.unit_ptr(unit) for unit in range(len(sides.tensors))]
    from_source, from_pool = extents(2, sides.src_ptrs), extents(3, pool_ptrs)

    def copies() -> None:
        for unit, tensor in enumerate(sides.tensors):
            pool.write((unit,), tensor)

    def cached(cache: EmbeddingCache, group: int) -> Callable[[], None]:
        def step() -> None:
            cache.insert_batch(groups[group], sides.tensors)
            if not cache.flush(et.WAIT_S):
                raise l3.BenchError("insert_batch: the batch put did not complete")

        return step

    return [
        raw,
        wrapped,
        lambda: adapter.put(from_source),
        lambda: adapter.put(from_pool),
        copies,
        cached(inline, 5),
        cached(sides.a, 6),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="embeddings per call")
    parser.add_argument("--calls", type=int, default=300, help="calls per round (3 rounds)")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.calls < 1:
        parser.error("--batch and --calls must be >= 1")
    torch.set_num_threads(1)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        seconds = split(args.batch, args.calls)
    except l3.SetupError as error:
        print(f"embedding_split: {error}", file=sys.stderr)
        return 2
    except l3.BenchError as error:
        print(f"embedding_split: failed: {error}", file=sys.stderr)
        return 1
    print(f"128 KiB embeddings, batch {args.batch}, {len(seconds['raw'])} calls per layer")
    for name, values in seconds.items():
        ordered = sorted(values)
        print(
            f"{name:13s} median {statistics.median(values) * 1e6:7.0f} us   "
            f"p10 {ordered[len(ordered) // 10] * 1e6:7.0f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
