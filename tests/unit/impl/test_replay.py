"""The trace replay as a library (issue 5): capacities, trace reading, token synthesis, the
theoretical maximum, synthetic KV and its verification, and whole replays through L1/L2/L3 with the
in-memory L3 (tests/unit/impl/test_cli.py runs the command line, including the Mooncake default)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.replay_traces import conversations, naive_max_hit_tokens, write_trace

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.errors import ConfigError
from kvstrata.impl.pools import DeviceKVPool, KVShape
from kvstrata.impl.replay import sample_trace
from kvstrata.impl.replay.background import Progress
from kvstrata.impl.replay.capacity import Capacity, CapacityKind
from kvstrata.impl.replay.config import ModelShape, ReplayConfig
from kvstrata.impl.replay.errors import TraceError, VerifyError
from kvstrata.impl.replay.kv import KVSynth
from kvstrata.impl.replay.maximum import max_hit_pages
from kvstrata.impl.replay.plot import write_plot
from kvstrata.impl.replay.runner import replay, sweep
from kvstrata.impl.replay.scheduler import ReferenceScheduler
from kvstrata.impl.replay.trace import (
    MAX_HASH_ID,
    Request,
    block_tokens,
    read_trace,
    request_tokens,
)
from kvstrata.model.keys import (
    KVKind,
    chain_page_hashes,
)

PAGE = 64
PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- capacities
@pytest.mark.parametrize(
    ("text", "kind", "amount"),
    [
        ("3M", CapacityKind.TOKENS, 3_000_000),
        ("12m", CapacityKind.TOKENS, 12_000_000),
        ("1.5k", CapacityKind.TOKENS, 1_500),
        ("4096", CapacityKind.TOKENS, 4_096),
        ("4gb", CapacityKind.BYTES, 4_000_000_000),
        ("512MiB", CapacityKind.BYTES, 512 << 20),
        ("1024b", CapacityKind.BYTES, 1_024),
        ("inf", CapacityKind.UNBOUNDED, 0),
        ("0", CapacityKind.OFF, 0),
        ("off", CapacityKind.OFF, 0),
    ],
)
def test_capacity_syntax(text: str, kind: CapacityKind, amount: int) -> None:
    capacity = Capacity.parse(text, flag="--l2")
    assert (capacity.kind, capacity.amount, str(capacity)) == (kind, amount, text)


@pytest.mark.parametrize("text", ["3x", "-1", "4gi", "", "M", "1e6"])
def test_capacity_syntax_errors_name_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--l1"):
        Capacity.parse(text, flag="--l1")


def test_capacity_in_pages() -> None:
    assert Capacity.parse("1M").pages(64, 16, 10, flag="--l1") == 15_625
    assert Capacity.parse("1mb").pages(64, 16, 10, flag="--l1") == 976  # 1e6 // 1024
    assert Capacity.parse("inf").pages(64, 16, 10, flag="--l1") == 10
    assert Capacity.parse("0").pages(64, 16, 10, flag="--l2") == 0
    with pytest.raises(ConfigError, match=r"--l1 63: 63 tokens cannot hold one page"):
        Capacity.parse("63").pages(64, 16, 10, flag="--l1")
    with pytest.raises(ConfigError, match="1023 bytes cannot hold one page"):
        Capacity.parse("1023b").pages(64, 16, 10, flag="--l3")
    with pytest.raises(ConfigError, match="cannot be off"):
        Capacity.parse("0", flag="--l1", allow_off=False)


def test_config_tiers() -> None:
    assert ReplayConfig(l2="0").l3.is_off  # L3 follows L2 off by default
    with pytest.raises(ConfigError, match="L3 needs an L2"):
        ReplayConfig(l2="0", l3="4M")
    with pytest.raises(ConfigError, match="write_policy"):
        ReplayConfig(write_policy="sometimes")
    with pytest.raises(ConfigError, match="heads"):
        ModelShape(kind="mla", heads=2)


# ---------------------------------------------------------------------------------- traces
def test_read_trace_and_limit(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", conversations(sessions=2, turns=2))
    path.write_text(path.read_text() + "\n\n", encoding="utf-8")  # trailing blank lines
    requests = read_trace(path)
    assert len(requests) == 4
    assert requests[0] == Request(0, 4 * 512 - 100, 10, (0, 1, 2, 3))
    assert len(read_trace(path, limit=3)) == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5}', "missing field"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "int >= 0"),
        ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [1]}', "int >= 0"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "need 2"),
        ('{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
        ('{"timestamp": "x", "input_length": 6, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        # issue 17: refused before 15 GiB of token ids are allocated
        (
            '{"timestamp": 0, "input_length": 2000000000, "output_length": 1, "hash_ids": [1]}',
            "cap",
        ),
    ],
)
def test_malformed_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    good = json.dumps(conversations(sessions=1, turns=1)[0])
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n", encoding="utf-8")
    with pytest.raises(TraceError, match=rf"bad\.jsonl:3: .*{message}"):
        read_trace(path)


def test_unreadable_traces(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="trace not found"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="directory"):
        read_trace(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(TraceError, match="no request"):
        read_trace(tmp_path / "empty.jsonl")
    good = json.dumps(conversations(sessions=1, turns=1)[0]).encode()
    (tmp_path / "latin.jsonl").write_bytes(good + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=r"latin\.jsonl:2: not UTF-8"):
        read_trace(tmp_path / "latin.jsonl")


def test_token_map_never_merges_blocks() -> None:
    # h and h + 3125 collide under a map reduced modulo 50,000; they must not here
    ids = [0, 3125, 6250, 12_345, MAX_HASH_ID]
    blocks = block_tokens(ids)
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            assert not np.any(blocks[i] == blocks[j]), (ids[i], ids[j])
    request = Request(0, 700, 1, (5, 6))
    tokens = request_tokens(request)
    assert tokens.dtype == np.uint32 and len(tokens) == 700
    assert np.array_equal(tokens[:512], block_tokens([5])[0])


def test_the_sample_trace_ships_and_reads() -> None:
    requests = read_trace(sample_trace())
    assert 200 <= len(requests) <= 500


# ---------------------------------------------------------------------------------- maximum
def test_max_hit_pages_by_hand() -> None:
    requests = [
        Request(0, 1024, 1, (1, 2)),  # 16 pages of 64, nothing before
        Request(0, 1000, 1, (1, 2)),  # 15 full pages, all seen
        Request(0, 1024, 1, (1, 3)),  # shares block 1 only: 8 pages
        Request(0, 2048, 1, (1, 2, 4, 5)),  # the first request's 16 pages
        Request(0, 30, 1, (1,)),  # no full page
    ]
    assert max_hit_pages(requests, 64) == [0, 15, 8, 16, 0]
    # pages of 100 tokens straddle blocks: page 5 (500..600) needs blocks 1 and 2
    assert max_hit_pages(requests, 100) == [0, 10, 5, 10, 0]


def test_max_hit_pages_matches_the_naive_oracle() -> None:
    records = conversations(sessions=4, turns=4, blocks_per_turn=2, cut=37)
    requests = [
        Request(r["timestamp"], r["input_length"], 1, tuple(r["hash_ids"])) for r in records
    ]
    for page in (16, 64, 100, 512, 700):
        assert sum(max_hit_pages(requests, page)) * page == naive_max_hit_tokens(records, page)


# ---------------------------------------------------------------------------------- synthetic KV
SHAPE = KVShape(KVKind.MHA, layers=2, heads=1, head_dim=2, dtype=torch.float16, page_size=PAGE)


def test_page_hashes_follow_the_key_schema() -> None:
    tokens = request_tokens(Request(0, 700, 1, (7, 8)))
    ours = KVSynth(SHAPE).page_hashes(tokens)
    assert ours == [page.digest for page in chain_page_hashes(tokens.tolist(), PAGE)]


def test_kv_is_deterministic_and_verified_byte_for_byte() -> None:
    synth = KVSynth(SHAPE, seed=3)
    hashes = synth.page_hashes(request_tokens(Request(0, 512, 1, (1,))))
    assert torch.equal(
        synth.kv(hashes).view(torch.int16), KVSynth(SHAPE, 3).kv(hashes).view(torch.int16)
    )
    assert not torch.equal(
        synth.kv(hashes).view(torch.int16), KVSynth(SHAPE, 4).kv(hashes).view(torch.int16)
    )
    pool = DeviceKVPool(SHAPE, 16, "cpu")
    slots = np.array([9, 2, 5, 0, 11, 3, 7, 1], dtype=np.int64)
    synth.write(pool, slots, hashes)
    assert synth.first_mismatch(pool, slots, hashes) is None
    pool.buffer.view(torch.int16)[1, 1, 0, 17, 0, 1] ^= (
        1  # one bit of V, layer 1, page slot 0 = position 3
    )
    assert synth.first_mismatch(pool, slots, hashes) == 3


def test_verification_fails_loudly_on_wrong_bytes() -> None:
    device = DeviceKVPool(SHAPE, 64, "cpu")
    cache = HierarchicalRadixCache.build(RadixCacheConfig(page_size=PAGE), device)
    scheduler = ReferenceScheduler(cache, device, KVSynth(SHAPE), Progress())
    tokens = request_tokens(Request(0, 1024, 1, (1, 2)))
    assert scheduler.serve(tokens, 0).l1_pages == 0
    assert scheduler.serve(tokens, 1).l1_pages == 16
    match = cache.match_prefix(tokens)
    device.buffer.view(torch.int16)[0, 0, int(match.device_indices[4]), 5, 0, 0] ^= 1
    with pytest.raises(VerifyError, match=r"request 2: page 4 of 16 served \(an L1 hit"):
        scheduler.serve(tokens, 2)


# ---------------------------------------------------------------------------------- whole replays
RECORDS = conversations(sessions=5, turns=5)
REQUESTS = [
    Request(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]))
    for r in RECORDS
]
MAX = naive_max_hit_tokens(RECORDS, PAGE)
LARGEST = max(r["input_length"] for r in RECORDS)


def memory(**fields: object) -> ReplayConfig:
    """In-memory L3, every continuation prefetched, and settled: hits independent of timing."""
    return ReplayConfig(l3_backend="memory", prefetch_threshold=0, settle=True, **fields)  # type: ignore[arg-type]


def check_sums(result: dict[str, object]) -> None:
    hits, ratio = result["hit_tokens"], result["hit_ratio"]
    assert isinstance(hits, dict) and isinstance(ratio, dict)
    assert hits["total"] == hits["l1"] + hits["l2"] + hits["l3"]
    assert ratio["total"] == pytest.approx(ratio["l1"] + ratio["l2"] + ratio["l3"])


def test_unbounded_l1_reaches_the_maximum() -> None:
    result = replay(memory(l1="inf", l2="0"), REQUESTS).as_json()
    check_sums(result)
    assert result["hit_tokens"] == {"l1": MAX, "l2": 0, "l3": 0, "total": MAX}
    assert result["max_hit_tokens"] == MAX
    assert result["hit_ratio"]["l1"] == result["max_hit_ratio"] > 0.4


def test_a_tiny_l1_recovers_through_l2_and_l3() -> None:
    tiny = str(LARGEST + PAGE)  # holds one request, nothing more
    alone = replay(memory(l1=tiny, l2="0"), REQUESTS).as_json()
    tiered = replay(memory(l1=tiny, l2=str(3 * LARGEST), l3="inf"), REQUESTS).as_json()
    for result in (alone, tiered):
        check_sums(result)
        assert result["refused_requests"] == 0
    assert alone["hit_tokens"]["total"] < MAX / 2
    hits = tiered["hit_tokens"]
    assert hits["total"] == MAX  # every page is found in some tier
    assert hits["l2"] > 0 and hits["l3"] > 0
    assert tiered["verify"]["pages_checked"] == hits["total"] // PAGE
    moved = tiered["bytes"]
    assert moved["l2_to_l1"] == (hits["l2"] + hits["l3"]) * 16
    assert moved["l3_to_l2"] >= hits["l3"] * 16
    assert moved["l1_to_l2"] > 0 and moved["l2_to_l3"] > 0


def test_sweep_and_plot(tmp_path: Path) -> None:
    tiny = Capacity.parse(str(LARGEST + PAGE))
    result = sweep(memory(l1=tiny, l2="0"), REQUESTS, [Capacity.parse("inf"), tiny])
    assert result.config["capacity"]["l1"] == str(tiny)
    points = result.as_json()["sweep"]
    assert [point["l1"] for point in points] == [str(tiny), "inf"]
    assert points[-1]["hit_ratio"]["l1"] == pytest.approx(MAX / result.input_tokens)
    path = tmp_path / "plot.png"
    write_plot(result, path)
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000
    timeline = result.as_json()["timeline"]
    assert timeline["requests"][-1] == len(REQUESTS)
    assert timeline["max_hit_tokens"][-1] == MAX


def test_result_schema(tmp_path: Path) -> None:
    result = replay(memory(l1="inf", l2="1M", l3="1M"), REQUESTS[:6], trace="t.jsonl", limit=6)
    path = tmp_path / "r.json"
    result.write_json(path)
    data = json.loads(path.read_text())
    assert data["schema"] == "kvstrata-replay/1"
    for key in (
        "requests",
        "input_tokens",
        "max_hit_ratio",
        "hit_ratio",
        "bytes",
        "timings",
        "config",
        "tiers",
        "l3",
        "verify",
        "timeline",
    ):
        assert key in data, key
    assert set(data["hit_ratio"]) == {"l1", "l2", "l3", "total"}
    assert set(data["bytes"]) == {"l1_to_l2", "l2_to_l1", "l2_to_l3", "l3_to_l2"}
    assert data["requests"] == 6 and data["trace"] == {"path": "t.jsonl", "limit": 6}
    assert data["tiers"]["l3"]["backend"] == "memory"
    assert data["timings"]["scheduler_us_per_request"] > 0
