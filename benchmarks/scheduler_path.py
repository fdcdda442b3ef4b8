"""Scheduler-path cost of the L1 radix cache against a chained-SHA-256 LRU dictionary (SPEC §12, issue 3).

Replays a Mooncake-format trace (default ``../shared/traces/conversation_trace.jsonl``) through

* the **baseline**: a plain ``OrderedDict`` of chained SHA-256 page hashes with LRU. Per request it
  hashes *every* full page (``sha256(previous digest + page bytes)``, tokens as 4-byte little-endian),
  counts the hit prefix (consecutive pages from the start that are present), inserts the rest and evicts
  least-recently-used pages over capacity. Pages are touched deepest first, so among the pages of one
  request the deepest is evicted first (ties broken leaf-first, like a tree);
* **kvstrata**: :class:`kvstrata.impl.cache.HierarchicalRadixCache`, L1 only (no host pool), doing
  the full scheduler protocol per request: ``match_prefix`` -> ``lock`` the device node ->
  ``alloc_device`` for the pages not on L1 (evicting itself) -> ``insert`` -> ``unlock``. In three
  modes: ``page_hashes=False`` ("L1 only, no L3": the tree matches by page fingerprints and hashes
  nothing), ``page_hashes=True`` with the hashing thread (``insert`` queues the SHA-256 chain of the
  new pages that L3 needs for the C thread; only the queueing is on the scheduler path, and the
  thread's CPU time and its lag after the last request are reported next to it) and
  ``hash_worker=False`` (the chain is computed inline in ``insert``, with the C loop when built);
* the **sha256 floor**: only the SHA-256 work kvstrata cannot avoid (chain-hashing the pages past its L1
  hit, one ``hashlib`` call per page like the baseline): the lowest ratio any cache that hashes new pages
  on the scheduler thread can reach.

All run unbounded (capacity = every page of the trace) and capped (``--cap-tokens``, default 3M tokens).
Token arrays are synthesised before any timing (:mod:`benchmarks.traces`); only the per-request cache work
is timed (``time.perf_counter_ns``). Untimed: kvstrata's page hashes (hashes mode) are compared with the
baseline's chain on sampled requests, and the metadata memory of every structure after the unbounded run
is measured by walking the objects it owns (cross-checked with ``tracemalloc`` on the first
``--tracemalloc-requests`` requests: tracemalloc slows the tree's replay too much for the full trace).

Usage::

    .venv/bin/python benchmarks/scheduler_path.py [--trace PATH] [--limit N] [--json PATH]

Exit status: 0 on success, 1 if the unbounded hit ratios disagree (kvstrata in either mode against the
baseline, or the two modes against each other in any run) or the page hashes differ from the baseline's,
2 if the trace is missing.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import os
import platform
import pstats
import sys
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.traces import load_trace, resolve_trace_or_exit, synthesise  # noqa: E402
from kvstrata.impl import fingerprint as fingerprint_module  # noqa: E402
from kvstrata.impl import hashing as hashing_module  # noqa: E402
from kvstrata.impl import kernels as kernels_module  # noqa: E402
from kvstrata.impl.cache import HierarchicalRadixCache  # noqa: E402
from kvstrata.impl.cache import api as cache_api_module  # noqa: E402
from kvstrata.impl.cache import index as cache_index_module  # noqa: E402
from kvstrata.impl.cache import locks as cache_locks_module  # noqa: E402
from kvstrata.impl.cache import lookup as cache_lookup_module  # noqa: E402
from kvstrata.impl.cache import tiers as cache_tiers_module  # noqa: E402
from kvstrata.impl.config import RadixCacheConfig  # noqa: E402
from kvstrata.impl.errors import CapacityError  # noqa: E402
from kvstrata.impl.pools import PageAllocator  # noqa: E402
from kvstrata.impl.pools import allocator as allocator_module  # noqa: E402

Tokens = npt.NDArray[np.uint32]
GOAL_TIME_RATIO = 0.25
GOAL_BYTES_PER_TOKEN = 2.0


# --------------------------------------------------------------------------------------------- results
@dataclass
class RunResult:
    """One timed replay of one structure."""

    impl: str
    capacity_pages: int
    total_ns: int
    requests: int
    input_tokens: int
    hit_tokens: int
    capacity_errors: int = 0
    cached_pages_end: int = 0
    hasher_busy_ns: int = 0  # CPU time of the hashing thread (hashing-thread mode)
    drain_ns: int = 0  # wall time after the last request until every page hash existed
    per_request_ns: list[int] = field(default_factory=list, repr=False)
    hit_pages: list[int] = field(default_factory=list, repr=False)

    @property
    def us_per_1k_tokens(self) -> float:
        return self.total_ns / 1e3 / (self.input_tokens / 1e3) if self.input_tokens else 0.0

    @property
    def us_per_request(self) -> float:
        return self.total_ns / 1e3 / self.requests if self.requests else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        per = np.asarray(self.per_request_ns, dtype=np.float64) / 1e3
        return {
            "capacity_pages": self.capacity_pages,
            "total_s": self.total_ns / 1e9,
            "us_per_1k_tokens": self.us_per_1k_tokens,
            "us_per_request": self.us_per_request,
            "us_per_request_p50": float(np.percentile(per, 50)) if per.size else 0.0,
            "us_per_request_p99": float(np.percentile(per, 99)) if per.size else 0.0,
            "hit_tokens": self.hit_tokens,
            "hit_ratio": self.hit_ratio,
            "cached_pages_end": self.cached_pages_end,
            "capacity_errors": self.capacity_errors,
            "hasher_busy_s": self.hasher_busy_ns / 1e9,
            "hasher_drain_s": self.drain_ns / 1e9,
        }


# -------------------------------------------------------------------------------------------- baseline
class BaselineLRU:
    """A plain dictionary of chained SHA-256 page hashes -> page slot, with LRU eviction."""

    def __init__(self, page_size: int, capacity_pages: int) -> None:
        self.page_size = page_size
        self.step = 4 * page_size
        self.capacity = capacity_pages
        self.pages: OrderedDict[bytes, int] = OrderedDict()
        self.free_slots: list[int] = []
        self.next_slot = 0

    def request(self, tokens: Tokens) -> int:
        """Hash every full page, count the hit prefix, insert the rest, evict; returns hit pages."""
        step = self.step
        data = tokens.tobytes()  # uint32 native order; the script checks little-endian at start
        sha256 = hashlib.sha256
        previous = b""
        digests = []
        for start in range(0, (len(tokens) // self.page_size) * step, step):
            previous = sha256(previous + data[start : start + step]).digest()
            digests.append(previous)
        pages = self.pages
        hit = 0
        for digest in digests:
            if digest not in pages:
                break
            hit += 1
        for digest in reversed(digests):
            if digest in pages:
                pages.move_to_end(digest)
            elif self.free_slots:
                pages[digest] = self.free_slots.pop()
            else:
                pages[digest] = self.next_slot
                self.next_slot += 1
        while len(pages) > self.capacity:
            self.free_slots.append(pages.popitem(last=False)[1])
        return hit


def chain_hashes(tokens: Tokens, page_size: int) -> list[bytes]:
    """The baseline's page hashes of ``tokens`` (for the cross-check against kvstrata's)."""
    data = tokens.astype("<u4", copy=False).tobytes()
    step = 4 * page_size
    previous = b""
    out = []
    for start in range(0, (len(tokens) // page_size) * step, step):
        previous = hashlib.sha256(previous + data[start : start + step]).digest()
        out.append(previous)
    return out


# -------------------------------------------------------------------------------------------- kvstrata
MODES: dict[str, dict[str, bool]] = {
    "kvstrata_no_hashes": {"page_hashes": False},
    "kvstrata_hashes": {"page_hashes": True, "hash_worker": True},
    "kvstrata_hashes_inline": {"page_hashes": True, "hash_worker": False},
}
"""The kvstrata runs: result key -> ``RadixCacheConfig`` fields."""
LABELS = {
    "baseline": "baseline",
    "kvstrata_no_hashes": "kvstrata, no hashes",
    "kvstrata_hashes": "kvstrata, + sha256 of new pages (hashing thread)",
    "kvstrata_hashes_inline": "kvstrata, + sha256 of new pages (inline)",
    "floor": "sha256 floor",
}


def make_kvstrata(
    page_size: int, capacity_pages: int, options: dict[str, bool]
) -> HierarchicalRadixCache:
    config = RadixCacheConfig(page_size=page_size, write_policy="write_through", **options)
    return HierarchicalRadixCache(config, PageAllocator(capacity_pages, "device"))


def settle_hashes(cache: HierarchicalRadixCache) -> int:
    """Wait until the hashing thread (if any) hashed every inserted page and every node holds its
    digests as bytes; returns the nanoseconds that took (the hashing thread's lag at the end)."""
    start = time.perf_counter_ns()
    drain = getattr(cache.hasher, "drain", None)
    if drain is not None:
        drain()
    waited = time.perf_counter_ns() - start
    for node in cache.nodes():
        if node.digests:
            _ = node.hashes  # resolves (and keeps) the bytes
    return waited


def kvstrata_request(cache: HierarchicalRadixCache, tokens: Tokens, page_size: int) -> int:
    """One request through the scheduler protocol; returns the L1 hit pages (-1: CapacityError)."""
    match = cache.match_prefix(tokens)
    node = match.device_node
    locked = not node.is_root
    if locked:
        cache.lock(node)
    hit = match.device_pages
    try:
        fresh = cache.alloc_device(len(tokens) // page_size - hit)
    except CapacityError:
        if locked:
            cache.unlock(node)
        return -1
    indices = np.concatenate((match.device_indices, fresh)) if hit else fresh
    cache.insert(tokens, indices)
    if locked:
        cache.unlock(node)
    return hit


# ------------------------------------------------------------------------------------------- replaying
def replay(
    impl: str,
    step: Callable[[Tokens], int],
    tokens_list: Sequence[Tokens],
    page_size: int,
    capacity_pages: int,
) -> RunResult:
    """Time ``step`` on every request (perf_counter_ns around each call)."""
    clock = time.perf_counter_ns
    per_request: list[int] = []
    hits: list[int] = []
    errors = 0
    hit_pages_total = 0
    for tokens in tokens_list:
        start = clock()
        hit = step(tokens)
        per_request.append(clock() - start)
        if hit < 0:
            errors += 1
            hit = 0
        hits.append(hit)
        hit_pages_total += hit
    return RunResult(
        impl=impl,
        capacity_pages=capacity_pages,
        total_ns=sum(per_request),
        requests=len(tokens_list),
        input_tokens=sum(len(t) for t in tokens_list),
        hit_tokens=hit_pages_total * page_size,
        capacity_errors=errors,
        per_request_ns=per_request,
        hit_pages=hits,
    )


def run_baseline(
    tokens_list: Sequence[Tokens],
    page_size: int,
    capacity: int,
    keep: list[BaselineLRU] | None = None,
) -> RunResult:
    lru = BaselineLRU(page_size, capacity)
    result = replay("baseline", lru.request, tokens_list, page_size, capacity)
    result.cached_pages_end = len(lru.pages)
    if keep is not None:
        keep.append(lru)
    return result


def run_floor(
    tokens_list: Sequence[Tokens], page_size: int, capacity: int, hit_pages: Sequence[int]
) -> RunResult:
    """The SHA-256 work kvstrata cannot avoid: chain-hash only the pages past its L1 hit, one
    ``hashlib`` call per page as the baseline does (the seed stands in for the hit's last digest).
    Its time over the baseline's is the lowest ratio a tree that hashes on insert can reach."""
    step = 4 * page_size
    seed = bytes(32)
    sha256 = hashlib.sha256

    def hash_new(tokens: Tokens, hit: int) -> None:
        data = tokens.tobytes()
        previous = seed if hit else b""
        for start in range(hit * step, (len(tokens) // page_size) * step, step):
            previous = sha256(previous + data[start : start + step]).digest()

    clock = time.perf_counter_ns
    per_request: list[int] = []
    for tokens, hit in zip(tokens_list, hit_pages, strict=True):
        start = clock()
        hash_new(tokens, hit)
        per_request.append(clock() - start)
    return RunResult(
        impl="sha256 floor",
        capacity_pages=capacity,
        total_ns=sum(per_request),
        requests=len(tokens_list),
        input_tokens=sum(len(t) for t in tokens_list),
        hit_tokens=sum(hit_pages) * page_size,
        per_request_ns=per_request,
        hit_pages=list(hit_pages),
    )


def run_kvstrata(
    tokens_list: Sequence[Tokens],
    page_size: int,
    capacity: int,
    mode: str,
    keep: list[HierarchicalRadixCache] | None = None,
) -> RunResult:
    cache = make_kvstrata(page_size, capacity, MODES[mode])
    result = replay(
        mode,
        lambda tokens: kvstrata_request(cache, tokens, page_size),
        tokens_list,
        page_size,
        capacity,
    )
    result.drain_ns = settle_hashes(cache)
    result.hasher_busy_ns = int(getattr(cache.hasher, "busy_ns", 0))
    result.cached_pages_end = cache.cached_pages()["device"]
    if keep is not None:
        keep.append(cache)
    return result


def best_of(repeat: int, run: Callable[[], RunResult], gc_off: bool) -> RunResult:
    """The fastest of ``repeat`` fresh runs (hit counts are identical across runs)."""
    best: RunResult | None = None
    for _ in range(repeat):
        gc.collect()
        if gc_off:
            gc.disable()
        try:
            result = run()
        finally:
            gc.enable()
        if best is None or result.total_ns < best.total_ns:
            best = result
        del result
    assert best is not None
    return best


# -------------------------------------------------------------------------------------------- checking
def first_mismatches(a: RunResult, b: RunResult, limit: int = 5) -> list[tuple[int, int, int]]:
    return [
        (index, x, y)
        for index, (x, y) in enumerate(zip(a.hit_pages, b.hit_pages, strict=True))
        if x != y
    ][:limit]


def check_hashes(
    cache: HierarchicalRadixCache, tokens_list: Sequence[Tokens], page_size: int, samples: int
) -> dict[str, Any]:
    """kvstrata's stored page hashes equal the baseline's chain on a sample of requests."""
    if not tokens_list:
        return {"requests": 0, "pages": 0, "ok": True}
    picks = sorted(set(np.linspace(0, len(tokens_list) - 1, samples).astype(int).tolist()))
    pages = 0
    for index in picks:
        tokens = tokens_list[index]
        expected = chain_hashes(tokens, page_size)
        got = [h.digest for h in cache.page_hashes(tokens)]
        if got != expected:
            return {
                "requests": len(picks),
                "pages": pages,
                "ok": False,
                "first_bad_request": index,
                "detail": f"kvstrata holds {len(got)} hashes, baseline chain has {len(expected)}",
            }
        pages += len(expected)
    return {"requests": len(picks), "pages": pages, "ok": True}


# ---------------------------------------------------------------------------------------------- memory
_SMALL_INTS = range(-5, 257)  # CPython's cached ints cost nothing per reference


def _int_size(value: object) -> int:
    return 0 if isinstance(value, int) and value in _SMALL_INTS else sys.getsizeof(value)


def _array_size(array: npt.NDArray[Any], seen: set[int]) -> int:
    """An array's header plus, once per buffer, the memory it owns (views share their base's)."""
    size = 0
    current: Any = array
    while isinstance(current, np.ndarray) and id(current) not in seen:
        seen.add(id(current))
        size += sys.getsizeof(current)  # includes the data when the array owns it
        current = current.base
    return size


def _bytes_size(value: bytes | bytearray, seen: set[int]) -> int:
    """A bytes object's size, once (the match memo shares the fingerprinter's bytes)."""
    if id(value) in seen:
        return 0
    seen.add(id(value))
    return sys.getsizeof(value)


def _cache_state_size(value: object, seen: set[int]) -> tuple[str, int]:
    """The part and bytes of one attribute of the cache itself: arrays (held mask, scratch),
    the lazy LRU heap (a list of (last_access, id, node) tuples: its ints are counted although some
    are shared with the nodes, so the heap is an upper bound), the fingerprinter (keys and the last
    request's memo) and the match memo (its path list; the nodes are the tree's)."""
    if isinstance(value, np.ndarray):
        return "cache_state", _array_size(value, seen)
    if isinstance(value, set | frozenset):
        return "cache_state", sys.getsizeof(value) + sum(_int_size(v) for v in value)
    if isinstance(value, list):
        size = sys.getsizeof(value)
        for entry in value:
            if isinstance(entry, tuple):
                size += sys.getsizeof(entry) + sum(_int_size(v) for v in entry[:2])
        return "lru_heap", size
    slots = getattr(type(value), "__slots__", None)
    if slots is None or isinstance(value, str | int | float | bool):
        return "cache_state", 0
    size = sys.getsizeof(value)
    for slot in slots:
        inner = getattr(value, slot, None)
        if isinstance(inner, bytes | bytearray):
            size += _bytes_size(inner, seen)
        elif isinstance(inner, np.ndarray):
            size += _array_size(inner, seen)
        elif isinstance(inner, list):
            size += sys.getsizeof(inner)
    return "cache_state", size


_PIECES = {"StepClock", "LockBook", "TreeIndex", "StateBook", "Tiers", "HeldPages", "Lookup"}
_PIECES |= {"CachePort"}


def _state_values(cache: HierarchicalRadixCache) -> list[object]:
    """The values the cache and its pieces hold (the pieces are composed objects of
    ``kvstrata.impl.cache``: walked once each, their own attributes counted, not themselves)."""
    values: list[object] = []
    pieces: list[object] = [cache]
    visited: set[int] = set()
    while pieces:
        piece = pieces.pop()
        if id(piece) in visited:
            continue
        visited.add(id(piece))
        slots = getattr(type(piece), "__slots__", None)
        names = slots if slots is not None and not hasattr(piece, "__dict__") else vars(piece)
        for name in names:
            value = getattr(piece, name, None)
            if type(value).__name__ in _PIECES and type(value).__module__.startswith(
                "kvstrata.impl.cache."
            ):
                pieces.append(value)
            else:
                values.append(value)
    return values


def walk_kvstrata(cache: HierarchicalRadixCache) -> dict[str, Any]:
    """Bytes the tree holds, by kind: every object reachable from the roots that belongs to the tree
    (node objects, page fingerprints, SHA-256 page hashes, child dicts and their keys, page-index
    arrays, ints) and the cache's own state (arrays, the lazy LRU heap, the fingerprint keys and
    memos). Shared objects (namespace, enum states, parents, ops) and CPython's cached small ints are
    not counted. Reads slots generically, so it follows changes to :class:`Node`."""
    parts = dict.fromkeys(
        (
            "node_objects",
            "fingerprints",
            "page_hashes",
            "child_dicts",
            "child_dict_keys",
            "indices",
            "ints",
            "lru_heap",
            "cache_state",
            "hashing_arena",
        ),
        0,
    )
    # the hashing thread's arena: a fixed working buffer (token copies and digests in flight)
    parts["hashing_arena"] = int(getattr(cache.hasher, "arena_nbytes", 0))
    seen: set[int] = set()
    count = 0
    stack = list(cache.roots.values())
    parts["cache_state"] += sys.getsizeof(cache.roots)
    for value in _state_values(cache):
        part, size = _cache_state_size(value, seen)
        parts[part] += size
    while stack:
        node = stack.pop()
        count += 0 if node.is_root else 1
        parts["node_objects"] += sys.getsizeof(node)
        for slot in type(node).__slots__:
            value = getattr(node, slot, None)
            if slot == "children":
                parts["child_dicts"] += sys.getsizeof(value)
                for key, child in value.items():
                    parts["child_dict_keys"] += (
                        _int_size(key) if isinstance(key, int) else _bytes_size(key, seen)
                    )
                    stack.append(child)
            elif isinstance(value, bytes | bytearray):
                part = "page_hashes" if slot == "digests" else "fingerprints"
                parts[part] += _bytes_size(value, seen)
            elif isinstance(value, np.ndarray):
                parts["indices"] += _array_size(value, seen)
            elif isinstance(value, int) and not isinstance(value, bool):
                parts["ints"] += _int_size(value)
    total = sum(parts.values())
    tokens = cache.cached_pages()["device"] * cache.page_size
    return {"bytes": total, "nodes": count, "cached_tokens": tokens, "parts": parts}


def walk_baseline(lru: BaselineLRU) -> dict[str, Any]:
    """The OrderedDict (its size includes the linked-list nodes), its keys and slot ints."""
    total = sys.getsizeof(lru.pages) + sys.getsizeof(lru.free_slots)
    for digest, slot in lru.pages.items():
        total += sys.getsizeof(digest) + _int_size(slot)
    total += sum(_int_size(slot) for slot in lru.free_slots)
    return {"bytes": total, "cached_tokens": len(lru.pages) * lru.page_size}


def allocator_bytes(capacity: int) -> int:
    """What a :class:`PageAllocator` of ``capacity`` pages holds (its arrays), via tracemalloc."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        allocator = PageAllocator(capacity, "device")
        size = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del allocator
    return size


def tree_summary(tree: dict[str, Any], allocator: int, page_size: int) -> dict[str, Any]:
    tokens = max(tree["cached_tokens"], 1)
    parts = tree["parts"]
    return {
        "cached_tokens": tree["cached_tokens"],
        "nodes": tree["nodes"],
        "tree_bytes": tree["bytes"],
        "allocator_bytes": allocator,
        "tree_and_allocator_bytes": tree["bytes"] + allocator,
        "tree_bytes_per_token": tree["bytes"] / tokens,
        "tree_and_allocator_bytes_per_token": (tree["bytes"] + allocator) / tokens,
        "bytes_per_token_by_part": {name: size / tokens for name, size in parts.items()},
        "bytes_per_node": tree["bytes"] / max(tree["nodes"], 1),
        "page_size": page_size,
    }


def memory_summary(
    trees: dict[str, dict[str, Any]], base: dict[str, Any], allocator: int, page_size: int
) -> dict[str, Any]:
    """``trees``: the walk of each kvstrata mode, by result key."""
    return {
        "method": "walk",
        **{mode: tree_summary(tree, allocator, page_size) for mode, tree in trees.items()},
        "baseline": {
            "cached_tokens": base["cached_tokens"],
            "bytes": base["bytes"],
            "bytes_per_token": base["bytes"] / max(base["cached_tokens"], 1),
        },
    }


def tracemalloc_check(
    tokens_list: Sequence[Tokens], page_size: int, capacity: int, top: int = 8
) -> dict[str, Any]:
    """tracemalloc (started before the cache is built, read after the replay) against the walk, on
    a prefix of the trace: tracemalloc slows the tree's replay ~40x, so the full trace uses the walk."""
    out: dict[str, Any] = {"requests": len(tokens_list)}
    for mode, options in MODES.items():
        out[mode] = tracemalloc_kvstrata(tokens_list, page_size, capacity, options, top)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        lru = BaselineLRU(page_size, capacity)
        for tokens in tokens_list:
            lru.request(tokens)
        gc.collect()
        total = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    walk_base = walk_baseline(lru)
    out["baseline"] = {
        "cached_tokens": walk_base["cached_tokens"],
        "traced_bytes": total,
        "traced_bytes_per_token": total / max(walk_base["cached_tokens"], 1),
        "walk_bytes": walk_base["bytes"],
        "walk_bytes_per_token": walk_base["bytes"] / max(walk_base["cached_tokens"], 1),
    }
    return out


def tracemalloc_kvstrata(
    tokens_list: Sequence[Tokens],
    page_size: int,
    capacity: int,
    options: dict[str, bool],
    top: int,
) -> dict[str, Any]:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        allocator = PageAllocator(capacity, "device")
        gc.collect()
        alloc_size = tracemalloc.get_traced_memory()[0] - base
        cache = HierarchicalRadixCache(
            RadixCacheConfig(page_size=page_size, write_policy="write_through", **options),
            allocator,
        )
        for tokens in tokens_list:
            kvstrata_request(cache, tokens, page_size)
        settle_hashes(cache)
        gc.collect()
        total = tracemalloc.get_traced_memory()[0] - base
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    walk = walk_kvstrata(cache)
    stats = snapshot.filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    ).statistics("lineno")
    tokens = max(walk["cached_tokens"], 1)
    summary = {
        "cached_tokens": walk["cached_tokens"],
        "traced_tree_bytes": total - alloc_size,
        "traced_allocator_bytes": alloc_size,
        "traced_tree_bytes_per_token": (total - alloc_size) / tokens,
        "traced_tree_and_allocator_bytes_per_token": total / tokens,
        "walk_tree_bytes": walk["bytes"],
        "walk_tree_bytes_per_token": walk["bytes"] / tokens,
        "top_allocation_sites": [
            {
                "site": f"{Path(s.traceback[0].filename).name}:{s.traceback[0].lineno}",
                "bytes": s.size,
                "blocks": s.count,
            }
            for s in stats[:top]
        ],
    }
    del cache, allocator, snapshot, stats
    return summary


# --------------------------------------------------------------------------------------------- profile
def profile_kvstrata(
    tokens_list: Sequence[Tokens],
    page_size: int,
    capacity: int,
    options: dict[str, bool],
    top: int,
) -> str:
    cache = make_kvstrata(page_size, capacity, options)
    profiler = cProfile.Profile()
    profiler.enable()
    for tokens in tokens_list:
        kvstrata_request(cache, tokens, page_size)
    profiler.disable()
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------- output
def impl_sources() -> dict[str, str]:
    """SHA-256 (first 16 hex digits) of the implementation files measured, and the git commit."""
    out: dict[str, str] = {}
    for module in (
        cache_api_module,
        cache_lookup_module,
        cache_index_module,
        cache_locks_module,
        cache_tiers_module,
        fingerprint_module,
        allocator_module,
        hashing_module,
        kernels_module,
    ):
        source = Path(module.__file__ or "")
        if source.is_file():
            out[source.name] = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    native = source.parent / "_native.c"
    if native.is_file():
        out[native.name] = hashlib.sha256(native.read_bytes()).hexdigest()[:16]
    out["c_kernels"] = "built" if kernels_module.NATIVE else "portable"
    head = REPO / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref = (REPO / ".git" / ref[5:]).read_text().strip()
        out["git_head"] = ref
    except OSError:
        pass
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console  # noqa: PLC0415 (optional dependency)
        from rich.table import Table  # noqa: PLC0415
    except ImportError:
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
        print(f"\n{title}")
        line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
        print(line)
        print("-" * len(line))
        for row in rows:
            print(
                "  ".join(
                    c.rjust(w) if i else c.ljust(w)
                    for i, (c, w) in enumerate(zip(row, widths, strict=True))
                )
            )
        return
    table = Table(title=title)
    for index, name in enumerate(header):
        table.add_column(name, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


_STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="Mooncake-format JSONL trace (default: the shared one)")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument(
        "--cap-tokens", type=int, default=3_000_000, help="capacity of the capped runs, in tokens"
    )
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per case (best kept)")
    parser.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while timing")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument(
        "--tracemalloc-requests",
        type=int,
        default=300,
        metavar="N",
        help="cross-check the memory walk with tracemalloc on the first N requests (0: skip)",
    )
    parser.add_argument(
        "--hash-samples", type=int, default=200, help="requests whose page hashes are cross-checked"
    )
    parser.add_argument(
        "--profile",
        type=int,
        metavar="TOP",
        help="also cProfile kvstrata in both modes (unbounded), top rows",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    if args.page_size < 1 or args.cap_tokens < args.page_size or args.repeat < 1:
        parser.error("--page-size >= 1, --cap-tokens >= --page-size and --repeat >= 1 are required")
    return args


def run_case(
    case: str,
    capacity: int,
    tokens_list: Sequence[Tokens],
    args: argparse.Namespace,
    walks: dict[str, Any],
) -> tuple[dict[str, RunResult], dict[str, Any] | None]:
    """Baseline, kvstrata in both modes and the sha256 floor at one capacity. On the unbounded case
    also the memory walks (into ``walks``) and the page-hash cross-check (returned)."""
    page = args.page_size
    log(f"[{case}] baseline ...")
    kept_base: list[BaselineLRU] = []

    def run_base(c: int = capacity, keep: list[BaselineLRU] = kept_base) -> RunResult:
        keep.clear()
        return run_baseline(tokens_list, page, c, keep)

    results = {"baseline": best_of(args.repeat, run_base, args.no_gc)}
    if case == "unbounded" and not args.no_memory:
        walks["baseline"] = walk_baseline(kept_base[0])
    kept_base.clear()
    hash_check: dict[str, Any] | None = None
    for mode, options in MODES.items():
        log(f"[{case}] {LABELS[mode]} ...")
        kept: list[HierarchicalRadixCache] = []

        def run_kv(
            c: int = capacity, m: str = mode, keep: list[HierarchicalRadixCache] = kept
        ) -> RunResult:
            keep.clear()
            return run_kvstrata(tokens_list, page, c, m, keep)

        results[mode] = best_of(args.repeat, run_kv, args.no_gc)
        if case == "unbounded":
            if options["page_hashes"]:
                log(f"[{case}] cross-checking page hashes ...")
                hash_check = check_hashes(kept[0], tokens_list, page, args.hash_samples)
            if not args.no_memory:
                walks[mode] = walk_kvstrata(kept[0])
        kept.clear()
        gc.collect()
    log(f"[{case}] sha256 floor (new pages only) ...")
    hits = results["kvstrata_hashes"].hit_pages
    results["floor"] = best_of(
        args.repeat, lambda: run_floor(tokens_list, page, capacity, hits), args.no_gc
    )
    gc.collect()
    return results, hash_check


def ratio(result: RunResult, base: RunResult) -> float:
    return result.total_ns / max(base.total_ns, 1)


def report_times(results: dict[str, dict[str, RunResult]], page: int, title: str) -> None:
    rows = []
    for case, runs in results.items():
        base = runs["baseline"]
        for key, result in runs.items():
            rows.append(
                [
                    f"{case} / {LABELS[key]}",
                    f"{result.capacity_pages * page:,}",
                    f"{result.us_per_1k_tokens:.1f}",
                    f"{result.us_per_request:.0f}",
                    f"{result.hit_ratio:.4f}",
                    "" if result is base else f"{ratio(result, base):.3f}",
                ]
            )
    print_table(
        title,
        ["run", "capacity (tokens)", "µs / 1k tokens", "µs / request", "hit ratio", "/ baseline"],
        rows,
    )
    rows = []
    for case, runs in results.items():
        threaded = runs.get("kvstrata_hashes")
        if threaded is None or not threaded.hasher_busy_ns:
            continue
        rows.append(
            [
                case,
                f"{threaded.hasher_busy_ns / 1e6:,.0f}",
                f"{threaded.hasher_busy_ns / max(runs['baseline'].total_ns, 1):.3f}",
                f"{threaded.drain_ns / 1e6:.1f}",
            ]
        )
    if rows:
        print_table(
            "The hashing thread (another core): its CPU time, and how long the last hashes took "
            "after the last request",
            ["run", "CPU ms", "CPU / baseline time", "drain ms"],
            rows,
        )


def report_memory(memory: dict[str, Any]) -> None:
    bm = memory["baseline"]
    rows = []
    for mode in MODES:
        kvm = memory[mode]
        label = LABELS[mode]
        rows.append(
            [f"{label}: tree", f"{kvm['tree_bytes']:,}", f"{kvm['tree_bytes_per_token']:.3f}"]
        )
        rows.append(
            [
                f"{label}: tree + allocator",
                f"{kvm['tree_and_allocator_bytes']:,}",
                f"{kvm['tree_and_allocator_bytes_per_token']:.3f}",
            ]
        )
        for part, per_token in kvm["bytes_per_token_by_part"].items():
            rows.append([f"  {part}", "", f"{per_token:.3f}"])
    rows.append(["baseline OrderedDict", f"{bm['bytes']:,}", f"{bm['bytes_per_token']:.3f}"])
    first = memory[next(iter(MODES))]
    print_table(
        f"Metadata memory after the unbounded run ({first['cached_tokens']:,} cached tokens, "
        f"{first['nodes']:,} nodes; object walk)",
        ["structure", "bytes", "bytes / cached token"],
        rows,
    )
    check = memory.get("tracemalloc_check")
    if check is None:
        return
    rows = []
    for mode in MODES:
        kc = check[mode]
        rows.append(
            [
                f"{LABELS[mode]}: tree",
                f"{kc['traced_tree_bytes_per_token']:.3f}",
                f"{kc['walk_tree_bytes_per_token']:.3f}",
            ]
        )
    bc = check["baseline"]
    rows.append(
        [
            "baseline OrderedDict",
            f"{bc['traced_bytes_per_token']:.3f}",
            f"{bc['walk_bytes_per_token']:.3f}",
        ]
    )
    print_table(
        f"tracemalloc cross-check, first {check['requests']:,} requests",
        ["structure", "tracemalloc B/token", "walk B/token"],
        rows,
    )
    for mode in MODES:
        print(f"largest allocation sites, {LABELS[mode]} (tracemalloc):")
        for site in check[mode]["top_allocation_sites"]:
            print(f"  {site['site']:<28} {site['bytes']:>14,} B in {site['blocks']:,} blocks")


def disagreements(results: dict[str, dict[str, RunResult]]) -> list[str]:
    """Hit counts that must agree: both modes with each other in every run (hashing changes nothing
    in the tree) and with the baseline when unbounded."""
    problems = []
    for case, runs in results.items():
        no_hashes = runs["kvstrata_no_hashes"]
        for mode in MODES:
            if runs[mode].hit_pages != no_hashes.hit_pages:
                problems.append(
                    f"{case}: kvstrata modes hit differently; first (request, no hashes, "
                    f"{mode}): {first_mismatches(no_hashes, runs[mode])}"
                )
    un = results["unbounded"]
    for mode in MODES:
        if un[mode].hit_tokens != un["baseline"].hit_tokens:
            problems.append(
                f"unbounded hit tokens differ: {mode} {un[mode].hit_tokens:,} vs baseline "
                f"{un['baseline'].hit_tokens:,}; first (request, kvstrata pages, baseline pages): "
                f"{first_mismatches(un[mode], un['baseline'])}"
            )
    return problems


def goals(
    results: dict[str, dict[str, RunResult]], memory: dict[str, Any] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"time_ratio": GOAL_TIME_RATIO, "bytes_per_token": GOAL_BYTES_PER_TOKEN}
    for case, runs in results.items():
        for mode in MODES:
            value = ratio(runs[mode], runs["baseline"])
            out[f"time_ratio_met_{case}_{mode}"] = value <= GOAL_TIME_RATIO
    for mode in MODES:
        out[f"bytes_per_token_met_{mode}"] = (
            None if memory is None else memory[mode]["tree_bytes_per_token"] <= GOAL_BYTES_PER_TOKEN
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if sys.byteorder != "little":
        print("error: the baseline hashes native uint32 bytes; run on a little-endian machine")
        return 2
    path = resolve_trace_or_exit(args.trace)
    page = args.page_size

    started = time.perf_counter()
    requests = load_trace(path, args.limit)
    tokens_list = synthesise(requests)
    input_tokens = sum(len(t) for t in tokens_list)
    unbounded = max(sum(len(t) // page for t in tokens_list), 1)
    capped = args.cap_tokens // page
    log(
        f"{len(requests)} requests, {input_tokens:,} input tokens, {unbounded:,} pages "
        f"(synthesised in {time.perf_counter() - started:.1f} s)"
    )
    gc.collect()
    gc.freeze()  # the trace's arrays are never scanned by the cyclic GC while timing

    results: dict[str, dict[str, RunResult]] = {}
    walks: dict[str, Any] = {}
    hash_check: dict[str, Any] = {}
    for case, capacity in (("unbounded", unbounded), ("capped", capped)):
        results[case], checked = run_case(case, capacity, tokens_list, args, walks)
        if checked is not None:
            hash_check = checked

    memory: dict[str, Any] | None = None
    if not args.no_memory:
        trees = {mode: walks[mode] for mode in MODES}
        memory = memory_summary(trees, walks["baseline"], allocator_bytes(unbounded), page)
        if args.tracemalloc_requests > 0:
            subset = tokens_list[: args.tracemalloc_requests]
            log(f"[memory] tracemalloc cross-check on {len(subset)} requests (untimed) ...")
            memory["tracemalloc_check"] = tracemalloc_check(
                subset, page, max(sum(len(t) // page for t in subset), 1)
            )

    # ------------------------------------------------------------------ report
    report_times(
        results,
        page,
        f"Scheduler path, page {page}: {len(requests):,} requests, {input_tokens:,} input tokens "
        f"({path.name})",
    )
    if memory is not None:
        report_memory(memory)
    print()
    for case, runs in results.items():
        for mode in MODES:
            value = ratio(runs[mode], runs["baseline"])
            met = "met" if value <= GOAL_TIME_RATIO else "NOT met"
            print(
                f"goal time ratio <= {GOAL_TIME_RATIO}: {case}, {LABELS[mode]}: {value:.3f} ({met})"
            )
    if memory is not None:
        for mode in MODES:
            per_token = memory[mode]["tree_bytes_per_token"]
            met = "met" if per_token <= GOAL_BYTES_PER_TOKEN else "NOT met"
            print(
                f"goal metadata <= {GOAL_BYTES_PER_TOKEN} B/token: {LABELS[mode]}: "
                f"{per_token:.3f} ({met})"
            )
    print(f"page hashes cross-checked: {hash_check}")
    status = 0
    for problem in disagreements(results):
        status = 1
        print(f"MISMATCH: {problem}", file=sys.stderr)
    if not hash_check.get("ok", False):
        status = 1
        print(
            f"MISMATCH: kvstrata's page hashes differ from the baseline's: {hash_check}",
            file=sys.stderr,
        )

    if args.json is not None:
        document = {
            "benchmark": "scheduler_path",
            "schema": 3,
            "trace": str(path),
            "requests": len(requests),
            "input_tokens": input_tokens,
            "page_size": page,
            "cap_tokens": args.cap_tokens,
            "repeat": args.repeat,
            "gc_during_timing": not args.no_gc,
            "runs": {
                case: {
                    "baseline": runs["baseline"].summary(),
                    **{mode: runs[mode].summary() for mode in MODES},
                    "sha256_floor": runs["floor"].summary(),
                    **{f"time_ratio_{mode}": ratio(runs[mode], runs["baseline"]) for mode in MODES},
                    "floor_ratio": ratio(runs["floor"], runs["baseline"]),
                }
                for case, runs in results.items()
            },
            "unbounded_hit_ratio_agree": not disagreements(results),
            "hash_check": hash_check,
            "memory": memory,
            "goals": goals(results, memory),
            "impl_sources": impl_sources(),
            "environment": {
                "python": platform.python_version(),
                "numpy": np.__version__,
                "cpu": cpu_model(),
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
            },
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        log(f"wrote {args.json}")

    if args.profile:
        for mode, options in MODES.items():
            log(f"[profile] cProfile of {LABELS[mode]}, unbounded ...")
            print(profile_kvstrata(tokens_list, page, unbounded, options, args.profile))
    log(f"done in {time.perf_counter() - started:.1f} s")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
