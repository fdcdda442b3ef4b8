"""The cache's L3 side against the in-memory backend: backup retries and their accounting, store
failures that degrade to misses, prefetch policies, configuration errors and metrics (issue 4).

The differential machine (tests/stateful/test_l3_differential.py) proves agreement with the model;
these tests pin down the implementation-only behaviour: back-off and abandonment, time-based
policies, a backend that raises, and the metric names an operator scrapes."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from support.l3_rig import KEYS, PAGE, SHAPE, Rig, kv
from support.unreachable import UnreachableBackend

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.metrics import registry_for
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.base import PutStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.transfer import ManualExecutor
from kvstrata.model.keys import KVKind, chain_page_hashes
from kvstrata.model.lifecycles import Health

TOKENS = list(range(1, 4 * PAGE + 1))


def test_backup_then_prefetch_by_another_instance_bit_for_bit() -> None:
    shared = MemoryStore()
    writer, reader = Rig(shared), Rig(shared)
    writer.insert(TOKENS)
    writer.settle()
    assert writer.counters.backup_pages["stored"] == 4
    op = reader.cache.prefetch(TOKENS)
    assert op is not None
    reader.settle()
    assert reader.cache.prefetch_ready(op)
    assert reader.cache.prefetch_commit(op) == 4
    match = reader.cache.match_prefix(TOKENS)
    assert (match.device_pages, match.host_pages) == (0, 4)
    assert reader.cache.load_back(match.host_node) is not None
    reader.settle()
    again = reader.cache.match_prefix(TOKENS)
    want = torch.cat([kv(p) for p in chain_page_hashes(TOKENS, PAGE)], dim=2)
    got = reader.device.read_pages(again.device_indices)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert reader.counters.prefetch_committed_pages == 4


def test_a_prefetch_commits_only_under_a_readable_l2_copy_so_a_failed_write_keeps_i3() -> None:
    """Found by the model's fuzz run: pages prefetched under a node whose write-through is still in
    flight are given back at the commit, so the write's failure cannot leave a host-only leaf under
    an L1-only node; a prefetch committed once the write landed attaches them."""
    shared = MemoryStore()
    writer = Rig(shared)
    writer.insert(TOKENS)
    writer.settle()
    for lands in (False, True):
        reader = Rig(shared)
        reader.insert(TOKENS[:PAGE])  # its write-through waits in reader.copies
        op = reader.cache.prefetch(TOKENS)
        assert op is not None
        while reader.io.run_all():
            reader.cache.check_events()
        assert reader.cache.prefetch_ready(op) and reader.cache.prefetch_reserved() == 3
        transfer = reader.cache.transfer
        assert transfer is not None
        if not lands:

            def broken(*_: object) -> int:
                raise RuntimeError("injected copy failure")

            transfer._copy = broken
        else:
            reader.copies.run_all()
            reader.cache.check_events()
        free = reader.cache.host_free
        assert reader.cache.prefetch_commit(op) == (3 if lands else 0)
        assert reader.cache.host_free == free + (0 if lands else 3)
        reader.settle()
        match = reader.cache.match_prefix(TOKENS)
        assert (match.device_pages, match.host_pages) == ((1, 3) if lands else (1, 0))
        if not lands:  # the node is L1-only again, its L2 slot given back
            assert reader.cache.host_free == 16


def test_failed_backup_is_retried_then_abandoned_and_counted() -> None:
    rig = Rig(config=StorageConfig(backup_retries=2, backup_backoff_s=0))
    rig.backend.down = True
    rig.insert(TOKENS)
    rig.settle()
    counters = rig.counters
    assert counters.backup_retries == 2
    assert counters.backup_abandoned_pages == 4
    assert counters.backup_pages["failed"] == 12  # 3 attempts of 4 pages
    assert rig.cache.l3 is not None and rig.cache.l3.idle()
    assert all(node.backup_pins == 0 for node in rig.cache.nodes())
    assert rig.cache.evict(4) == 4  # demoted to L2
    assert rig.cache.evict_host(4) == 4  # unpinned: L2 can be reclaimed


def test_store_full_is_a_counted_miss_and_succeeds_on_retry() -> None:
    rig = Rig()
    rig.backend.fail_next(1, status=PutStatus.FULL, op="put")
    rig.insert(TOKENS)
    rig.settle()
    assert rig.counters.backup_pages["full"] == 4
    assert rig.counters.backup_pages["stored"] == 4
    assert rig.backend.exists(rig.cache.namespace_of(None), chain_page_hashes(TOKENS, PAGE)) == 4


def test_full_right_after_the_store_came_back_spends_no_retry() -> None:
    """A restarted Mooncake master answers puts "full" until its clients have remounted their
    segments (MOONCAKE.md §5.3). Within ``remount_grace_s`` of a recovery such answers spend no
    retry, so the backups deferred while the store was down land; after the grace they count again,
    and a store really full is abandoned as before."""
    config = StorageConfig(backup_retries=1, backup_backoff_s=0, remount_grace_s=5.0)
    rig = Rig(config=config, backend=UnreachableBackend)
    backend = rig.backend
    assert isinstance(backend, UnreachableBackend)
    l3 = rig.cache.l3
    assert l3 is not None
    backend.unreachable = True
    rig.insert(TOKENS)  # fails (spending its retries) and takes the link down
    rig.settle()
    assert l3.link.state is Health.DOWN
    abandoned = rig.counters.backup_abandoned_pages
    outage = [t + 500 for t in TOKENS]
    rig.insert(outage)
    rig.settle()
    assert l3.backup.deferred, "the backup waits for the store"
    backend.unreachable = False
    rig.backend.fail_next(4, status=PutStatus.FULL, op="put")  # more than backup_retries + 1
    rig.clock.now = 1.0  # the probe's back-off is over
    rig.settle()
    assert l3.link.state is Health.HEALTHY and l3.link.recoveries == 1
    assert rig.counters.backup_pages["full"] >= 4 * 4
    assert rig.counters.backup_abandoned_pages == abandoned
    assert rig.backend.exists(rig.cache.namespace_of(None), chain_page_hashes(outage, PAGE)) == 4
    # the grace is over: "full" spends retries again
    rig.clock.now = 7.0
    rig.backend.fail_next(2, status=PutStatus.FULL, op="put")
    later = [t + 1000 for t in TOKENS]
    rig.insert(later)
    rig.settle()
    assert rig.counters.backup_abandoned_pages == abandoned + 4
    assert all(node.backup_pins == 0 for node in rig.cache.nodes())


def test_backup_waits_for_back_off() -> None:
    rig = Rig(config=StorageConfig(backup_backoff_s=1.0))
    rig.backend.fail_next(1, op="put")
    rig.insert(TOKENS)
    rig.copies.run_all()
    rig.cache.check_events()
    rig.io.run_all()
    rig.cache.check_events()
    assert not rig.io.jobs, "retried before its back-off"
    rig.clock.now = 1.0
    rig.cache.check_events()
    assert len(rig.io.jobs) == 1


def test_backup_pins_host_pages_until_acked() -> None:
    rig = Rig()
    rig.insert(TOKENS)
    rig.copies.run_all()
    rig.cache.check_events()
    rig.cache.evict(4)  # demote: L1 freed, host copy kept
    assert rig.cache.evict_host(4) == 0, "host pages read by a backup were evicted"
    rig.settle()
    assert rig.cache.evict_host(4) == 4


class Exploding(MemoryBackend):
    def put(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    def exists(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")


def test_a_backend_that_raises_is_a_failure_not_a_crash() -> None:
    rig = Rig(config=StorageConfig(backup_retries=0, prefetch_threshold=PAGE))
    rig.cache.close()
    rig.backend = Exploding(KEYS)
    rig.copies, rig.io = ManualExecutor(), ManualExecutor()
    rig.cache = HierarchicalRadixCache.build(
        RadixCacheConfig(page_size=PAGE),
        rig.device,
        HostKVPool(SHAPE, 16, HostLayout.PAGE_FIRST),
        executor=rig.copies,
        storage=rig.backend,
        storage_config=StorageConfig(backup_retries=0, prefetch_threshold=PAGE),
        storage_executor=rig.io,
    )
    rig.insert(TOKENS)
    rig.settle()
    assert rig.counters.backup_abandoned_pages == 4
    # a raising backend is a faulty store: the backup and the probe that followed it faulted, so
    # the store is down and a prefetch is answered "nothing" at once (no call is issued)
    l3 = rig.cache.l3
    assert l3 is not None and l3.link.state is Health.DOWN
    assert rig.cache.prefetch([*TOKENS, 99, 98, 97, 96]) is None
    assert l3.link.answered_nothing == 1 and rig.counters.prefetch_unserved == 1


def test_wait_complete_and_timeout_policies() -> None:
    shared = MemoryStore()
    writer = Rig(shared)
    writer.insert(TOKENS)
    writer.settle()
    waiting = Rig(shared, StorageConfig(prefetch_threshold=PAGE, prefetch_policy="wait_complete"))
    op = waiting.cache.prefetch(TOKENS)
    assert op is not None and not waiting.cache.prefetch_ready(op)
    waiting.settle()
    assert waiting.cache.prefetch_ready(op)
    timed = Rig(
        shared,
        StorageConfig(
            prefetch_threshold=PAGE,
            prefetch_policy="timeout",
            prefetch_timeout_base_s=0.5,
            prefetch_timeout_per_1k_s=0,
        ),
    )
    op = timed.cache.prefetch(TOKENS)
    assert op is not None and not timed.cache.prefetch_ready(op)
    timed.clock.now = 0.5
    assert timed.cache.prefetch_ready(op)
    timed.cache.prefetch_abort(op)
    timed.settle()
    assert timed.cache.prefetch_reserved() == 0
    assert timed.cache.host_free == 16


def test_abort_while_reading_keeps_slots_until_the_read_drains() -> None:
    shared = MemoryStore()
    writer = Rig(shared)
    writer.insert(TOKENS)
    writer.settle()
    reader = Rig(shared)
    op = reader.cache.prefetch(TOKENS)
    assert op is not None
    reader.io.run_next()  # the query
    reader.cache.check_events()
    assert reader.cache.prefetch_reserved() == 4
    reader.cache.prefetch_abort(op)
    assert reader.cache.host_free == 12, "slots freed while the read may still write them"
    reader.settle()
    assert reader.cache.host_free == 16
    with pytest.raises(MisuseError):
        reader.cache.prefetch_commit(op)


def test_prefetch_below_threshold_or_without_l3() -> None:
    rig = Rig(config=StorageConfig(prefetch_threshold=8 * PAGE))
    assert rig.cache.prefetch(TOKENS) is None
    plain = HierarchicalRadixCache.build(
        RadixCacheConfig(page_size=PAGE),
        DeviceKVPool(SHAPE, 4, "cpu"),
        HostKVPool(SHAPE, 4),
        executor=ManualExecutor(),
    )
    assert plain.prefetch(TOKENS) is None
    with pytest.raises(MisuseError):
        plain.prefetch_commit(1)


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="page-first"):
        HierarchicalRadixCache.build(
            RadixCacheConfig(page_size=PAGE),
            DeviceKVPool(SHAPE, 4, "cpu"),
            HostKVPool(SHAPE, 4, HostLayout.LAYER_FIRST),
            storage=MemoryBackend(KEYS),
        )
    with pytest.raises(ConfigError, match="host pool"):
        HierarchicalRadixCache.build(
            RadixCacheConfig(page_size=PAGE),
            DeviceKVPool(SHAPE, 4, "cpu"),
            storage=MemoryBackend(KEYS),
        )
    with pytest.raises(ConfigError, match="page size"):
        HierarchicalRadixCache.build(
            RadixCacheConfig(page_size=2),
            DeviceKVPool(
                KVShape(
                    KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=2
                ),
                4,
                "cpu",
            ),
            HostKVPool(
                KVShape(
                    KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=2
                ),
                4,
                HostLayout.PAGE_FIRST,
            ),
            storage=MemoryBackend(KEYS),
        )
    for bad in (
        {"prefetch_policy": "eventually"},
        {"prefetch_reserve_fraction": 0},
        {"backup_retries": -1},
        {"backup_backoff_s": -0.1},
        {"backup_batch_pages": 0},
        {"backup_merge_pages": -1},
        {"backup_merge_pages": "256"},
        {"prefetch_merge_pages": -1},
        {"prefetch_merge_pages": 1.5},
    ):
        with pytest.raises(ConfigError):
            StorageConfig(**bad)  # type: ignore[arg-type]


def test_metrics_are_scraped_from_the_cache() -> None:
    shared = MemoryStore()
    rig = Rig(shared)
    rig.insert(TOKENS)
    rig.settle()
    rig.cache.match_prefix(TOKENS)
    text = generate_latest(registry_for(rig.cache)).decode()
    assert 'kvstrata_hit_tokens_total{tier="l1"} 16.0' in text
    assert 'kvstrata_backup_pages_total{status="stored"} 4.0' in text
    assert 'kvstrata_copy_pages_total{direction="write"} 4.0' in text
    assert 'kvstrata_queue_depth{queue="backup"} 0.0' in text
    assert "kvstrata_store_errors_total" in text
    assert 'kvstrata_store_health{state="healthy"} 1.0' in text
    assert 'kvstrata_store_health{state="down"} 0.0' in text
    assert "kvstrata_store_faults_total 0.0" in text
    assert "kvstrata_backup_deferred_pages 0.0" in text


def test_partial_failure_retries_only_the_failed_pages() -> None:
    rig = Rig()
    rig.backend.fail_next(1, status=PutStatus.FULL, op="put", after=2)
    rig.insert(TOKENS)
    rig.copies.run_all()
    rig.cache.check_events()
    rig.io.run_next()
    rig.cache.check_events()
    assert rig.cache.l3 is not None
    (retry,) = rig.cache.l3.backups.values()
    assert retry.num_pages == 2
    assert [node.backup_pins for node in rig.cache.nodes()] == [1]
    rig.settle()
    assert rig.counters.backup_pages == {
        "stored": 4,
        "existed": 0,
        "skipped": 0,
        "full": 2,
        "failed": 0,
    }
    assert all(node.backup_pins == 0 for node in rig.cache.nodes())


def test_long_nodes_are_cut_into_batches_and_splits_keep_pins_exact() -> None:
    rig = Rig(config=StorageConfig(prefetch_threshold=PAGE, backup_batch_pages=3))
    rig.insert(TOKENS)  # one node of 4 pages -> batches of 3 and 1
    rig.copies.run_all()
    rig.cache.check_events()
    assert rig.cache.l3 is not None
    assert sorted(op.num_pages for op in rig.cache.l3.backups.values()) == [1, 3]
    (node,) = rig.cache.nodes()
    assert node.backup_pins == 2
    rig.cache.match_prefix(TOKENS[: 2 * PAGE])  # split 2 | 2 while both batches are pending
    prefix, suffix = rig.cache.nodes()  # parents first
    assert suffix.parent is prefix
    assert (prefix.backup_pins, suffix.backup_pins) == (1, 2)  # batch A: pages 0-2; B: page 3
    rig.io.run_next()  # batch A acks
    rig.cache.check_events()
    assert (prefix.backup_pins, suffix.backup_pins) == (0, 1)
    rig.settle()
    assert all(n.backup_pins == 0 for n in rig.cache.nodes())
    assert rig.counters.backup_pages["stored"] == 4


def test_a_prefetch_that_found_nothing_leaves_the_tree_as_it_is() -> None:
    """A prefetch whose query found nothing commits nothing, and touches nothing: it does not
    split the node that a later request inserted over its prefix (found by the L3 differential
    machine: the model never splits there)."""
    rig = Rig(config=StorageConfig(prefetch_threshold=PAGE, backup_backoff_s=0))
    prefix = TOKENS[: 2 * PAGE]
    rig.insert(prefix)
    rig.settle()
    longer = [*prefix, *range(900, 900 + PAGE)]  # its third page is in no store
    op = rig.cache.prefetch(longer)
    assert op is not None
    rig.settle()
    assert rig.cache.prefetch_ready(op)
    rig.cache.evict(10**6)
    rig.cache.evict_host(10**6)
    assert rig.cache.residency(prefix) == ()
    rig.insert(longer)  # one new node of three pages
    rig.settle()
    assert rig.cache.residency(prefix) == (), "the three pages are one node"
    assert rig.cache.prefetch_commit(op) == 0
    assert rig.cache.residency(prefix) == (), "a commit of nothing split the node"
    assert len(rig.cache.residency(longer)) == 3


def test_back_off_of_many_retries_stays_finite() -> None:
    """A long remount grace can count thousands of waits with ``backup_backoff_s=0``: the back-off
    stays a number (2.0 ** 1024 would raise OverflowError on the scheduler thread)."""
    assert StorageConfig(backup_backoff_s=0).backoff(5000) == 0.0
    assert StorageConfig().backoff(10**6) == StorageConfig().backup_backoff_cap_s


def test_reset_drops_the_backups_waiting_for_the_store_so_l3_never_gets_reused_pages() -> None:
    """A backup deferred while the store is down pins its host pages; ``reset`` frees them (the
    cache is idle: a deferred op is not in flight). Resumed after the store came back, that op
    would have put the pages' new contents (another prefix) under the old keys, for good."""
    shared = MemoryStore()
    config = StorageConfig(backup_retries=1, backup_backoff_s=0, prefetch_threshold=PAGE)
    rig = Rig(shared, config=config, backend=UnreachableBackend)
    backend, l3 = rig.backend, rig.cache.l3
    assert isinstance(backend, UnreachableBackend) and l3 is not None
    backend.unreachable = True
    rig.insert(TOKENS)  # fails and takes the link down
    rig.settle()
    outage = [t + 500 for t in TOKENS]
    rig.insert(outage)
    rig.settle()
    assert l3.backup.deferred and rig.cache.idle(), "a deferred backup leaves the cache idle"
    dropped = rig.counters.backup_dropped_pages
    rig.cache.reset()
    assert not l3.backup.ops and not l3.backup.deferred and l3.backup.deferred_pages() == 0
    assert rig.counters.backup_dropped_pages == dropped + 4
    assert rig.cache.host_free == 16
    for k in range(4):  # other prefixes take every host page, the outage's among them
        rig.insert([t + 9000 + 100 * k for t in TOKENS])
        rig.copies.run_all()
        rig.cache.check_events()
    assert rig.cache.host_free == 0
    backend.unreachable = False
    rig.clock.now = 1.0  # the probe's back-off is over
    rig.settle()
    assert l3.link.state is Health.HEALTHY
    namespace = rig.cache.namespace_of(None)
    assert backend.exists(namespace, chain_page_hashes(outage, PAGE)) == 0
    reader = Rig(shared)
    op = reader.cache.prefetch(outage)
    assert op is not None
    reader.settle()
    assert reader.cache.prefetch_ready(op) and reader.cache.prefetch_commit(op) == 0
    later = [t + 9300 for t in TOKENS]  # written since, into the outage's old host pages
    assert backend.exists(namespace, chain_page_hashes(later, PAGE)) == 4
    reader.read_back(later, 4)


