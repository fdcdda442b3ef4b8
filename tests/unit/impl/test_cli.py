"""The ``kvstrata`` command as a user runs it (issue 5): subprocesses, exit statuses, what reaches
stdout and stderr, and the files written. One replay uses the default L3 (a real Mooncake
LocalCluster); the others use the in-memory L3 to stay fast."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.replay_traces import conversations, naive_max_hit_tokens, write_trace

PAGE = 64
PNG = b"\x89PNG\r\n\x1a\n"
RECORDS = conversations(sessions=5, turns=5)
LARGEST = max(record["input_length"] for record in RECORDS)


def kvstrata(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    return subprocess.run(
        [sys.executable, "-m", "kvstrata.impl.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trace(tmp_path_factory.mktemp("trace") / "chats.jsonl", RECORDS)


def ratios_sum(result: dict[str, object]) -> None:
    hits, ratio = result["hit_tokens"], result["hit_ratio"]
    assert isinstance(hits, dict) and isinstance(ratio, dict)
    assert hits["total"] == hits["l1"] + hits["l2"] + hits["l3"]
    assert ratio["total"] == pytest.approx(ratio["l1"] + ratio["l2"] + ratio["l3"])
    assert ratio["total"] == pytest.approx(hits["total"] / result["input_tokens"])  # type: ignore[operator]


def test_replay_reports_json_plot_summary_and_progress(trace: Path, tmp_path: Path) -> None:
    tiny = str(LARGEST + PAGE)
    out, plot = tmp_path / "result.json", tmp_path / "plot.png"
    run = kvstrata(
        "replay", str(trace), "--l3-backend", "memory", "--l1", tiny, "--l2", str(3 * LARGEST),
        "--l3", "inf", "--prefetch-threshold", "0", "--settle", "--sweep-l1", "inf",
        "--json", str(out), "--plot", str(plot),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    for text in (
        "Hits",
        "L1 device",
        "L2 host",
        "L3 memory",
        "max (unbounded)",
        "Data moved",
        "scheduler path",
        "wall time",
        "Hit ratio against L1 capacity",
    ):
        assert text in run.stdout, text
    assert f"{len(RECORDS)}/{len(RECORDS)} requests (100%)" in run.stderr  # progress
    result = json.loads(out.read_text())
    ratios_sum(result)
    maximum = naive_max_hit_tokens(RECORDS, PAGE)  # the test's own computation
    assert result["requests"] == len(RECORDS) and result["refused_requests"] == 0
    assert result["max_hit_tokens"] == maximum
    assert result["max_hit_ratio"] == pytest.approx(maximum / result["input_tokens"])
    # a tiny L1 alone cannot hold the reuse; with L2 and L3 behind it the total recovers
    assert result["hit_tokens"]["total"] == maximum
    assert result["hit_tokens"]["l2"] > 0 and result["hit_tokens"]["l3"] > 0
    assert result["verify"] == {"enabled": True, "pages_checked": maximum // PAGE}
    unbounded = [point for point in result["sweep"] if point["l1"] == "inf"]
    assert unbounded[0]["hit_ratio"]["l1"] == pytest.approx(result["max_hit_ratio"])
    assert plot.read_bytes()[:8] == PNG and plot.stat().st_size > 10_000


def test_replay_of_the_sample_through_a_local_mooncake_cluster(tmp_path: Path) -> None:
    out = tmp_path / "sample.json"
    run = kvstrata("replay", "--sample", "--limit", "40", "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "L3 mooncake" in run.stdout
    result = json.loads(out.read_text())
    ratios_sum(result)
    assert result["requests"] == 40
    assert result["tiers"]["l3"]["backend"] == "mooncake"
    assert result["tiers"]["l3"]["store_bytes"] >= 16 << 20
    assert result["bytes"]["l2_to_l3"] > 0  # pages were backed up into the cluster
    assert result["l3"]["backup_abandoned_pages"] == 0
    assert result["hit_tokens"]["total"] <= result["max_hit_tokens"]
    assert result["verify"]["pages_checked"] * PAGE == result["hit_tokens"]["total"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{dir}/missing.jsonl"], "trace not found: "),
        (["{bad}"], "bad.jsonl:2: not valid JSON"),
        (["--sample", "--l1", "63"], "--l1 63: 63 tokens cannot hold one page (64 tokens"),
        (["--sample", "--l2", "100b"], "--l2 100b: 100 bytes cannot hold one page"),
        (["--sample", "--l1", "3x"], "--l1: expected tokens like '3M'"),
        (["--sample", "--master", "127.0.0.1:{port}"], "is not reachable"),
        (["--sample", "--l2", "0", "--l3", "4M"], "L3 needs an L2 (host) tier"),
    ],
)
def test_bad_input_is_one_line_on_stderr(tmp_path: Path, args: list[str], message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n{oops\n", encoding="utf-8")
    fields = {"dir": str(tmp_path), "bad": str(bad), "port": str(free_port())}
    run = kvstrata("replay", *(arg.format(**fields) for arg in args), timeout=60)
    assert run.returncode == 1
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("kvstrata: error: ") and message in lines[0], lines[0]


def test_usage_errors() -> None:
    for args in (
        ["replay"],
        ["replay", "x.jsonl", "--sample"],
        ["replay", "--sample", "--limit", "0"],
    ):
        run = kvstrata(*args, timeout=60)
        assert run.returncode == 2, args
        assert "Traceback" not in run.stderr and "Error:" in run.stderr


def test_master_runs_in_the_foreground_until_sigterm() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstrata.impl.cli.main", "master", "--segment", "16mib"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("mooncake master at 127.0.0.1:"), first
        address = first.split()[3]
        exports = [proc.stdout.readline().strip() for _ in range(3)]
        assert f"export KVSTRATA_MOONCAKE_MASTER={address}" in exports
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5):
            pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bench_lists_the_benchmarks() -> None:
    run = kvstrata("bench", "--list", timeout=60)
    assert run.returncode == 0, run.stderr
    for name in (
        "stateful",
        "copy",
        "scheduler_path",
        "replay",
        "mutants",
        "embedding",
        "hybrid",
        "chaos",
    ):
        assert name in run.stdout
    assert "--limit 2000 --l1 1M --l2 4M --l3 16M" in run.stdout


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--host", "10.1.2.3"), "--host 10.1.2.3: not an address this machine can bind to"),
        (("--segment", "100tib"), "--segment 100tib: "),
    ],
)
def test_master_names_the_flag_that_cannot_work_before_starting_anything(
    flags: tuple[str, ...], named: str
) -> None:
    """Issue 17: these said ``[Errno 99] ...`` and "the storage node did not start (said '')"."""
    result = kvstrata("master", *flags, timeout=60)
    assert result.returncode != 0
    assert named in result.stderr, result.stderr
    assert "did not start" not in result.stderr


def test_replay_as_two_tp_ranks_equals_one_rank(tmp_path: Path) -> None:
    """``--tp 2``: two rank processes (gloo, loopback) on one local Mooncake cluster, each with its
    own shard; with ``--settle`` the hits do not depend on timing, so they equal ``--tp 1``'s."""
    results = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        args = ("replay", "--sample", "--limit", "120", "--settle", "--l1", "64K", "--l2", "256K")
        run = kvstrata(*args, "--tp", str(tp), "--json", str(out))
        assert run.returncode == 0, run.stderr
        results[tp] = json.loads(out.read_text())
    assert results[2]["config"]["tp"] == 2
    assert results[2]["hit_tokens"] == results[1]["hit_tokens"]
    assert results[1]["hit_tokens"]["l3"] > 0  # the comparison covers all three tiers
    assert results[2]["verify"]["pages_checked"] == results[1]["verify"]["pages_checked"]


