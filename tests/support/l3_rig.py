"""One cache with manual copy and storage executors over a (possibly shared) memory store, and
page bytes that are a pure function of the page hash (the L3 unit tests' rig)."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.transfer import ManualExecutor
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, PageHash, chain_page_hashes

PAGE = 4
SHAPE = KVShape(KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=PAGE)
KEYS = KeySpace(
    ModelIdentity(name="unit", dtype="float16", kind=KVKind.MHA, page_size=PAGE), tag="unit"
)


def kv(page: PageHash) -> torch.Tensor:
    dims = SHAPE.canonical(1)
    raw = hashlib.shake_256(page.digest).digest(int(np.prod(dims)) * SHAPE.itemsize)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(SHAPE.dtype).reshape(dims)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Rig:
    """One cache with manual copy and storage executors over a (possibly shared) memory store."""

    def __init__(
        self,
        store: MemoryStore | None = None,
        config: StorageConfig | None = None,
        host_pages: int = 16,
        backend: type[MemoryBackend] = MemoryBackend,
    ) -> None:
        self.device = DeviceKVPool(SHAPE, 16, "cpu")
        self.host = HostKVPool(SHAPE, host_pages, HostLayout.PAGE_FIRST)
        self.backend = backend(KEYS, store=store if store is not None else MemoryStore())
        self.copies = ManualExecutor()
        self.io = ManualExecutor()
        self.cache = HierarchicalRadixCache.build(
            RadixCacheConfig(page_size=PAGE),
            self.device,
            self.host,
            executor=self.copies,
            storage=self.backend,
            storage_config=config or StorageConfig(prefetch_threshold=PAGE, backup_backoff_s=0),
            storage_executor=self.io,
        )
        self.clock = Clock()
        assert self.cache.l3 is not None
        self.cache.l3._now = self.clock

    def insert(self, tokens: list[int]) -> None:
        pages = chain_page_hashes(tokens, PAGE)
        match = self.cache.match_prefix(tokens)
        fresh = self.cache.alloc_device(len(pages) - match.device_pages)
        if len(fresh):
            kvs = torch.cat([kv(p) for p in pages[match.device_pages :]], dim=2)
            self.device.write_pages(fresh, kvs)
        self.cache.insert(tokens, match.device_indices.tolist() + fresh.tolist())

    def settle(self) -> None:
        """Run every copy and storage job (and the retries they cause) until nothing is pending."""
        for _ in range(100):
            ran = self.copies.run_all() + self.io.run_all()
            self.cache.check_events()
            if not ran and not self.copies.jobs and not self.io.jobs:
                return
        raise AssertionError("jobs keep coming")

    def read_back(self, tokens: list[int], pages: int) -> None:
        """Prefetch ``tokens`` from the store, commit (``pages`` gained), load them back to L1 and
        check the bytes there against the page hashes' KV, bit for bit."""
        op = self.cache.prefetch(tokens)
        assert op is not None
        self.settle()
        assert self.cache.prefetch_commit(op) == pages
        match = self.cache.match_prefix(tokens)
        assert self.cache.load_back(match.host_node) is not None
        self.settle()
        got = self.device.read_pages(self.cache.match_prefix(tokens).device_indices)
        want = torch.cat([kv(p) for p in chain_page_hashes(tokens, PAGE)], dim=2)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "L3 bytes differ"

    @property
    def counters(self):  # type: ignore[no-untyped-def]
        assert self.cache.l3 is not None
        return self.cache.l3.counters
