"""The engine-independent half of the sglang backend (kvstrata/integrations): options, page runs,
hybrid hit rules and stats, on kvstrata's own backends. tests/engines/sglang drives the same code
through sglang's real types."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import pytest
import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import KVShape
from kvstrata.impl.storage.memory import MemoryStore
from kvstrata.integrations.hicache import HiCachePages, PoolAsk, side_detail
from kvstrata.integrations.store import StoreOptions
from kvstrata.model.engines import EngineShard, HashScheme
from kvstrata.model.hybrid import HitPolicy
from kvstrata.model.keys import KVKind

PAGE = 4
SHAPE = KVShape(KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float32, page_size=PAGE)
SHARD = EngineShard(HashScheme.SGLANG, "org/model", "float32", mla=False, page_size=PAGE)


def keys(n: int, seed: str = "") -> list[str]:
    return [hashlib.sha256(f"{seed}{i}".encode()).hexdigest() for i in range(n)]


def runs(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def pages_on(store: MemoryStore, shard: EngineShard = SHARD) -> HiCachePages:
    return pages_with(
        StoreOptions.parse({"store": "memory", "memory_store": store}, where="t"), shard
    )


def pages_with(options: StoreOptions, shard: EngineShard = SHARD) -> HiCachePages:
    host = HostKVPool(SHAPE, 8, "page_first_direct")
    host.buffer.copy_(torch.randn(host.buffer.shape))
    return HiCachePages(shard, options, host)


def test_options_name_the_bad_key(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="'colour'"):
        StoreOptions.parse({"colour": "red"}, where="t")
    with pytest.raises(ConfigError, match="'path'"):
        StoreOptions.parse({"store": "file"}, where="t")
    with pytest.raises(ConfigError, match="master"):
        StoreOptions.parse({"store": "mooncake"}, where="t", env={})
    parsed = StoreOptions.parse(
        {"backend_name": "kvstrata", "interface_v1": 1, "tag": "prod"},
        where="t",
        env={"KVSTRATA_MOONCAKE_MASTER": "127.0.0.1:5"},
    )
    assert parsed.store == "mooncake" and parsed.mooncake is not None
    assert parsed.mooncake.master == "127.0.0.1:5" and parsed.tag == "prod"
    over = StoreOptions.parse(
        {"master": "10.0.0.1:7", "mooncake": {"protocol": "tcp"}}, where="t", env={}
    )
    assert over.mooncake is not None and over.mooncake.master == "10.0.0.1:7"
    with pytest.raises(ConfigError, match="mooncake"):
        StoreOptions.parse({"master": "10.0.0.1:7", "mooncake": {"colour": 1}}, where="t", env={})
    assert StoreOptions.parse({"store": "memory"}, where="t").key_schema == 1
    assert StoreOptions.parse({"store": "memory", "key_schema": "2"}, where="t").key_schema == 2
    for bad in (3, True, "one"):
        with pytest.raises(ConfigError, match="'key_schema' expects 1 or 2"):
            StoreOptions.parse({"store": "memory", "key_schema": bad}, where="t")


def test_pages_round_trip_and_stop_at_the_first_miss() -> None:
    store = MemoryStore()
    a, b = pages_on(store), pages_on(store)
    chain = keys(3)
    assert a.set([chain[0], chain[2]], runs([1, 2])) == [True, True]
    assert b.exists(chain) == 1
    assert b.get(chain, runs([5, 6, 7])) == [True, False, False]
    assert torch.equal(b.host.read_pages([5]), a.host.read_pages([1]))
    assert b.drain_stats().prefetch_pages == [1] and b.drain_stats().prefetch_pages == []


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        (runs([0, 1]) + 1, "aligned"),
        (runs([0, 1]).flip(0), "aligned"),
        (runs([0]), "host slots"),
        (runs([0, 1]).float(), "integer"),
    ],
)
def test_bad_page_runs_are_refused_before_any_io(indices: torch.Tensor, match: str) -> None:
    store = MemoryStore()
    pages = pages_on(store)
    with pytest.raises(MisuseError, match=match):
        pages.set(keys(2), indices)
    assert pages.exists(keys(2)) == 0


def test_a_file_store_shares_pages_between_instances(tmp_path: Path) -> None:
    options = StoreOptions.parse({"store": "file", "path": str(tmp_path)}, where="t")
    hosts = [HostKVPool(SHAPE, 4, "page_first") for _ in range(2)]
    hosts[0].buffer.copy_(torch.randn(hosts[0].buffer.shape))
    a, b = (HiCachePages(SHARD, options, host) for host in hosts)
    assert a.set(keys(2), runs([0, 3])) == [True, True]
    assert b.get(keys(2), runs([1, 2])) == [True, True]
    assert torch.equal(b.host.read_pages([1, 2]), a.host.read_pages([0, 3]))


class Flat:
    """Entries of one side pool as an engine exposes them: flat tensors by index."""

    def __init__(self, count: int, width: int = 3) -> None:
        self.data = torch.randn(count, width)

    def read(self, index: int) -> torch.Tensor:
        return self.data[index]

    def write(self, index: int, flat: torch.Tensor) -> None:
        self.data[index] = flat.view(torch.float32)


@pytest.mark.parametrize(
    ("state_pages", "window", "restorable"),
    [
        ({3}, 1, [4]),  # the state at the last page: the whole prefix
        ({1}, 1, [2]),  # a state that ends at page 1: a prefix of 2
        ({0, 1, 3}, 2, [1, 2]),  # a window of 2 needs pages 2 and 3 for a prefix of 4
        ({2, 3}, 2, [4]),
        (set(), 1, []),
    ],
)
def test_hybrid_exists_applies_the_hit_rules(
    state_pages: set[int], window: int, restorable: list[int]
) -> None:
    store = MemoryStore()
    a, b = pages_on(store), pages_on(store)
    chain = keys(4, "hybrid")
    a_states, b_states, indexer = Flat(4), Flat(4), Flat(8, width=2)
    for pages, pool in ((a, a_states), (b, b_states)):
        pages.attach_side("mamba", 12, pool.read, pool.write)
        pages.attach_side("indexer", 8, indexer.read, indexer.write)
    assert a.set(chain, runs([0, 1, 2, 3])) == [True] * 4
    assert a.set_side("indexer", chain, [0, 1, 2, 3]) == [True] * 4
    positions = sorted(state_pages)
    assert a.set_side("mamba", [chain[p] for p in positions], positions) == [True] * len(positions)
    hit = b.exists_v2(
        chain,
        [
            PoolAsk("indexer", HitPolicy.ALL_PAGES),
            PoolAsk("mamba", HitPolicy.TRAILING_PAGES, window),
        ],
    )
    assert hit.restorable == restorable and hit.kv_hit == (restorable[-1] if restorable else 0)
    if restorable:
        last = restorable[-1] - 1
        assert b.get_side("mamba", [chain[last]], [2]) == [True]
        assert torch.equal(b_states.data[2], a_states.data[last])


def test_side_pools_are_never_asked_beyond_the_kv_hit() -> None:
    store = MemoryStore()
    a, b = pages_on(store), pages_on(store)
    chain = keys(3, "beyond")
    states = Flat(4)
    for pages in (a, b):
        pages.attach_side("mamba", 12, states.read, states.write)
    a.set(chain[:1], runs([0]))
    a.set_side("mamba", chain, [0, 1, 2])  # states exist for all three pages, KV for the first only
    hit = b.exists_v2(chain, [PoolAsk("mamba", HitPolicy.TRAILING_PAGES)])
    assert (hit.kv_hit, hit.restorable) == (1, [1])


class MambaHost:
    """The attributes of sglang's ``MambaPoolHost`` that :func:`side_detail` reads."""

    def __init__(self, temporal: torch.dtype) -> None:
        self.conv_dtype = torch.bfloat16
        self.temporal_dtype = temporal
        self.dtype = self.conv_dtype
        self.conv_state_shapes = [torch.Size([3, 4])]
        self.temporal_state_shape = torch.Size([2, 2])
        self.page_size = 1  # not a layout fact: left out


