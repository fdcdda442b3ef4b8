"""The cache in a TP group, in one process (``support.tp.InProcessTp``): one collective per
``check_events`` on every rank (started there, applied at the next call); a rank that skips it ends
in ``TpAgreementError`` within the timeout and closes the cache; a refused store job does not split
the ranks; a copy failure waits until no rank copies; a cache with no group makes no collective."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from support.tp import InProcessTp
from support.unreachable import UnreachableBackend

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.errors import CacheClosed, ConfigError, MisuseError, TpAgreementError
from kvstrata.impl.l3 import L3Tier
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.base import PutStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.tp import TorchTpGroup
from kvstrata.impl.transfer import ManualExecutor
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Shard
from kvstrata.model.lifecycles import Health

PAGE = 2
SHAPE = KVShape(KVKind.MHA, layers=1, heads=1, head_dim=2, dtype=torch.float16, page_size=PAGE)
IDENTITY = ModelIdentity("tp-unit", "float16", KVKind.MHA, page_size=PAGE)


class Ranks:
    def __init__(self, size: int, timeout_s: float = 1.0) -> None:
        self.tp = InProcessTp(size, timeout_s=timeout_s)
        store = MemoryStore()
        self.copies = [ManualExecutor() for _ in range(size)]
        self.io = [ManualExecutor() for _ in range(size)]
        self.backends = [
            MemoryBackend(KeySpace(IDENTITY, shard=Shard(tp_rank=r, tp_size=size)), store=store)
            for r in range(size)
        ]
        self.caches = self.tp.on_each(self._build)

    def _build(self, rank: int) -> HierarchicalRadixCache:
        return HierarchicalRadixCache.build(
            RadixCacheConfig(page_size=PAGE, write_through_threshold=1),
            DeviceKVPool(SHAPE, 8),
            HostKVPool(SHAPE, 8, HostLayout.PAGE_FIRST),
            self.copies[rank],
            storage=self.backends[rank],
            storage_config=StorageConfig(prefetch_threshold=PAGE, backup_backoff_s=0.0),
            storage_executor=self.io[rank],
            tp_group=self.tp.group(rank),
        )

    def insert(self, tokens: list[int]) -> None:
        def one(rank: int) -> None:
            cache = self.caches[rank]
            fresh = cache.alloc_device(len(tokens) // PAGE)
            cache.insert(tokens, fresh)

        self.tp.on_each(one)

    def agree(self) -> list[object]:
        """Two ``check_events`` on every rank: the first starts an agreement on what each rank
        holds now, the second applies it (agreements are pipelined: applied at the next call)."""
        self.tp.on_each(lambda r: self.caches[r].check_events())
        return self.tp.on_each(lambda r: self.caches[r].check_events())

    def close(self) -> None:
        self.tp.on_each(lambda rank: self.caches[rank].close())
        self.tp.close()


@pytest.fixture
def ranks() -> Iterator[Ranks]:
    group = Ranks(2)
    yield group
    group.close()


def test_a_copy_applies_only_once_every_rank_has_it(ranks: Ranks) -> None:
    ranks.insert([1, 2, 3, 4])
    assert [c.pending().write for c in ranks.caches] == [1, 1]
    ranks.copies[0].run_all()  # rank 0's write-through landed, rank 1's not yet
    ranks.agree()
    assert [c.pending().write for c in ranks.caches] == [1, 1]
    ranks.copies[1].run_all()
    events = ranks.agree()
    assert [c.pending().write for c in ranks.caches] == [0, 0]
    assert events[0] == events[1] and events[0][0].ok  # type: ignore[index]
    assert [c.agreement.agreements for c in ranks.caches if c.agreement] == [4, 4]


def test_one_rank_s_failed_copy_fails_it_on_every_rank(ranks: Ranks) -> None:
    ranks.insert([1, 2, 3, 4])
    transfer = ranks.caches[1].transfer
    assert transfer is not None

    def broken(*_: object) -> int:
        raise RuntimeError("rank 1's copy failed")

    transfer._copy = broken
    for executor in ranks.copies:
        executor.run_all()
    ranks.agree()
    assert [c.cached_pages() for c in ranks.caches] == [{"device": 2, "host": 0}] * 2


def test_a_rank_that_skips_its_collective_fails_the_others_within_the_timeout(
    ranks: Ranks,
) -> None:
    started = time.monotonic()
    ranks.tp.on_rank(0, ranks.caches[0].check_events)  # starts an agreement rank 1 never joins
    with pytest.raises(TpAgreementError, match="no answer"):
        ranks.tp.on_rank(0, ranks.caches[0].check_events)
    assert time.monotonic() - started < 5
    with pytest.raises(CacheClosed):  # its tree can no longer follow the others'
        ranks.tp.on_rank(0, lambda: ranks.caches[0].alloc_device(1))


def test_a_refused_query_does_not_split_the_ranks(ranks: Ranks) -> None:
    ranks.insert([1, 2, 3, 4])
    for executor in ranks.copies:
        executor.run_all()
    for _ in range(3):
        for executor in (*ranks.copies, *ranks.io):
            executor.run_all()
        ranks.agree()
    ranks.tp.on_each(lambda r: (ranks.caches[r].evict(10), ranks.caches[r].evict_host(10)))
    ranks.backends[1].down = True  # rank 1's store refuses: its query is not even sent
    ops = ranks.tp.on_each(lambda r: ranks.caches[r].prefetch([1, 2, 3, 4]))
    assert ops[0] == ops[1] and ops[0] is not None
    for executor in ranks.io:
        executor.run_all()
    ranks.agree()
    ready = ranks.tp.on_each(lambda r: ranks.caches[r].prefetch_ready(ops[0]))
    added = ranks.tp.on_each(lambda r: ranks.caches[r].prefetch_commit(ops[0]))
    assert ready == [True, True] and added == [0, 0]  # rank 1 hit nothing: the minimum is 0


def test_no_group_no_collective() -> None:
    cache = HierarchicalRadixCache.build(
        RadixCacheConfig(page_size=PAGE), DeviceKVPool(SHAPE, 4), HostKVPool(SHAPE, 4)
    )
    assert cache.agreement is None
    assert cache.check_events() == []
    cache.close()


def test_a_torch_group_needs_torch_distributed() -> None:
    with pytest.raises(ConfigError, match="not initialized"):
        TorchTpGroup()


def test_a_failure_waits_until_no_rank_still_copies_that_direction(ranks: Ranks) -> None:
    """Rank 1's first write-through fails; rank 0's second is still copying: failing both now
    would free host pages rank 0's copy still writes, so the failure waits for it."""
    ranks.insert([1, 2, 3, 4])
    ranks.insert([5, 6, 7, 8])
    assert [c.pending().write for c in ranks.caches] == [2, 2]
    transfer = ranks.caches[1].transfer
    assert transfer is not None
    real = transfer._copy
    calls = []

    def first_fails(*args: object) -> int:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("rank 1's first copy failed")
        return real(*args)  # type: ignore[arg-type]

    transfer._copy = first_fails
    ranks.copies[1].run_all()
    ranks.copies[0].run_next()  # rank 0: the first landed, the second is still in flight
    ranks.agree()
    assert [c.pending().write for c in ranks.caches] == [2, 2]
    ranks.copies[0].run_all()
    ranks.agree()
    assert [c.pending().write for c in ranks.caches] == [0, 0]
    assert [c.cached_pages() for c in ranks.caches] == [{"device": 4, "host": 0}] * 2