def test_a_committed_or_aborted_prefetch_is_gone_for_the_scheduler_while_its_read_drains() -> None:
    """After ``prefetch_commit`` or ``prefetch_abort`` of an op whose fetch is still out, a second
    commit, abort or ready is ``MisuseError`` (as for an unknown id), and changes nothing: not the
    slots the read may still write, not the step clock (the model's ``open_op``)."""
    shared = MemoryStore()
    writer = Rig(shared)
    writer.insert(TOKENS)
    writer.settle()
    for first in ("commit", "abort"):
        reader = Rig(shared)
        op = reader.cache.prefetch(TOKENS)
        assert op is not None
        reader.io.run_all()  # the query
        reader.cache.check_events()  # its result: slots reserved, the fetch submitted, not run
        getattr(reader.cache, f"prefetch_{first}")(op)
        before = (reader.cache.clock, reader.cache.prefetch_reserved(), reader.cache.host_free)
        for verb in ("prefetch_ready", "prefetch_commit", "prefetch_abort"):
            with pytest.raises(MisuseError, match="no prefetch op"):
                getattr(reader.cache, verb)(op)
        after = (reader.cache.clock, reader.cache.prefetch_reserved(), reader.cache.host_free)
        assert after == before and before[1] == 4, "the in-flight read keeps its slots"
        reader.settle()  # the read lands and drains the op
        assert reader.cache.prefetch_reserved() == 0 and reader.cache.host_free == 16


