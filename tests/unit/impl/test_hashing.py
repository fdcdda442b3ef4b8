"""Page hashes off the scheduler thread (kvstrata.impl.hashing) and the radix cache over either kernel
set: the hashing thread, inline hashing and the portable kernels all give the model's chain, and the
hasher's edges (no C module, a chain larger than the arena, after close, an idle thread) behave."""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator
from unittest import mock

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from kvstrata.impl import fingerprint as fingerprint_module
from kvstrata.impl import hashing as hashing_module
from kvstrata.impl import kernels
from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.cache import pages as cache_pages_module
from kvstrata.impl.cache import parts as cache_parts_module
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.errors import HashingError
from kvstrata.impl.hashing import BackgroundHasher, InlineHasher, PendingDigests, resolve
from kvstrata.impl.pools import PageAllocator
from kvstrata.impl.pools import allocator as allocator_module
from kvstrata.model.keys import chain_page_hashes

native_only = pytest.mark.skipif(not kernels.NATIVE, reason="the C kernels are not built")
PAGE = 4


@contextlib.contextmanager
def portable_kernels() -> Iterator[None]:
    """The cache as it runs without kvstrata.impl._native: numpy and hashlib everywhere."""
    with (
        mock.patch.object(cache_parts_module, "NATIVE", False),
        mock.patch.object(cache_pages_module, "check_pages", kernels.check_pages_portable),
        mock.patch.object(fingerprint_module, "NATIVE", False),
        mock.patch.object(fingerprint_module, "nh_fingerprints", kernels.nh_fingerprints_portable),
        mock.patch.object(allocator_module, "take_lowest", None),
        mock.patch.object(allocator_module, "give_back", None),
    ):
        yield


