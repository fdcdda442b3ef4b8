"""Page fingerprints (kvstrata.impl.fingerprint): the numpy pass equals the multilinear hash written out
with Python ints, keys are reproducible only when seeded, and the memo never changes a result."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given

from kvstrata.impl.fingerprint import (
    FINGERPRINT_BYTES,
    Fingerprinter,
    common_pages,
    fingerprint_keys,
    page_fingerprints,
)

MASK = 2**64 - 1
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=40)


def reference(tokens: list[int], keys: np.ndarray) -> bytes:
    """sum_i keys[i, lane] * token_i mod 2**64 per lane and whole page, with Python ints."""
    page_size = len(keys)
    out = b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        for lane in range(2):
            value = sum(int(k) * t for k, t in zip(keys[:, lane], page, strict=True)) & MASK
            out += value.to_bytes(8, "little")
    return out


@given(tokens=token_lists, page_size=st.integers(1, 5), seed=st.integers(0, 2**32))
def test_numpy_pass_equals_the_hash_written_out(
    tokens: list[int], page_size: int, seed: int
) -> None:
    keys = fingerprint_keys(page_size, seed)
    got = page_fingerprints(np.asarray(tokens, dtype=np.uint32), keys)
    assert got == reference(tokens, keys)
    assert len(got) == (len(tokens) // page_size) * FINGERPRINT_BYTES


def test_keys_are_seeded_or_secret() -> None:
    assert fingerprint_keys(4, 7).shape == (4, 2)
    assert fingerprint_keys(4, 7).dtype == np.uint64
    assert np.array_equal(fingerprint_keys(4, 7), fingerprint_keys(4, 7))
    assert not np.array_equal(fingerprint_keys(4, 7), fingerprint_keys(4, 8))
    assert not np.array_equal(fingerprint_keys(4), fingerprint_keys(4))  # os.urandom


def test_a_one_token_change_changes_both_lanes() -> None:
    keys = fingerprint_keys(64, 1)
    tokens = np.arange(128, dtype=np.uint32)
    changed = tokens.copy()
    changed[70] += 1
    a, b = page_fingerprints(tokens, keys), page_fingerprints(changed, keys)
    assert a[:16] == b[:16]
    assert a[16:24] != b[16:24] and a[24:32] != b[24:32]


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


@given(first=token_lists, more=token_lists, page_size=st.integers(1, 4))
def test_the_memo_never_changes_a_result(first: list[int], more: list[int], page_size: int) -> None:
    keys = fingerprint_keys(page_size, 3)
    memo = Fingerprinter(keys)
    for tokens in (first, first, first + more, more, first[: len(first) // 2]):
        array = np.asarray(tokens, dtype=np.uint32)
        assert memo(array) == page_fingerprints(array, keys)
    memo.forget()
    assert memo(np.asarray(more, dtype=np.uint32)) == page_fingerprints(
        np.asarray(more, dtype=np.uint32), keys
    )
