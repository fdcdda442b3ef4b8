"""kvstrata as sglang's L3 backend, through sglang's own factory, types and fault injector.

Every backend here is built by ``StorageBackendFactory.create_backend("dynamic", ...)`` from sglang's
``HiCacheStorageConfig``, as sglang's cache controller builds it, and attached with
``register_mem_pool_host`` to sglang's own host pool classes. Page keys come from sglang's
``get_hash_str``.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str
from support.sglang_host import HEADS, LAYERS, PAGE, mha_pool, mla_pool, storage_config

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.storage.memory import MemoryStore
from kvstrata.impl.storage.mooncake import LocalCluster
from kvstrata.integrations.sglang import KvstrataHiCacheStorage
from kvstrata.model.keys import PageHash, parse_store_key, render_store_key

LAYOUTS = ("page_first", "page_first_direct")
PAGE_HASH = PageHash(bytes(32))


def page_keys(pages: int, seed: int = 0) -> list[str]:
    """sglang's page hashes of ``pages`` pages of random tokens (a chain, as its radix cache makes)."""
    rng = random.Random(seed)
    keys: list[str] = []
    prior = None
    for _ in range(pages):
        prior = get_hash_str([rng.randrange(32000) for _ in range(PAGE)], prior)
        keys.append(prior)
    return keys


