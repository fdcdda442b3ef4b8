"""The sharing rule of model/engines.py: two plug-in instances share keys exactly when they should."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.model.engines import (
    EngineShard,
    HashScheme,
    engine_kv_format,
    engine_page_hash,
    model_slug,
)
from kvstrata.model.errors import MisuseError
from kvstrata.model.keys import PageHash, parse_store_key, render_store_key


@st.composite
def shards(draw: st.DrawFn) -> EngineShard:
    tp_size = draw(st.sampled_from([1, 2, 4]))
    pp_size = draw(st.sampled_from([1, 2]))
    dtype = draw(st.sampled_from(["bfloat16", "torch.bfloat16", "float16", "uint8", "torch.uint8"]))
    formats = ["float8_e4m3fn", "torch.float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"]
    byte = dtype.removeprefix("torch.") == "uint8"
    return EngineShard(
        scheme=draw(st.sampled_from(list(HashScheme))),
        model_name=draw(st.sampled_from(["org/a", "org/A", "org-a", "org/b"])),
        dtype=dtype,
        kv_format=draw(st.sampled_from(formats if byte else ["", *formats])),
        weights=draw(st.sampled_from(["", "revision=r1", "revision=r2;quantization=fp8"])),
        kv_layout=draw(st.sampled_from(["", "hnd", "HND", "nhd"])),
        kv_backend=draw(st.sampled_from(["", "TRITON_ATTN", "triton_attn", "FLASHINFER"])),
        mla=draw(st.booleans()),
        page_size=draw(st.sampled_from([16, 64])),
        tp_rank=draw(st.integers(0, tp_size - 1)),
        tp_size=tp_size,
        pp_rank=draw(st.integers(0, pp_size - 1)),
        pp_size=pp_size,
        tag=draw(st.sampled_from([None, "prod"])),
        tenant=draw(st.sampled_from(["", "t1"])),
        key_schema=draw(st.sampled_from([1, 2])),
    )


def should_share(a: EngineShard, b: EngineShard) -> bool:
    """The rule of model/engines.py's docstring, spelled out independently."""
    same = (
        a.scheme == b.scheme
        and a.model_name == b.model_name
        and a.weights == b.weights
        and a.dtype.removeprefix("torch.") == b.dtype.removeprefix("torch.")
        and a.kv_format.removeprefix("torch.") == b.kv_format.removeprefix("torch.")
        and a.kv_layout.lower() == b.kv_layout.lower()
        and a.kv_backend.lower() == b.kv_backend.lower()
        and a.mla == b.mla
        and a.page_size == b.page_size
        and (a.pp_rank, a.pp_size) == (b.pp_rank, b.pp_size)
        and a.tag == b.tag
        and a.tenant == b.tenant
        and a.key_schema == b.key_schema
    )
    return same and (a.mla or (a.tp_rank, a.tp_size) == (b.tp_rank, b.tp_size))


PAGE = PageHash(hashlib.sha256(b"page").digest())


@given(shards(), shards())
def test_two_instances_share_a_page_key_exactly_when_the_rule_says(
    a: EngineShard, b: EngineShard
) -> None:
    key_a = a.keyspace().page_keys(a.namespace(), PAGE)[0]
    key_b = b.keyspace().page_keys(b.namespace(), PAGE)[0]
    assert (key_a == key_b) is should_share(a, b)
    assert render_store_key(parse_store_key(key_a)) == key_a  # rendered once, parses back


@given(shards())
def test_mla_has_one_writer_sharded_kv_every_rank(shard: EngineShard) -> None:
    assert shard.writer is (not shard.mla or shard.tp_rank == shard.writer_rank)


def test_model_slugs_are_key_safe_deterministic_and_keep_names_apart() -> None:
    slugs = {model_slug(name) for name in ("org/a", "org/A", "org-a", "Org/A ")}
    assert len(slugs) == 4
    assert model_slug("meta-llama/Llama-3.1-8B") == model_slug("meta-llama/Llama-3.1-8B")
    assert model_slug("meta-llama/Llama-3.1-8B").startswith("m_meta_llama_llama_3_1_8b_")
    assert model_slug("###").startswith("m_")
    with pytest.raises(MisuseError):
        model_slug("  ")


def test_engine_page_hashes_are_taken_verbatim_and_checked() -> None:
    digest = hashlib.sha256(b"x").digest()
    assert engine_page_hash(digest.hex(), HashScheme.SGLANG) == PageHash(digest)
    assert engine_page_hash(digest, HashScheme.VLLM) == PageHash(digest)
    for bad, scheme in [
        (digest.hex()[:-1], HashScheme.SGLANG),
        (digest, HashScheme.SGLANG),
        ("zz" * 32, HashScheme.SGLANG),
        (digest[:31], HashScheme.VLLM),
        (digest.hex(), HashScheme.VLLM),
    ]:
        with pytest.raises(MisuseError):
            engine_page_hash(bad, scheme)


@pytest.mark.parametrize(
    "fields",
    [
        {"tp_rank": 2, "tp_size": 2},
        {"pp_rank": 1},
        {"writer_rank": 1},
        {"page_size": 0},
        {"model_name": ""},
        {"mla": 1},
        {"dtype": "uint8"},  # a byte pool with no format: every fp8 variant would share keys
        {"dtype": "torch.int8", "kv_format": " "},
        {"kv_format": None},
        {"weights": 3},
        {"kv_layout": None},
        {"kv_layout": "~"},  # named, but says nothing: it would render the old key
        {"kv_format": "--"},
        {"kv_backend": b"TRITON_ATTN"},
        {"kv_backend": "@"},
    ],
)
def test_bad_shards_are_refused(fields: dict[str, object]) -> None:
    base: dict[str, object] = {
        "scheme": HashScheme.SGLANG, "model_name": "m", "dtype": "bfloat16", "mla": False, "page_size": 16,
    }  # fmt: skip
    with pytest.raises(MisuseError):
        EngineShard(**{**base, **fields})  # type: ignore[arg-type]


