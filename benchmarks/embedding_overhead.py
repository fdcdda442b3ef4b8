"""The embedding cache's own cost per item, without a store or a thread (issue 20).

A store that answers every put and get DONE at once and every ``exists`` as asked (nothing moves), and
:class:`~kvstrata.impl.transfer.ManualExecutor`s run right after each call, so what is timed is the
cache's Python and its copies, the four paths of ``embedding_throughput.py``: node A ``insert_batch``
(one copy per tensor into the pool) + applying the put; node B ``prefetch`` + applying the get +
``get`` (one copy per tensor out); node C ``reserve`` + ``commit`` (written in place: no copy) +
applying the put; node D ``prefetch(probe=False)`` + applying the get + ``borrow`` + ``give_back``
(read in place: no copy). 128 KiB float16 embeddings ([64, 1024]), one unit each, pools of one
batch. Prints microseconds per item: the
median over the calls of a round of 1920 items, the lowest of 5 rounds (this is CPU work only, so
the quietest round is the least disturbed by the rest of a shared machine). Run it from any tree to
compare versions (the module path is printed on stderr).

``--pool-units`` sizes every pool (default: one batch); a larger pool is filled first, untimed, so
every timed call plans its room in a full pool of that many entries (each call evicts the LRU
ones): the cost of planning room must not grow with the pool.

Usage: python benchmarks/embedding_overhead.py [--batches 1,32] [--pool-units 0,1024,8192]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from kvstrata.impl import embedding
from kvstrata.impl.embedding import EmbeddingCache, EmbeddingPool, Extents, ExtentStatus, PoolShape
from kvstrata.impl.transfer import ManualExecutor
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    RenderedKeys,
    Shard,
    StoreKey,
    content_hash,
)

ITEMS = 1920
ROUNDS = 5
COLUMNS = ("insert", "prefetch+get", "reserve+commit", "prefetch+borrow")


class NullStore:
    """Answers at once; ``exists`` says ``there`` for every key."""

    def __init__(self, there: bool) -> None:
        self.there = there

    def register(self, ptr: int, nbytes: int) -> None:
        """Nothing to register."""

    def unregister(self, ptr: int) -> None:
        """Nothing to unregister."""

    def exists(self, keys: Sequence[StoreKey] | RenderedKeys) -> list[bool]:
        return [self.there] * len(keys)

    def put(self, extents: Extents) -> list[ExtentStatus]:
        return [ExtentStatus.DONE] * len(extents)

    def get(self, extents: Extents) -> list[ExtentStatus]:
        return [ExtentStatus.DONE] * len(extents)


def per_item(batch: int, pool_units: int = 0) -> dict[str, float]:
    model = ModelIdentity(name="overhead", dtype="float16", kind=KVKind.EMBEDDING, dim=1024)
    keyspace = KeySpace(model, shard=Shard.replicated())
    units = max(batch, pool_units)
    shape = PoolShape(units, 64, 1024, torch.float16)
    io_a, io_b, io_c, io_d = ManualExecutor(), ManualExecutor(), ManualExecutor(), ManualExecutor()
    a = EmbeddingCache(EmbeddingPool(shape), NullStore(False), keyspace, executor=io_a)
    b = EmbeddingCache(EmbeddingPool(shape), NullStore(True), keyspace, executor=io_b)
    c = EmbeddingCache(EmbeddingPool(shape), NullStore(False), keyspace, executor=io_c)
    d = EmbeddingCache(EmbeddingPool(shape), NullStore(True), keyspace, executor=io_d)
    tensors = [torch.randn(64, 1024).to(torch.float16) for _ in range(batch)]
    seconds: dict[str, list[float]] = {name: [] for name in COLUMNS}
    fill = -(-units // batch) if units > batch else 0
    tokens = [64] * batch
    for call in range(-fill, ITEMS // batch):
        media = [content_hash(f"{call}/{i}".encode()) for i in range(batch)]
        times = [time.perf_counter()]
        a.insert_batch(media, tensors)  # insert: one copy per tensor into the pool
        io_a.run_all()
        a.poll()
        times.append(time.perf_counter())
        b.prefetch(f"r{call}", media, tokens)  # prefetch+get: one copy per tensor out
        io_b.run_all()
        b.poll()
        b.get(media)
        times.append(time.perf_counter())
        c.commit(c.reserve(media, tokens))  # reserve+commit: nothing copied (written in place)
        io_c.run_all()
        c.poll()
        times.append(time.perf_counter())
        d.prefetch(f"r{call}", media, tokens, probe=False)  # prefetch+borrow: nothing copied
        io_d.run_all()
        d.poll()
        d.give_back(d.borrow(media))
        times.append(time.perf_counter())
        b.release(f"r{call}")
        d.release(f"r{call}")
        if call < 0:
            continue
        for name, begin, end in zip(COLUMNS, times[:-1], times[1:], strict=True):
            seconds[name].append(end - begin)
    return {name: statistics.median(values) * 1e6 / batch for name, values in seconds.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batches", default="1,32", help="items per call")
    parser.add_argument(
        "--pool-units", default="0", help="units per pool, comma-separated (0: one batch)"
    )
    args = parser.parse_args(argv)
    print(f"module: {embedding.__file__}", file=sys.stderr)
    pools = [int(u) for u in args.pool_units.split(",")]
    for pool_units in pools:
        for batch in (int(b) for b in args.batches.split(",")):
            rounds = [per_item(batch, pool_units) for _ in range(ROUNDS)]
            cost = {name: min(r[name] for r in rounds) for name in rounds[0]}
            units = max(batch, pool_units)
            columns = ", ".join(f"{name} {cost[name]:.1f}" for name in COLUMNS)
            print(f"pool {units} units, batch {batch}: {columns} (us/item)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
