"""The side-by-side benchmark against sglang's own ``RadixCache`` (benchmarks/sglang_radix.py, issue
20 item 6) drives both structures with the same requests: on the shipped sample trace they must
serve the same hits request by request when nothing is evicted, and about as many under eviction
(both evict least recently used leaves, but break ties and stamp recency differently), or the
timing comparison compares different work."""

from __future__ import annotations

import pytest

from benchmarks.sglang_radix import import_sglang, one_round
from benchmarks.traces import load_trace, synthesise
from kvstrata.impl.replay import sample_trace


@pytest.mark.parametrize("capped", [False, True], ids=["unbounded", "capped"])
def test_sglang_and_kvstrata_hit_the_same_pages(capped: bool) -> None:
    tokens_list = synthesise(load_trace(sample_trace(), 150))
    page = 16
    pages = sum(len(tokens) // page for tokens in tokens_list)
    capacity = pages // 4 if capped else pages
    runs = one_round(import_sglang(), tokens_list, page, capacity)
    sglang = runs["sglang"]
    assert sum(sglang.hit_pages) > 0
    for name, result in runs.items():
        assert result.capacity_errors == 0, name
        if capped:
            assert abs(sum(result.hit_pages) - sum(sglang.hit_pages)) <= 0.05 * sum(
                sglang.hit_pages
            ), (name, sum(result.hit_pages), sum(sglang.hit_pages))
        else:
            assert result.hit_pages == sglang.hit_pages, name
    assert runs["kvstrata_hashes"].hasher_busy_ns > 0  # the hashing thread really hashed
