"""One replay run, end to end: size the tiers, open the L3, build the pools and the cache, serve every
request through the :class:`~.scheduler.ReferenceScheduler`, drain, and collect a
:class:`~.result.ReplayResult`. A sweep is one run per L1 capacity.

Everything a run opens (worker threads, the store client, a local Mooncake cluster, a temporary
directory) is closed when it ends, also when it fails.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.replay.background import Progress, signalling_executor
from kvstrata.impl.replay.capacity import Capacity
from kvstrata.impl.replay.config import ReplayConfig, TierPages, TimestampMode
from kvstrata.impl.replay.kv import KVSynth
from kvstrata.impl.replay.maximum import max_hit_pages
from kvstrata.impl.replay.result import DIRECTIONS, Moved, ReplayResult
from kvstrata.impl.replay.scheduler import ReferenceScheduler, Served
from kvstrata.impl.replay.store import L3Store, open_l3
from kvstrata.impl.replay.trace import Request, request_tokens
from kvstrata.impl.tp import TpGroup
from kvstrata.model.keys import Shard

__all__ = ["OnServed", "ProgressSink", "replay", "sweep"]

TIMELINE_POINTS = 256

#: ``on_served(index, served, cache)``: called after each request of a replay.
OnServed = Callable[[int, Served, HierarchicalRadixCache], None]


class ProgressSink(Protocol):
    """Where a run reports its progress (the command line draws a bar)."""

    def start(self, total: int, label: str) -> None: ...

    def advance(self, done: int, hit_ratio: float) -> None: ...

    def stop(self) -> None: ...


def _kv_shape(config: ReplayConfig) -> Any:
    import torch  # noqa: PLC0415 (the configuration stays importable without torch)

    from kvstrata.impl.pools import KVShape  # noqa: PLC0415

    shape = config.shape
    return KVShape(
        shape.kind,
        layers=shape.layers,
        heads=shape.heads,
        head_dim=shape.head_dim,
        dtype=getattr(torch, shape.dtype),
        page_size=config.page_size,
    )


@contextlib.contextmanager
def _cache(
    config: ReplayConfig,
    pages: TierPages,
    store: L3Store | None,
    progress: Progress,
    tp_group: TpGroup | None = None,
) -> Iterator[tuple[HierarchicalRadixCache, Any]]:
    """The pools and the cache over them; the cache (its workers, the backend) closed on exit."""
    from kvstrata.impl.l3 import Lanes  # noqa: PLC0415
    from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout  # noqa: PLC0415

    shape = _kv_shape(config)
    device = DeviceKVPool(shape, pages.l1)
    layout = HostLayout.PAGE_MAJOR if config.key_schema == 2 else HostLayout.PAGE_FIRST_DIRECT
    host = HostKVPool(shape, pages.l2, layout) if pages.l2 else None
    copies = signalling_executor(progress, "kvstrata-copy") if host is not None else None
    io = (
        None
        if store is None
        else Lanes(  # fetches, backups, probes and queries apart (model/l3/health.py)
            signalling_executor(progress, "kvstrata-l3-read"),
            signalling_executor(progress, "kvstrata-l3-write"),
            signalling_executor(progress, "kvstrata-l3-probe"),
            signalling_executor(progress, "kvstrata-l3-query"),
        )
    )
    try:
        cache = HierarchicalRadixCache.build(
            RadixCacheConfig(page_size=config.page_size, write_policy=config.write_policy),
            device,
            host,
            copies,
            storage=None if store is None else store.backend,
            storage_config=config.storage_config(),
            storage_executor=io,
            tp_group=tp_group,
        )
    except BaseException:
        for executor in (copies, io):
            if executor is not None:
                executor.close()
        if store is not None:
            store.backend.close()
        raise
    try:
        yield cache, device
    finally:
        cache.close()


def _tiers(config: ReplayConfig, pages: TierPages, store: L3Store | None) -> dict[str, Any]:
    size, per_token = config.page_size, config.shape.bytes_per_token

    def tier(count: int) -> dict[str, Any]:
        return {"pages": count, "tokens": count * size, "bytes": count * size * per_token}

    out: dict[str, Any] = {"l1": tier(pages.l1), "l2": tier(pages.l2), "l3": None}
    if store is not None:
        l3 = (
            tier(pages.l3) if config.master is None else dict.fromkeys(("pages", "tokens", "bytes"))
        )
        l3.update(backend=store.kind, where=store.where, store_bytes=store.capacity_bytes)
        out["l3"] = l3
    return out


def _moved(cache: HierarchicalRadixCache) -> Moved:
    stats = cache.stats
    pages = dict.fromkeys(DIRECTIONS, 0)
    moved = dict.fromkeys(DIRECTIONS, 0)
    pages["l1_to_l2"], moved["l1_to_l2"] = stats.write_pages, stats.write_bytes
    pages["l2_to_l1"], moved["l2_to_l1"] = stats.load_pages, stats.load_bytes
    if cache.l3 is not None:
        counters = cache.l3.counters
        pages["l2_to_l3"] = counters.backup_pages.get("stored", 0)
        moved["l2_to_l3"] = counters.backup_bytes
        pages["l3_to_l2"] = counters.prefetch_pages.get("loaded", 0)
        moved["l3_to_l2"] = counters.prefetch_bytes
    return Moved(pages, moved)


def replay(
    config: ReplayConfig,
    requests: Sequence[Request],
    *,
    trace: str = "",
    limit: int | None = None,
    progress: ProgressSink | None = None,
    label: str = "replay",
    clock: Callable[[], float] = time.monotonic,
    on_served: OnServed | None = None,
    tp_group: TpGroup | None = None,
    shard: Shard | None = None,
) -> ReplayResult:
    """Replay ``requests`` through a fresh three-tier stack built from ``config``; ``on_served`` (the
    chaos benchmark's hook) runs after each request; ``tp_group``/``shard``: one TP rank (:mod:`.tp`)."""
    started = clock()
    pages = config.tier_pages(requests)
    size, max_pages = config.page_size, max_hit_pages(requests, config.page_size)
    result = ReplayResult(trace=trace, limit=limit, config=config.describe())
    step = max(1, len(requests) // TIMELINE_POINTS)
    background = Progress()
    with open_l3(config, pages.l3, size * config.shape.bytes_per_token, shard) as store:
        result.tiers = _tiers(config, pages, store)
        with _cache(config, pages, store, background, tp_group) as (cache, device):
            kv = KVSynth(_kv_shape(config), seed=config.seed)
            knobs = {"verify": config.verify, "settle": config.settle}
            scheduler = ReferenceScheduler(
                cache, device, kv, background, **knobs, wait_limit_s=config.wait_limit_s
            )
            loop_start = clock()
            result.timings.startup_s = loop_start - started
            if progress is not None:
                progress.start(len(requests), label)
            try:
                _serve_all(
                    config=config,
                    requests=requests,
                    max_pages=max_pages,
                    scheduler=scheduler,
                    result=result,
                    step=step,
                    progress=progress,
                    clock=clock,
                    on_served=on_served,
                )
            finally:
                if progress is not None:
                    progress.stop()
            drain_start = clock()
            result.timings.replay_s = drain_start - loop_start
            drained = scheduler.drain()
            result.timings.drain_s = clock() - drain_start
            result.timings.scheduler_ns += drained.scheduler_ns
            result.moved = _moved(cache)
            result.l3 = None if cache.l3 is None else cache.l3.describe()
            result.pages_verified = scheduler.pages_verified
            closing = clock()  # the cache is closed at the end of this block, the store below
    result.timings.shutdown_s = clock() - closing
    result.timings.wall_s = clock() - started
    return result


def _serve_all(
    *,
    config: ReplayConfig,
    requests: Sequence[Request],
    max_pages: Sequence[int],
    scheduler: ReferenceScheduler,
    result: ReplayResult,
    step: int,
    progress: ProgressSink | None,
    clock: Callable[[], float],
    on_served: OnServed | None = None,
) -> None:
    size = config.page_size
    honour = config.timestamps is TimestampMode.HONOUR
    origin = requests[0].timestamp if requests else 0.0
    start = clock()
    hits = result.hits
    last = len(requests) - 1
    for index, request in enumerate(requests):
        if honour:
            scheduler.idle_until(start + (request.timestamp - origin) / 1000.0 / config.speed)
        served = scheduler.serve(request_tokens(request), index)
        result.requests += 1
        result.input_tokens += request.input_length
        result.refused += served.refused
        hits.l1 += served.l1_pages * size
        hits.l2 += served.l2_pages * size
        hits.l3 += served.l3_pages * size
        result.max_hit_tokens += max_pages[index] * size
        result.timings.scheduler_ns += served.scheduler_ns
        result.timings.wait_ns += served.wait_ns
        result.timings.waits_ns.append(served.wait_ns)
        result.timings.l3_waits_ns.append(served.l3_wait_ns)
        result.timings.kv_ns += served.kv_ns
        if on_served is not None:
            on_served(index, served, scheduler.cache)
        if index % step == 0 or index == last:
            result.timeline.add(result.requests, result.input_tokens, hits, result.max_hit_tokens)
            if progress is not None:
                progress.advance(result.requests, result.hit_ratio["total"])


def sweep(
    config: ReplayConfig,
    requests: Sequence[Request],
    l1_capacities: Sequence[Capacity],
    *,
    trace: str = "",
    limit: int | None = None,
    progress: ProgressSink | None = None,
) -> ReplayResult:
    """One run per L1 capacity (``config.l1`` always among them, each once); the result of the run
    at ``config.l1``, with ``sweep`` holding every run's summary in increasing L1 size."""
    runs: dict[int, tuple[Capacity, ReplayResult | None]] = {}
    for capacity in (config.l1, *l1_capacities):
        pages = config.with_l1(capacity).tier_pages(requests).l1
        runs.setdefault(pages, (capacity, None))
    main_pages = config.tier_pages(requests).l1
    summaries: list[dict[str, Any]] = []
    main: ReplayResult | None = None
    for pages_l1 in sorted(runs):
        capacity, _ = runs[pages_l1]
        run = replay(
            config.with_l1(capacity),
            requests,
            trace=trace,
            limit=limit,
            progress=progress,
            label=f"L1 {capacity}",
        )
        summaries.append(run.summary())
        if pages_l1 == main_pages:
            main = run
    assert main is not None
    main.sweep = summaries
    return main