class KVHost:
    """A KV-shaped side pool (sglang's SWA pool): its flat page's order follows its ``layout``."""

    def __init__(self, layout: str) -> None:
        self.dtype = torch.bfloat16
        self.layout = layout


def test_side_entries_of_another_engine_dtype_are_never_read() -> None:
    """Two deployments whose flat side entries have the same size but another SSM dtype
    (sglang's ``--mamba-ssm-dtype`` bfloat16 against float16) share the KV and never each
    other's states: the detail (the host pool's dtypes) is part of the side pool's keys."""
    flat = torch.empty(0, dtype=torch.uint8)
    bf16, fp16 = (
        side_detail(MambaHost(torch.bfloat16), flat),
        side_detail(MambaHost(torch.float16), flat),
    )
    assert bf16 == (
        "MambaHost;flat=torch.uint8;dtype=torch.bfloat16;conv_dtype=torch.bfloat16;"
        "temporal_dtype=torch.bfloat16;conv_state_shapes=((3,4));temporal_state_shape=(2,2)"
    )
    assert bf16 != fp16
    assert side_detail(KVHost("page_first"), flat) != side_detail(KVHost("layer_first"), flat)
    store = MemoryStore()
    a, b, a_again = pages_on(store), pages_on(store), pages_on(store)
    chain = keys(2, "ssm-dtype")
    a_states, b_states, read_back = Flat(4), Flat(4), Flat(4)
    a.attach_side("mamba", 12, a_states.read, a_states.write, detail=bf16)
    b.attach_side("mamba", 12, b_states.read, b_states.write, detail=fp16)
    a_again.attach_side("mamba", 12, read_back.read, read_back.write, detail=bf16)
    assert a.set(chain, runs([0, 1])) == [True, True]
    assert a.set_side("mamba", chain[1:], [1]) == [True]
    ask = [PoolAsk("mamba", HitPolicy.TRAILING_PAGES)]
    assert b.exists_v2(chain, ask).restorable == []  # the KV is there, its state is not
    assert b.get_side("mamba", chain[1:], [0]) == [False]
    assert a_again.exists_v2(chain, ask).restorable == [2]
    assert a_again.get_side("mamba", chain[1:], [3]) == [True]
    assert torch.equal(read_back.data[3], a_states.data[1])
    a.attach_side("mamba", 12, a_states.read, a_states.write, detail=bf16)  # the same: a no-op
    with pytest.raises(MisuseError, match="another layout"):
        a.attach_side("mamba", 12, a_states.read, a_states.write, detail=fp16)
    with pytest.raises(MisuseError, match="another layout"):
        a.attach_side("mamba", 16, a_states.read, a_states.write, detail=bf16)
    assert a.get_side("mamba", chain[1:], [2]) == [True]  # the first registration still serves


