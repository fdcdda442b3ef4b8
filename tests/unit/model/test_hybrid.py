"""Tests of kvstrata.model.hybrid: side-pool hit policies and the usable prefix (SPEC §5, I6)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.hybrid import (
    KV_POOL,
    HitPolicy,
    Probe,
    SidePool,
    check_side_pools,
    check_usable,
    hybrid_exists,
    is_usable,
    pool_boundary,
    pool_segment,
    side_components,
    side_page_keys,
    side_rendered,
    usable_prefix,
)
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    SCHEMA_VERSIONS,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    StoreKey,
    chain_page_hashes,
    parse_store_key,
)
from kvstrata.model.store import StoreModel

ALL = HitPolicy.ALL_PAGES
TRAILING = HitPolicy.TRAILING_PAGES


class RecordingProbe:
    """A probe over a presence list that records every page it is asked about."""

    def __init__(self, present: Sequence[bool]) -> None:
        self.present = list(present)
        self.calls: list[int] = []

    def __call__(self, index: int) -> bool:
        self.calls.append(index)
        return self.present[index]


def _never(index: int) -> bool:
    raise AssertionError(f"probed page {index}")


def _usable_oracle(policy: HitPolicy, present: Sequence[bool], prefix: int) -> bool:
    if policy is ALL:
        return all(present[:prefix])
    return prefix == 0 or present[prefix - 1]


def _prefix_oracle(kv_hit: int, pools: Sequence[tuple[HitPolicy, Sequence[bool]]]) -> int:
    """Brute force: the largest n <= kv_hit usable in every pool."""
    return max(
        n
        for n in range(kv_hit + 1)
        if all(_usable_oracle(policy, present, n) for policy, present in pools)
    )


# ----------------------------------------------------------------------------------------------
# pool_boundary / is_usable


@pytest.mark.parametrize(
    ("present", "kv_hit", "expected", "probed"),
    [
        ([True, True, False, True], 4, 2, [0, 1, 2]),
        ([True, True, True, True], 3, 3, [0, 1, 2]),
        ([False, True], 2, 0, [0]),
        ([True], 0, 0, []),
    ],
)
def test_all_pages_boundary(
    present: list[bool], kv_hit: int, expected: int, probed: list[int]
) -> None:
    probe = RecordingProbe(present)
    assert pool_boundary(ALL, probe, kv_hit) == expected
    assert probe.calls == probed


@pytest.mark.parametrize(
    ("present", "kv_hit", "expected", "probed"),
    [
        ([False, True, False, False, True], 5, 5, [4]),
        ([False, True, False, False, True], 4, 2, [3, 2, 1]),
        ([False, False, False], 3, 0, [2, 1, 0]),
        ([True, False, True], 2, 1, [1, 0]),
        ([True], 0, 0, []),
    ],
)
def test_trailing_pages_boundary(
    present: list[bool], kv_hit: int, expected: int, probed: list[int]
) -> None:
    probe = RecordingProbe(present)
    assert pool_boundary(TRAILING, probe, kv_hit) == expected
    assert probe.calls == probed


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_boundary_rejects_bad_counts(bad: object) -> None:
    with pytest.raises(MisuseError):
        pool_boundary(ALL, _never, bad)  # type: ignore[arg-type]
    with pytest.raises(MisuseError):
        usable_prefix(bad, [])  # type: ignore[arg-type]
    with pytest.raises(MisuseError):
        is_usable(ALL, _never, bad)  # type: ignore[arg-type]


def test_bad_policy_is_misuse() -> None:
    with pytest.raises(MisuseError):
        pool_boundary("all", _never, 1)  # type: ignore[arg-type]
    with pytest.raises(MisuseError):
        is_usable("all", _never, 1)  # type: ignore[arg-type]
    with pytest.raises(MisuseError):
        usable_prefix(2, [("all", _never)])  # type: ignore[list-item]


def test_is_usable() -> None:
    present = [True, False, True]
    assert is_usable(ALL, RecordingProbe(present), 1)
    assert not is_usable(ALL, RecordingProbe(present), 3)
    assert is_usable(TRAILING, RecordingProbe(present), 3)
    assert not is_usable(TRAILING, RecordingProbe(present), 2)
    assert is_usable(TRAILING, _never, 0)
    assert is_usable(ALL, _never, 0)


# ----------------------------------------------------------------------------------------------
# usable_prefix


def test_no_side_pools_gives_the_kv_hit() -> None:
    assert usable_prefix(5, []) == 5
    assert usable_prefix(0, []) == 0


def test_kv_miss_probes_nothing() -> None:
    assert usable_prefix(0, [(ALL, _never), (TRAILING, _never)]) == 0


def test_min_of_independent_boundaries_would_break_i6() -> None:
    # The design-rationale example: indexer on pages 0-1 only, Mamba state only at page 4. The
    # naive minimum of independent boundaries is min(2, 5) = 2, which the Mamba pool cannot serve.
    indexer = [True, True, False, False, False]
    mamba = [False, False, False, False, True]
    naive = min(
        pool_boundary(ALL, RecordingProbe(indexer), 5),
        pool_boundary(TRAILING, RecordingProbe(mamba), 5),
    )
    assert naive == 2
    assert not _usable_oracle(TRAILING, mamba, naive)
    assert (
        usable_prefix(5, [(TRAILING, RecordingProbe(mamba)), (ALL, RecordingProbe(indexer))]) == 0
    )


@pytest.mark.parametrize(
    ("kv_hit", "pools", "expected"),
    [
        (5, [(ALL, [1, 1, 1, 0, 1]), (TRAILING, [0, 1, 0, 0, 1])], 2),
        (5, [(TRAILING, [0, 1, 0, 1, 0]), (TRAILING, [0, 0, 1, 1, 0])], 4),
        (5, [(TRAILING, [0, 1, 0, 0, 1]), (TRAILING, [0, 1, 0, 1, 0])], 2),
        (5, [(TRAILING, [1, 0, 1, 0, 1]), (TRAILING, [0, 1, 0, 1, 0])], 0),
        (3, [(TRAILING, [1, 1, 1, 1, 1])], 3),  # never beyond the KV hit
        (4, [(ALL, [1, 1, 1, 1]), (ALL, [1, 1, 0, 1])], 2),
    ],
)
def test_usable_prefix_examples(
    kv_hit: int, pools: list[tuple[HitPolicy, list[int]]], expected: int
) -> None:
    probes = [(policy, RecordingProbe([bool(x) for x in present])) for policy, present in pools]
    assert usable_prefix(kv_hit, probes) == expected
    assert _prefix_oracle(kv_hit, [(p, [bool(x) for x in present]) for p, present in pools]) == (
        expected
    )


presence_maps = st.integers(0, 7).flatmap(
    lambda length: st.tuples(
        st.integers(0, length),
        st.lists(
            st.tuples(
                st.sampled_from(HitPolicy),
                st.lists(st.booleans(), min_size=length, max_size=length),
            ),
            max_size=4,
        ),
    )
)


@given(case=presence_maps)
def test_usable_prefix_matches_the_brute_force_oracle(
    case: tuple[int, list[tuple[HitPolicy, list[bool]]]],
) -> None:
    kv_hit, pools = case
    probes = [(policy, RecordingProbe(present)) for policy, present in pools]
    result = usable_prefix(kv_hit, probes)
    assert result == _prefix_oracle(kv_hit, pools)
    for (policy, present), (_policy, probe) in zip(pools, probes, strict=True):
        assert _usable_oracle(policy, present, result)  # I6
        assert all(0 <= index < kv_hit for index in probe.calls)  # never beyond the KV hit
        assert len(probe.calls) == len(set(probe.calls))  # each page probed at most once


@given(case=presence_maps)
def test_usable_prefix_is_the_min_of_capped_boundaries(
    case: tuple[int, list[tuple[HitPolicy, list[bool]]]],
) -> None:
    # SPEC §5 "the minimum over pools of each pool's policy boundary", each boundary taken under the
    # final cap: at the result every pool's boundary is the result itself.
    kv_hit, pools = case
    result = usable_prefix(kv_hit, [(p, RecordingProbe(present)) for p, present in pools])
    for policy, present in pools:
        assert pool_boundary(policy, RecordingProbe(present), result) == result
    assert result <= min(
        [kv_hit] + [pool_boundary(p, RecordingProbe(present), kv_hit) for p, present in pools]
    )


# ----------------------------------------------------------------------------------------------
# SidePool


def test_side_pool_values() -> None:
    pool = SidePool("mamba", TRAILING, ["conv0", "temporal"])  # converted to a tuple
    assert pool.components == ("conv0", "temporal")
    assert attrs.evolve(pool, name="mamba2").name == "mamba2"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        pool.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "policy", "components", "error"),
    [
        (KV_POOL, ALL, ("idx",), MisuseError),
        ("Mamba", TRAILING, ("conv0",), MisuseError),
        ("", TRAILING, ("conv0",), MisuseError),
        ("a/b", TRAILING, ("conv0",), MisuseError),
        ("mamba", TRAILING, (), MisuseError),
        ("mamba", TRAILING, ("conv0", "conv0"), MisuseError),
        ("mamba", TRAILING, ("conv-0",), MisuseError),
        ("mamba", TRAILING, "conv0", MisuseError),
        ("mamba", "trailing_pages", ("conv0",), TypeError),
    ],
)
def test_side_pool_validation(
    name: str, policy: object, components: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        SidePool(name, policy, components)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# hybrid_exists / check_usable against a StoreModel


@attrs.frozen
class RecordingKeySpace(KeySpace):
    """A KeySpace that logs every key it renders."""

    log: list[StoreKey] = attrs.field(factory=list, eq=False)

    def key(self, namespace: Namespace, pool: str, component: str, page_hash: PageHash) -> StoreKey:
        rendered = super().key(namespace, pool, component, page_hash)
        self.log.append(rendered)
        return rendered

    def component_keys(
        self, namespace: Namespace, pool: str, components: tuple[str, ...], page_hash: PageHash
    ) -> tuple[StoreKey, ...]:
        rendered = super().component_keys(namespace, pool, components, page_hash)
        self.log.extend(rendered)
        return rendered


MODEL = ModelIdentity(name="org/hybrid", dtype="bf16", kind=KVKind.MHA, page_size=2)
NS = Namespace(extra_key="lora-1")
HASHES = chain_page_hashes(list(range(12)), 2, NS)  # 6 pages
INDEXER = SidePool("indexer", ALL, ("idx",))
MAMBA = SidePool("mamba", TRAILING, ("conv0", "temporal"))


def _store_with(
    keys: KeySpace,
    kv: Sequence[int],
    indexer: Sequence[int] = (),
    mamba: Sequence[int] = (),
    in_flight: Sequence[StoreKey] = (),
) -> StoreModel:
    store = StoreModel()
    objects: list[StoreKey] = []
    for page in kv:
        objects.extend(keys.page_keys(NS, HASHES[page]))
    for page in indexer:
        objects.extend(side_page_keys(keys, NS, INDEXER, HASHES[page]))
    for page in mamba:
        objects.extend(side_page_keys(keys, NS, MAMBA, HASHES[page]))
    for key in objects:
        assert store.begin_put(key)
        store.end_put(key, key.text)
    for key in in_flight:
        assert store.begin_put(key)
    return store


def test_hybrid_exists_without_side_pools_is_the_kv_hit() -> None:
    keys = KeySpace(MODEL)
    store = _store_with(keys, kv=[0, 1, 2, 4])
    assert hybrid_exists(store, keys, NS, HASHES, []) == 3
    assert hybrid_exists(store, keys, DEFAULT_NAMESPACE, HASHES, []) == 0  # namespaces never mix


def test_hybrid_exists_all_pools() -> None:
    keys = KeySpace(MODEL)
    store = _store_with(keys, kv=range(6), indexer=[0, 1, 2, 3], mamba=[1, 4])
    assert hybrid_exists(store, keys, NS, HASHES, [INDEXER]) == 4
    assert hybrid_exists(store, keys, NS, HASHES, [MAMBA]) == 5
    assert hybrid_exists(store, keys, NS, HASHES, [INDEXER, MAMBA]) == 2
    assert hybrid_exists(store, keys, NS, HASHES, [MAMBA, INDEXER]) == 2
    assert hybrid_exists(store, keys, NS, HASHES[:4], [MAMBA]) == 2


def test_partial_mamba_state_is_a_miss() -> None:
    keys = KeySpace(MODEL)
    store = _store_with(keys, kv=range(4), mamba=[3])
    assert hybrid_exists(store, keys, NS, HASHES[:4], [MAMBA]) == 4
    store.evict(keys.key(NS, "mamba", "temporal", HASHES[3]))
    assert hybrid_exists(store, keys, NS, HASHES[:4], [MAMBA]) == 0


def test_side_entries_are_one_object_under_schema_2() -> None:
    """Schema 1 keys a side entry per component, schema 2 as the one ``page`` object; the two
    versions' keys never meet, so a schema-1 store answers nothing to a schema-2 lookup."""
    one, two = KeySpace(MODEL), KeySpace(MODEL, schema=2)
    assert side_components(one, MAMBA) == ("conv0", "temporal")
    assert side_components(two, MAMBA) == ("page",)
    assert side_components(two, INDEXER) == ("page",)
    assert side_page_keys(one, NS, MAMBA, HASHES[1]) == (
        one.key(NS, "mamba", "conv0", HASHES[1]),
        one.key(NS, "mamba", "temporal", HASHES[1]),
    )
    (whole,) = side_page_keys(two, NS, MAMBA, HASHES[1])
    parts = parse_store_key(whole)
    assert (parts.version, parts.pool, parts.component) == (2, "mamba", "page")
    store = _store_with(one, kv=range(6), indexer=range(6), mamba=range(6))
    assert hybrid_exists(store, one, NS, HASHES, [INDEXER, MAMBA]) == 6
    assert hybrid_exists(store, two, NS, HASHES, [INDEXER, MAMBA]) == 0
    store = _store_with(two, kv=range(6), indexer=range(6), mamba=[2])
    assert hybrid_exists(store, two, NS, HASHES, [INDEXER, MAMBA]) == 3
    store.evict(side_page_keys(two, NS, INDEXER, HASHES[1])[0])
    assert hybrid_exists(store, two, NS, HASHES, [INDEXER]) == 1


