"""Unit tests of the radix cache with side pools (SPEC §5): an indexer pool (``ALL_PAGES``) and a
Mamba state pool (``TRAILING_PAGES``) on real pools and a real worker thread; states round trip
L1 -> L2 -> L1 bit for bit, ``evict_state`` makes matches report less, configuration errors are
typed, misuse changes nothing."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import pytest
import torch
from support.differential import kv_for, side_bytes
from support.settle import settle_until

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.errors import CapacityError, ConfigError, MisuseError
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.pools.side import indexer_spec, mamba_spec
from kvstrata.impl.transfer import Executor, ManualExecutor, ThreadExecutor
from kvstrata.model.hybrid import HitPolicy, SidePool
from kvstrata.model.keys import KVKind, PageHash, chain_page_hashes
from kvstrata.model.lifecycles import Residency

PAGE = 2
SHAPE = KVShape(KVKind.MHA, layers=2, heads=1, head_dim=4, dtype=torch.float16, page_size=PAGE)
INDEXER = indexer_spec(layers=2, page_size=PAGE, dim=3, dtype=torch.float16)
MAMBA = mamba_spec(layers=2, conv=[(3,), (2,)], temporal=(2, 2), dtype=torch.float32)
SPECS = (INDEXER, MAMBA)
POOLS = tuple(spec.pool for spec in SPECS)
TOKENS = [1, 2, 3, 4, 5, 6]  # three pages


entry = side_bytes  # one side-pool entry of a page: bytes named by the pool and the page hash


def kv(pages: tuple[PageHash, ...]) -> torch.Tensor:
    """The KV of ``pages``: each page's bytes named by its hash (``kv_for``)."""
    return torch.cat([kv_for(SHAPE, page) for page in pages], dim=2)


def build(
    executor: Executor | None = None,
    *,
    host: bool = True,
    device_states: int = 2,
    host_states: int = 2,
) -> HierarchicalRadixCache:
    return HierarchicalRadixCache.build(
        RadixCacheConfig(
            page_size=PAGE,
            side_pools=POOLS,
            device_states=device_states,
            host_states=host_states if host else 0,
        ),
        DeviceKVPool(SHAPE, 8, "cpu"),
        HostKVPool(SHAPE, 8, HostLayout.PAGE_FIRST) if host else None,
        executor=executor if executor is not None else ManualExecutor(),
        side_specs=SPECS,
    )


def serve(cache: HierarchicalRadixCache, tokens: list[int], *, state: bool = True) -> bool:
    """One request: match, compute the missing KV and indexer keys (and the state), insert."""
    assert cache.device_group is not None
    pages = chain_page_hashes(tokens, PAGE)
    result = cache.match_prefix(tokens)
    fresh = cache.alloc_device(len(pages) - result.device_pages)
    if len(fresh):
        new = pages[result.device_pages :]
        cache.device_group.kv.write_pages(fresh, kv(new))
        parts = [entry(INDEXER, p) for p in new]
        cache.device_group.side["indexer"].write(
            fresh, [torch.cat(c) for c in zip(*parts, strict=True)]
        )
    slot = None
    if state:
        slot = cache.alloc_device_state()
        cache.device_group.side["mamba"].write([slot], entry(MAMBA, pages[-1]))
    got = cache.insert(tokens, np.concatenate([result.device_indices, fresh]), state_slot=slot)
    return got.state_kept


def wait_for_copies(cache: HierarchicalRadixCache) -> None:
    """Every copy applied, by events (``support.settle``): copies nothing will finish fail at once."""
    settle_until(cache, lambda: not cache.pending().write and not cache.pending().load, "copies")


