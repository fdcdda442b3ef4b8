"""Tests of kvstrata.model.keys: page-hash chains, namespaces and the store key schema (SPEC §4).

Known answers are computed here independently (hashlib + struct), so a change of the hash or key
format fails loudly: external routers predict these keys (I1, I8).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvstrata.model.errors import DoubleRenderError, KeyParseError, MisuseError
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    KeyParts,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    RenderedKeys,
    Shard,
    StoreKey,
    chain_page_hashes,
    content_hash,
    parse_store_key,
    render_store_key,
)

MHA = ModelIdentity(name="meta-llama/Llama-3.1-8B", dtype="bf16", kind=KVKind.MHA, page_size=4)
MLA = ModelIdentity(name="deepseek-ai/DeepSeek-V3", dtype="fp8_e4m3", kind=KVKind.MLA, page_size=2)
EMB = ModelIdentity(name="qwen/vision", dtype="bf16", kind=KVKind.EMBEDDING, dim=1280)
H0 = PageHash(bytes(range(32)))


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _page_bytes(tokens: list[int]) -> bytes:
    return b"".join(struct.pack("<I", token) for token in tokens)


# ----------------------------------------------------------------------------------------------
# Page-hash chains


def test_known_answer_two_pages() -> None:
    tokens = [1, 2, 3, 70000, 2**32 - 1, 0, 9]  # two full pages of 3, and a partial page
    first = _sha(_page_bytes([1, 2, 3]))
    second = _sha(first + _page_bytes([70000, 2**32 - 1, 0]))
    hashes = chain_page_hashes(tokens, 3)
    assert [h.digest for h in hashes] == [first, second]
    # Pinned literal: the format is a contract with external routers.
    assert hashes[0].hex() == hashlib.sha256(bytes.fromhex("010000000200000003000000")).hexdigest()
    assert hashes[1].hex() == second.hex()


def test_token_bytes_are_little_endian_uint32() -> None:
    (only,) = chain_page_hashes([0x01020304], 1)
    assert only.digest == _sha(bytes([4, 3, 2, 1]))


def test_each_page_hash_covers_every_previous_page() -> None:
    base = [1, 2, 3, 4, 5, 6, 7, 8]
    hashes = chain_page_hashes(base, 2)
    for changed_page in range(4):
        tokens = list(base)
        tokens[changed_page * 2] += 100
        other = chain_page_hashes(tokens, 2)
        assert other[:changed_page] == hashes[:changed_page]
        for index in range(changed_page, 4):
            assert other[index] != hashes[index]


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=24),
    page_size=st.integers(1, 4),
    split_pages=st.integers(0, 6),
    extra_key=st.none() | st.text(max_size=3),
)
def test_parent_continues_the_chain(
    tokens: list[int], page_size: int, split_pages: int, extra_key: str | None
) -> None:
    namespace = Namespace(extra_key=extra_key)
    whole = chain_page_hashes(tokens, page_size, namespace)
    cut = min(split_pages, len(whole))
    head = chain_page_hashes(tokens[: cut * page_size], page_size, namespace)
    parent = head[-1] if head else None
    tail = chain_page_hashes(tokens[cut * page_size :], page_size, namespace, parent=parent)
    assert head + tail == whole


@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=20), page_size=st.integers(1, 5))
def test_trailing_partial_page_is_ignored(tokens: list[int], page_size: int) -> None:
    hashes = chain_page_hashes(tokens, page_size)
    assert len(hashes) == len(tokens) // page_size
    full = tokens[: len(hashes) * page_size]
    assert chain_page_hashes(full, page_size) == hashes
    assert chain_page_hashes([*full, *([7] * (page_size - 1))], page_size) == hashes


def test_empty_and_short_inputs_give_no_pages() -> None:
    assert chain_page_hashes([], 4) == ()
    assert chain_page_hashes([1, 2, 3], 4) == ()


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, 1.5, "1", None])
def test_token_out_of_range_is_misuse(bad: object) -> None:
    with pytest.raises(MisuseError):
        chain_page_hashes([1, bad, 3, 4], 2)  # type: ignore[list-item]


@pytest.mark.parametrize("page_size", [0, -1, -4])
def test_page_size_must_be_positive(page_size: int) -> None:
    with pytest.raises(MisuseError, match="page_size"):
        chain_page_hashes([1, 2, 3, 4], page_size)


def test_boundary_token_ids_are_accepted() -> None:
    assert len(chain_page_hashes([0, 2**32 - 1], 2)) == 1


# ----------------------------------------------------------------------------------------------
# Namespaces


def test_default_namespace_uses_the_plain_chain() -> None:
    assert DEFAULT_NAMESPACE.is_default
    assert DEFAULT_NAMESPACE.seed() == b""
    assert DEFAULT_NAMESPACE.key_id() == "default"
    tokens = [5, 6, 7, 8]
    plain = _sha(_page_bytes([5, 6]))
    assert [h.digest for h in chain_page_hashes(tokens, 2)] == [
        plain,
        _sha(plain + _page_bytes([7, 8])),
    ]
    assert chain_page_hashes(tokens, 2, Namespace()) == chain_page_hashes(tokens, 2)


def test_namespace_seed_known_answer() -> None:
    namespace = Namespace(extra_key="lora-7", salt="tenant-a")
    extra = b"\x01lora-7"
    salt = b"tenant-a"
    expected = _sha(
        b"kvstrata.namespace.v1\x00"
        + struct.pack("<Q", len(extra))
        + extra
        + struct.pack("<Q", len(salt))
        + salt
    )
    assert namespace.seed() == expected
    assert namespace.key_id() == "ns-" + expected.hex()[:32]
    (first,) = chain_page_hashes([1, 2], 2, namespace)
    assert first.digest == _sha(expected + _page_bytes([1, 2]))


NAMESPACES = [
    Namespace(),
    Namespace(extra_key=""),
    Namespace(extra_key="a"),
    Namespace(extra_key="a", salt="b"),
    Namespace(extra_key="ab"),
    Namespace(extra_key="ab", salt=""),
    Namespace(extra_key=None, salt="ab"),
    Namespace(extra_key="b", salt="a"),
    Namespace(extra_key="", salt="ab"),
    Namespace(extra_key="a\x00", salt="b"),
    Namespace(extra_key="a", salt="\x00b"),
]


def test_namespaces_are_disjoint() -> None:
    distinct = list(dict.fromkeys(NAMESPACES))  # ("ab") and ("ab", "") are the same value
    assert len(distinct) == len(NAMESPACES) - 1
    tokens = [1, 2, 3, 4]
    seeds = {ns.seed() for ns in distinct}
    key_ids = {ns.key_id() for ns in distinct}
    chains = {chain_page_hashes(tokens, 2, ns) for ns in distinct}
    assert len(seeds) == len(key_ids) == len(chains) == len(distinct)
    page_hashes = [h for chain in chains for h in chain]
    assert len(set(page_hashes)) == len(page_hashes)  # no page hash shared across namespaces


def test_domain_separation_of_extra_key_and_salt() -> None:
    concatenated = Namespace(extra_key="a", salt="b")
    joined = Namespace(extra_key="ab", salt="")
    assert concatenated.seed() != joined.seed()
    assert concatenated.key_id() != joined.key_id()
    assert chain_page_hashes([1], 1, concatenated) != chain_page_hashes([1], 1, joined)


def test_extra_key_none_and_empty_differ() -> None:
    assert Namespace(extra_key=None).is_default
    assert not Namespace(extra_key="").is_default
    assert Namespace(extra_key="").seed() != b""
    assert Namespace(extra_key=None, salt="s").seed() != Namespace(extra_key="", salt="s").seed()
    assert chain_page_hashes([1], 1, Namespace(extra_key="")) != chain_page_hashes([1], 1)


@given(
    a=st.tuples(st.none() | st.text(max_size=4), st.text(max_size=4)),
    b=st.tuples(st.none() | st.text(max_size=4), st.text(max_size=4)),
)
def test_distinct_namespaces_never_share_a_chain(
    a: tuple[str | None, str], b: tuple[str | None, str]
) -> None:
    assume(a != b)
    first, second = Namespace(*a), Namespace(*b)
    assert first.key_id() != second.key_id()
    assert chain_page_hashes([3, 1], 1, first)[0] != chain_page_hashes([3, 1], 1, second)[0]


# ----------------------------------------------------------------------------------------------
# Value validation


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": "", "dtype": "bf16", "kind": KVKind.MHA, "page_size": 1}, MisuseError),
        ({"name": 3, "dtype": "bf16", "kind": KVKind.MHA, "page_size": 1}, MisuseError),
        ({"name": "m", "dtype": "", "kind": KVKind.MHA, "page_size": 1}, MisuseError),
        ({"name": "m", "dtype": "bf16", "kind": KVKind.MHA, "page_size": 0}, MisuseError),
        ({"name": "m", "dtype": "bf16", "kind": KVKind.MLA, "page_size": -1}, MisuseError),
        ({"name": "m", "dtype": "bf16", "kind": KVKind.MHA, "page_size": 4, "dim": 8}, MisuseError),
        ({"name": "m", "dtype": "bf16", "kind": KVKind.EMBEDDING, "dim": 0}, MisuseError),
        (
            {"name": "m", "dtype": "bf16", "kind": KVKind.EMBEDDING, "dim": 8, "page_size": 1},
            MisuseError,
        ),
        ({"name": "m", "dtype": "bf16", "kind": "mha", "page_size": 1}, TypeError),
    ],
)
def test_model_identity_validation(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        ModelIdentity(**kwargs)  # type: ignore[arg-type]


def test_model_identity_components() -> None:
    assert MHA.components == ("k", "v")
    assert MLA.components == ("latent",)
    assert EMB.components == ("emb",)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp_size": 0},
        {"tp_rank": 2, "tp_size": 2},
        {"tp_rank": -1, "tp_size": 2},
        {"pp_size": 0},
        {"pp_rank": 1, "pp_size": 1},
        {"pp_rank": -1, "pp_size": 2},
    ],
)
def test_shard_validation(kwargs: dict[str, int]) -> None:
    with pytest.raises(MisuseError):
        Shard(**kwargs)


def test_shard_replicated() -> None:
    assert Shard.replicated() == Shard(tp_rank=None, tp_size=1)
    assert Shard.replicated(pp_rank=1, pp_size=2).pp_rank == 1
    with pytest.raises(MisuseError):
        Shard.replicated(pp_rank=2, pp_size=2)


@pytest.mark.parametrize("digest", [b"", bytes(31), bytes(33), "00" * 32, bytearray(32)])
def test_page_hash_is_32_bytes(digest: object) -> None:
    with pytest.raises(MisuseError):
        PageHash(digest)  # type: ignore[arg-type]


def test_page_hash_hex_round_trip() -> None:
    assert PageHash.from_hex(H0.hex()) == H0
    for bad in ["zz", "00" * 31, ""]:
        with pytest.raises(KeyParseError):
            PageHash.from_hex(bad)


@pytest.mark.parametrize(
    "field_values",
    [
        {"pool": "KV"},
        {"pool": ""},
        {"pool": "1kv"},
        {"component": "k-v"},
        {"component": "k/v"},
        {"tag": "-prod"},
        {"tag": "pr/od"},
        {"tag": ""},
        {"tag": "_"},
    ],
)
def test_key_parts_validation(field_values: dict[str, str]) -> None:
    fields: dict[str, object] = {
        "model": MHA,
        "namespace_id": "default",
        "shard": Shard(),
        "pool": "kv",
        "component": "k",
        "page_hash": H0,
        **field_values,
    }
    with pytest.raises(MisuseError):
        KeyParts(**fields)  # type: ignore[arg-type]


def test_key_space_tag_validation() -> None:
    with pytest.raises(MisuseError):
        KeySpace(MHA, tag="bad tag")


def test_content_hash() -> None:
    data = b"\x89PNG..."
    assert content_hash(data).digest == _sha(b"kvstrata.content.v1\x00" + data)
    # content_hash is annotated `bytes` but documents and accepts bytearray and memoryview too.
    assert content_hash(bytearray(data)) == content_hash(data)  # type: ignore[arg-type]
    assert content_hash(memoryview(data)) == content_hash(data)  # type: ignore[arg-type]
    assert content_hash(data).digest != _sha(data)  # domain-separated
    with pytest.raises(MisuseError):
        content_hash("text")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Store keys: strategies

_TEXT = st.text(min_size=1, max_size=12)
model_names = (
    st.sampled_from(
        ["meta-llama/Llama-3.1-8B", "my model v2", "模型/\u03b1 β", "a%2Fb", "_", ".", "..", "kvs1"]
    )
    | _TEXT
)
dtypes = st.sampled_from(["bf16", "fp8_e4m3", "float16", "q/4 bits"]) | _TEXT
identifiers = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
tags = st.none() | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9.\-]{0,8}", fullmatch=True)
page_hashes = st.binary(min_size=32, max_size=32).map(PageHash)
namespaces = st.builds(Namespace, st.none() | st.text(max_size=4), st.text(max_size=4))
namespace_ids = namespaces.map(Namespace.key_id) | _TEXT


@st.composite
def model_identities(draw: st.DrawFn) -> ModelIdentity:
    kind = draw(st.sampled_from(KVKind))
    name, dtype = draw(model_names), draw(dtypes)
    if kind is KVKind.EMBEDDING:
        return ModelIdentity(name=name, dtype=dtype, kind=kind, dim=draw(st.integers(1, 10**6)))
    return ModelIdentity(name=name, dtype=dtype, kind=kind, page_size=draw(st.integers(1, 1024)))


@st.composite
def shards(draw: st.DrawFn) -> Shard:
    pp_size = draw(st.integers(1, 8))
    pp_rank = draw(st.integers(0, pp_size - 1))
    if draw(st.booleans()):
        return Shard.replicated(pp_rank=pp_rank, pp_size=pp_size)
    tp_size = draw(st.integers(1, 64))
    tp_rank = draw(st.integers(0, tp_size - 1))
    return Shard(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)


key_parts = st.builds(
    KeyParts,
    model=model_identities(),
    namespace_id=namespace_ids,
    shard=shards(),
    pool=identifiers,
    component=identifiers,
    page_hash=page_hashes,
    tag=tags,
    version=st.sampled_from(SCHEMA_VERSIONS),
)

_PARTS_FIELDS = (
    "model",
    "namespace_id",
    "shard",
    "pool",
    "component",
    "page_hash",
    "tag",
    "version",
)


# ----------------------------------------------------------------------------------------------
# Store keys: rendering and parsing


def test_rendered_key_known_answer() -> None:
    parts = KeyParts(
        model=MHA,
        namespace_id="default",
        shard=Shard(tp_rank=1, tp_size=4, pp_rank=0, pp_size=2),
        pool="kv",
        component="v",
        page_hash=H0,
        tag="prod-eu.1",
    )
    key = render_store_key(parts)
    assert isinstance(key, StoreKey)
    assert key.text == (
        f"kvs{SCHEMA_VERSION}/prod-eu.1/meta-llama%2FLlama-3.1-8B/bf16/mha/p4/default/tp1of4/pp0of2/"
        f"kv/v/{H0.hex()}"
    )
    assert str(key) == key.text
    assert parse_store_key(key) == parts
    assert parse_store_key(key.text) == parts


def test_rendered_key_replicated_and_embedding() -> None:
    rep = KeySpace(MLA, Shard.replicated()).key(DEFAULT_NAMESPACE, "kv", "latent", H0)
    assert rep.text == (
        "kvs1/_/deepseek-ai%2FDeepSeek-V3/fp8_e4m3/mla/p2/default/tp-rep/pp0of1/kv/latent/"
        + H0.hex()
    )
    emb = KeySpace(EMB).key(DEFAULT_NAMESPACE, "mm", "emb", H0)
    assert "/emb/d1280/" in emb.text
    assert parse_store_key(emb).model == EMB


@given(parts=key_parts)
def test_render_parse_round_trip(parts: KeyParts) -> None:
    key = render_store_key(parts)
    assert parse_store_key(key) == parts
    assert render_store_key(parse_store_key(key.text)) == key
    assert key.text.count("/") == 11  # one segment per field: '/' in names is always escaped


@given(first=key_parts, second=key_parts, field=st.sampled_from(_PARTS_FIELDS))
def test_rendering_is_injective_field_by_field(
    first: KeyParts, second: KeyParts, field: str
) -> None:
    changed = attrs.evolve(first, **{field: getattr(second, field)})
    assume(changed != first)
    assert render_store_key(changed) != render_store_key(first)


@given(parts=key_parts, name=model_names, dtype=dtypes)
def test_model_name_and_dtype_changes_change_the_key(
    parts: KeyParts, name: str, dtype: str
) -> None:
    for model in (attrs.evolve(parts.model, name=name), attrs.evolve(parts.model, dtype=dtype)):
        if model != parts.model:
            assert render_store_key(attrs.evolve(parts, model=model)) != render_store_key(parts)


@given(first=key_parts, second=key_parts)
def test_rendering_is_injective(first: KeyParts, second: KeyParts) -> None:
    assert (render_store_key(first) == render_store_key(second)) == (first == second)


def test_replicated_shard_has_no_tp_size() -> None:
    """A replicated (MLA) shard is the same for every tp size; giving it one is refused, so two
    shards can never render to the same key."""
    with pytest.raises(MisuseError):
        Shard(tp_rank=None, tp_size=4)
    parts = KeyParts(
        model=MLA,
        namespace_id="default",
        shard=Shard.replicated(),
        pool="kv",
        component="latent",
        page_hash=H0,
    )
    assert parse_store_key(render_store_key(parts)) == parts


def test_empty_namespace_id_is_rejected() -> None:
    with pytest.raises(MisuseError):
        KeyParts(model=MHA, namespace_id="", shard=Shard(), pool="kv", component="k", page_hash=H0)


# ----------------------------------------------------------------------------------------------
# Double rendering and corrupted keys (I1)


def test_rendering_a_rendered_key_is_refused() -> None:
    key = KeySpace(MHA).key(DEFAULT_NAMESPACE, "kv", "k", H0)
    with pytest.raises(DoubleRenderError):
        render_store_key(key)  # type: ignore[arg-type]
    with pytest.raises(DoubleRenderError):
        render_store_key(key.text)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        render_store_key(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("wrong", ["store_key", "store_key_text", "hex"])
def test_page_hash_field_must_be_a_page_hash(wrong: str) -> None:
    key = KeySpace(MHA).key(DEFAULT_NAMESPACE, "kv", "k", H0)
    value = {"store_key": key, "store_key_text": key.text, "hex": H0.hex()}[wrong]
    parts = KeyParts(
        model=MHA,
        namespace_id="default",
        shard=Shard(),
        pool="kv",
        component="k",
        page_hash=value,  # type: ignore[arg-type]
    )
    with pytest.raises(DoubleRenderError):
        render_store_key(parts)
    with pytest.raises(DoubleRenderError):
        KeySpace(MHA).key(DEFAULT_NAMESPACE, "kv", "k", value)  # type: ignore[arg-type]


def test_double_render_error_is_a_type_error() -> None:
    assert issubclass(DoubleRenderError, TypeError)


@pytest.mark.parametrize("version", [0, 3, -1])
def test_other_schema_versions_are_not_rendered(version: int) -> None:
    parts = KeyParts(
        model=MHA,
        namespace_id="default",
        shard=Shard(),
        pool="kv",
        component="k",
        page_hash=H0,
        version=version,
    )
    with pytest.raises(MisuseError):
        render_store_key(parts)


@pytest.mark.parametrize("schema", [0, 3, True, "2", None])
def test_a_key_space_takes_a_known_schema_only(schema: object) -> None:
    with pytest.raises(MisuseError, match="a key schema version is one of"):
        KeySpace(MHA, schema=schema)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model", "v1", "v2"),
    [(MHA, ("k", "v"), ("page",)), (MLA, ("latent",), ("page",)), (EMB, ("emb",), ("emb",))],
)
def test_schema_two_stores_one_object_per_kv_page(
    model: ModelIdentity, v1: tuple[str, ...], v2: tuple[str, ...]
) -> None:
    """Issue 20: under schema 2 a KV page is one ``page`` object; nothing of schema 1 is ever
    rendered by a schema-2 key space (the version is the first segment), side pools keep their
    components."""
    old, new = KeySpace(model, tag="t"), KeySpace(model, tag="t", schema=2)
    assert (old.components, new.components) == (v1, v2)
    assert old != new
    pool = "emb" if model.kind is KVKind.EMBEDDING else "kv"
    new_keys = new.page_keys(DEFAULT_NAMESPACE, H0, pool)
    assert [parse_store_key(key).version for key in new_keys] == [2] * len(v2)
    assert all(key.text.startswith("kvs2/t/") for key in new_keys)
    assert not set(new_keys) & set(old.page_keys(DEFAULT_NAMESPACE, H0, pool))
    side = new.key(DEFAULT_NAMESPACE, "mamba", "conv_0", H0)
    assert parse_store_key(side).component == "conv_0"
    assert side != old.key(DEFAULT_NAMESPACE, "mamba", "conv_0", H0)


def _corruptions(text: str, tag: str | None) -> list[str]:
    prefix = text[: text.index("/") + 1]
    version = int(prefix[3:-1])
    rest = text[len(prefix) :]
    out = [
        prefix + text,  # doubled prefix, glued
        text.replace(prefix, prefix + prefix, 1),  # doubled prefix, inserted
        "prod/" + text,  # tag concatenated in front
        text + "/prod",  # tag concatenated at the end
        text + "prod",
        prefix + "prod/" + rest,  # a second tag segment inserted
        f"kvs0{version}/" + rest,  # non-canonical version
        f"kvs{max(SCHEMA_VERSIONS) + 1}/" + rest,  # unknown version
        text[:-64] + text[-64:].upper(),  # non-canonical hex
        text[:-2],  # truncated hash
        text.replace("/", "//", 1),
        text + "/",
    ]
    if tag is not None:
        out.append(text.replace(f"/{tag}/", f"/{tag}/{tag}/", 1))  # tag segment doubled
        out.append(text.replace(f"{prefix}{tag}/", f"{prefix}_/{tag}/", 1))  # tag added to untagged
    return [corrupted for corrupted in out if corrupted != text]


@given(parts=key_parts)
def test_corrupted_keys_do_not_parse(parts: KeyParts) -> None:
    text = render_store_key(parts).text
    for corrupted in _corruptions(text, parts.tag):
        with pytest.raises(KeyParseError):
            parse_store_key(corrupted)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "kvs1",
        "hello/world",
        f"kvs1/_/m/bf16/mha/p04/default/tp0of1/pp0of1/kv/k/{'0' * 64}",  # non-canonical number
        f"kvs1/_/m/bf16/mha/d4/default/tp0of1/pp0of1/kv/k/{'0' * 64}",  # KV kind with a dim
        f"kvs1/_/m/bf16/emb/p4/default/tp0of1/pp0of1/kv/k/{'0' * 64}",  # embedding with pages
        f"kvs1/_/m/bf16/xyz/p4/default/tp0of1/pp0of1/kv/k/{'0' * 64}",  # unknown kind
        f"kvs1/_/m/bf16/mha/p4/default/tp4of4/pp0of1/kv/k/{'0' * 64}",  # rank out of range
        f"kvs1/_/m/bf16/mha/p4/default/tp0of1/pp0of1/KV/k/{'0' * 64}",  # bad pool name
        f"kvs1/_/%6D/bf16/mha/p4/default/tp0of1/pp0of1/kv/k/{'0' * 64}",  # over-escaped name
    ],
)
def test_malformed_keys_do_not_parse(text: str) -> None:
    with pytest.raises(KeyParseError):
        parse_store_key(text)


def test_parse_rejects_non_strings() -> None:
    with pytest.raises(KeyParseError):
        parse_store_key(b"kvs1/...")  # type: ignore[arg-type]


def test_key_parse_error_is_a_value_error() -> None:
    assert issubclass(KeyParseError, ValueError)


# ----------------------------------------------------------------------------------------------
# Isolation: different key spaces never share a key


def test_tp_size_isolation() -> None:
    small = KeySpace(MHA, Shard(tp_rank=0, tp_size=2))
    large = KeySpace(MHA, Shard(tp_rank=0, tp_size=4))
    assert small.page_keys(DEFAULT_NAMESPACE, H0) != large.page_keys(DEFAULT_NAMESPACE, H0)
    assert not set(small.page_keys(DEFAULT_NAMESPACE, H0)) & set(
        large.page_keys(DEFAULT_NAMESPACE, H0)
    )


def test_tp_rank_pp_and_replication_isolation() -> None:
    spaces = [
        KeySpace(MLA, Shard(tp_rank=0, tp_size=2)),
        KeySpace(MLA, Shard(tp_rank=1, tp_size=2)),
        KeySpace(MLA, Shard.replicated()),
        KeySpace(MLA, Shard(tp_rank=0, tp_size=1)),
        KeySpace(MLA, Shard(tp_rank=0, tp_size=1, pp_rank=1, pp_size=2)),
        KeySpace(MLA, Shard(tp_rank=0, tp_size=1, pp_rank=0, pp_size=2)),
    ]
    keys = {space.key(DEFAULT_NAMESPACE, "kv", "latent", H0) for space in spaces}
    assert len(keys) == len(spaces)


def test_namespace_isolation() -> None:
    space = KeySpace(MHA)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    all_keys: list[StoreKey] = []
    for namespace in (Namespace(), Namespace("lora-1"), Namespace("lora-1", "t"), Namespace("")):
        for page_hash in chain_page_hashes(tokens, 4, namespace):
            all_keys.extend(space.page_keys(namespace, page_hash))
    assert len(set(all_keys)) == len(all_keys)
    # Even the same page hash under two namespaces renders to different keys.
    assert space.key(Namespace(), "kv", "k", H0) != space.key(Namespace("x"), "kv", "k", H0)


def test_tag_isolation() -> None:
    keys = {
        KeySpace(MHA, tag=tag).key(DEFAULT_NAMESPACE, "kv", "k", H0)
        for tag in (None, "a", "b", "A", "a.b", "a-b")
    }
    assert len(keys) == 6


def test_model_identity_isolation() -> None:
    variants = [
        MHA,
        attrs.evolve(MHA, dtype="fp16"),
        attrs.evolve(MHA, page_size=8),
        attrs.evolve(MHA, name="other"),
        attrs.evolve(MHA, kind=KVKind.MLA),
    ]
    keys = {KeySpace(model).key(DEFAULT_NAMESPACE, "kv", "k", H0) for model in variants}
    assert len(keys) == len(variants)


def test_pool_and_component_isolation() -> None:
    space = KeySpace(MHA)
    keys = {
        space.key(DEFAULT_NAMESPACE, pool, component, H0)
        for pool in ("kv", "mamba", "indexer")
        for component in ("k", "v", "conv0", "temporal")
    }
    assert len(keys) == 12


@pytest.mark.parametrize(("model", "components"), [(MHA, ("k", "v")), (MLA, ("latent",))])
def test_page_keys_per_kind(model: ModelIdentity, components: tuple[str, ...]) -> None:
    space = KeySpace(model, tag="t1")
    keys = space.page_keys(DEFAULT_NAMESPACE, H0)
    assert tuple(parse_store_key(key).component for key in keys) == components
    for key in keys:
        parts = parse_store_key(key)
        assert (parts.pool, parts.page_hash, parts.tag, parts.model) == ("kv", H0, "t1", model)
    assert keys == tuple(space.key(DEFAULT_NAMESPACE, "kv", c, H0) for c in components)
    side = space.page_keys(DEFAULT_NAMESPACE, H0, pool="indexer")
    assert {parse_store_key(key).pool for key in side} == {"indexer"}


# ----------------------------------------------------------------------------------------------
# Determinism across processes (I8)

_DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import json
    from kvstrata.model.keys import (
        KeySpace, KVKind, ModelIdentity, Namespace, Shard, chain_page_hashes, content_hash,
    )

    def compute():
        model = ModelIdentity(name="org/model x", dtype="bf16", kind=KVKind.MHA, page_size=3)
        out = {}
        for label, namespace in [
            ("default", Namespace()),
            ("lora", Namespace(extra_key="lora-7")),
            ("tenant", Namespace(extra_key="lora-7", salt="tenant-\\u00e9")),
            ("empty", Namespace(extra_key="")),
        ]:
            hashes = chain_page_hashes(list(range(10)) + [2**32 - 1, 5], 3, namespace)
            space = KeySpace(model, Shard(tp_rank=1, tp_size=2), tag="blue")
            out[label] = {
                "key_id": namespace.key_id(),
                "hashes": [h.hex() for h in hashes],
                "keys": [k.text for h in hashes for k in space.page_keys(namespace, h)],
                "side": [space.key(namespace, "mamba", "conv0", h).text for h in hashes],
            }
        out["content"] = content_hash(b"media").hex()
        return out
    """
)