def test_a_shard_that_names_no_format_or_weights_keeps_the_keys_deployments_hold() -> None:
    """Part 19 added ``kv_format`` and ``weights``; left empty, keys are byte for byte the old ones
    (objects already in a store stay readable)."""
    shard = EngineShard(HashScheme.VLLM, "org/a", "torch.bfloat16", False, 16)
    key = shard.keyspace().page_keys(shard.namespace(), PAGE)[0]
    # rendered by the code before part 19 (cbc0ec1)
    assert key.text == (
        "kvs1/_/m_org_a_526e33173f53/bfloat16/mha/p16/ns-910c9b573b1a6c8bb0ce20ee69aaae38/tp0of1/"
        "pp0of1/kv/k/3660315a9af3df255d8f19ab077e4797822b41488a0e2a04bc6af71213c23274"
    )
    assert model_slug("org/a") == model_slug("org/a", "") == "m_org_a_526e33173f53"


def test_the_format_of_a_byte_pool_is_in_the_dtype_segment() -> None:
    def dtype_segment(**fields: str) -> str:
        shard = EngineShard(HashScheme.SGLANG, "m", "torch.uint8", False, 16, **fields)  # type: ignore[arg-type]
        return parse_store_key(shard.keyspace().page_keys(shard.namespace(), PAGE)[0]).model.dtype

    assert dtype_segment(kv_format="float8_e5m2") == "uint8.float8_e5m2"
    assert dtype_segment(kv_format="torch.float8_e4m3fn") == "uint8.float8_e4m3fn"


def test_the_page_layout_follows_the_dtype_and_format_after_a_tilde() -> None:
    """A plug-in that names the order of a page's bytes (vLLM's ``hnd``) keys it after the dtype
    and format; dtype and format slugs never hold a ``~``, so no two combinations render alike."""

    def dtype_segment(dtype: str, **fields: str) -> str:
        shard = EngineShard(HashScheme.VLLM, "m", dtype, False, 16, **fields)  # type: ignore[arg-type]
        return parse_store_key(shard.keyspace().page_keys(shard.namespace(), PAGE)[0]).model.dtype

    assert dtype_segment("torch.bfloat16", kv_layout="hnd") == "bfloat16~hnd"
    assert (
        dtype_segment("uint8", kv_format="float8_e5m2", kv_layout="HND") == "uint8.float8_e5m2~hnd"
    )
    assert dtype_segment("bfloat16", kv_layout="") == "bfloat16"


def test_the_writing_backend_follows_the_format_after_an_at() -> None:
    """A plug-in that names the kernels that wrote a byte-typed KV (vLLM: the attention backend)
    keys them between the format and the layout; no slug holds an ``@``, ``.`` or ``~``."""

    def dtype_segment(**fields: str) -> str:
        shard = EngineShard(HashScheme.VLLM, "m", "torch.uint8", False, 16, **fields)  # type: ignore[arg-type]
        return parse_store_key(shard.keyspace().page_keys(shard.namespace(), PAGE)[0]).model.dtype

    e5m2 = {"kv_format": "float8_e5m2", "kv_layout": "hnd"}
    assert dtype_segment(**e5m2, kv_backend="TRITON_ATTN") == "uint8.float8_e5m2@triton_attn~hnd"
    assert dtype_segment(**e5m2, kv_backend="CPU_ATTN:vec") == "uint8.float8_e5m2@cpu_attn_vec~hnd"
    assert dtype_segment(**e5m2, kv_backend="") == "uint8.float8_e5m2~hnd"
    assert dtype_segment(kv_format="float8_e5m2", kv_backend="FLASHINFER") == (
        "uint8.float8_e5m2@flashinfer"
    )


def test_weights_are_domain_separated_from_a_bare_name() -> None:
    bare = {model_slug(name) for name in ("a", '["kvstrata.weights.v1", "a", "b"]')}
    assert model_slug("a", "b") not in bare
    assert model_slug("a", "b") != model_slug("a", "c")
    assert model_slug("a", "b").startswith("m_a_")
    with pytest.raises(MisuseError):
        model_slug("a", None)  # type: ignore[arg-type]


def test_engine_kv_cache_dtypes_become_one_name_per_element_type() -> None:
    assert engine_kv_format("fp8") == engine_kv_format("fp8_e4m3") == "float8_e4m3fn"
    assert engine_kv_format("FP8_E4M3", "torch.float8_e4m3fnuz") == "float8_e4m3fnuz"
    assert engine_kv_format("fp8_e5m2", "float8_e4m3fnuz") == "float8_e5m2"
    assert engine_kv_format("torch.float8_e5m2") == "float8_e5m2"
    # sglang on ROCm keeps fp8_e5m2 KV in its e4m3 type: the bytes, not the name, decide
    assert engine_kv_format("fp8_e5m2", "float8_e4m3fnuz", "float8_e4m3fnuz") == "float8_e4m3fnuz"
    assert engine_kv_format("int8_per_token_head") == "int8_per_token_head"
    with pytest.raises(MisuseError):
        engine_kv_format(" ")