def test_close_after_a_failed_agreement_still_stops_the_workers() -> None:
    group = Ranks(2, timeout_s=0.5)
    cache = group.caches[0]
    group.tp.on_rank(0, cache.check_events)
    with pytest.raises(TpAgreementError):
        group.tp.on_rank(0, cache.check_events)
    transfer = cache.transfer
    assert transfer is not None
    closed: list[bool] = []
    real = transfer.close
    transfer.close = lambda: (closed.append(True), real())[1]  # type: ignore[method-assign]
    group.tp.on_rank(0, cache.close)
    group.tp.on_rank(0, cache.close)  # idempotent
    assert closed == [True]
    group.tp.on_rank(1, group.caches[1].close)
    group.tp.close()


def _rank_0_down(clock: list[float], config: StorageConfig) -> tuple[Ranks, UnreachableBackend]:
    """Two ranks on one memory store, rank 0's backend :class:`UnreachableBackend` (returned),
    both caches on ``clock``, 16 pages each tier; rank 0's store has gone down under a request of
    tokens 1-4 (its link is down, rank 1's healthy)."""
    group = _rank_0_unreachable(clock, config)
    try:
        unreachable = group.backends[0]
        assert isinstance(unreachable, UnreachableBackend)
        unreachable.unreachable = True
        group.insert([1, 2, 3, 4])
        _run_all(group)
    except BaseException:
        group.close()
        raise
    return group, unreachable