def _in_process_values() -> object:
    scope: dict[str, object] = {}
    exec(_DETERMINISM_SCRIPT, scope)
    return scope["compute"]()  # type: ignore[operator]


@pytest.mark.slow
@pytest.mark.parametrize("hash_seed", ["0", "12345", "random"])
def test_keys_are_deterministic_across_processes(hash_seed: str) -> None:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    script = _DETERMINISM_SCRIPT + "\nprint(json.dumps(compute(), sort_keys=True))\n"
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(result.stdout) == _in_process_values()


@given(
    name=st.text(min_size=1, max_size=12),
    tag=st.none() | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9.-]{0,8}", fullmatch=True),
    extra=st.none() | st.text(max_size=8),
    pool=st.sampled_from(["kv", "indexer", "mamba"]),
    component=st.sampled_from(["k", "v", "latent", "conv0", "temporal"]),
    digest=st.binary(min_size=32, max_size=32),
    mla=st.booleans(),
    schema=st.sampled_from(SCHEMA_VERSIONS),
)
def test_key_space_fast_path_equals_the_one_renderer(  # noqa: PLR0917
    name: str,
    tag: str | None,
    extra: str | None,
    pool: str,
    component: str,
    digest: bytes,
    mla: bool,
    schema: int,
) -> None:
    """KeySpace.key memoises the constant part of a key: byte for byte what render_store_key makes,
    parseable back, and a second call with another page hash reuses the memo correctly."""
    kind = KVKind.MLA if mla else KVKind.MHA
    shard = Shard.replicated() if mla else Shard(tp_rank=1, tp_size=2)
    space = KeySpace(
        ModelIdentity(name=name, dtype="bf16", kind=kind, page_size=16), shard, tag, schema=schema
    )
    namespace = Namespace(extra_key=extra)
    for page in (PageHash(digest), PageHash(bytes(reversed(digest)))):
        expected = render_store_key(
            KeyParts(
                model=space.model,
                namespace_id=namespace.key_id(),
                shard=shard,
                pool=pool,
                component=component,
                page_hash=page,
                tag=tag,
                version=schema,
            )
        )
        assert space.key(namespace, pool, component, page) == expected
        assert parse_store_key(expected).page_hash == page


