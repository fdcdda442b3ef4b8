"""The cache's L3 tier with side pools (SPEC §5, issue 6) on the in-memory backend: one instance backs
up KV, indexer objects and Mamba states, another (own pools, same store) prefetches them and gets the
same bytes bit for bit; a side object missing from the store cuts the prefetch back to the deepest
usable state; configuration errors are typed. The differential machine
(``HybridL3TierDifferential`` in tests/stateful/test_l3_differential.py) proves agreement with the
model; these tests run the real worker threads end to end."""

from __future__ import annotations

import pytest
import torch
from support.hybrid_rig import HybridRig

from kvstrata.impl.errors import ConfigError
from kvstrata.impl.pools import HostLayout, KVShape
from kvstrata.impl.pools.side import indexer_spec, mamba_spec
from kvstrata.impl.storage.base import StorageBackend
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.transfer import Executor, ManualExecutor
from kvstrata.model.hybrid import side_page_keys
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    chain_page_hashes,
)
from kvstrata.model.lifecycles import Residency

PAGE = 2
SHAPE = KVShape(KVKind.MHA, layers=2, heads=1, head_dim=4, dtype=torch.float16, page_size=PAGE)
INDEXER = indexer_spec(layers=2, page_size=PAGE, dim=3, dtype=torch.float16)
MAMBA = mamba_spec(layers=2, conv=[(3,), (2,)], temporal=(2, 2), dtype=torch.float32)
SPECS = (INDEXER, MAMBA)
KEYS = KeySpace(
    ModelIdentity(name="hybrid-unit", dtype="float16", kind=KVKind.MHA, page_size=PAGE),
    tag="hybrid-unit",
)
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]  # four pages
PAGES = chain_page_hashes(TOKENS, PAGE)


def Rig(
    backend: StorageBackend,
    *,
    layout: HostLayout = HostLayout.PAGE_FIRST,
    storage_executor: Executor | None = None,
) -> HybridRig:
    """One hybrid cache instance (own pools) over ``backend``; worker threads unless told."""
    return HybridRig(
        backend, SHAPE, INDEXER, MAMBA, layout=layout, storage_executor=storage_executor
    )


def back_up(store: MemoryStore) -> None:
    """An instance backs up TOKENS with states at page 1 (a shorter request) and page 3."""
    writer = Rig(MemoryBackend(KEYS, store=store))
    try:
        writer.insert(TOKENS[: 2 * PAGE])
        writer.insert(TOKENS)
        writer.settle()
        l3 = writer.cache.l3
        assert l3 is not None
        assert l3.counters.backup_pages["stored"] == 4
    finally:
        writer.close()


def state_keys(index: int) -> tuple:  # type: ignore[type-arg]
    return side_page_keys(KEYS, DEFAULT_NAMESPACE, MAMBA.pool, PAGES[index])


def test_two_instances_round_trip_kv_indexer_and_state_bit_for_bit() -> None:
    store = MemoryStore()
    back_up(store)
    visible = set(store.visible_keys())
    for index, page in enumerate(PAGES):
        assert set(side_page_keys(KEYS, DEFAULT_NAMESPACE, INDEXER.pool, page)) <= visible
        states = set(state_keys(index))
        assert (states <= visible) == (index in (1, 3)), index
        assert not (states & visible) or states <= visible
    reader = Rig(MemoryBackend(KEYS, store=store))
    try:
        assert reader.prefetch(TOKENS) == 4
        assert reader.cache.state_residency(TOKENS)[-1] is Residency.HOST
        match = reader.cache.match_prefix(TOKENS)
        assert (match.device_pages, match.host_pages) == (0, 4)
        assert reader.check_l1(TOKENS) == 4
    finally:
        reader.close()


@pytest.mark.parametrize(("evicted", "usable"), [(3, 2), (2, 2), (1, 0), (0, 0)])
def test_a_missing_indexer_object_stops_the_prefetch_at_the_deepest_state_below(
    evicted: int, usable: int
) -> None:
    store = MemoryStore()
    back_up(store)
    assert (
        store.drop([side_page_keys(KEYS, DEFAULT_NAMESPACE, INDEXER.pool, PAGES[evicted])[0]]) == 1
    )
    reader = Rig(MemoryBackend(KEYS, store=store))
    try:
        assert reader.prefetch(TOKENS) == usable
        assert reader.cache.match_prefix(TOKENS).host_pages == usable
        assert reader.check_l1(TOKENS) == usable
        assert reader.cache.host_states_free == 4 - (1 if usable else 0)
    finally:
        reader.close()


def test_a_state_lost_between_query_and_read_falls_back_to_a_shallower_state() -> None:
    store = MemoryStore()
    back_up(store)
    io = ManualExecutor()
    reader = Rig(MemoryBackend(KEYS, store=store), storage_executor=io)
    try:
        op = reader.cache.prefetch(TOKENS)
        assert op is not None
        assert io.run_next()  # the query: 4 usable pages, 4 pages and a state slot reserved
        reader.cache.check_events()
        l3 = reader.cache.l3
        assert l3 is not None
        assert len(l3.prefetches[op].host) == 4 and reader.cache.host_states_free == 3
        assert store.drop([state_keys(3)[1]]) == 1  # one component of the deepest state
        assert io.run_next()  # the read: KV and indexer of 4 pages, the state of page 1
        reader.cache.check_events()
        assert l3.prefetches[op].arrived == 2
        assert reader.cache.prefetch_commit(op) == 2
        assert reader.cache.host_free == 16 - 2 and reader.cache.host_states_free == 3
        assert reader.check_l1(TOKENS) == 2
    finally:
        reader.close()


def test_side_pools_with_storage_refuse_a_layer_first_host_pool() -> None:
    with pytest.raises(ConfigError, match="page-first"):
        Rig(MemoryBackend(KEYS, store=MemoryStore()), layout=HostLayout.LAYER_FIRST)


def test_an_abandoned_backup_unpins_its_state_so_l2_can_be_reclaimed() -> None:
    """Every put fails until the backup's retries run out: the op is abandoned, and with it the
    state it carried must be unpinned as well as its pages, or that state's host slot and its
    node's L2 pages could never be freed (a mutation sweep of impl/l3 found no test of it)."""
    backend = MemoryBackend(KEYS, store=MemoryStore())
    backend.fail_next(50, op="put")  # more than every attempt of every put makes
    rig = Rig(backend)
    try:
        rig.insert(TOKENS)
        rig.settle()
        l3 = rig.cache.l3
        assert l3 is not None and l3.counters.backup_abandoned_pages == 4
        assert rig.cache.evict(4) == 4  # demoted to L2
        assert rig.cache.evict_host(4) == 4  # unpinned: L2 can be reclaimed
        assert rig.cache.host_free == 16 and rig.cache.host_states_free == 4
    finally:
        rig.close()