def same_bits(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> bool:
    """Every component of ``got`` equals ``want``'s bit for bit."""
    return all(
        torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
        for g, w in zip(got, want, strict=True)
    )


def snapshot(cache: HierarchicalRadixCache) -> tuple[object, ...]:
    return (
        cache.residency(TOKENS),
        cache.state_residency(TOKENS),
        cache.device_free,
        cache.host_free,
        cache.device_states_free,
        cache.host_states_free,
        cache.held_state_slots(),
        cache.pending().write,
        cache.pending().load,
        cache.evictable_pages,
        cache.protected_pages,
    )


def test_state_and_indexer_round_trip_l1_l2_l1_on_a_worker_thread() -> None:
    cache = build(ThreadExecutor())
    group = cache.device_group
    assert group is not None
    pages = chain_page_hashes(TOKENS, PAGE)
    assert serve(cache, TOKENS)
    wait_for_copies(cache)
    assert cache.state_residency(TOKENS) == (None, None, Residency.BOTH)
    assert cache.evict(8) == 3  # demoted: KV and state keep their L2 copies
    assert cache.state_residency(TOKENS) == (None, None, Residency.HOST)
    group.kv.buffer.zero_()  # wipe L1: what comes back must come from L2
    for buffer in group.side.values():
        for tensor in buffer.tensors:
            tensor.zero_()
    result = cache.match_prefix(TOKENS)
    assert (result.device_pages, result.host_pages, result.device_state_slot) == (0, 3, None)
    assert cache.load_back(result.host_node) is not None
    wait_for_copies(cache)
    again = cache.match_prefix(TOKENS)
    assert again.device_pages == 3 and again.device_state_slot is not None
    assert same_bits(group.side["mamba"].read([again.device_state_slot]), entry(MAMBA, pages[-1]))
    want = [torch.cat(c) for c in zip(*[entry(INDEXER, p) for p in pages], strict=True)]
    assert same_bits(group.side["indexer"].read(again.device_indices), want)
    assert same_bits((group.kv.read_pages(again.device_indices),), [kv(pages)])
    cache.close()


def test_match_is_cut_back_to_the_deepest_node_end_with_a_state() -> None:
    cache = build(host=False)
    assert serve(cache, TOKENS[:2])  # a state after page 1
    assert not serve(cache, TOKENS, state=False)  # pages 2-3 without a state
    result = cache.match_prefix(TOKENS)
    assert result.device_pages == 1 and result.device_state_slot is not None
    assert cache.state_residency(TOKENS) == (Residency.DEVICE, None, None)


def test_evict_state_makes_match_report_less() -> None:
    executor = ManualExecutor()
    cache = build(executor)
    assert serve(cache, TOKENS)
    executor.run_all()
    cache.check_events()
    node = cache.match_prefix(TOKENS).device_node
    cache.evict_state(node)  # L1 copy dropped: the L2 one still serves a load-back
    result = cache.match_prefix(TOKENS)
    assert (result.device_pages, result.host_pages, result.device_state_slot) == (0, 3, None)
    cache.evict_state(node, host=True)  # no copy left: nothing usable
    result = cache.match_prefix(TOKENS)
    assert (result.device_pages, result.host_pages) == (0, 0)
    assert cache.state_residency(TOKENS) == (None, None, None)
    assert (cache.device_states_free, cache.host_states_free) == (2, 2)


def test_a_state_only_load_ignores_the_threshold_and_brings_the_state_back() -> None:
    executor = ManualExecutor()
    cache = build(executor)
    assert serve(cache, TOKENS)
    executor.run_all()
    cache.check_events()
    node = cache.match_prefix(TOKENS).device_node
    cache.evict_state(node)
    assert cache.load_back(node) is not None
    assert cache.state_residency(TOKENS)[-1] is Residency.LOADING
    executor.run_all()
    cache.check_events()
    assert cache.match_prefix(TOKENS).device_pages == 3


def test_a_failed_state_copy_gives_its_slot_back() -> None:
    executor = ManualExecutor()
    cache = build(executor)
    assert cache.transfer is not None
    transfer = cache.transfer

    def broken(*_args: object) -> int:
        raise RuntimeError("injected")

    transfer._side_copy = broken
    assert serve(cache, TOKENS)
    assert cache.host_states_free == 1
    executor.run_all()
    cache.check_events()
    assert cache.host_states_free == 2 and cache.host_free == 8
    assert cache.state_residency(TOKENS)[-1] is Residency.DEVICE


def test_state_slots_run_out_only_when_every_state_is_in_use() -> None:
    cache = build(host=False, device_states=1)
    slot = cache.alloc_device_state()
    with pytest.raises(CapacityError):
        cache.alloc_device_state()  # the only slot is the scheduler's
    cache.free_device_state(slot)
    assert serve(cache, TOKENS)
    node = cache.match_prefix(TOKENS).device_node
    cache.lock(node)
    with pytest.raises(CapacityError):
        cache.alloc_device_state()  # the state of a locked node is not dropped
    cache.unlock(node)
    assert cache.alloc_device_state() == slot  # the LRU idle L1 state is dropped
    assert cache.state_residency(TOKENS) == (None, None, None)


def test_misuse_raises_typed_errors_and_changes_nothing() -> None:
    cache = build()
    serve(cache, TOKENS[:2], state=False)
    assert serve(cache, TOKENS[:4])
    node = cache.match_prefix(TOKENS[:4]).device_node
    assert node.parent is not None
    stateless = node.parent
    before = snapshot(cache)
    calls = [
        lambda: cache.insert(TOKENS[:2], [0], state_slot=1),  # a slot the scheduler does not hold
        lambda: cache.insert([], [], state_slot=0),
        lambda: cache.free_device_state(1),
        lambda: cache.evict_state(stateless),  # a node with no state
        lambda: cache.evict_state(node, host=True),  # WRITING: being copied
    ]
    for call in calls:
        with pytest.raises(MisuseError):
            call()
        assert snapshot(cache) == before
    cache.lock(node)
    before = snapshot(cache)
    with pytest.raises(MisuseError):
        cache.evict_state(node)
    assert snapshot(cache) == before


def test_a_cache_without_states_refuses_state_calls() -> None:
    cache = HierarchicalRadixCache.build(
        RadixCacheConfig(page_size=PAGE), DeviceKVPool(SHAPE, 4, "cpu")
    )
    with pytest.raises(MisuseError):
        cache.alloc_device_state()
    with pytest.raises(MisuseError):
        cache.insert(TOKENS[:2], cache.alloc_device(1), state_slot=0)
    result = cache.match_prefix(TOKENS)
    assert result.device_state_slot is None and cache.device_group is None


MAMBA_POOL = SidePool("mamba", HitPolicy.TRAILING_PAGES, ("conv_0", "temporal"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"side_pools": (MAMBA_POOL,)}, "device_states"),
        ({"device_states": 2}, "TRAILING_PAGES"),
        ({"host_states": 1}, "TRAILING_PAGES"),
        ({"side_pools": (MAMBA_POOL, MAMBA_POOL), "device_states": 1}, "distinct"),
        ({"side_pools": MAMBA_POOL, "device_states": 1}, "one SidePool"),
        ({"side_pools": ("mamba",), "device_states": 1}, "SidePool"),
        ({"side_pools": (MAMBA_POOL,), "device_states": -1}, "device_states"),
    ],
)
def test_config_validation(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RadixCacheConfig(page_size=PAGE, **fields)  # type: ignore[arg-type]


def test_build_validation() -> None:
    device = DeviceKVPool(SHAPE, 4, "cpu")
    host = HostKVPool(SHAPE, 4, HostLayout.PAGE_FIRST)
    config = RadixCacheConfig(page_size=PAGE, side_pools=POOLS, device_states=1, host_states=1)
    with pytest.raises(ConfigError, match="side_specs"):
        HierarchicalRadixCache.build(config, device, host, side_specs=(MAMBA,))
    with pytest.raises(ConfigError, match="host_states"):
        HierarchicalRadixCache.build(config, device, None, side_specs=SPECS)
    no_l2_states = RadixCacheConfig(page_size=PAGE, side_pools=POOLS, device_states=1)
    with pytest.raises(ConfigError, match="host_states"):
        HierarchicalRadixCache.build(no_l2_states, device, host, side_specs=SPECS)
    # a config may list the pools without the layout their specs fill in; never another layout
    bare = tuple(attrs.evolve(pool, layout="") for pool in POOLS)
    assert all(not pool.layout for pool in bare) and bare != POOLS
    bare_config = RadixCacheConfig(page_size=PAGE, side_pools=bare, device_states=1, host_states=1)
    assert HierarchicalRadixCache.build(bare_config, device, host, side_specs=SPECS).device_group
    other = (POOLS[0], attrs.evolve(POOLS[1], layout="0" * 16))
    other_config = attrs.evolve(bare_config, side_pools=other)
    with pytest.raises(ConfigError, match="side_specs"):
        HierarchicalRadixCache.build(other_config, device, host, side_specs=SPECS)
    with pytest.raises(ConfigError, match="side_specs"):
        HierarchicalRadixCache.build(config, device, host, side_specs=(MAMBA, INDEXER))
    # side pools with an L3 backend: tests/unit/impl/test_l3_hybrid.py (layer_first refused there)


def test_several_trailing_pools_share_one_state_slot() -> None:
    """Two ``TRAILING_PAGES`` pools: one state slot is the same entry of both, allocated in
    lockstep, and a write-through moves both."""
    second = mamba_spec(layers=1, conv=[(2,)], temporal=(3,), dtype=torch.float16, name="linear")
    specs = (MAMBA, second)
    executor = ManualExecutor()
    cache = HierarchicalRadixCache.build(
        RadixCacheConfig(
            page_size=PAGE,
            side_pools=tuple(s.pool for s in specs),
            device_states=2,
            host_states=2,
        ),
        DeviceKVPool(SHAPE, 8, "cpu"),
        HostKVPool(SHAPE, 8, HostLayout.PAGE_FIRST),
        executor=executor,
        side_specs=specs,
    )
    assert cache.device_group is not None and cache.host_group is not None
    page = chain_page_hashes(TOKENS[:2], PAGE)[0]
    fresh = cache.alloc_device(1)
    cache.device_group.kv.write_pages(fresh, kv((page,)))
    slot = cache.alloc_device_state()
    for spec in specs:
        cache.device_group.side[spec.name].write([slot], entry(spec, page))
    assert cache.insert(TOKENS[:2], fresh, state_slot=slot).state_kept
    executor.run_all()
    cache.check_events()
    assert cache.state_residency(TOKENS[:2]) == (Residency.BOTH,)
    assert cache.host_group.free_counts() == {"kv": 7, "mamba": 1, "linear": 1}
    for spec in specs:  # the state's host slot is the lowest one: 0 in both pools
        assert same_bits(cache.host_group.side[spec.name].read([0]), entry(spec, page))