@given(
    digests=st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=4),
    components=st.lists(
        st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), min_size=1, max_size=4
    ),
    extra=st.sampled_from([None, "lora-1"]),
    schema=st.sampled_from(SCHEMA_VERSIONS),
)
def test_component_keys_are_the_key_of_each_component(
    digests: list[bytes], components: list[str], extra: str | None, schema: int
) -> None:
    """KeySpace.component_keys (one memo lookup for all of an embedding's unit objects) renders
    what KeySpace.key renders for each component, in order, for every page it is asked about, with
    one memo per namespace, pool and component list (two namespaces, two pools and a shorter
    component list share the one key space here, interleaved)."""
    space = KeySpace(EMB, tag="t", schema=schema)
    namespaces = (Namespace(extra_key=extra), Namespace(extra_key=f"{extra or ''}other"))
    lists = (tuple(components), tuple(components[:1]))
    for digest in digests:
        page = PageHash(digest)
        for namespace in namespaces:
            for pool in ("emb", "emb2"):
                for names in lists:
                    want = tuple(space.key(namespace, pool, name, page) for name in names)
                    assert space.component_keys(namespace, pool, names, page) == want
    with pytest.raises(DoubleRenderError):
        space.component_keys(namespaces[0], "emb", lists[0], want[0])  # type: ignore[arg-type]


