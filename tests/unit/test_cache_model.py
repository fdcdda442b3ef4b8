"""Scenario tests of the cache model: each names one rule of SPEC §3/§4 and checks it directly."""

from __future__ import annotations

import pytest

from kvstrata.model.cache import CacheConfig, CacheModel, WritePolicy
from kvstrata.model.errors import CapacityError, MisuseError
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    chain_page_hashes,
)
from kvstrata.model.lifecycles import PrefetchState, Residency
from kvstrata.model.prefetch import PrefetchPolicy, PrefetchTimeout
from kvstrata.model.store import StoreModel

KEYS = KeySpace(ModelIdentity("tiny", "bf16", KVKind.MHA, page_size=1))
B, H, W, D = Residency.BOTH, Residency.HOST, Residency.WRITING, Residency.DEVICE


def make(store: StoreModel | None = None, **overrides: object) -> CacheModel:
    config: dict[str, object] = {
        "page_size": 1,
        "device_pages": 8,
        "host_pages": 8,
        "keys": KEYS,
        "prefetch_threshold": 1,
    }
    config.update(overrides)
    return CacheModel(CacheConfig(**config), StoreModel() if store is None else store)  # type: ignore[arg-type]


def request(cache: CacheModel, tokens: tuple[int, ...], ns: Namespace = DEFAULT_NAMESPACE) -> None:
    """The scheduler protocol: match, lock, allocate the rest, compute, insert, unlock."""
    result = cache.match(tokens, ns)
    pages = chain_page_hashes(tokens, cache.page_size, ns)
    fresh = cache.alloc_device(len(pages) - result.device_pages)
    for slot, page in zip(fresh, pages[result.device_pages :], strict=True):
        cache.write_device(slot, page)
    cache.insert(tokens, ns, result.device_slots + fresh)


def drain(cache: CacheModel) -> None:
    while cache.write_ops:
        cache.ack_write()
    while cache.backup_ops:
        cache.start_backup()
        cache.ack_backup()


def test_split_while_write_through_in_flight_keeps_coverage() -> None:
    """The lost-split scenario: the prefix of a node split during its write-through still reaches L2
    and L3 (I4)."""
    cache = make()
    request(cache, (1, 2, 3, 4))
    assert cache.residency((1, 2, 3, 4)) == (W, W, W, W)
    cache.match((1, 2, 9))  # splits the node after two pages while the copy is in flight
    assert len(cache.tree.nodes) == 3
    drain(cache)
    assert cache.residency((1, 2, 3, 4)) == (B, B, B, B)
    assert cache.l3_exists((1, 2, 3, 4)) == 4


def test_write_policies() -> None:
    through = make(write_policy=WritePolicy.WRITE_THROUGH)
    request(through, (1, 2))
    assert through.residency((1, 2)) == (W, W)

    selective = make(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, write_through_threshold=2)
    request(selective, (1, 2))
    assert selective.residency((1, 2)) == (D, D)
    selective.match((1, 2))
    selective.match((1, 2))
    assert selective.residency((1, 2)) == (W, W)

    back = make(write_policy=WritePolicy.WRITE_BACK, device_pages=2)
    request(back, (1, 2))
    assert back.residency((1, 2)) == (D, D)
    back.evict_device(2)
    assert back.residency((1, 2)) == (H, H)  # staged to L2 on eviction
    assert back.host_content([back.page_info[p].host_slot for p in chain_page_hashes((1, 2), 1)])  # type: ignore[misc]


def test_eviction_demotes_or_deletes_and_respects_locks() -> None:
    cache = make(host_pages=0)
    request(cache, (1, 2))
    node = cache.match((1, 2)).device_node
    cache.lock(node)
    assert cache.evict_device(8) == 0
    cache.unlock(node)
    assert cache.evict_device(1) == 2  # a whole leaf goes
    assert cache.residency((1, 2)) == ()
    with pytest.raises(MisuseError):
        cache.unlock(node)


def test_load_back_is_all_or_nothing_and_pinned_until_ack() -> None:
    cache = make(device_pages=4, load_back_quota=3)
    request(cache, (1, 2, 3, 4))
    drain(cache)
    cache.evict_device(4)
    assert cache.residency((1, 2, 3, 4)) == (H, H, H, H)
    host_node = cache.match((1, 2, 3, 4)).host_node
    assert cache.load_back(host_node) is None  # 4 pages > quota 3: nothing moves
    assert cache.residency((1, 2, 3, 4)) == (H, H, H, H)
    cache.match((1, 2, 3))  # split so that a chain of 3 fits the quota
    assert cache.load_back(cache.match((1, 2, 3)).host_node) is not None
    assert cache.evict_host(8) == 1  # only the unloaded last page can go
    cache.ack_load()
    assert cache.match((1, 2, 3)).device_pages == 3