@pytest.mark.parametrize("schema", SCHEMA_VERSIONS)
def test_a_pools_layout_is_part_of_its_keys(schema: int) -> None:
    """Two pools of one name whose entries are laid out differently (the layout token) render
    disjoint keys under either version, so neither sees the other's objects; the layout rides in
    the pool segment (``name.layout``) and parses back."""
    keys = KeySpace(MODEL, schema=schema)
    bf16 = attrs.evolve(MAMBA, layout="0123456789abcdef")
    fp16 = attrs.evolve(MAMBA, layout="fedcba9876543210")
    assert MAMBA.segment == "mamba" and bf16.segment == "mamba.0123456789abcdef"
    plain, ours, theirs = (side_page_keys(keys, NS, p, HASHES[2]) for p in (MAMBA, bf16, fp16))
    assert not set(ours) & set(theirs) and not set(ours) & set(plain)
    assert {parse_store_key(k).pool for k in ours} == {"mamba.0123456789abcdef"}
    store = _store_with(keys, kv=range(6))
    for key in side_page_keys(keys, NS, fp16, HASHES[2]):
        assert store.begin_put(key)
        store.end_put(key, key.text)
    assert hybrid_exists(store, keys, NS, HASHES[:3], [fp16]) == 3
    assert hybrid_exists(store, keys, NS, HASHES[:3], [bf16]) == 0  # another layout: a miss
    assert hybrid_exists(store, keys, NS, HASHES[:3], [MAMBA]) == 0


