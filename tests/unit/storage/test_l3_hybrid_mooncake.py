"""The hybrid L3 tier on a real Mooncake master and storage node (the session cluster of
``conftest.py``): one cache instance backs up KV pages, indexer objects and Mamba states, another
(own pools, same store) prefetches them and gets the same bytes bit for bit; a missing indexer
object cuts the prefetch back to the deepest state below it (SPEC §5, issue 6)."""

from __future__ import annotations

import time

import torch
from support.differential import kv_for, same_bits, side_bytes

from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.pools.side import indexer_spec, mamba_spec
from kvstrata.impl.radix_cache import HierarchicalRadixCache
from kvstrata.impl.storage.mooncake import MooncakeBackend, MooncakeClient
from kvstrata.model.hybrid import side_page_keys
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    PageHash,
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


entry = side_bytes  # one side-pool entry of a page: bytes named by the pool and the page hash


def kv(pages: tuple[PageHash, ...]) -> torch.Tensor:
    """The KV of ``pages``: each page's bytes named by its hash (``kv_for``)."""
    return torch.cat([kv_for(SHAPE, page) for page in pages], dim=2)


same = same_bits


class Instance:
    """One scheduler's cache with side pools over the shared client; worker threads."""

    def __init__(self, client: MooncakeClient) -> None:
        self.device = DeviceKVPool(SHAPE, 16, "cpu")
        self.host = HostKVPool(SHAPE, 16, HostLayout.PAGE_FIRST_DIRECT)
        self.cache = HierarchicalRadixCache.build(
            RadixCacheConfig(
                page_size=PAGE,
                side_pools=tuple(spec.pool for spec in SPECS),
                device_states=4,
                host_states=4,
            ),
            self.device,
            self.host,
            storage=MooncakeBackend(client, KEYS),
            storage_config=StorageConfig(prefetch_threshold=PAGE, backup_backoff_s=0.05),
            side_specs=SPECS,
        )

    def insert(self, tokens: list[int]) -> None:
        pages = chain_page_hashes(tokens, PAGE)
        match = self.cache.match_prefix(tokens)
        fresh = self.cache.alloc_device(len(pages) - match.device_pages)
        new = pages[match.device_pages :]
        group = self.cache.device_group
        assert group is not None
        if len(fresh):
            self.device.write_pages(fresh, kv(new))
            parts = [entry(INDEXER, p) for p in new]
            group.side[INDEXER.name].write(fresh, [torch.cat(c) for c in zip(*parts, strict=True)])
        slot = self.cache.alloc_device_state()
        group.side[MAMBA.name].write([slot], entry(MAMBA, pages[-1]))
        self.cache.insert(tokens, match.device_indices.tolist() + fresh.tolist(), state_slot=slot)

    def settle(self, rounds: int = 3000) -> None:
        l3 = self.cache.l3
        assert l3 is not None
        for _ in range(rounds):
            self.cache.check_events()
            if not self.cache.write_ops and not self.cache.load_ops and l3.idle():
                return
            time.sleep(0.01)
        raise AssertionError("background work did not finish")

    def prefetch(self, tokens: list[int], rounds: int = 3000) -> int:
        op = self.cache.prefetch(tokens)
        if op is None:
            return 0
        l3 = self.cache.l3
        assert l3 is not None
        for _ in range(rounds):
            self.cache.check_events()
            if op not in l3.prefetches:
                return 0
            if l3.prefetches[op].state is not None and not l3.prefetches[op].in_flight:
                return self.cache.prefetch_commit(op)
            time.sleep(0.01)
        raise AssertionError("prefetch did not finish")

    def check_l1(self, tokens: list[int]) -> int:
        match = self.cache.match_prefix(tokens)
        if match.host_pages:
            assert self.cache.load_back(match.host_node) is not None
            self.settle()
            match = self.cache.match_prefix(tokens)
        n = match.device_pages
        if n:
            pages = chain_page_hashes(tokens, PAGE)[:n]
            assert same(self.device.read_pages(match.device_indices), kv(pages))
            group = self.cache.device_group
            assert group is not None and match.device_state_slot is not None
            wanted = [entry(INDEXER, p) for p in pages]
            read = group.side[INDEXER.name].read(match.device_indices)
            for have, column in zip(read, zip(*wanted, strict=True), strict=True):
                assert same(have, torch.cat(column)), "indexer bytes differ"
            state = group.side[MAMBA.name].read([match.device_state_slot])
            for have, want in zip(state, entry(MAMBA, pages[-1]), strict=True):
                assert same(have, want), "state bytes differ"
        return n

    def close(self) -> None:
        self.cache.close()


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