def test_prefetch_from_another_instance_commit_and_drain() -> None:
    store = StoreModel()
    writer, reader = make(store=store), make(store=store)
    request(writer, (1, 2, 3, 4))
    drain(writer)
    op = reader.prefetch((1, 2, 3, 4))
    assert op is not None
    reader.prefetch_arrive(op, 2)
    assert reader.prefetch_commit(op) == 2  # best effort: what arrived
    assert reader.prefetch_ops[op].state is PrefetchState.CANCELLING  # pages 3-4 still in flight
    held = reader.host.used_count
    reader.prefetch_drain(op)
    assert reader.host.used_count == held - 2
    assert reader.residency((1, 2, 3, 4)) == (H, H)
    with pytest.raises(MisuseError):
        reader.prefetch_drain(op)


def test_prefetch_policies_and_rate_limit() -> None:
    store = StoreModel()
    writer = make(store=store, device_pages=16, host_pages=16)
    request(writer, tuple(range(1, 9)))
    drain(writer)
    timeout = make(
        store=store,
        host_pages=8,
        prefetch_policy=PrefetchPolicy.TIMEOUT,
        prefetch_timeout=PrefetchTimeout(base=3, per_1k_tokens=0, cap=3),
    )
    assert timeout.prefetch(tuple(range(1, 9))) is None  # 8 pages > half of L2
    op = timeout.prefetch(tuple(range(1, 5)))
    assert op is not None and not timeout.prefetch_ready(op)
    timeout.tick(3)
    assert timeout.prefetch_ready(op)
    timeout.prefetch_abort(op)
    timeout.prefetch_drain(op)
    assert timeout.host.used_count == 0 and not timeout.prefetch_ops


def test_store_eviction_ends_a_prefetch_early() -> None:
    store = StoreModel()
    writer, reader = make(store=store), make(store=store)
    request(writer, (1, 2, 3))
    drain(writer)
    op = reader.prefetch((1, 2, 3))
    assert op is not None
    third = KEYS.page_keys(DEFAULT_NAMESPACE, chain_page_hashes((1, 2, 3), 1)[2])[1]
    reader.store_evict(third)
    assert reader.prefetch_arrive(op, 3) == 2
    assert reader.prefetch_ops[op].state is PrefetchState.COMPLETE
    assert reader.prefetch_commit(op) == 2


def test_backup_retries_when_another_writers_put_did_not_complete() -> None:
    store = StoreModel()
    a, b = make(store=store), make(store=store)
    request(a, (1,))
    request(b, (1,))
    a.ack_write()
    b.ack_write()
    a.start_backup()  # a begins the puts
    b.start_backup()  # b finds them in flight: nothing to write
    assert b.ack_backup() == 0  # not visible yet: b queues the page again
    a.fail_backup()  # a's puts are aborted
    b.start_backup()
    assert b.ack_backup() == 1
    assert b.l3_exists((1,)) == 1


def test_namespaces_never_share_pages_or_keys() -> None:
    cache = make()
    request(cache, (1, 2), Namespace(extra_key="tenant-a"))
    drain(cache)
    assert cache.match((1, 2)).device_pages == 0
    assert cache.l3_exists((1, 2)) == 0
    assert cache.l3_exists((1, 2), Namespace(extra_key="tenant-a")) == 2


def test_bad_input_is_rejected_without_change() -> None:
    cache = make(device_pages=2)
    request(cache, (1, 2))
    before = (repr(cache.page_info), cache.clock, cache.device.allocated())
    with pytest.raises(MisuseError):
        cache.insert((1, 2, 3), DEFAULT_NAMESPACE, (0,))  # wrong slot count
    with pytest.raises(MisuseError):
        cache.insert(["a"])  # type: ignore[list-item]
    with pytest.raises(MisuseError):
        cache.free_device((0,))  # the tree's slot, not the scheduler's
    with pytest.raises(MisuseError):
        cache.prefetch_drain(1)  # no such op
    assert (repr(cache.page_info), cache.clock, cache.device.allocated()) == before
    cache.lock(cache.match((1, 2)).device_node)
    with pytest.raises(CapacityError):
        cache.alloc_device(1)
    with pytest.raises(MisuseError):
        CacheConfig(page_size=0, device_pages=1)