def test_a_fetch_refused_because_the_store_went_down_frees_what_it_reserved() -> None:
    """The query found pages, then the link went down before the fetch was issued: the fetch
    is refused, the op completes with nothing, and the host pages (and state slot) it reserved
    are free again, not lost for good (a mutation sweep of impl/l3 found no test of it)."""
    shared = MemoryStore()
    writer = Rig(shared)
    writer.insert(TOKENS)
    writer.settle()
    reader = Rig(shared, backend=UnreachableBackend)
    backend, l3 = reader.backend, reader.cache.l3
    assert isinstance(backend, UnreachableBackend) and l3 is not None
    for offset in (700, 800):  # two backup jobs come first in the queue
        reader.insert([t + offset for t in TOKENS])
        reader.copies.run_all()
        reader.cache.check_events()
    op = reader.cache.prefetch(TOKENS)
    assert op is not None
    free = reader.cache.host_free
    backend.unreachable = True
    assert reader.io.run_next() and reader.io.run_next()  # two backup calls fail
    backend.unreachable = False
    assert reader.io.run_next()  # the query finds all four pages
    reader.cache.check_events()  # two faults: the link is down; the query's fetch is refused
    assert l3.link.state is Health.DOWN
    assert reader.cache.prefetch_ready(op) and reader.cache.prefetch_commit(op) == 0
    assert l3.counters.prefetch_unserved == 1
    assert reader.cache.host_free == free
