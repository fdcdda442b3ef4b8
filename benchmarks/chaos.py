"""Chaos: a replay slice while the L3 store fails, against the same replay without L3 (issue 17).

Every run replays the same trace slice through the reference scheduler (``kvstrata replay``'s code,
``wait_complete`` prefetch policy, KV verified bit for bit) with L1 and L2 small enough that L3
serves. The L3 is a :class:`~kvstrata.impl.storage.mooncake.LocalCluster` this script starts (a
``mooncake_master`` and a storage node on loopback) and the replay uses as a configured cluster, so
the script can break it mid-run:

- ``no_l3``: the baseline, no L3 at all;
- ``healthy``: L3, nothing breaks (the hit-ratio reference);
- ``down``: at ``--fault-at`` of the slice the master is SIGKILLed for good;
- ``restart``: the master is SIGKILLed there and restarted ``--restart-after`` seconds later (empty:
  Mooncake keeps its metadata in memory), while the replay goes on;
- ``node``: the storage node (the process whose segment holds every object) is SIGKILLed there.

Each run is a child process of this script (``--run NAME``), so its stderr can be counted line by
line and every Mooncake client starts fresh. Reported per run: the per-request L3 wait (p50, p99,
max, ms; the time a request spent in ``prefetch_ready`` waits), replay time ÷ the ``no_l3`` run's
(whole run, and from the fault request to the end), stderr lines in all and the native client's
lines kept off stderr, pages verified (a wrong byte ends the run with a verify error: the row says
so), the L3 hit ratio of the ``--window`` requests before the fault and of the last ``--window``
requests (beside the same requests of the ``healthy`` run), and for ``restart``: seconds from the
master accepting calls again to the link serving (state ``healthy``) and to the first request with
an L3 hit.

Copies and store I/O overlap the next requests (the replay's default): a replay runs requests back to
back with no model compute in between, so on a 2-core machine backups lag behind and the L3 hit ratio
is lower than with ``kvstrata replay --settle``; the same holds for the ``healthy`` reference.

Usage: python benchmarks/chaos.py [--trace PATH] [--limit N] [--json OUT] [--quick]
       (``kvstrata bench chaos`` runs it with the documented arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCENARIOS = ("no_l3", "healthy", "down", "restart", "node")
SHARED_TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"


def default_trace() -> str:
    shared = SHARED_TRACE / "conversation_trace.jsonl"
    if shared.is_file():
        return str(shared.resolve())
    from kvstrata.impl.replay import sample_trace  # noqa: PLC0415

    return sample_trace()


# ----------------------------------------------------------------------------------- one run
class Chaos:
    """The hook called after every request: breaks the cluster at the fault request and watches
    the store link come back."""

    def __init__(self, scenario: str, cluster: Any, fault_at: int, restart_after: float) -> None:
        self.scenario, self.cluster = scenario, cluster
        self.fault_at, self.restart_after = fault_at, restart_after
        self.killed_at: float | None = None
        self.restarted_at: float | None = None
        self.serving_at: float | None = None
        self.first_hit_at: float | None = None
        self.l3_pages: list[int] = []
        self.tokens: list[int] = []
        self.states: list[str] = []
        self.times: list[float] = []  # when each request finished

    def __call__(self, index: int, served: Any, cache: Any) -> None:
        now = time.monotonic()
        self.times.append(now)
        self.l3_pages.append(served.l3_pages)
        self.tokens.append(served.pages)
        link = cache.l3.link if cache.l3 is not None else None
        self.states.append(link.state.value if link is not None else "none")
        if index == self.fault_at and self.scenario in ("down", "restart"):
            self.cluster.kill_master()
            self.killed_at = now
        elif index == self.fault_at and self.scenario == "node":
            pid = self.cluster.node_pid
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            self.killed_at = now
        if (
            self.scenario == "restart"
            and self.killed_at is not None
            and self.restarted_at is None
            and now - self.killed_at >= self.restart_after
        ):
            self.cluster.restart_master()  # returns once the new master accepts connections
            self.restarted_at = time.monotonic()
        if self.restarted_at is not None and link is not None:
            if self.serving_at is None and link.state.value == "healthy":
                self.serving_at = link.healthy_since  # when the probe that brought it back landed
            if self.first_hit_at is None and served.l3_pages:
                self.first_hit_at = now


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.impl.replay.config import ReplayConfig  # noqa: PLC0415
    from kvstrata.impl.replay.runner import replay  # noqa: PLC0415
    from kvstrata.impl.replay.store import segment_bytes  # noqa: PLC0415
    from kvstrata.impl.replay.trace import read_trace  # noqa: PLC0415
    from kvstrata.impl.storage.mooncake import LocalCluster  # noqa: PLC0415
    from kvstrata.impl.storage.mooncake.native_log import quiet_native_logs  # noqa: PLC0415

    requests = read_trace(Path(args.trace), args.limit)
    fault_at = int(len(requests) * args.fault_at)
    base = {"l1": args.l1, "l2": args.l2, "page_size": args.page_size}
    out: dict[str, Any] = {"name": name, "requests": len(requests), "fault_at": fault_at}
    if name == "no_l3":
        config = ReplayConfig(**base, l3="0")
        watch = Chaos(name, None, fault_at, args.restart_after)
        started = time.monotonic()
        result = replay(config, requests, on_served=watch)
        out["run_s"] = time.monotonic() - started
        out["result"] = result.as_json()
        out["times"] = [t - started for t in watch.times]
        return out
    probe = ReplayConfig(**base, l3=args.l3)
    pages = probe.tier_pages(requests).l3
    size = segment_bytes(pages, args.page_size * probe.shape.bytes_per_token)
    quiet = quiet_native_logs()
    with LocalCluster(segment_size=size) as cluster:
        config = ReplayConfig(**base, l3=args.l3, master=cluster.master_address)
        chaos = Chaos(name, cluster, fault_at, args.restart_after)
        started = time.monotonic()
        try:
            result = replay(config, requests, on_served=chaos)
            out["result"] = result.as_json()
            out["verify_error"] = None
        except Exception as error:  # a wrong byte (VerifyError) or a stall: the row says so
            out["result"] = None
            out["verify_error"] = f"{type(error).__name__}: {error}"
        out["run_s"] = time.monotonic() - started
    out["native_lines"] = quiet.lines
    out["l3_pages"], out["pages"], out["states"] = chaos.l3_pages, chaos.tokens, chaos.states
    out["times"] = [t - started for t in chaos.times]
    restarted = chaos.restarted_at
    out["restart"] = {
        "killed_to_restart_s": None if restarted is None else restarted - (chaos.killed_at or 0),
        "serving_after_s": None
        if restarted is None or chaos.serving_at is None
        else chaos.serving_at - restarted,
        "first_l3_hit_after_s": None
        if restarted is None or chaos.first_hit_at is None
        else chaos.first_hit_at - restarted,
    }
    return out


# ----------------------------------------------------------------------------------- the report
def child(name: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    target = scratch / f"{name}.json"
    command = [
        sys.executable, __file__, "--run", name, "--json", str(target), "--trace", args.trace,
        "--limit", str(args.limit), "--l1", args.l1, "--l2", args.l2, "--l3", args.l3,
        "--page-size", str(args.page_size), "--fault-at", str(args.fault_at),
        "--restart-after", str(args.restart_after),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "KVSTRATA_DEBUG"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    report: dict[str, Any] = (
        json.loads(target.read_text()) if target.is_file() else {"name": name, "result": None}
    )
    report["exit"] = done.returncode
    report["stderr_lines"] = len(done.stderr.splitlines())
    report["stderr"] = done.stderr.splitlines()[:20]
    return report


def ratio(hits: list[int], pages: list[int]) -> float:
    return sum(hits) / max(sum(pages), 1)


def after_fault_s(run: dict[str, Any]) -> float | None:
    """Seconds from the fault request to the last request."""
    times, fault = run.get("times") or [], run.get("fault_at", 0)
    return times[-1] - times[fault] if len(times) > fault else None


def summarize(runs: dict[str, dict[str, Any]], window: int) -> list[dict[str, Any]]:
    base = runs["no_l3"]["result"]["timings"]["replay_s"]
    base_after = after_fault_s(runs["no_l3"])
    healthy = runs.get("healthy", {})
    rows = []
    for name, run in runs.items():
        result = run.get("result")
        row: dict[str, Any] = {"run": name, "exit": run.get("exit")}
        if result is not None:
            timings = result["timings"]
            row["l3_wait_ms"] = timings["l3_wait_ms_per_request"]
            row["replay_s"] = timings["replay_s"]
            row["drain_s"] = timings["drain_s"]
            row["replay_vs_no_l3"] = round(timings["replay_s"] / base, 3)
            after = after_fault_s(run)
            if after is not None and base_after:
                row["after_fault_vs_no_l3"] = round(after / base_after, 3)
            row["pages_verified"] = result["verify"]["pages_checked"]
        row["wrong_bytes"] = "none" if run.get("verify_error") is None else run["verify_error"]
        row["stderr_lines"] = run.get("stderr_lines")
        row["stderr"] = run.get("stderr", [])
        row["native_lines_hidden"] = run.get("native_lines")
        if "l3_pages" in run:
            fault, mine, pages = run["fault_at"], run["l3_pages"], run["pages"]
            ref = healthy.get("l3_pages")
            before = slice(max(fault - window, 0), fault)
            last = slice(-window, None)
            row["l3_hit"] = {
                "before_fault": round(ratio(mine[before], pages[before]), 4),
                "last_window": round(ratio(mine[last], pages[last]), 4),
                "healthy_before_fault": ref and round(ratio(ref[before], pages[before]), 4),
                "healthy_last_window": ref and round(ratio(ref[last], pages[last]), 4),
            }
        if run.get("restart", {}).get("killed_to_restart_s") is not None:
            row["restart"] = {
                k: None if v is None else round(v, 3) for k, v in run["restart"].items()
            }
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=None)
    parser.add_argument("--limit", type=int, default=6000)
    parser.add_argument("--l1", default="256k")
    parser.add_argument("--l2", default="512k")
    parser.add_argument("--l3", default="16M")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--fault-at", type=float, default=0.1)
    parser.add_argument("--restart-after", type=float, default=10.0)
    parser.add_argument("--window", type=int, default=500, help="requests per hit-ratio window")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--quick", action="store_true", help="a smoke run (300 requests)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--run", choices=SCENARIOS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.trace = args.trace or default_trace()
    if args.quick:
        args.limit, args.fault_at, args.restart_after, args.window = 400, 0.2, 0.5, 100
    if args.run:
        report = run_one(args.run, args)
        if args.json is not None:
            args.json.write_text(json.dumps(report))
        return
    names = [name for name in args.scenarios.split(",") if name]
    if "no_l3" not in names:
        names.insert(0, "no_l3")
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-chaos-") as scratch:
        for name in names:
            print(f"chaos: {name} ...", file=sys.stderr, flush=True)
            runs[name] = child(name, args, Path(scratch))
    rows = summarize(runs, args.window)
    text = json.dumps({"trace": args.trace, "limit": args.limit, "rows": rows}, indent=1)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    if any(row["exit"] not in (0, None) for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