def slots(pages: list[int]) -> torch.Tensor:
    """Token slots of whole host pages, as sglang's controller passes them."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def build(extra: dict[str, Any], pool: Any, **config: Any) -> Any:
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def page_bytes(pool: Any, page: int) -> torch.Tensor:
    """One host page in canonical ``[planes, L, page, H, D]`` order, whatever the layout."""
    flat = pool.get_data_page(page * PAGE, flat=True)
    if pool.layout == "page_first":
        planes = flat.numel() // (PAGE * LAYERS * pool.head_num * pool.head_dim)
        return flat.reshape(planes, PAGE, LAYERS, pool.head_num, pool.head_dim).transpose(1, 2)
    return flat.reshape(-1, LAYERS, PAGE, pool.head_num, pool.head_dim)


def fill(pool: Any, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(
        torch.randn(pool.kv_buffer.shape, generator=generator).to(pool.kv_buffer.dtype)
    )


# ------------------------------------------------------------------------------------- loading
def test_factory_builds_kvstrata_from_the_dynamic_extra_config() -> None:
    backend = build({"store": "memory"}, mha_pool("page_first_direct"))
    assert type(backend) is KvstrataHiCacheStorage
    assert backend.pages is not None and backend.pages.backend is not None
    # zero-copy: the kvstrata host pool is sglang's buffer
    assert backend.pages.host.buffer.data_ptr() == backend.mem_pool_host.kv_buffer.data_ptr()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"store": "memory", "stor": 1}, "'stor'"),
        ({"store": "s3"}, "'store'"),
        ({"store": "file"}, "'path'"),
        ({"store": "mooncake", "master": "no-port"}, "master"),
        ({"store": "memory", "capacity": True}, "'capacity'"),
    ],
)
def test_bad_extra_config_fails_at_construction_naming_the_key(
    extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra), mha_pool("page_first")
        )


def test_unsupported_host_layout_is_refused_at_attach() -> None:
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config({"store": "memory"}), None
    )
    with pytest.raises(ConfigError, match="page_head"):
        backend.register_mem_pool_host(mha_pool("page_head"))


# ------------------------------------------------------------------------------------- sharing
@pytest.mark.parametrize("writer_layout", LAYOUTS)
@pytest.mark.parametrize("reader_layout", LAYOUTS)
def test_a_second_instance_reads_the_first_ones_pages_bit_for_bit(
    writer_layout: str, reader_layout: str
) -> None:
    store = MemoryStore()
    a_pool, b_pool = mha_pool(writer_layout), mha_pool(reader_layout)
    fill(a_pool, seed=1)
    a = build({"store": "memory", "memory_store": store}, a_pool)
    b = build({"store": "memory", "memory_store": store}, b_pool)
    keys = page_keys(3)
    assert a.batch_set_v1(keys, slots([5, 1, 6])) == [True, True, True]
    assert b.batch_exists(keys) == 3
    assert b.batch_get_v1(keys, slots([0, 2, 3])) == [True, True, True]
    for a_page, b_page in zip([5, 1, 6], [0, 2, 3], strict=True):
        assert torch.equal(page_bytes(b_pool, b_page), page_bytes(a_pool, a_page))
    # pages B did not ask for are untouched
    assert not page_bytes(b_pool, 1).any()


def test_a_hole_stops_exists_and_get() -> None:
    store = MemoryStore()
    a_pool, b_pool = mha_pool("page_first_direct"), mha_pool("page_first_direct")
    fill(a_pool, seed=2)
    a = build({"store": "memory", "memory_store": store}, a_pool)
    b = build({"store": "memory", "memory_store": store}, b_pool)
    keys = page_keys(3, seed=3)
    assert a.batch_set_v1([keys[0], keys[2]], slots([0, 2])) == [True, True]
    assert b.batch_exists(keys) == 1
    assert b.batch_get_v1(keys, slots([4, 5, 6])) == [True, False, False]
    assert torch.equal(page_bytes(b_pool, 4), page_bytes(a_pool, 0))
    # page 2 exists, but after a hole it is no hit (its slot's bytes are unspecified: sglang frees it)


def test_tp_sizes_and_models_never_share_mla_ranks_do() -> None:
    store = MemoryStore()
    extra = {"store": "memory", "memory_store": store}
    keys = page_keys(2, seed=4)
    writer_pool = mha_pool("page_first_direct")
    fill(writer_pool, seed=5)
    assert build(extra, writer_pool, tp_size=1).batch_set_v1(keys, slots([0, 1])) == [True, True]
    assert build(extra, mha_pool("page_first_direct"), tp_size=1).batch_exists(keys) == 2
    for rank in (0, 1):
        assert (
            build(extra, mha_pool("page_first_direct"), tp_rank=rank, tp_size=2).batch_exists(keys)
            == 0
        )
    assert build(extra, mha_pool("page_first_direct"), model="other/model").batch_exists(keys) == 0
    # MLA: replicated; rank 1 of 2 does not write, but reads what rank 0 of any TP size wrote
    mla_writer = mla_pool("page_first_direct")
    fill(mla_writer, seed=6)
    non_writer = build(extra, mla_pool("page_first_direct"), tp_rank=1, tp_size=2, mla=True)
    assert non_writer.batch_set_v1(keys, slots([0, 1])) == [True, True]  # not its duty
    assert non_writer.batch_exists(keys) == 0
    assert build(extra, mla_writer, tp_rank=0, tp_size=4, mla=True).batch_set_v1(
        keys, slots([0, 1])
    ) == [True, True]
    reader_pool = mla_pool("page_first")
    reader = build(extra, reader_pool, tp_rank=1, tp_size=2, mla=True, layout="page_first")
    assert reader.batch_get_v1(keys, slots([3, 4])) == [True, True]
    assert torch.equal(
        reader_pool.get_data_page(3 * PAGE).reshape(PAGE, LAYERS, -1).transpose(0, 1),
        mla_writer.get_data_page(0).reshape(LAYERS, PAGE, -1),
    )


def test_fp8_variants_sglang_stores_as_bytes_never_read_each_others_pages() -> None:
    """sglang keeps fp8_e4m3 and fp8_e5m2 KV alike in uint8 host pools of one size: the KV cache
    dtype goes into the key (issue 20, part 19), so deployments that differ in it share no page;
    sglang's name and the torch dtype's name for one type share."""
    store = MemoryStore()

    def fp8(kv_dtype: str | None) -> tuple[Any, Any]:
        pool = mha_pool("page_first_direct", dtype=torch.uint8)
        extra = {"store": "memory", "memory_store": store}
        return pool, build(extra if kv_dtype is None else {**extra, "kv_dtype": kv_dtype}, pool)

    keys = page_keys(3, seed=9)
    e4m3_pool, e4m3 = fp8("fp8_e4m3")
    e4m3_pool.kv_buffer.copy_(torch.randint(0, 256, e4m3_pool.kv_buffer.shape, dtype=torch.uint8))
    assert e4m3.batch_set_v1(keys, slots([0, 1, 2])) == [True, True, True]
    e5m2_pool, e5m2 = fp8("fp8_e5m2")
    assert e5m2.batch_exists(keys) == 0  # same bytes a page, other numbers: never served
    assert e5m2.batch_get_v1(keys, slots([3, 4, 5]))[0] is False
    assert not e5m2_pool.kv_buffer.any()
    reader_pool, reader = fp8("float8_e4m3fn")
    assert reader.batch_get_v1(keys, slots([3, 4, 5])) == [True, True, True]
    for written, read in zip([0, 1, 2], [3, 4, 5], strict=True):
        assert torch.equal(page_bytes(reader_pool, read), page_bytes(e4m3_pool, written))
    with pytest.raises(ConfigError, match="kv_dtype"):
        fp8(None)  # the server published no --kv-cache-dtype here: never a key of every variant
    with pytest.raises(ConfigError, match="'kv_dtype'"):
        fp8(" ")
    # a bfloat16 pool's dtype is its element type: kv_dtype is not read, keys stay as they were
    plain = build({"store": "memory", "memory_store": store}, mha_pool("page_first_direct"))
    assert "/bfloat16/" in plain.pages.keyspace.page_keys(plain.pages.namespace, PAGE_HASH)[0].text


def test_the_servers_kv_cache_dtype_scales_and_weights_are_in_the_keys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In a server, sglang publishes its arguments (``runtime_context.get_server_args``): the KV
    cache dtype comes from there when the extra config names none (and must agree with it when it
    does), a KV scales file's content is part of the format (the numbers the fp8 bytes stand
    for), and a revision or online quantization part of the model's weights."""
    import sglang.srt.runtime_context as runtime  # noqa: PLC0415

    store = MemoryStore()
    extra = {"store": "memory", "memory_store": store}

    def server(**args: Any) -> None:
        fields = {"kv_cache_dtype": "auto", "quantization_param_path": None, "revision": None,
                  "quantization": None, **args}  # fmt: skip
        monkeypatch.setattr(runtime, "get_server_args", lambda: SimpleNamespace(**fields))

    def backend(dtype: torch.dtype = torch.uint8, **config: Any) -> tuple[Any, Any]:
        pool = mha_pool("page_first_direct", dtype=dtype)
        return pool, build({**extra, **config}, pool)

    keys = page_keys(2, seed=11)
    scales = tmp_path / "scales.json"
    scales.write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 0.5}}}}')
    server(kv_cache_dtype="fp8_e4m3", quantization_param_path=str(scales))
    pool, writer = backend()
    pool.kv_buffer.copy_(torch.randint(0, 256, pool.kv_buffer.shape, dtype=torch.uint8))
    assert writer.batch_set_v1(keys, slots([0, 1])) == [True, True]
    copy = tmp_path / "elsewhere.json"  # the same scales at another path: the same numbers
    copy.write_bytes(scales.read_bytes())
    server(kv_cache_dtype="fp8_e4m3", quantization_param_path=str(copy))
    assert backend()[1].batch_exists(keys) == 2
    other = tmp_path / "other.json"
    other.write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 2.0}}}}')
    server(kv_cache_dtype="fp8_e4m3", quantization_param_path=str(other))
    assert backend()[1].batch_exists(keys) == 0
    server(kv_cache_dtype="fp8_e4m3")  # no scales file: 1.0, other numbers again
    assert backend()[1].batch_exists(keys) == 0
    server(kv_cache_dtype="fp8_e5m2", quantization_param_path=str(scales))
    assert backend()[1].batch_exists(keys) == 0
    with pytest.raises(ConfigError, match="not the server's"):
        backend(kv_dtype="fp8_e4m3")
    with pytest.raises(ConfigError, match="cannot read the KV scales"):
        server(kv_cache_dtype="fp8_e4m3", quantization_param_path=str(tmp_path / "gone.json"))
        backend()
    # weights: a bfloat16 pool's keys change only with the revision or an online quantization
    server()
    plain_pool, plain = backend(torch.bfloat16)
    fill(plain_pool, seed=12)
    assert plain.batch_set_v1(keys, slots([0, 1])) == [True, True]
    assert backend(torch.bfloat16)[1].batch_exists(keys) == 2
    for weights in ({"revision": "r2"}, {"quantization": "fp8"}):
        server(**weights)
        assert backend(torch.bfloat16)[1].batch_exists(keys) == 0