def test_key_space_memo_is_not_part_of_identity() -> None:
    model = ModelIdentity(name="m", dtype="bf16", kind=KVKind.MHA, page_size=4)
    warm, cold = KeySpace(model, tag="t"), KeySpace(model, tag="t")
    warm.page_keys(Namespace(), PageHash(bytes(32)))
    assert warm == cold and hash(warm) == hash(cold)
    with pytest.raises(DoubleRenderError):
        warm.key(Namespace(), "kv", "k", warm.page_keys(Namespace(), PageHash(bytes(32)))[0])  # type: ignore[arg-type]


@given(
    digests=st.lists(st.binary(min_size=32, max_size=32), max_size=6),
    model=st.sampled_from([MHA, MLA]),
    extra=st.sampled_from([None, "lora-1"]),
    pool=st.sampled_from(["kv", "indexer"]),
    tag=st.sampled_from([None, "prod.eu-1"]),
    schema=st.sampled_from(SCHEMA_VERSIONS),
)
def test_a_rendered_batch_is_the_page_keys_of_every_page(  # noqa: PLR0917
    digests: list[bytes],
    model: ModelIdentity,
    extra: str | None,
    pool: str,
    tag: str | None,
    schema: int,
) -> None:
    """Issue 20: ``KeySpace.rendered`` (one object per batch) gives exactly the strings
    ``page_keys`` gives page by page, page-major."""
    space = KeySpace(model, tag=tag, schema=schema)
    namespace = Namespace(extra_key=extra)
    pages = [PageHash(d) for d in digests]
    want = [key.text for page in pages for key in space.page_keys(namespace, page, pool)]
    assert space.rendered(namespace, pages, pool).texts == want
    assert len(space.rendered(namespace, pages, pool)) == len(want)


