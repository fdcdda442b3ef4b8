"""The chaos benchmark end to end (issue 17), smoke-sized: a replay slice whose real Mooncake master
is SIGKILLed for good a fifth of the way in finishes, serves no wrong byte, and leaves a few lines of
kvstrata's own on stderr and none of the native client's. Timings are the benchmark's to report
(docs/benchmarks.md), never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvstrata.impl.storage.mooncake.native_log import GLOG_LINE

REPO = Path(__file__).resolve().parents[2]


def test_a_master_killed_mid_replay_costs_hits_not_bytes(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/chaos.py",
            "--quick",
            "--scenarios",
            "down",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = {row["run"]: row for row in json.loads(out.read_text())["rows"]}
    down = rows["down"]
    assert down["exit"] == 0 and down["wrong_bytes"] == "none"
    assert down["pages_verified"] > 0
    assert down["l3_hit"]["last_window"] == 0.0  # the store is gone for good
    assert 1 <= down["stderr_lines"] <= 10, down["stderr"]
    assert any("L3 store down" in line for line in down["stderr"])
    assert not [line for line in down["stderr"] if GLOG_LINE.match(line.encode())]
    assert down["native_lines_hidden"] > 0  # the native client did complain, off stderr
