"""What ``kvstrata.model.keys`` and ``kvstrata.model.l3.objects`` promise that ``test_keys.py`` and the
cache tests did not pin down: found by mutation testing (``scripts/mutation_score.py``), one test per
surviving mutant.

The exact error messages (each names what was wrong and quotes the offending value: a message turned
into ``None``, or one that blames the wrong check, fails here), the type checks of ``ModelIdentity``
and ``Shard`` (a bool, a float, ``None`` or a string where an int belongs is a ``MisuseError``, never a
``TypeError`` from a comparison or a silently accepted value), the seed of a namespace with a salt and
no extra key, the short form of a page hash's repr, the key space's memo (the fixed part of a key is
rendered once per namespace, pool and component, as its docstring promises), and the store objects
of a page and of a state when a config has several side pools of one policy.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable, Sequence

import pytest

from kvstrata.model import keys as keys_module
from kvstrata.model.cache.config import CacheConfig
from kvstrata.model.errors import DoubleRenderError, KeyParseError, MisuseError
from kvstrata.model.hybrid import HitPolicy, SidePool
from kvstrata.model.keys import (
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
from kvstrata.model.l3.objects import page_objects, state_objects

MHA = ModelIdentity(name="m", dtype="bf16", kind=KVKind.MHA, page_size=4)
H0 = PageHash(bytes(range(32)))
NS = Namespace(extra_key="lora-1")
ZERO_KEY = f"kvs1/_/m/bf16/mha/p4/default/tp0of1/pp0of1/kv/k/{'0' * 64}"


def exactly(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for the whole message, nothing around it."""
    return "^" + re.escape(message) + "$"


# ------------------------------------------------------------------------------------- namespaces
def test_seed_of_a_salt_without_extra_key_known_answer() -> None:
    salt = b"tenant-a"
    expected = hashlib.sha256(
        b"kvstrata.namespace.v1\x00"
        + struct.pack("<Q", 1)
        + b"\x00"  # no extra key: one zero byte, where an extra key has \x01 and its bytes
        + struct.pack("<Q", len(salt))
        + salt
    ).digest()
    assert Namespace(salt="tenant-a").seed() == expected
    assert Namespace(salt="tenant-a").key_id() == "ns-" + expected.hex()[:32]


# ------------------------------------------------------------------------------------- page hashes
def test_page_hash_repr_shows_the_first_twelve_hex_digits() -> None:
    assert repr(H0) == "PageHash(000102030405…)"


def test_from_hex_message_quotes_the_text() -> None:
    with pytest.raises(KeyParseError, match=exactly("not a hex page hash: 'zz'")):
        PageHash.from_hex("zz")


def test_content_hash_message_names_the_type() -> None:
    with pytest.raises(MisuseError, match=exactly("content_hash takes bytes, got str")):
        content_hash("text")  # type: ignore[arg-type]


def test_chain_message_names_the_token_range() -> None:
    with pytest.raises(MisuseError, match=r"^token ids must be ints in \[0, 4294967295\]: \S"):
        chain_page_hashes([1, -1], 2)


# ---------------------------------------------------------------------- identities, shards, parts
def _identity(**fields: object) -> Callable[[], object]:
    values: dict[str, object] = {"name": "m", "dtype": "bf16", "kind": KVKind.MHA, "page_size": 4}
    return lambda: ModelIdentity(**{**values, **fields})  # type: ignore[arg-type]


def _shard(**fields: object) -> Callable[[], object]:
    return lambda: Shard(**fields)  # type: ignore[arg-type]


def _parts(**fields: object) -> Callable[[], object]:
    values: dict[str, object] = {
        "model": MHA,
        "namespace_id": "default",
        "shard": Shard(),
        "pool": "kv",
        "component": "k",
        "page_hash": H0,
    }
    return lambda: KeyParts(**{**values, **fields})  # type: ignore[arg-type]


