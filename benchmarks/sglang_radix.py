"""kvstrata's scheduler path side by side with sglang's own ``RadixCache`` (issue 20, item 6).

Runs in the sglang venv (``scripts/engines`` builds ``.venv-sglang``: sglang 0.5.23 installed
``--no-deps`` as ../shared/ENGINES.md shows, kvstrata editable on top)::

    .venv-sglang/bin/python benchmarks/sglang_radix.py [--trace PATH] [--limit N] [--json PATH]

The same requests (``benchmarks.traces``: a Mooncake-format trace's hash ids turned into token arrays
before any timing) and the same page size go through, interleaved run by run, ``--repeat`` times each
(the fastest run of each is kept, as in ``scheduler_path.py``):

* **sglang**: ``sglang.srt.mem_cache.radix_cache.RadixCache`` (no HiCache: it hashes nothing),
  driven as sglang's scheduler drives it per request: ``match_prefix`` -> ``inc_lock_ref`` of the
  matched node -> ``evict`` what the new tokens need beyond the capacity -> ``insert`` of the whole
  page-aligned prompt with its KV index tensor -> ``dec_lock_ref``. Its token allocator is a stand-in
  that only counts (sglang's own would cost more); each request's ``RadixKey`` token list and index
  tensor are built before timing, as sglang has them in the request already;
* **kvstrata** in the three modes of ``scheduler_path.py`` (no page hashes; page hashes on the C
  hashing thread; page hashes inline), with the scheduler protocol ``match_prefix`` -> ``lock`` ->
  ``alloc_device`` -> ``insert`` -> ``unlock``;
* the chained-SHA-256 ``OrderedDict`` **baseline** of ``scheduler_path.py``, kept for continuity.

Per structure: scheduler-thread time (``perf_counter_ns`` around each request), the hashing thread's
CPU time (``kvstrata, hashing thread``; ``all threads`` adds it), and the hit ratio. Unbounded and at
a token capacity (``--cap-tokens``, default 3M). Goals (issue 20): all threads <= 0.5x sglang and the
scheduler thread <= 0.25x sglang, in both cases. Exit status 0, or 2 when sglang cannot be imported.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.scheduler_path import (  # noqa: E402
    LABELS,
    MODES,
    RunResult,
    Tokens,
    best_of,
    replay,
    run_baseline,
    run_kvstrata,
)
from benchmarks.traces import load_trace, resolve_trace_or_exit, synthesise  # noqa: E402

GOAL_ALL_THREADS = 0.5
GOAL_SCHEDULER_THREAD = 0.25


def import_sglang() -> dict[str, Any]:
    """sglang's radix cache classes, after the torchvision stand-in its model configs import."""
    spec = importlib.util.spec_from_file_location(
        "kvstrata_sglang_stand_in", REPO / "tests" / "engines" / "sglang" / "conftest.py"
    )
    if spec is None or spec.loader is None:
        raise ImportError("tests/engines/sglang/conftest.py is missing")
    sys.path.insert(0, str(REPO / "tests"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # installs the stand-in, then imports sglang's storage API
    from sglang.srt.mem_cache import (  # noqa: PLC0415
        base_prefix_cache,
        cache_init_params,
        radix_cache,
    )

    return {
        "RadixCache": radix_cache.RadixCache,
        "RadixKey": radix_cache.RadixKey,
        "CacheInitParams": cache_init_params.CacheInitParams,
        "MatchPrefixParams": base_prefix_cache.MatchPrefixParams,
        "InsertParams": base_prefix_cache.InsertParams,
        "EvictParams": base_prefix_cache.EvictParams,
    }


class CountingAllocator:
    """The token allocator sglang's ``evict`` hands freed KV indices to: counts, keeps nothing."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free_segment(self, value: torch.Tensor, start_pos: int = 0) -> None:
        self.freed += len(value) - start_pos

    def free(self, value: torch.Tensor) -> None:
        self.freed += len(value)


def run_sglang(
    api: dict[str, Any], tokens_list: Sequence[Tokens], page_size: int, capacity_pages: int
) -> RunResult:
    """One timed replay through sglang's ``RadixCache`` at ``capacity_pages`` pages."""
    allocator = CountingAllocator()
    cache = api["RadixCache"](
        api["CacheInitParams"](
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
        )
    )
    capacity = capacity_pages * page_size
    make_key, match_params = api["RadixKey"], api["MatchPrefixParams"]
    insert_params, evict_params = api["InsertParams"], api["EvictParams"]
    prepared = iter(
        [
            (
                make_key(tokens[: len(tokens) // page_size * page_size].tolist()),
                torch.arange(len(tokens)),
            )
            for tokens in tokens_list
        ]
    )

    def step(_tokens: Tokens) -> int:
        key, value = next(prepared)
        match = cache.match_prefix(match_params(key=key))
        node = match.last_device_node
        cache.inc_lock_ref(node)
        hit = match.device_prefix_len
        need = len(key) - hit
        held = cache.evictable_size_ + cache.protected_size_
        if held + need > capacity:
            cache.evict(evict_params(num_tokens=held + need - capacity))
            if cache.evictable_size_ + cache.protected_size_ + need > capacity:
                cache.dec_lock_ref(node)
                return -1
        cache.insert(insert_params(key=key, value=value))
        cache.dec_lock_ref(node)
        return hit // page_size

    result = replay("sglang", step, tokens_list, page_size, capacity_pages)
    result.cached_pages_end = (cache.evictable_size_ + cache.protected_size_) // page_size
    return result


def row(result: RunResult, sglang: RunResult) -> dict[str, Any]:
    threads = result.total_ns + result.hasher_busy_ns
    return {
        "scheduler_ms": result.total_ns / 1e6,
        "hashing_thread_ms": result.hasher_busy_ns / 1e6,
        "all_threads_ms": threads / 1e6,
        "scheduler_vs_sglang": result.total_ns / sglang.total_ns,
        "all_threads_vs_sglang": threads / sglang.total_ns,
        "hit_ratio": result.hit_ratio,
        "capacity_errors": result.capacity_errors,
    }


def one_round(
    api: dict[str, Any], tokens_list: Sequence[Tokens], page: int, capacity: int
) -> dict[str, RunResult]:
    """Every structure once, one after the other (the cyclic GC off while each runs)."""
    runs = {
        "sglang": lambda: run_sglang(api, tokens_list, page, capacity),
        "baseline": lambda: run_baseline(tokens_list, page, capacity),
        **{mode: (lambda m=mode: run_kvstrata(tokens_list, page, capacity, m)) for mode in MODES},
    }
    out = {}
    for name, run in runs.items():
        out[name] = best_of(1, run, gc_off=True)
        gc.collect()
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trace", type=Path, default=None, help="Mooncake-format trace")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--cap-tokens", type=int, default=3_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="runs per structure (fastest kept)")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        api = import_sglang()
    except Exception as error:  # any import failure means: not in the sglang venv
        print(
            f"sglang_radix: sglang's RadixCache cannot be imported here ({error!r}); run it with "
            ".venv-sglang/bin/python (scripts/engines builds it)",
            file=sys.stderr,
        )
        return 2
    path = resolve_trace_or_exit(args.trace)
    page = args.page_size
    tokens_list = synthesise(load_trace(path, args.limit))
    unbounded = max(sum(len(t) // page for t in tokens_list), 1)
    gc.collect()
    gc.freeze()
    report: dict[str, Any] = {
        "trace": path.name,
        "requests": len(tokens_list),
        "input_tokens": int(sum(len(t) for t in tokens_list)),
        "page_size": page,
        "repeat": args.repeat,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "cases": {},
    }
    started = time.perf_counter()
    for case, capacity in (("unbounded", unbounded), ("capped", args.cap_tokens // page)):
        runs: dict[str, RunResult] = {}
        for _ in range(args.repeat):  # interleaved: each round runs every structure once
            for name, result in one_round(api, tokens_list, page, capacity).items():
                if name not in runs or result.total_ns < runs[name].total_ns:
                    runs[name] = result
        sglang = runs["sglang"]
        report["cases"][case] = {
            "capacity_pages": capacity,
            "sglang": {"scheduler_ms": sglang.total_ns / 1e6, "hit_ratio": sglang.hit_ratio},
            **{name: row(runs[name], sglang) for name in ("baseline", *MODES)},
        }
        print(f"\n{case} ({capacity:,} pages of {page} tokens), fastest of {args.repeat}:")
        print(
            "| structure | scheduler ms | hashing thread ms | ÷ sglang (scheduler) | ÷ sglang "
            "(all threads) | hit ratio |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        print(
            f"| sglang RadixCache | {sglang.total_ns / 1e6:.0f} | | 1.00 | 1.00 | "
            f"{sglang.hit_ratio:.4f} |"
        )
        for name in ("baseline", *MODES):
            r = report["cases"][case][name]
            print(
                f"| {LABELS.get(name, name)} | {r['scheduler_ms']:.0f} | "
                f"{r['hashing_thread_ms']:.0f} | {r['scheduler_vs_sglang']:.3f} | "
                f"{r['all_threads_vs_sglang']:.3f} | {r['hit_ratio']:.4f} |"
            )
        hashed = report["cases"][case]["kvstrata_hashes"]
        for what, value, goal in (
            ("all threads", hashed["all_threads_vs_sglang"], GOAL_ALL_THREADS),
            ("scheduler thread", hashed["scheduler_vs_sglang"], GOAL_SCHEDULER_THREAD),
        ):
            verdict = "met" if value <= goal else "NOT met"
            print(
                f"goal {what} <= {goal}x sglang ({case}, hashing thread): {value:.3f} ({verdict})"
            )
    report["seconds"] = time.perf_counter() - started
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips triton's reference-leak report at interpreter exit (sglang imports it)
