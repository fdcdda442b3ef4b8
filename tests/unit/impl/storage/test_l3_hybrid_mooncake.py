"""The hybrid L3 tier on a real Mooncake master and storage node (the session cluster of
``conftest.py``): one cache instance backs up KV pages, indexer objects and Mamba states, another
(own pools, same store) prefetches them and gets the same bytes bit for bit; a missing indexer
object cuts the prefetch back to the deepest state below it (SPEC §5, issue 6). Deployments whose
Mamba states have the same size but another dtype share the KV pages and never each other's
states (the side pool's layout is in its keys)."""

from __future__ import annotations

import torch
from support.hybrid_rig import HybridRig

from kvstrata.impl.pools import HostLayout, KVShape
from kvstrata.impl.pools.side import SideSpec, indexer_spec, mamba_spec
from kvstrata.impl.storage.mooncake import MooncakeBackend, MooncakeClient
from kvstrata.model.hybrid import side_page_keys
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    chain_page_hashes,
)

PAGE = 4
SHAPE = KVShape(KVKind.MHA, layers=2, heads=2, head_dim=8, dtype=torch.float16, page_size=PAGE)
INDEXER = indexer_spec(layers=2, page_size=PAGE, dim=8, dtype=torch.bfloat16)
MAMBA = mamba_spec(layers=2, conv=[(4, 3)], temporal=(2, 8), dtype=[torch.float16, torch.float32])
SPECS = (INDEXER, MAMBA)
KEYS = KeySpace(
    ModelIdentity(name="hybrid-mc", dtype="float16", kind=KVKind.MHA, page_size=PAGE),
    tag="hybridmc",
)
TOKENS = list(range(1, 4 * PAGE + 1))  # four pages
PAGES = chain_page_hashes(TOKENS, PAGE)


def Instance(client: MooncakeClient, mamba: SideSpec = MAMBA) -> HybridRig:
    """One scheduler's cache with side pools over the shared client; worker threads."""
    return HybridRig(
        MooncakeBackend(client, KEYS),
        SHAPE,
        INDEXER,
        mamba,
        layout=HostLayout.PAGE_FIRST_DIRECT,
        backoff_s=0.05,
    )


def test_hybrid_round_trip_between_two_instances_on_mooncake(
    mooncake_store: MooncakeClient,
) -> None:
    writer = Instance(mooncake_store)
    try:
        writer.insert(TOKENS[: 2 * PAGE])  # a state at page 1
        writer.insert(TOKENS)  # and at page 3
        writer.settle()
        l3 = writer.cache.l3
        assert l3 is not None
        assert l3.counters.backup_pages["stored"] == 4
    finally:
        writer.close()
    reader = Instance(mooncake_store)
    try:
        assert reader.prefetch(TOKENS) == 4
        assert reader.check_l1(TOKENS) == 4
    finally:
        reader.close()
    # the store loses the indexer object of page 3: the prefetch stops at the state of page 1
    indexer_key = side_page_keys(KEYS, DEFAULT_NAMESPACE, INDEXER.pool, PAGES[3])[0]
    assert mooncake_store.batch_remove([indexer_key], force=True) == [0]
    again = Instance(mooncake_store)
    try:
        assert again.prefetch(TOKENS) == 2
        assert again.check_l1(TOKENS) == 2
    finally:
        again.close()


def test_states_of_another_layout_are_never_read_on_mooncake(
    mooncake_store: MooncakeClient,
) -> None:
    """One deployment keeps its Mamba conv state in float16, another in bfloat16 (the same size,
    other bytes for the same state). They share the KV and indexer objects, and each reads back only
    its own states: before the layout was in the keys, the second found the first's state objects
    (the store keeps a key's first bytes, so its own backup changed nothing) and served their bytes
    as its own."""
    other = mamba_spec(
        layers=2, conv=[(4, 3)], temporal=(2, 8), dtype=[torch.bfloat16, torch.float32]
    )
    assert other.bytes_per_entry == MAMBA.bytes_per_entry
    assert other.pool.layout != MAMBA.pool.layout
    tokens = [t + 1000 for t in TOKENS]  # pages no other test of this session writes
    writer = Instance(mooncake_store)
    try:
        writer.insert(tokens)
        writer.settle()
    finally:
        writer.close()
    stranger = Instance(mooncake_store, other)
    try:
        assert stranger.prefetch(tokens) == 0  # the KV is there, a state in its layout is not
        stranger.insert(tokens)
        stranger.settle()
    finally:
        stranger.close()
    pages = chain_page_hashes(tokens, PAGE)
    states = [side_page_keys(KEYS, DEFAULT_NAMESPACE, m.pool, pages[3]) for m in (MAMBA, other)]
    assert not set(states[0]) & set(states[1])
    assert mooncake_store.batch_is_exist([*states[0], *states[1]]) == [1, 1, 1, 1]
    for mamba in (MAMBA, other):
        reader = Instance(mooncake_store, mamba)
        try:
            assert reader.prefetch(tokens) == 4
            assert reader.check_l1(tokens) == 4  # the state bytes of its own layout
        finally:
            reader.close()