SHARD = r"Shard\(tp_rank="


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PageHash(b"ab"), exactly("a page hash is 32 bytes of SHA-256, got b'ab'")),
        (_identity(name=""), exactly("name must be a non-empty string, got ''")),
        (_identity(dtype=""), exactly("dtype must be a non-empty string, got ''")),
        (_identity(page_size=True), exactly("page_size must be an int, got True")),
        (_identity(page_size=4.0), exactly("page_size must be an int, got 4.0")),
        (_identity(page_size=4, dim=2.5), exactly("dim must be an int, got 2.5")),
        (
            _identity(kind=KVKind.EMBEDDING, page_size=4, dim=8),
            "^" + re.escape("an embedding identity needs dim > 0 and no page size: ModelIdentity("),
        ),
        (
            _identity(page_size=4, dim=8),
            "^" + re.escape("a KV identity needs page_size > 0 and no dim: ModelIdentity("),
        ),
        (_shard(tp_size=True), exactly("tp_size must be an int, got True")),
        (_shard(tp_size=2.0), exactly("tp_size must be an int, got 2.0")),
        (_shard(pp_size=None), exactly("pp_size must be an int, got None")),
        (_shard(pp_rank=0.0), exactly("pp_rank must be an int, got 0.0")),
        (_shard(tp_rank="0"), exactly("tp_rank must be an int, got '0'")),
        (_shard(tp_rank=True, tp_size=2), exactly("tp_rank must be an int, got True")),
        (
            _shard(tp_rank=None, tp_size=4),
            "^" + re.escape("a replicated shard has no tp size (use Shard.replicated()): ") + SHARD,
        ),
        (_shard(tp_size=0), "^" + re.escape("tp_size and pp_size must be > 0: ") + SHARD),
        (_shard(pp_size=0), "^" + re.escape("tp_size and pp_size must be > 0: ") + SHARD),
        (
            _shard(tp_rank=2, tp_size=2),
            "^" + re.escape("tp_rank must be in [0, tp_size): ") + SHARD,
        ),
        (_shard(pp_rank=1), "^" + re.escape("pp_rank must be in [0, pp_size): ") + SHARD),
        (_parts(namespace_id=""), exactly("namespace_id must be a non-empty string, got ''")),
        (
            _parts(pool="KV"),
            exactly(
                "pool must match [a-z][a-z0-9_]* with an optional .<layout> of 1-32 [0-9a-z], "
                "got 'KV'"
            ),
        ),
        (
            _parts(pool="mamba.AB"),
            exactly(
                "pool must match [a-z][a-z0-9_]* with an optional .<layout> of 1-32 [0-9a-z], "
                "got 'mamba.AB'"
            ),
        ),
        (_parts(component="k-v"), exactly("component must match [a-z][a-z0-9_]*, got 'k-v'")),
        (
            _parts(tag="-x"),
            exactly("a deployment tag must match [A-Za-z0-9][A-Za-z0-9.-]*, got '-x'"),
        ),
    ],
    ids=lambda value: None if callable(value) else re.sub(r"\W+", "-", value).strip("-")[:48],
)
def test_validation_messages_name_the_field_and_the_value(
    make: Callable[[], object], message: str
) -> None:
    with pytest.raises(MisuseError, match=message):
        make()


# ------------------------------------------------------------------------------- render messages
def test_render_messages_say_what_was_given() -> None:
    key = KeySpace(MHA).key(Namespace(), "kv", "k", H0)
    with pytest.raises(
        DoubleRenderError, match=exactly(f"refusing to render an already rendered key: {key!r}")
    ):
        render_store_key(key)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=exactly("render_store_key takes KeyParts, got int")):
        render_store_key(42)  # type: ignore[arg-type]
    with pytest.raises(DoubleRenderError, match=exactly("page_hash is not a PageHash: 'abc'")):
        render_store_key(_parts(page_hash="abc")())  # type: ignore[arg-type]
    with pytest.raises(MisuseError, match=exactly("cannot render schema version 3")):
        render_store_key(_parts(version=3)())  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- parse messages
def test_parse_messages_say_what_is_wrong() -> None:
    with pytest.raises(KeyParseError, match=exactly("a store key is a string, got bytes")):
        parse_store_key(b"kvs1/...")  # type: ignore[arg-type]
    with pytest.raises(KeyParseError, match=exactly("not a kvstrata v1 or v2 store key: 'hello'")):
        parse_store_key("hello")
    malformed = ZERO_KEY.replace("/mha/", "/xyz/")
    with pytest.raises(
        KeyParseError,
        match=exactly(f"malformed store key {malformed!r}: 'xyz' is not a valid KVKind"),
    ):
        parse_store_key(malformed)
    padded = ZERO_KEY.replace("/p4/", "/p04/")
    with pytest.raises(
        KeyParseError, match=exactly(f"store key is not in canonical form: {padded!r}")
    ):
        parse_store_key(padded)
    assert parse_store_key(ZERO_KEY).page_hash == PageHash(bytes(32))


# ------------------------------------------------------------------------------------------ key space
def test_key_space_refuses_a_non_page_hash_with_its_repr() -> None:
    with pytest.raises(DoubleRenderError, match=exactly("page_hash is not a PageHash: 'abc'")):
        KeySpace(MHA).key(NS, "kv", "k", "abc")  # type: ignore[arg-type]


def test_key_space_renders_the_fixed_part_once_per_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The docstring's promise: one render_store_key call per (namespace, pool, component), then
    only the page hash's hex digits are appended."""
    calls: list[KeyParts] = []
    render = keys_module.render_store_key

    def counting(parts: KeyParts) -> StoreKey:
        calls.append(parts)
        return render(parts)

    monkeypatch.setattr(keys_module, "render_store_key", counting)
    space = KeySpace(MHA, Shard(tp_rank=1, tp_size=2), tag="t")
    pages = [PageHash(bytes([i]) * 32) for i in range(5)]
    first = [space.page_keys(NS, page) for page in pages]
    assert len(calls) == 2  # k and v, once each
    assert [space.page_keys(NS, page) for page in pages] == first
    assert len(calls) == 2
    space.key(Namespace(), "kv", "k", pages[0])
    space.key(NS, "mamba", "k", pages[0])
    space.key(NS, "kv", "conv0", pages[0])
    assert len(calls) == 5
    monkeypatch.undo()
    for page, keys in zip(pages, first, strict=True):
        assert keys == tuple(
            render_store_key(
                KeyParts(
                    model=MHA,
                    namespace_id=NS.key_id(),
                    shard=space.shard,
                    pool="kv",
                    component=component,
                    page_hash=page,
                    tag="t",
                )
            )
            for component in ("k", "v")
        )