def _rank_0_unreachable(clock: list[float], config: StorageConfig) -> Ranks:
    group = Ranks(2)
    group.tp.on_each(lambda r: group.caches[r].close())  # rebuilt below on fresh backends
    store = MemoryStore()
    group.backends = [
        kind(backend.keyspace, store=store)
        for kind, backend in zip((UnreachableBackend, MemoryBackend), group.backends, strict=True)
    ]

    def build(rank: int) -> HierarchicalRadixCache:
        cache = HierarchicalRadixCache.build(
            RadixCacheConfig(page_size=PAGE, write_through_threshold=1),
            DeviceKVPool(SHAPE, 16),
            HostKVPool(SHAPE, 16, HostLayout.PAGE_FIRST),
            group.copies[rank],
            storage=group.backends[rank],
            storage_config=config,
            storage_executor=group.io[rank],
            tp_group=group.tp.group(rank),
        )
        assert cache.l3 is not None
        cache.l3._now = lambda: clock[0]
        return cache

    group.caches = group.tp.on_each(build)
    return group


def _run_all(group: Ranks, rounds: int = 4) -> None:
    for _ in range(rounds):
        for executor in (*group.copies, *group.io):
            executor.run_all()
        group.agree()


def test_the_remount_grace_holds_on_every_rank_once_the_republish_is_agreed() -> None:
    """Only rank 0's link goes down and comes back; the agreed re-publish starts the remount grace
    on rank 1 too, so "full" answers right after it (a restarted master remounting) spend no retry
    on either rank, and nothing is abandoned (rank 1 alone would vote to give up)."""
    clock = [0.0]
    config = StorageConfig(
        prefetch_threshold=PAGE, backup_backoff_s=0.0, backup_retries=0, remount_grace_s=5.0
    )
    group, unreachable = _rank_0_down(clock, config)
    try:
        links = [cache.l3.link for cache in group.caches if cache.l3 is not None]
        assert links[0].state is Health.DOWN and links[1].state is Health.HEALTHY
        abandoned = [cache.l3.counters.backup_abandoned_pages for cache in group.caches if cache.l3]
        unreachable.unreachable = False
        for backend in group.backends:  # the re-published puts meet a master still remounting
            backend.fail_next(1, status=PutStatus.FULL, op="put")
        clock[0] = 1.0  # the probe's back-off is over
        _run_all(group, 8)
        assert links[0].state is Health.HEALTHY and links[0].recoveries == 1
        counters = [cache.l3.counters for cache in group.caches if cache.l3 is not None]
        assert [c.republished_pages for c in counters] == [2, 2]
        assert [c.backup_pages["full"] for c in counters] == [2, 2]
        assert [c.backup_abandoned_pages for c in counters] == abandoned
        for rank, backend in enumerate(group.backends):
            namespace = group.caches[rank].namespace_of(None)
            pages = group.caches[rank].page_hashes([1, 2, 3, 4])
            assert backend.exists(namespace, list(pages)) == 2, f"rank {rank}"
    finally:
        group.close()


def _parked_on_rank_0(clock: list[float]) -> tuple[Ranks, UnreachableBackend, list[L3Tier]]:
    """:func:`_rank_0_down` (no back-off, no retry), then a request of tokens 5-8 whose backup is
    deferred on rank 0 and stored on rank 1, everything run and agreed; the ranks' L3 tiers."""
    config = StorageConfig(prefetch_threshold=PAGE, backup_backoff_s=0.0, backup_retries=0)
    group, unreachable = _rank_0_down(clock, config)
    try:
        group.insert([5, 6, 7, 8])  # deferred on rank 0
        _run_all(group)
    except BaseException:
        group.close()
        raise
    return group, unreachable, [cache.l3 for cache in group.caches if cache.l3 is not None]