@pytest.mark.parametrize("layout", ["ABC", "a.b", "a/b", "x" * 33, "a_b", 7])
def test_a_layout_is_short_lowercase_alphanumerics(layout: object) -> None:
    with pytest.raises(MisuseError, match="layout"):
        SidePool("mamba", TRAILING, ("conv0",), layout=layout)  # type: ignore[arg-type]
    with pytest.raises(MisuseError, match="layout"):
        pool_segment("mamba", layout)  # type: ignore[arg-type]


@given(
    schema=st.sampled_from(SCHEMA_VERSIONS),
    pool=st.sampled_from([INDEXER, MAMBA]),
    pages=st.lists(st.integers(0, 5), max_size=6),
)
def test_side_rendered_is_side_page_keys_of_every_page(
    schema: int, pool: SidePool, pages: list[int]
) -> None:
    """The batch twin renders exactly :func:`side_page_keys` page by page, page-major."""
    keys = KeySpace(MODEL, schema=schema)
    chosen = [HASHES[i] for i in pages]
    want = [key.text for page in chosen for key in side_page_keys(keys, NS, pool, page)]
    assert side_rendered(keys, NS, pool, chosen).texts == want


def test_in_flight_objects_never_count() -> None:
    keys = KeySpace(MODEL)
    in_flight = [
        keys.key(NS, "kv", "v", HASHES[3]),
        keys.key(NS, "indexer", "idx", HASHES[2]),
        keys.key(NS, "mamba", "temporal", HASHES[1]),
    ]
    store = _store_with(keys, kv=[0, 1, 2], indexer=[0, 1], mamba=[0], in_flight=in_flight)
    for key in (keys.key(NS, "kv", "k", HASHES[3]), keys.key(NS, "mamba", "conv0", HASHES[1])):
        assert store.begin_put(key)  # the other half of each page is still in flight
        store.end_put(key, "done")
    assert hybrid_exists(store, keys, NS, HASHES, []) == 3
    assert hybrid_exists(store, keys, NS, HASHES, [INDEXER]) == 2
    assert hybrid_exists(store, keys, NS, HASHES, [INDEXER, MAMBA]) == 1
    for key in in_flight:
        store.end_put(key, "done")
    assert hybrid_exists(store, keys, NS, HASHES, [INDEXER, MAMBA]) == 2