def test_a_host_pool_with_bytes_outside_its_kv_buffer_is_refused() -> None:
    """sglang's MXFP8 host pool keeps its per-page block scales apart from ``kv_buffer``; its
    pages would reach L3 without them (and come back with another page's scales)."""
    from sglang.srt.mem_cache.pool_host.mha_mxfp8 import (  # noqa: PLC0415
        MHATokenToKVPoolMXFP8Host,
    )

    def mxfp8(pool: Any) -> None:
        pool.k_sf_page_bytes = pool.v_sf_page_bytes = 2 * PAGE * HEADS  # as its __init__ sets

    pool = mha_pool("page_first", dtype=torch.uint8, cls=MHATokenToKVPoolMXFP8Host, ready=mxfp8)
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config({"store": "memory", "kv_dtype": "fp8_e4m3"}), pool
    )
    with pytest.raises(ConfigError, match="MHATokenToKVPoolMXFP8Host holds"):
        backend.register_mem_pool_host(pool)


def test_misaligned_or_short_host_indices_are_refused_and_change_nothing() -> None:
    store = MemoryStore()
    pool = mha_pool("page_first_direct")
    fill(pool, seed=7)
    backend = build({"store": "memory", "memory_store": store}, pool)
    keys = page_keys(2, seed=8)
    with pytest.raises(MisuseError, match="aligned"):
        backend.batch_set_v1(keys, slots([0, 1]) + 1)
    with pytest.raises(MisuseError, match="host slots"):
        backend.batch_set_v1(keys, slots([0]))
    with pytest.raises(MisuseError, match="64 hex"):
        backend.batch_exists(["not-a-hash"])
    assert backend.batch_exists(keys) == 0 and len(store._visible) == 0