def test_a_rendered_batch_slices_and_selects_into_rendered_batches() -> None:
    space = KeySpace(MHA)
    batch = space.rendered(DEFAULT_NAMESPACE, [H0, PageHash(bytes(range(32)))])
    assert batch[1:3].texts == batch.texts[1:3] and isinstance(batch[1:3], RenderedKeys)
    assert batch.select([3, 0]).texts == [batch.texts[3], batch.texts[0]]
    with pytest.raises(MisuseError, match="takes a slice"):
        batch[0]  # type: ignore[call-overload]


@given(
    digests=st.lists(st.binary(min_size=32, max_size=32), max_size=5),
    components=st.sampled_from([("idx",), ("conv0", "temporal"), ("page",)]),
    order=st.permutations(range(4)),
)
def test_a_rendered_batch_of_given_components_is_their_keys(
    digests: list[bytes], components: tuple[str, ...], order: list[int]
) -> None:
    """``rendered(..., components=...)`` (a side pool's batch) is :meth:`KeySpace.key` of a fresh
    key space (no shared memo) per page and component, for every pool and namespace asked, in
    whatever order they are first asked (its memo is keyed by all three, apart from the KV pool's
    own), and ``join`` concatenates."""
    space = KeySpace(MHA)
    pages = [PageHash(d) for d in digests]
    asks = [
        (ns, pool)
        for ns in (DEFAULT_NAMESPACE, Namespace(extra_key="lora-1"))
        for pool in ("indexer", "mamba")
    ]
    batches = []
    for ns, pool in (asks[i] for i in order):
        batch = space.rendered(ns, pages, pool, components)
        want = [KeySpace(MHA).key(ns, pool, c, p).text for p in pages for c in components]
        assert batch.texts == want
        assert space.rendered(ns, pages, pool).texts == [  # the KV components' memo is apart
            KeySpace(MHA).key(ns, pool, c, p).text for p in pages for c in space.components
        ]
        batches.append(batch)
    joined = RenderedKeys.join(batches)
    assert joined.texts == [text for batch in batches for text in batch.texts]
    with pytest.raises(MisuseError):
        RenderedKeys.join([batches[0], ["kvs1/not/a/batch"]])  # type: ignore[list-item]


def test_a_rendered_batch_takes_page_hashes_only() -> None:
    space = KeySpace(MHA)
    with pytest.raises(DoubleRenderError):
        space.rendered(DEFAULT_NAMESPACE, [H0, H0.digest.hex()])  # type: ignore[list-item]
