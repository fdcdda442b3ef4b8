"""The per-page kernels (kvstrata.impl.kernels): the C versions equal the portable ones and the SPEC §4
chain of the reference model, bad arguments are typed errors, and CI runs the C versions."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from kvstrata.impl import kernels
from kvstrata.model.keys import Namespace, PageHash, chain_page_hashes

native_only = pytest.mark.skipif(not kernels.NATIVE, reason="the C kernels are not built")


def test_ci_runs_the_c_kernels() -> None:
    """scripts/test sets KVSTRATA_REQUIRE_NATIVE=1: a build that silently fell back to the portable
    kernels would otherwise pass every other test while measuring something else."""
    if os.environ.get("KVSTRATA_REQUIRE_NATIVE") == "1":
        assert kernels.NATIVE, "kvstrata.impl._native is not built (C compiler, OpenSSL headers?)"


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    page_size=st.integers(1, 6),
    namespace=st.sampled_from([None, "tenant-a"]),
)
def test_chains_equal_the_reference_model(
    tokens: list[int], page_size: int, namespace: str | None
) -> None:
    ns = Namespace(extra_key=namespace) if namespace else Namespace()
    expected = b"".join(h.digest for h in chain_page_hashes(tokens, page_size, ns))
    data = np.asarray(tokens, dtype="<u4")
    usable = data[: len(tokens) // page_size * page_size]
    page_bytes = 4 * page_size
    assert kernels.sha256_chain_portable(ns.seed(), usable.tobytes(), page_bytes) == expected
    assert kernels.sha256_chain(ns.seed(), usable, page_bytes) == expected
    assert kernels.sha256_chain_portable(ns.seed(), usable, page_bytes) == expected  # an array
    # a trailing partial page is ignored
    assert kernels.sha256_chain(ns.seed(), data, page_bytes) == expected


@pytest.mark.parametrize(
    "chain", [kernels.sha256_chain, kernels.sha256_chain_portable], ids=["c", "portable"]
)
def test_bad_chain_arguments_are_value_errors(chain: object) -> None:
    assert callable(chain)
    with pytest.raises(ValueError, match="seed"):
        chain(b"short", b"\0" * 8, 8)
    with pytest.raises(ValueError, match="page_bytes"):
        chain(b"", b"\0" * 8, 6)
    with pytest.raises(ValueError, match="page_bytes"):
        chain(b"", b"\0" * 8, 0)


def test_page_hash_type_round_trip() -> None:
    """A chain digest is a valid PageHash (32 bytes) the model accepts as a parent."""
    first = kernels.sha256_chain(b"", np.arange(8, dtype="<u4"), 16)
    parent = PageHash(first[-32:])
    rest = chain_page_hashes(list(range(8, 16)), 4, parent=parent)
    assert kernels.sha256_chain(first[-32:], np.arange(8, 16, dtype="<u4"), 16) == b"".join(
        h.digest for h in rest
    )


@native_only
@given(
    free=st.lists(st.booleans(), min_size=1, max_size=3000),
    shift=st.sampled_from([2, 5, 10]),
    data=st.data(),
)
def test_take_lowest_and_give_back_against_numpy(
    free: list[bool], shift: int, data: st.DataObject
) -> None:
    assert kernels.take_lowest is not None and kernels.give_back is not None
    block = 1 << shift
    blocks = -(-len(free) // block)
    mask = np.zeros(blocks * block, dtype=np.bool_)
    mask[: len(free)] = free
    counts = mask.reshape(blocks, block).sum(axis=1).astype(np.int64)
    available = int(mask.sum())
    n = data.draw(st.integers(0, available))
    out = np.empty(n, dtype=np.int64)
    expected = np.flatnonzero(mask)[:n]
    first = kernels.take_lowest(mask, counts, out, shift, 0)
    assert out.tolist() == expected.tolist()
    assert not mask[expected].any()
    assert counts.tolist() == mask.reshape(blocks, block).sum(axis=1).tolist()
    assert not counts[:first].any()
    # asking for more than is free changes nothing
    before = (mask.copy(), counts.copy())
    with pytest.raises(ValueError, match="fewer free"):
        kernels.take_lowest(mask, counts, np.empty(available - n + 1, np.int64), shift, 0)
    assert np.array_equal(mask, before[0]) and np.array_equal(counts, before[1])
    # give back a subset of what was taken, then a bad list: nothing changes on the error
    back = np.asarray(data.draw(st.permutations(expected.tolist())), dtype=np.int64)[: n // 2]
    if back.size:
        low = kernels.give_back(mask, counts, back, shift, len(free))
        assert low == int(back.min())
        assert mask[back].all()
        assert counts.tolist() == mask.reshape(blocks, block).sum(axis=1).tolist()
        before = (mask.copy(), counts.copy())
        with pytest.raises(ValueError, match=r"not allocated|more than once"):
            kernels.give_back(mask, counts, back[:1].repeat(2), shift, len(free))
        with pytest.raises(ValueError, match="out of range"):
            kernels.give_back(mask, counts, np.array([len(free)], np.int64), shift, len(free))
        assert np.array_equal(mask, before[0]) and np.array_equal(counts, before[1])


@native_only
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    page_size=st.sampled_from([1, 2, 3, 7, 8, 9, 16, 63, 64]),
)
def test_the_cpu_specific_nh_loop_equals_the_portable_c_loop(
    tokens: list[int], page_size: int
) -> None:
    """The AVX2 loop (where the CPU has it) and the plain C loop give the same fingerprints, for
    page sizes below, at and around its 8-token step."""
    native = kernels.native_module()
    assert native is not None
    keys = np.random.default_rng(page_size).integers(
        0, 2**32, 2 * (page_size + (page_size & 1)), dtype=np.uint32
    )
    array = np.asarray(tokens, dtype=np.uint32)
    assert native.nh_fingerprints(array, keys, page_size) == native.nh_scalar_fingerprints(
        array, keys, page_size
    )
    assert native.nh_variant() in {"avx2", "scalar"}