# ------------------------------------------------------------------------------------- faults
def test_sglang_fault_injector_never_raises_and_never_serves_a_failed_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = MemoryStore()
    extra = {"store": "memory", "memory_store": store}
    source = mha_pool("page_first_direct", pages=16)
    fill(source, seed=9)
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    writer = build(extra, source)
    reader_pool = mha_pool("page_first_direct", pages=16)
    reader = build(extra, reader_pool)
    assert isinstance(writer, HiCacheStorageFailureInjector)
    rng = random.Random(10)
    stored: set[str] = set()
    chains = [page_keys(4, seed=100 + n) for n in range(12)]
    hits = loaded_pages = 0
    for round_ in range(60):
        keys = rng.choice(chains)
        index = chains.index(keys)
        host_pages = [(index + k) % 16 for k in range(4)]
        if rng.random() < 0.5:
            done = writer.batch_set_v1(keys, slots(host_pages))
            stored.update(key for key, ok in zip(keys, done, strict=True) if ok)
            continue
        hit = reader.batch_exists(keys)
        assert all(key in stored for key in keys[:hit]), (
            f"round {round_}: a hit on a page never stored"
        )
        hits += hit
        reader_pool.kv_buffer.zero_()
        target = list(range(4))
        got = reader.batch_get_v1(keys, slots(target))
        for key, ok, src, dst in zip(keys, got, host_pages, target, strict=True):
            if ok:
                loaded_pages += 1
                assert key in stored
                assert torch.equal(page_bytes(reader_pool, dst), page_bytes(source, src))
    assert hits > 0 and loaded_pages > 0  # the faults left something to check


# ------------------------------------------------------------------------------------- hybrid
class StatePool:
    """A side host pool with sglang's flat-page interface (``page_size`` 1, as Mamba's): one
    state of ``width`` floats per slot."""

    page_size = 1

    def __init__(self, slots_: int, width: int = 6) -> None:
        self.states = torch.zeros(slots_, width, dtype=torch.float32)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.states[index].flatten()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.states[0]).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.states[index] = data_page.view(torch.uint8).view(torch.float32).reshape(-1)


def hybrid(extra: dict[str, Any], pool: Any, states: StatePool, indexer: StatePool) -> Any:
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(states, PoolName.MAMBA)
    backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    backend.on_host_pools_registered()
    return backend


