"""Page fingerprints (kvstrata.impl.fingerprint): NH written out with Python ints equals both kernels
(C and numpy), keys are reproducible only when seeded, and the portable memo never changes a result."""

from __future__ import annotations

from unittest import mock

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from kvstrata.impl import fingerprint as fingerprint_module
from kvstrata.impl import kernels
from kvstrata.impl.fingerprint import (
    FINGERPRINT_BYTES,
    Fingerprinter,
    common_pages,
    fingerprint_keys,
    page_fingerprints,
)

MASK32, MASK64 = 2**32 - 1, 2**64 - 1
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=40)


def reference(tokens: list[int], keys: np.ndarray, page_size: int) -> bytes:
    """NH per lane and whole page with Python ints: the sum over token pairs of
    ((a + k) mod 2**32) * ((b + k') mod 2**32), mod 2**64; an odd page ends with a zero token."""
    padded = page_size + (page_size & 1)
    out = b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size] + [0] * (padded - page_size)
        for lane in range(2):
            k = [int(x) for x in keys[lane * padded : (lane + 1) * padded]]
            value = 0
            for i in range(0, padded, 2):
                value += ((page[i] + k[i]) & MASK32) * ((page[i + 1] + k[i + 1]) & MASK32)
            out += (value & MASK64).to_bytes(8, "little")
    return out


@given(tokens=token_lists, page_size=st.integers(1, 5), seed=st.integers(0, 2**32))
def test_both_kernels_equal_nh_written_out(tokens: list[int], page_size: int, seed: int) -> None:
    keys = fingerprint_keys(page_size, seed)
    array = np.asarray(tokens, dtype=np.uint32)
    expected = reference(tokens, keys, page_size)
    assert kernels.nh_fingerprints_portable(array, keys, page_size) == expected
    assert page_fingerprints(array, keys, page_size) == expected  # C when built
    assert len(expected) == (len(tokens) // page_size) * FINGERPRINT_BYTES


def test_keys_are_seeded_or_secret() -> None:
    assert fingerprint_keys(4, 7).shape == (8,)
    assert fingerprint_keys(5, 7).shape == (12,)  # an odd page is padded to 6 positions
    assert fingerprint_keys(4, 7).dtype == np.uint32
    assert np.array_equal(fingerprint_keys(4, 7), fingerprint_keys(4, 7))
    assert not np.array_equal(fingerprint_keys(4, 7), fingerprint_keys(4, 8))
    assert not np.array_equal(fingerprint_keys(4), fingerprint_keys(4))  # os.urandom


def test_a_one_token_change_changes_both_lanes() -> None:
    keys = fingerprint_keys(64, 1)
    tokens = np.arange(128, dtype=np.uint32)
    changed = tokens.copy()
    changed[70] += 1
    a, b = page_fingerprints(tokens, keys, 64), page_fingerprints(changed, keys, 64)
    assert a[:16] == b[:16]
    assert a[16:24] != b[16:24] and a[24:32] != b[24:32]


def test_keys_must_fit_the_page_size() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        Fingerprinter(fingerprint_keys(4, 1), 6)
    with pytest.raises(ValueError, match="keys must hold"):
        kernels.nh_fingerprints(np.arange(8, dtype=np.uint32), fingerprint_keys(4, 1), 6)


@given(data=st.data(), pages=st.integers(1, 6))
def test_common_pages_counts_leading_equal_fingerprints(data: st.DataObject, pages: int) -> None:
    stored = [data.draw(st.binary(min_size=16, max_size=16)) for _ in range(pages)]
    cut = data.draw(st.integers(0, pages))
    query = stored[:cut] + [
        data.draw(st.binary(min_size=16, max_size=16)) for _ in range(data.draw(st.integers(0, 3)))
    ]
    lead = [b"\x00" * 16] * data.draw(st.integers(0, 2))  # the node starts at this offset
    expected = 0
    for mine, theirs in zip(stored, query, strict=False):
        if mine != theirs:
            break
        expected += 1
    got = common_pages(b"".join(stored), b"".join(lead + query), 16 * len(lead))
    assert got == expected


@pytest.mark.parametrize("native", [True, False])
@given(first=token_lists, more=token_lists, page_size=st.integers(1, 4))
def test_the_fingerprinter_never_changes_a_result(
    native: bool, first: list[int], more: list[int], page_size: int
) -> None:
    """With the C kernel every call fingerprints afresh; with numpy the memo of the last request
    serves the next one: either way the results are the plain function's."""
    keys = fingerprint_keys(page_size, 3)
    with mock.patch.object(fingerprint_module, "NATIVE", native and kernels.NATIVE):
        memo = Fingerprinter(keys, page_size)
        for tokens in (first, first, first + more, more, first[: len(first) // 2]):
            array = np.asarray(tokens, dtype=np.uint32)
            assert memo(array) == page_fingerprints(array, keys, page_size)
        memo.forget()
        assert memo(np.asarray(more, dtype=np.uint32)) == page_fingerprints(
            np.asarray(more, dtype=np.uint32), keys, page_size
        )