def test_replay_under_either_key_schema_serves_the_same_hits(tmp_path: Path) -> None:
    """Issue 20: ``--key-schema 2`` (the default: one store object per page, a ``page_major`` host
    pool) and ``--key-schema 1`` (K and V objects, ``page_first_direct``) change how pages are laid
    out in the store, never which pages hit: with ``--settle`` the hits are equal, L3 included, and
    every served page verifies byte for byte."""
    results = {}
    for schema in ("1", "2"):
        out = tmp_path / f"schema{schema}.json"
        args = ("replay", "--sample", "--limit", "120", "--settle", "--l1", "64K", "--l2", "256K")
        run = kvstrata(*args, "--key-schema", schema, "--json", str(out))
        assert run.returncode == 0, run.stderr
        results[schema] = json.loads(out.read_text())
    assert results["2"]["config"]["key_schema"] == 2 and results["1"]["config"]["key_schema"] == 1
    assert results["2"]["hit_tokens"] == results["1"]["hit_tokens"]
    assert results["2"]["hit_tokens"]["l3"] > 0
    assert results["2"]["verify"]["pages_checked"] == results["1"]["verify"]["pages_checked"] > 0
    assert kvstrata("replay", "--sample", "--key-schema", "3").returncode == 2


def test_tp_refuses_what_it_cannot_keep_in_lockstep() -> None:
    run = kvstrata("replay", "--sample", "--tp", "2", "--timestamps", "honour")
    assert run.returncode != 0 and "--timestamps ignore" in run.stderr
    run = kvstrata("replay", "--sample", "--tp", "2", "--sweep-l1", "1M")
    assert run.returncode == 2 and "--tp 1" in run.stderr