def test_hybrid_v2_round_trip_through_sglang_types_keys_tagged_once() -> None:
    store = MemoryStore()
    extra = {"store": "memory", "memory_store": store, "tag": "prod"}
    a_pool, a_states, a_index = mha_pool("page_first_direct"), StatePool(4), StatePool(8, width=3)
    fill(a_pool, seed=11)
    a_states.states.copy_(torch.randn(4, 6))
    a_index.states.copy_(torch.randn(8, 3))
    a = hybrid(extra, a_pool, a_states, a_index)
    keys = page_keys(3, seed=12)
    done = a.batch_set_v2(
        [
            PoolTransfer(PoolName.KV, host_indices=slots([0, 1, 2]), keys=keys),
            PoolTransfer(PoolName.INDEXER, host_indices=torch.tensor([0, 1, 2]), keys=keys),
            PoolTransfer(
                PoolName.MAMBA,
                host_indices=torch.tensor([3]),
                keys=keys[-1:],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]
    )
    assert done == {"kv": [True] * 3, "indexer": [True] * 3, "mamba": [True]}
    # every key was rendered once: it parses, renders back to itself and names the page as sglang did
    for key in store._visible:
        parts = parse_store_key(key)
        assert render_store_key(parts) == key
        assert parts.tag == "prod" and key.text.count("prod") == 1
        assert parts.page_hash.hex() in keys
        # a side pool's segment carries its layout (the flat page's size and the host pool's
        # class and dtypes): name.<16 hex>
        name, _, layout = parts.pool.partition(".")
        assert (name, layout == "") in {("kv", True), ("indexer", False), ("mamba", False)}
    b_pool, b_states, b_index = mha_pool("page_first_direct"), StatePool(4), StatePool(8, width=3)
    b = hybrid(extra, b_pool, b_states, b_index)
    asks = [
        PoolTransfer(PoolName.INDEXER, keys=keys),
        PoolTransfer(PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ]
    hit = b.batch_exists_v2(keys, asks)
    assert isinstance(hit, PoolTransferResult)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (3, [3])
    assert hit.extra_pool_hit_pages == {"kv": 3, "indexer": 3, "mamba": 3}
    got = b.batch_get_v2(
        [
            PoolTransfer(PoolName.KV, host_indices=slots([4, 5, 6]), keys=keys),
            PoolTransfer(PoolName.INDEXER, host_indices=torch.tensor([5, 6, 7]), keys=keys),
            PoolTransfer(
                PoolName.MAMBA,
                host_indices=torch.tensor([1]),
                keys=keys[-1:],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]
    )
    assert got == {"kv": [True] * 3, "indexer": [True] * 3, "mamba": [True]}
    assert torch.equal(b_states.states[1], a_states.states[3])
    assert torch.equal(b_index.states[5:8], a_index.states[0:3])
    for a_page, b_page in zip([0, 1, 2], [4, 5, 6], strict=True):
        assert torch.equal(page_bytes(b_pool, b_page), page_bytes(a_pool, a_page))
    # a state that ends at page 1 only: the usable prefix is 2, not 3 (the KV hit)
    c_keys = page_keys(3, seed=13)
    a.batch_set_v2(
        [
            PoolTransfer(PoolName.KV, host_indices=slots([0, 1, 2]), keys=c_keys),
            PoolTransfer(PoolName.INDEXER, host_indices=torch.tensor([0, 1, 2]), keys=c_keys),
            PoolTransfer(
                PoolName.MAMBA,
                host_indices=torch.tensor([0]),
                keys=c_keys[1:2],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]
    )
    c_hit = b.batch_exists_v2(c_keys, asks)
    assert (c_hit.kv_hit_pages, c_hit.restorable_prefix_pages) == (2, [2])


def mamba_host(ssm: torch.dtype) -> Any:
    """sglang's own ``MambaPoolHost`` on the CPU: one conv buffer (bfloat16) and a temporal (SSM)
    state of dtype ``ssm``, 2 layers, flat entries of 72 bytes whatever ``ssm`` (2 bytes each)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: PLC0415

    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, 5, 3, 4, dtype=ssm),
        conv=(torch.zeros(2, 5, 6, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=4, pin_memory=False, layout="page_first")


def mamba_backend(store: MemoryStore, states: Any) -> Any:
    extra = {"store": "memory", "memory_store": store}
    pool = mha_pool("page_first_direct")
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(states, PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend, pool


def test_mamba_states_of_another_ssm_dtype_are_never_read() -> None:
    """Two deployments of one model with sglang's real ``MambaPoolHost``, the SSM state in
    bfloat16 on one and float16 on the other (``--mamba-ssm-dtype``): their flat entries have the
    same size, so before the layout was in the keys the second read the first's states as its own.
    They share the KV pages; each reads back only the states of its own dtype."""
    store = MemoryStore()
    bf16, fp16, bf16_again = (
        mamba_host(d) for d in (torch.bfloat16, torch.float16, torch.bfloat16)
    )
    sizes = {h.get_dummy_flat_data_page().numel() for h in (bf16, fp16)}
    assert sizes == {72}
    state = torch.randint(0, 256, (72,), dtype=torch.uint8)
    bf16.set_from_flat_data_page(3, state)
    (a, a_pool), (b, _), (c, _) = (mamba_backend(store, h) for h in (bf16, fp16, bf16_again))
    fill(a_pool, seed=21)
    keys = page_keys(3, seed=22)
    mamba = PoolTransfer(
        PoolName.MAMBA,
        host_indices=torch.tensor([3]),
        keys=keys[-1:],
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )
    done = a.batch_set_v2(
        [PoolTransfer(PoolName.KV, host_indices=slots([0, 1, 2]), keys=keys), mamba]
    )
    assert done == {"kv": [True] * 3, "mamba": [True]}
    ask = [PoolTransfer(PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    other = b.batch_exists_v2(keys, ask)
    assert (other.kv_hit_pages, other.restorable_prefix_pages) == (0, [])
    assert other.extra_pool_hit_pages.get("kv") == 3  # the KV is there, a state of its dtype not
    same = c.batch_exists_v2(keys, ask)
    assert (same.kv_hit_pages, same.restorable_prefix_pages) == (3, [3])
    got = c.batch_get_v2(
        [
            PoolTransfer(
                PoolName.MAMBA,
                host_indices=torch.tensor([1]),
                keys=keys[-1:],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
        ]
    )
    assert got == {"mamba": [True]}
    assert torch.equal(bf16_again.get_data_page(1, flat=True), state)


# ------------------------------------------------------------------------------------- legacy, stats
def test_legacy_flat_pages_share_objects_with_the_zero_copy_path() -> None:
    store = MemoryStore()
    extra = {"store": "memory", "memory_store": store}
    a_pool = mha_pool("page_first")
    fill(a_pool, seed=14)
    a = build({**extra, "interface_v1": 0}, a_pool, layout="page_first")
    keys = page_keys(2, seed=15)
    assert a.batch_set(keys, [a_pool.get_data_page(p * PAGE) for p in (2, 3)]) is True
    b_pool = mha_pool("page_first_direct")
    b = build(extra, b_pool)
    assert b.batch_get_v1(keys, slots([0, 1])) == [True, True]
    assert torch.equal(page_bytes(b_pool, 1), page_bytes(a_pool, 3))
    targets = [a_pool.get_dummy_flat_data_page() for _ in keys]
    assert a.batch_get(keys, targets) == targets
    assert torch.equal(targets[0], a_pool.get_data_page(2 * PAGE))
    assert a.get(page_keys(1, seed=99)[0], a_pool.get_dummy_flat_data_page()) is None


def test_get_stats_reports_sglang_storage_metrics() -> None:
    store = MemoryStore()
    pool = mha_pool("page_first_direct")
    backend = build({"store": "memory", "memory_store": store}, pool)
    keys = page_keys(3, seed=16)
    backend.batch_set_v1(keys, slots([0, 1, 2]))
    backend.batch_get_v1(keys, slots([3, 4, 5]))
    metrics = backend.get_stats()
    assert (metrics.backup_pgs, metrics.prefetch_pgs) == ([3], [3])
    assert len(metrics.backup_bandwidth) == 1 and metrics.backup_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []  # drained


# ------------------------------------------------------------------------------------- Mooncake
def test_two_instances_share_pages_through_a_real_mooncake_master(
    mooncake_cluster: LocalCluster,
) -> None:
    extra = {"store": "mooncake", "master": mooncake_cluster.config.master}
    a_pool, b_pool = mha_pool("page_first_direct"), mha_pool("page_first")
    fill(a_pool, seed=17)
    a = build(extra, a_pool, model="tiny-org/mooncake-test")
    b = build(extra, b_pool, model="tiny-org/mooncake-test", layout="page_first")
    keys = page_keys(3, seed=18)
    try:
        assert a.batch_set_v1(keys, slots([2, 3, 4])) == [True] * 3
        assert b.batch_exists(keys) == 3
        assert b.batch_get_v1(keys, slots([0, 1, 2])) == [True] * 3
        for a_page, b_page in zip([2, 3, 4], [0, 1, 2], strict=True):
            assert torch.equal(page_bytes(b_pool, b_page), page_bytes(a_pool, a_page))
        other = build(
            extra, mha_pool("page_first_direct"), model="tiny-org/mooncake-test", tp_size=2
        )
        assert other.batch_exists(keys) == 0
    finally:
        a.close()
        b.close()


def test_an_unreachable_master_is_no_l3_not_a_crash() -> None:
    backend = build(
        {"store": "mooncake", "master": "127.0.0.1:9", "mooncake": {"setup_retries": 1}},
        mha_pool("page_first_direct"),
    )
    keys = page_keys(2, seed=19)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, slots([0, 1])) == [False, False]
    assert backend.batch_get_v1(keys, slots([0, 1])) == [False, False]


def test_a_layer_first_host_pool_is_refused_with_the_reason() -> None:
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config({"store": "memory"}), None
    )
    with pytest.raises(ConfigError, match="page-first"):
        backend.register_mem_pool_host(mha_pool("layer_first"))