def test_side_pools_without_a_reachable_master_store_nothing_and_never_raise() -> None:
    """An unreachable master at attach means no L3 and no exception to sglang, for the hybrid
    side pools as for KV (the review's find of 2026-11-28: they raised "not registered")."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options = StoreOptions.parse(
        {"store": "mooncake", "master": f"127.0.0.1:{port}", "mooncake": {"setup_retries": 1}},
        where="t",
        env={},
    )
    pages = HiCachePages(SHARD, options, HostKVPool(SHAPE, 8, "page_first_direct"))
    assert pages.backend is None
    states = Flat(4)
    pages.attach_side("mamba", 12, states.read, states.write)
    chain = keys(2, "no-store")
    assert pages.set_side("mamba", chain, [0, 1]) == [False, False]
    assert pages.get_side("mamba", chain, [0, 1]) == [False, False]
    assert pages.exists_v2(chain, [PoolAsk("mamba", HitPolicy.TRAILING_PAGES)]).kv_hit == 0
    with pytest.raises(MisuseError):  # the arguments are still checked
        pages.set_side("mamba", chain, [0])


def test_every_backend_of_one_memory_options_shares_one_store() -> None:
    """sglang's page path and flat path open a backend each from one options object: with
    ``"store": "memory"`` they must see each other's pages (the review's find of 2026-11-28:
    each made a store of its own, so the legacy path's pages were never found)."""
    options = StoreOptions.parse({"store": "memory", "capacity": "1MiB"}, where="t")
    a, b = pages_with(options), pages_with(options)
    chain = keys(2, "shared-memory")
    assert a.set(chain, runs([0, 1])) == [True, True]
    assert b.exists(chain) == 2
    assert options.memory_store is not None and options.memory_store.capacity_bytes == 1 << 20