def replay(cache: HierarchicalRadixCache, requests: list[list[int]]) -> list[int]:
    """The scheduler protocol per request; returns the L1 hit pages of each."""
    hits = []
    for tokens in requests:
        array = np.asarray(tokens, dtype=np.uint32)
        if len(tokens) % 3 == 0:
            array.flags.writeable = False  # frozen: the hashing thread reads it in place
        match = cache.match_prefix(array)
        hits.append(match.device_pages)
        fresh = cache.alloc_device(len(tokens) // PAGE - match.device_pages)
        cache.insert(array, np.concatenate((match.device_indices, fresh)))
        if not array.flags.writeable:
            continue
        array[:] = 7  # the scheduler reuses its buffer: cached hashes must not change
    return hits


requests_strategy = st.lists(
    st.lists(st.integers(0, 3), min_size=PAGE, max_size=6 * PAGE).map(
        lambda tail: [1, 2, 3, 4, *tail]  # a shared first page: splits and continuations
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40)
@given(requests=requests_strategy)
def test_every_hashing_mode_gives_the_model_chain(requests: list[list[int]]) -> None:
    caches = {
        "thread": RadixCacheConfig(page_size=PAGE, fingerprint_seed=1),
        "inline": RadixCacheConfig(page_size=PAGE, fingerprint_seed=1, hash_worker=False),
    }
    hits = {}
    for name, config in caches.items():
        cache = HierarchicalRadixCache(config, PageAllocator(1000))
        hits[name] = replay(cache, requests)
        for tokens in requests:
            expected = chain_page_hashes(tokens, PAGE)
            got = cache.page_hashes(tokens)
            assert got == expected[: len(got)]
            assert len(got) == len(tokens) // PAGE  # unbounded: every page stays cached
        cache.close()
    with portable_kernels():
        cache = HierarchicalRadixCache(caches["thread"], PageAllocator(1000))
        assert isinstance(cache.hasher, InlineHasher)
        hits["portable"] = replay(cache, requests)
        for tokens in requests:
            assert cache.page_hashes(tokens) == chain_page_hashes(tokens, PAGE)
    assert hits["thread"] == hits["inline"] == hits["portable"]


@native_only
def test_the_thread_hashes_and_a_split_keeps_both_halves() -> None:
    cache = HierarchicalRadixCache(RadixCacheConfig(page_size=PAGE), PageAllocator(100))
    assert isinstance(cache.hasher, BackgroundHasher)
    cache.hasher.pause()  # keep the job pending through the split
    first = np.arange(6 * PAGE, dtype=np.uint32)
    cache.insert(first, cache.alloc_device(6))
    (node,) = cache.nodes()
    assert isinstance(node.digests, PendingDigests) and not node.digests.finished
    second = np.concatenate((first[: 2 * PAGE], np.full(PAGE, 99, dtype=np.uint32)))
    match = cache.match_prefix(second)  # splits the pending node after 2 pages
    assert match.device_pages == 2
    cache.insert(second, np.concatenate((match.device_indices, cache.alloc_device(1))))
    pending = [n.digests for n in cache.nodes() if isinstance(n.digests, PendingDigests)]
    assert len(pending) == 3  # both halves of the split and the new leaf's chain
    cache.hasher.resume()
    assert cache.page_hashes(first) == chain_page_hashes(first.tolist(), PAGE)
    assert cache.page_hashes(second) == chain_page_hashes(second.tolist(), PAGE)
    cache.close()


@native_only
def test_hasher_edges() -> None:
    hasher = BackgroundHasher(8, arena_bytes=32)
    tokens = np.arange(2 * 6, dtype="<u4")  # 6 pages of 2 tokens: 48 bytes, more than the arena
    got = hasher.submit(b"", tokens, 6)
    assert type(got) is bytes and hasher.inline_chains == 1  # too large: hashed inline
    assert got == kernels.sha256_chain_portable(b"", tokens.tobytes(), 8)
    pending = hasher.submit(b"", tokens[:4], 2)
    assert isinstance(pending, PendingDigests)
    assert resolve(pending) == kernels.sha256_chain_portable(b"", tokens[:4].tobytes(), 8)
    assert hasher.submit(b"", tokens[:0], 0) == b""
    hasher.close()
    after = hasher.submit(pending, tokens[4:8], 2)  # after close: inline, seeded by the view
    assert after == kernels.sha256_chain_portable(resolve(pending)[-32:], tokens[4:8].tobytes(), 8)
    with pytest.raises(ValueError, match="multiple of 4"):
        BackgroundHasher(6)
    with pytest.raises(ValueError, match="arena_bytes"):
        BackgroundHasher(8, arena_bytes=4)
    with (
        mock.patch.object(hashing_module, "_NativeHasher", None),
        pytest.raises(HashingError, match="C kernels"),
    ):
        BackgroundHasher(8)


@native_only
def test_an_idle_thread_exits_and_the_next_submit_starts_one() -> None:
    hasher = BackgroundHasher(8)
    tokens = np.arange(4, dtype="<u4")
    first = hasher.submit(b"", tokens, 2)
    assert isinstance(first, PendingDigests)
    resolve(first)
    deadline = time.monotonic() + 10
    while hasher._native.running and time.monotonic() < deadline:  # about 1.2 s idle
        time.sleep(0.05)
    assert not hasher._native.running
    second = hasher.submit(b"", tokens, 2)
    assert resolve(second) == resolve(first)
    hasher.close()


@native_only
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_hashes_with_a_thread_of_its_own() -> None:
    """The hashing thread does not survive a fork; the child's first call starts its own, and jobs
    queued before the fork still finish in the child."""
    hasher = BackgroundHasher(8)
    tokens = np.arange(8, dtype="<u4")
    done = hasher.submit(b"", tokens, 4)
    resolve(done)  # the thread is running now
    hasher.pause()
    queued = hasher.submit(b"", tokens[::-1].copy(), 4)  # still queued at the fork
    expected = kernels.sha256_chain_portable(b"", tokens[::-1].tobytes(), 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: that is the point
        pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if both chains come out right
        ok = resolve(queued) == expected and resolve(hasher.submit(b"", tokens, 4)) == resolve(done)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    hasher.resume()
    assert resolve(queued) == expected
    hasher.close()