def _check_events(group: Ranks) -> None:
    group.tp.on_each(lambda r: group.caches[r].check_events())


def test_a_parked_backup_whose_job_runs_on_another_rank_keeps_every_rank_busy() -> None:
    """Rank 0's store is down, rank 1's is not: a backup is deferred on rank 0 (parked on both
    ranks) while rank 1's job of it has not run. Neither cache is idle and ``reset`` refuses on
    both, nothing changed (it would free host pages rank 1's job still reads, and put the bytes
    of whatever took them under the op's keys); once rank 1's result is held both are idle, and
    ``reset`` drops the op and that result on every rank."""
    clock = [0.0]
    config = StorageConfig(prefetch_threshold=PAGE, backup_backoff_s=0.0, backup_retries=0)
    group, unreachable = _rank_0_down(clock, config)
    try:
        group.insert([5, 6, 7, 8])
        for executor in group.copies:
            executor.run_all()
        for _ in range(3):  # the copy lands, the backup is queued, its facts are agreed
            _check_events(group)
        tiers = [cache.l3 for cache in group.caches if cache.l3 is not None]
        assert tiers[0].backup.deferred and group.io[1].jobs, "rank 1's job has not run"
        assert all(op.parked for tier in tiers for op in tier.backup.ops.values())
        assert group.tp.on_each(lambda r: group.caches[r].idle()) == [False, False]
        for rank in range(2):
            with pytest.raises(MisuseError, match="in flight"):
                group.tp.on_rank(rank, group.caches[rank].reset)
        assert all(tier.backup.ops for tier in tiers), "a refused reset changed something"
        group.io[1].run_all()
        for _ in range(2):  # rank 1 holds its result; the ranks agree that no job runs
            _check_events(group)
        assert tiers[1].reports is not None and tiers[1].reports.backups
        assert group.tp.on_each(lambda r: group.caches[r].idle()) == [True, True]
        dropped = [tier.counters.backup_dropped_pages for tier in tiers]
        group.tp.on_each(lambda r: group.caches[r].reset())
        assert [tier.counters.backup_dropped_pages for tier in tiers] == [d + 2 for d in dropped]
        assert not tiers[1].reports.backups, "a result held for a dropped op"
        unreachable.unreachable = False
        clock[0] = 1.0
        _run_all(group, 8)
        assert not any(tier.backup.ops for tier in tiers)
    finally:
        group.close()


def test_a_store_back_under_an_idle_tp_cache_starts_no_job_before_the_ranks_agree() -> None:
    """Both caches are idle (a backup parked and quiet: deferred on rank 0, its result held on
    rank 1). Rank 0's store comes back during a ``check_events``: its deferred op waits until the
    ranks agree that no rank defers it, so that call leaves both caches idle with no job queued
    on rank 0 (one started there would read pages a ``reset`` now frees); the next agreement
    starts it, and the op is stored on every rank."""
    clock = [0.0]
    group, unreachable, tiers = _parked_on_rank_0(clock)
    try:
        assert tiers[0].backup.deferred
        assert group.tp.on_each(lambda r: group.caches[r].idle()) == [True, True]
        unreachable.unreachable = False
        clock[0] = 1.0  # the probe's back-off is over
        _check_events(group)  # the probe is issued
        group.io[0].run_all()
        _check_events(group)  # the probe's answer: the link is back, the op waits to resume
        assert tiers[0].link.state is Health.HEALTHY
        assert tiers[0].backup.ready and not group.io[0].jobs, "started before the ranks agreed"
        assert group.tp.on_each(lambda r: group.caches[r].idle()) == [True, True]
        _check_events(group)  # agreed: no rank defers it; its job starts on rank 0
        assert not tiers[0].backup.ready and group.io[0].jobs
        assert group.tp.on_each(lambda r: group.caches[r].idle()) == [False, False]
        # no op counts as parked any more (idle() reads the flag: one left set would answer
        # idle while the job runs, once the other ops are done)
        assert not any(op.parked for tier in tiers for op in tier.backup.ops.values())
        _run_all(group, 8)
        assert not any(tier.backup.ops for tier in tiers)
        namespace = group.caches[0].namespace_of(None)
        for rank, backend in enumerate(group.backends):
            hashes = group.caches[rank].page_hashes([5, 6, 7, 8])
            assert backend.exists(namespace, list(hashes)) == 2, f"rank {rank}"
    finally:
        group.close()


