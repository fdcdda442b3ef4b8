"""The benchmark helpers of issue 20, smoke-sized: ``benchmarks/against.py`` runs a script with the
library of the checkout it names (and refuses a folder that is not one),
``benchmarks/backend_overhead.py`` times every call it lists against a real master's client, and
``benchmarks/client_history.py`` times every client history it names on a real cluster, with the
bytes it reads back checked, and the two throughput benchmarks whose ratios are issue 20's goals
(``l3_throughput.py``, ``embedding_throughput.py``) run end to end in their smallest form, their raw
baseline and the second client's scale row among their results (their store paths check the bytes
they moved in a warm-up repetition and exit 1 when they differ; the cache rows check counts only).
Timings are the benchmarks' to report (docs/benchmarks.md), never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvstrata.impl import kernels

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_against_imports_the_named_checkouts_library(tmp_path: Path) -> None:
    script = tmp_path / "where.py"
    script.write_text(
        "import sys\nimport kvstrata.model.keys as keys\nprint(keys.__file__)\nsys.exit(3)\n"
    )
    done = run("benchmarks/against.py", str(REPO), str(script))
    assert done.returncode == 3, done.stderr  # the script's own exit status
    assert Path(done.stdout.strip()).resolve() == REPO / "model" / "keys.py"
    refused = run("benchmarks/against.py", str(tmp_path), str(script))
    assert refused.returncode == 2 and "not a kvstrata checkout" in refused.stderr


def test_backend_overhead_times_every_call(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    done = run(
        "benchmarks/backend_overhead.py", "--rounds", "1", "--calls", "3", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert {"exists, 1024 pages", "put + confirm, 64 pages", "get, 64 pages"} <= set(results)
    assert ("keys of 1024 pages, C kernel" in results) == (kernels.join_keys is not None)
    assert all(us > 0 for us in results.values())


def test_client_history_times_every_history_on_a_real_cluster(tmp_path: Path) -> None:
    out = tmp_path / "history.json"
    done = run(
        "benchmarks/client_history.py",
        *("--batch", "2", "--kib", "64", "--history-mib", "8", "--big-mib", "4"),
        *("--calls", "3", "--repeats", "1", "--json", str(out)),
    )
    assert done.returncode == 0, done.stderr
    clients = json.loads(out.read_text())["clients"]
    assert set(clients) == {"fresh", "small_objects", "big_objects", "big_objects_removed"}
    assert all(row["put_us"] > 0 and row["get_us"] > 0 for row in clients.values())
    refused = run("benchmarks/client_history.py", "--big-mib", "128", "--history-mib", "64")
    assert refused.returncode == 2 and "--big-mib" in refused.stderr


def test_l3_throughput_runs_its_rows_against_kvstratas_instance(tmp_path: Path) -> None:
    out = tmp_path / "l3.json"
    done = run(
        "benchmarks/l3_throughput.py",
        *("--quick", "--sizes", "256", "--skip-exists", "--cache-schema", "2"),
        *("--repeats", "1", "--json", str(out)),
    )
    assert done.returncode == 0, done.stderr
    (cell,) = json.loads(out.read_text())["cells"]
    rows = {row["path"]: row for row in cell["rows"]}
    assert {"raw", "raw_second", "direct", "raw_one_object", "cache_raw", "cache_l2"} <= set(rows)
    assert cell["cache_raw_objects_per_page"] == 1  # schema 2's cache against raw one-object calls
    assert all(row[f"{what}_ratio"] > 0 for row in rows.values() for what in ("put", "get"))


def test_embedding_throughput_reports_the_second_client_beside_the_baseline(
    tmp_path: Path,
) -> None:
    out = tmp_path / "embedding.json"
    done = run(
        "benchmarks/embedding_throughput.py",
        *("--quick", "--shapes", "small", "--batches", "1", "--repeats", "1", "--json", str(out)),
    )
    assert done.returncode == 0, done.stderr
    (cell,) = json.loads(out.read_text())["cells"]
    names = ("insert", "in_place", "prefetch", "borrow", "second_put", "second_get")
    assert all(cell["median_call_ratios"][name] > 0 for name in names)