def test_keys_are_rendered_through_the_key_space_and_never_beyond_the_kv_hit() -> None:
    keys = RecordingKeySpace(MODEL, tag="blue")
    store = _store_with(keys, kv=[0, 1, 2], indexer=range(6), mamba=range(6))
    keys.log.clear()
    assert hybrid_exists(store, keys, NS, HASHES, [INDEXER, MAMBA]) == 3
    parsed = [parse_store_key(key) for key in keys.log]  # I1: every key parses back
    assert all(parts.tag == "blue" for parts in parsed)
    kv_pages = [HASHES.index(p.page_hash) for p in parsed if p.pool == KV_POOL]
    side = [(p.pool, p.component, HASHES.index(p.page_hash)) for p in parsed if p.pool != KV_POOL]
    assert max(kv_pages) == 3  # the first KV miss, and no further
    assert side, "side pools were probed"
    assert all(page < 3 for _pool, _component, page in side)  # never beyond the KV hit
    assert len(side) == len(set(side))  # each side component key rendered once
    # The Mamba state is probed at page 2 only (TRAILING: first hit from the top).
    assert sorted(c for pool, c, _page in side if pool == "mamba") == ["conv0", "temporal"]


def test_kv_miss_probes_no_side_pool() -> None:
    keys = RecordingKeySpace(MODEL)
    store = _store_with(keys, kv=[1, 2], indexer=range(6), mamba=range(6))
    keys.log.clear()
    assert hybrid_exists(store, keys, NS, HASHES, [INDEXER, MAMBA]) == 0
    assert {parse_store_key(key).pool for key in keys.log} == {KV_POOL}