def test_every_path_reuses_the_memoised_fixed_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """``key``, ``component_keys``, ``page_keys`` and ``rendered`` (with the key space's components
    or given ones) share one memo: a (namespace, pool, component)'s fixed part is rendered once,
    whichever path asked for it first."""
    calls: list[KeyParts] = []
    render = keys_module.render_store_key
    monkeypatch.setattr(
        keys_module, "render_store_key", lambda parts: calls.append(parts) or render(parts)
    )
    space = KeySpace(MHA)
    pages = [PageHash(bytes([i]) * 32) for i in range(5)]
    space.rendered(NS, pages, "kv", ("k",))
    assert len(calls) == 1
    space.page_keys(NS, pages[0])  # k from the memo, v rendered
    assert len(calls) == 2
    space.rendered(NS, pages)
    space.component_keys(NS, "kv", ("v", "k"), pages[1])
    space.key(NS, "kv", "v", pages[2])
    space.rendered(NS, pages, "kv", ("v",))
    assert len(calls) == 2


def test_rendered_takes_a_joins_answer_and_falls_back_when_it_declines() -> None:
    """``join(prefixes, pages)`` gets the fixed parts in component order and the pages; its answer
    is taken as it is when it has one key per page and component, and left for the key space's
    own rendering when it is None or of another length."""
    space = KeySpace(MHA, schema=1)
    pages = [PageHash(bytes([i]) * 32) for i in range(5)]
    expected = [key.text for page in pages for key in space.page_keys(NS, page)]
    asked: list[tuple[tuple[str, ...], list[PageHash]]] = []
    answer: list[str] = []

    def join(prefixes: tuple[str, ...], batch: Sequence[PageHash]) -> list[str]:
        asked.append((prefixes, list(batch)))
        answer.extend(prefix + page.digest.hex() for page in batch for prefix in prefixes)
        return answer

    got = space.rendered(NS, pages, join=join)
    assert got.texts is answer and got.texts == expected
    prefixes = tuple(key.text[:-64] for key in space.page_keys(NS, pages[0]))
    assert asked == [(prefixes, pages)]
    assert space.rendered(NS, pages, join=lambda *_: None).texts == expected
    short = ["not a key"]
    assert space.rendered(NS, pages, join=lambda *_: short).texts == expected


def test_batch_errors_name_the_value() -> None:
    space = KeySpace(MHA)
    message = exactly("page_hash is not a PageHash: 'abc'")
    with pytest.raises(DoubleRenderError, match=message):
        space.component_keys(NS, "kv", ("k",), "abc")  # type: ignore[arg-type]
    with pytest.raises(DoubleRenderError, match=message):
        space.rendered(NS, [PageHash(bytes(32)), "abc"])  # type: ignore[list-item]
    with pytest.raises(MisuseError, match=exactly("RenderedKeys.join takes RenderedKeys, got 'x'")):
        RenderedKeys.join([RenderedKeys([]), "x"])  # type: ignore[list-item]


# --------------------------------------------------------------------------- model/l3/objects.py
def test_page_and_state_objects_cover_every_side_pool_of_each_policy() -> None:
    keys = KeySpace(MHA)
    pools = (
        SidePool("indexer", HitPolicy.ALL_PAGES, ("idx",)),
        SidePool("conv", HitPolicy.TRAILING_PAGES, ("conv0", "conv1")),
        SidePool("swa", HitPolicy.ALL_PAGES, ("k", "v")),
        SidePool("ssm", HitPolicy.TRAILING_PAGES, ("temporal",)),
    )
    config = CacheConfig(
        page_size=4,
        device_pages=8,
        host_pages=8,
        keys=keys,
        side_pools=pools,
        device_states=1,
        host_states=1,
    )
    assert page_objects(config, NS, H0) == (
        ("k", keys.key(NS, "kv", "k", H0)),
        ("v", keys.key(NS, "kv", "v", H0)),
        ("idx", keys.key(NS, "indexer", "idx", H0)),
        ("k", keys.key(NS, "swa", "k", H0)),
        ("v", keys.key(NS, "swa", "v", H0)),
    )
    assert state_objects(config, NS, H0) == (
        ("conv0", keys.key(NS, "conv", "conv0", H0)),
        ("conv1", keys.key(NS, "conv", "conv1", H0)),
        ("temporal", keys.key(NS, "ssm", "temporal", H0)),
    )
