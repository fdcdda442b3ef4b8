"""One hybrid cache instance (own pools, real worker threads) over an L3 backend, for the unit tests
of the L3 tier with side pools: it computes and inserts requests (KV, indexer keys and the state at
the end, all bytes named by page hashes), waits for background work, prefetches, and checks what it
serves on L1 bit for bit. Shared by the in-memory and the real-Mooncake tests."""

from __future__ import annotations

import torch

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.pools.side import SideSpec
from kvstrata.impl.storage.base import StorageBackend
from kvstrata.impl.transfer import Executor, ThreadExecutor
from kvstrata.model.keys import PageHash, chain_page_hashes
from support.differential import kv_for, same_bits, side_bytes
from support.settle import settle, settle_until

__all__ = ["HybridRig"]


class HybridRig:
    """A cache of ``shape`` pages with side pools ``indexer`` (ALL_PAGES) and ``mamba``
    (TRAILING_PAGES), 16 pages and 4 state slots per tier, over ``backend``. Waits are events
    (``support.settle``), never deadlines."""

    def __init__(
        self,
        backend: StorageBackend,
        shape: KVShape,
        indexer: SideSpec,
        mamba: SideSpec,
        *,
        layout: HostLayout = HostLayout.PAGE_FIRST,
        storage_executor: Executor | None = None,
        backoff_s: float = 0.0,
    ) -> None:
        self.shape, self.indexer, self.mamba = shape, indexer, mamba
        self.device = DeviceKVPool(shape, 16, "cpu")
        self.host = HostKVPool(shape, 16, layout)
        self.cache = HierarchicalRadixCache.build(
            RadixCacheConfig(
                page_size=shape.page_size,
                side_pools=(indexer.pool, mamba.pool),
                device_states=4,
                host_states=4,
            ),
            self.device,
            self.host,
            executor=ThreadExecutor("test-copies"),
            storage=backend,
            storage_config=StorageConfig(
                prefetch_threshold=shape.page_size, backup_backoff_s=backoff_s
            ),
            storage_executor=storage_executor or ThreadExecutor("test-storage"),
            side_specs=(indexer, mamba),
        )

    def kv(self, pages: tuple[PageHash, ...]) -> torch.Tensor:
        return torch.cat([kv_for(self.shape, page) for page in pages], dim=2)

    def insert(self, tokens: list[int]) -> None:
        """Compute ``tokens`` (KV and indexer keys of new pages, the state at its end) and insert."""
        pages = chain_page_hashes(tokens, self.shape.page_size)
        match = self.cache.match_prefix(tokens)
        fresh = self.cache.alloc_device(len(pages) - match.device_pages)
        new = pages[match.device_pages :]
        group = self.cache.device_group
        assert group is not None
        if len(fresh):
            self.device.write_pages(fresh, self.kv(new))
            parts = [side_bytes(self.indexer, p) for p in new]
            group.side[self.indexer.name].write(
                fresh, [torch.cat(c) for c in zip(*parts, strict=True)]
            )
        slot = self.cache.alloc_device_state()
        group.side[self.mamba.name].write([slot], side_bytes(self.mamba, pages[-1]))
        self.cache.insert(tokens, match.device_indices.tolist() + fresh.tolist(), state_slot=slot)

    def settle(self) -> None:
        """Step the workers until no copy, backup or prefetch is pending (``support.settle``: by
        events; pending work nothing will finish fails at once)."""
        settle(self.cache)

    def prefetch(self, tokens: list[int]) -> int:
        """Prefetch ``tokens``, wait for the read and commit; the pages the tree gained."""
        op = self.cache.prefetch(tokens)
        if op is None:
            return 0
        l3 = self.cache.l3
        assert l3 is not None
        settle_until(
            self.cache,
            lambda: (
                op not in l3.prefetches
                or (l3.prefetches[op].state is not None and not l3.prefetches[op].in_flight)
            ),
            "the prefetch read done",
        )
        return self.cache.prefetch_commit(op) if op in l3.prefetches else 0

    def check_l1(self, tokens: list[int]) -> int:
        """Load the cached prefix to L1 and compare KV, indexer and state bit for bit with what
        the page hashes name; returns the pages on L1."""
        match = self.cache.match_prefix(tokens)
        if match.host_pages:
            assert self.cache.load_back(match.host_node) is not None
            self.settle()
            match = self.cache.match_prefix(tokens)
        n = match.device_pages
        if n:
            pages = chain_page_hashes(tokens, self.shape.page_size)[:n]
            assert same_bits(self.device.read_pages(match.device_indices), self.kv(pages))
            group = self.cache.device_group
            assert group is not None and match.device_state_slot is not None
            wanted = [side_bytes(self.indexer, p) for p in pages]
            read = group.side[self.indexer.name].read(match.device_indices)
            for have, column in zip(read, zip(*wanted, strict=True), strict=True):
                assert same_bits(have, torch.cat(column)), "indexer bytes differ"
            state = group.side[self.mamba.name].read([match.device_state_slot])
            for have, want in zip(state, side_bytes(self.mamba, pages[-1]), strict=True):
                assert same_bits(have, want), "state bytes differ"
        return n

    def close(self) -> None:
        self.cache.close()