def test_hybrid_exists_rejects_bad_side_pools() -> None:
    keys = KeySpace(MODEL)
    store = _store_with(keys, kv=[0])
    with pytest.raises(MisuseError):
        hybrid_exists(store, keys, NS, HASHES, [INDEXER, SidePool("indexer", TRAILING, ("x",))])
    with pytest.raises(MisuseError):
        hybrid_exists(store, keys, NS, HASHES, ["indexer"])  # type: ignore[list-item]


def test_check_usable() -> None:
    keys = KeySpace(MODEL)
    store = _store_with(keys, kv=[0, 1, 2, 3], indexer=[0, 1, 2], mamba=[1, 3])
    pools = [INDEXER, MAMBA]
    for prefix in (0, 2):
        check_usable(store, keys, NS, HASHES, pools, prefix=prefix)
    check_usable(store, keys, NS, HASHES, [MAMBA], prefix=4)
    check_usable(store, keys, NS, HASHES, [INDEXER], prefix=3)
    bad = [
        (pools, 1),  # no Mamba state ends at page 0
        (pools, 3),  # no Mamba state ends at page 2
        ([INDEXER], 4),  # indexer missing on page 3
        ([], 5),  # KV missing on page 4
        ([], 7),  # longer than the pages asked
    ]
    for side_pools, prefix in bad:
        with pytest.raises(InvariantViolation) as info:
            check_usable(store, keys, NS, HASHES, side_pools, prefix=prefix)
        assert info.value.invariant == "I6"
    result = hybrid_exists(store, keys, NS, HASHES, pools)
    assert result == 2
    check_usable(store, keys, NS, HASHES, pools, prefix=result)


def test_check_usable_ignores_in_flight_objects() -> None:
    keys = KeySpace(MODEL)
    store = _store_with(keys, kv=[0], in_flight=[*keys.page_keys(NS, HASHES[1])])
    check_usable(store, keys, NS, HASHES, [], prefix=1)
    with pytest.raises(InvariantViolation, match="I6"):
        check_usable(store, keys, NS, HASHES, [], prefix=2)


def test_probe_type_is_a_callable_alias() -> None:
    probe: Probe = RecordingProbe([True])
    assert probe(0)


def test_check_side_pools_is_public_and_validates() -> None:
    indexer = SidePool("indexer", HitPolicy.ALL_PAGES, ("idx",))
    check_side_pools([indexer])
    with pytest.raises(MisuseError, match="distinct"):
        check_side_pools([indexer, indexer])
    with pytest.raises(MisuseError, match="SidePool"):
        check_side_pools(["indexer"])  # type: ignore[list-item]