def test_a_retry_waiting_for_its_back_off_keeps_every_rank_busy() -> None:
    """Each rank on a clock of its own (as separate processes are). Rank 1's puts failed, so the
    ranks agreed to retry, and rank 1's retries wait for their back-off; rank 0's store then went
    down and its retries were deferred (the ops parked). A retry waiting for its back-off starts
    on its rank's clock, with no agreement: neither cache is idle until it ran and returned
    (the review's find: counted quiet, ``reset`` could free the pages the retry then reads)."""
    clocks = [0.0, 0.0]
    config = StorageConfig(prefetch_threshold=PAGE, backup_backoff_s=1.0, backup_retries=50)
    group = _rank_0_unreachable([0.0], config)
    try:
        for rank, cache in enumerate(group.caches):
            assert cache.l3 is not None
            cache.l3._now = lambda r=rank: clocks[r]  # type: ignore[misc]
        tiers = [cache.l3 for cache in group.caches if cache.l3 is not None]
        group.backends[1].fail_next(1, op="put")  # rank 1's put fails: a retry is agreed
        group.insert([1, 2, 3, 4])
        _run_all(group, 4)
        assert [len(tier.backup._retry) for tier in tiers] == [1, 1]
        group.backends[0].unreachable = True  # rank 0's store goes down under a new request
        group.insert([5, 6, 7, 8])
        _run_all(group, 4)
        assert tiers[0].link.state is Health.DOWN and tiers[1].link.state is Health.HEALTHY
        clocks[0] = 30.0  # rank 0's retries are due: deferred there (parked on every rank)
        for _ in range(4):
            _check_events(group)
        assert tiers[0].backup.deferred and tiers[1].backup._retry and not group.io[1].jobs
        assert all(op.parked for op in tiers[1].backup.ops.values())
        assert group.tp.on_each(lambda r: group.caches[r].idle()) == [False, False]
        clocks[1] = 30.0  # rank 1's retries start on its own clock
        _check_events(group)
        assert group.io[1].jobs
        assert group.tp.on_each(lambda r: group.caches[r].idle()) == [False, False]
    finally:
        group.close()


def test_reset_drops_the_parked_backups_on_every_rank_alike() -> None:
    """Rank 0's store is down: a backup is deferred there and parked (agreed) on both ranks, so
    both caches are idle. ``reset`` on every rank drops it on every rank (its host pages are
    freed); after the store is back nothing resumes it on rank 0, the ranks keep agreeing, and
    what came after the reset is in both stores."""
    clock = [0.0]
    group, unreachable, tiers = _parked_on_rank_0(clock)
    try:
        assert tiers[0].backup.deferred and all(tier.backup.ops for tier in tiers)
        assert group.tp.on_each(lambda r: group.caches[r].idle()) == [True, True]
        dropped = [tier.counters.backup_dropped_pages for tier in tiers]
        outage = [group.caches[r].page_hashes([5, 6, 7, 8]) for r in range(2)]  # before reset
        group.tp.on_each(lambda r: group.caches[r].reset())
        assert [tier.counters.backup_dropped_pages for tier in tiers] == [d + 2 for d in dropped]
        assert not any(tier.backup.ops or tier.backup.deferred for tier in tiers)
        group.insert([9, 10, 11, 12])  # takes host pages the dropped backup read
        unreachable.unreachable = False
        clock[0] = 1.0  # the probe's back-off is over
        _run_all(group, 8)
        assert tiers[0].link.state is Health.HEALTHY
        assert not any(tier.backup.ops for tier in tiers)
        namespace = group.caches[0].namespace_of(None)
        assert len(outage[0]) == 2
        assert group.backends[0].exists(namespace, list(outage[0])) == 0, "rank 0 resumed it"
        for rank, backend in enumerate(group.backends):
            later = group.caches[rank].page_hashes([9, 10, 11, 12])
            assert backend.exists(namespace, list(later)) == 2, f"rank {rank}"
    finally:
        group.close()
