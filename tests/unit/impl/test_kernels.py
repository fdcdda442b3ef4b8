"""The per-page kernels (kvstrata.impl.kernels): the C versions equal the portable ones and the SPEC §4
chain of the reference model, bad arguments are typed errors, and CI runs the C versions."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from kvstrata.impl import kernels
from kvstrata.model.errors import DoubleRenderError
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    Shard,
    chain_page_hashes,
)

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


class _Page(PageHash):
    """A PageHash subclass (the C loop takes it like isinstance does)."""


@native_only
@given(
    prefixes=st.lists(st.text(alphabet="abcxyz09/-_.", max_size=40), max_size=3).map(tuple),
    digests=st.lists(st.binary(min_size=32, max_size=32), max_size=12),
    subclass=st.booleans(),
)
def test_key_texts_equal_the_python_rendering(
    prefixes: tuple[str, ...], digests: list[bytes], subclass: bool
) -> None:
    """Issue 20: ``join_keys`` makes KeySpace.rendered's texts, page-major, prefix by prefix."""
    pages = [(_Page if subclass else PageHash)(digest) for digest in digests]
    assert kernels.join_keys is not None
    want = [prefix + page.digest.hex() for page in pages for prefix in prefixes]
    assert kernels.join_keys(prefixes, pages) == want
    assert kernels.join_keys(prefixes, tuple(pages)) == want


@native_only
def test_key_texts_leave_what_they_cannot_render_to_python() -> None:
    """None (nothing kept) for a page that is not a PageHash, a non-ASCII or non-str prefix; a
    prefixes value that is not a tuple is a TypeError."""
    join = kernels.join_keys
    assert join is not None
    page = PageHash(bytes(range(32)))
    assert join(("a/",), [page, b"x" * 32]) is None  # type: ignore[list-item]
    assert join(("a/", "é/"), [page]) is None
    assert join(("a/", 7), [page]) is None  # type: ignore[arg-type]
    assert join((), [page]) == []
    assert join(("a/",), []) == []
    with pytest.raises(TypeError):
        join(["a/"], [page])  # type: ignore[arg-type]


@native_only
def test_rendered_keys_are_the_same_with_the_kernel_or_without() -> None:
    """KeySpace.rendered with ``join=kernels.join_keys`` (what MooncakeBackend passes) gives the
    texts of page_keys, an ASCII model name or not (a name is percent-quoted into the key, so the
    kernel renders both), a tuple of pages or a generator (which the kernel leaves to Python), and
    a page that is not a PageHash is a DoubleRenderError either way."""
    pages = list(chain_page_hashes(list(range(40)), 4, Namespace(extra_key="lora-1")))
    ns = Namespace(extra_key="lora-1")
    for name in ("tiny-llama", "модель"):
        space = KeySpace(
            ModelIdentity(name=name, dtype="bfloat16", kind=KVKind.MHA, page_size=4),
            shard=Shard(tp_rank=1, tp_size=2),
            tag="blue",
        )
        want = [key.text for page in pages for key in space.page_keys(ns, page)]
        assert space.rendered(ns, pages, join=kernels.join_keys).texts == want
        assert space.rendered(ns, tuple(pages), join=kernels.join_keys).texts == want
        assert space.rendered(ns, pages).texts == want
        assert kernels.join_keys(("a/",), iter(pages)) is None  # type: ignore[arg-type]
        with pytest.raises(DoubleRenderError):
            space.rendered(ns, [*pages, want[0]], join=kernels.join_keys)  # type: ignore[list-item]
