"""``kvstrata bench``: the benchmark scripts of a source checkout behind one command, with the arguments
that produce the numbers in docs/benchmarks.md (``--quick``: a smoke-sized run of each).

The benchmarks are the scripts under ``benchmarks/`` (plus the mutant catalogue,
``tests/mutants/run.py``, and the replay measurement itself). Known ones run with the documented
arguments; any other script under ``benchmarks/`` with a ``__main__`` guard runs with none, so a new
benchmark is picked up without touching this file. Each runs as its own process (the running
interpreter), one after another, its output streamed; JSON results go to ``--out``. The exit status is
1 if any of them failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import attrs
import click

__all__ = ["BENCHMARKS", "Benchmark", "bench", "discover"]

_TRACE = "../shared/traces/conversation_trace.jsonl"


@attrs.frozen
class Benchmark:
    """One benchmark: the script (relative to the checkout), its full and its quick arguments
    (``{out}`` is replaced by the output directory; ``quick=None``: skipped with ``--quick``)."""

    name: str
    script: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] | None = ()
    what: str = ""


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "stateful",
        "benchmarks/stateful_throughput.py",
        ("--examples", "100", "--steps", "50", "--json", "{out}/stateful.json"),
        ("--examples", "5", "--steps", "10", "--json", "{out}/stateful.json"),
        "stateful suite steps per second",
    ),
    Benchmark(
        "mutants",
        "tests/mutants/run.py",
        (),
        None,
        "mutant catch rate (several minutes; skipped with --quick)",
    ),
    Benchmark(
        "copy",
        "benchmarks/copy_throughput.py",
        ("--repeats", "7", "--threads", "1", "--json", "{out}/copy.json"),
        ("--repeats", "1", "--threads", "1", "--total-mib", "16", "--json", "{out}/copy.json"),
        "L1 <-> L2 copy throughput against memcpy",
    ),
    Benchmark(
        "scheduler_path",
        "benchmarks/scheduler_path.py",
        ("--repeat", "3", "--json", "{out}/scheduler_path.json"),
        ("--limit", "500", "--no-memory", "--json", "{out}/scheduler_path.json"),
        "scheduler-path cost against a SHA-256 dict baseline",
    ),
    Benchmark(
        "l3",
        "benchmarks/l3_throughput.py",
        ("--json", "{out}/l3.json"),
        ("--quick", "--json", "{out}/l3.json"),
        "L2 <-> L3 throughput through kvstrata against the raw Mooncake client",
    ),
    Benchmark(
        "embedding",
        "benchmarks/embedding_throughput.py",
        ("--json", "{out}/embedding.json"),
        ("--quick", "--json", "{out}/embedding.json"),
        "embedding cache insert / prefetch (copied and in place) against the raw Mooncake client",
    ),
    Benchmark(
        "client_history",
        "benchmarks/client_history.py",
        ("--json", "{out}/client_history.json"),
        ("--calls", "8", "--repeats", "1", "--json", "{out}/client_history.json"),
        "a native Mooncake client's past calls and its speed on small objects (the raw baselines)",
    ),
    Benchmark(
        "hybrid",
        "benchmarks/hybrid_throughput.py",
        ("--json", "{out}/hybrid.json"),
        ("--quick", "--json", "{out}/hybrid.json"),
        "hybrid page sets (KV, indexer, Mamba state) through L3 against the raw Mooncake client",
    ),
    Benchmark(
        "chaos",
        "benchmarks/chaos.py",
        ("--json", "{out}/chaos.json"),
        ("--quick", "--json", "{out}/chaos.json"),
        "replay while the Mooncake master dies, restarts or loses its storage node (issue 17)",
    ),
    Benchmark(
        "tp",
        "benchmarks/tp_agreement.py",
        ("--reps", "7", "--calls", "1000", "--replay-reps", "3", "--json", "{out}/tp.json"),
        (
            "--reps",
            "1",
            "--calls",
            "200",
            "--replay-reps",
            "1",
            "--limit",
            "20",
            "--json",
            "{out}/tp.json",
        ),
        "the TP agreement's cost per check_events and on the scheduler path (gloo, loopback)",
    ),
    Benchmark(
        "replay",
        "-m kvstrata.impl.cli.main",
        (
            "replay",
            _TRACE,
            "--limit",
            "2000",
            "--l1",
            "1M",
            "--l2",
            "4M",
            "--l3",
            "16M",
            "--page-size",
            "64",
            "--no-progress",
            "--json",
            "{out}/replay.json",
            "--plot",
            "{out}/replay.png",
        ),
        ("replay", "--sample", "--no-progress", "--json", "{out}/replay.json"),
        "hit ratio per tier of 2,000 public-trace requests (Mooncake L3)",
    ),
)


def find_root(given: Path | None) -> Path:
    """The source checkout holding ``benchmarks/``: ``given``, else the one this package was
    installed from (an editable install), else the current directory."""
    candidates = [given] if given is not None else []
    candidates += [Path(__file__).resolve().parents[2], Path.cwd()]
    for candidate in candidates:
        if candidate is not None and (candidate / "benchmarks").is_dir():
            return candidate
    raise click.ClickException(
        "kvstrata bench runs the scripts in a source checkout's benchmarks/ folder and none was "
        "found; run it from the checkout or pass --root PATH"
    )


def discover(root: Path) -> list[Benchmark]:
    """The known benchmarks whose script exists, then every other script under ``benchmarks/``
    that has a ``__main__`` guard (run without arguments)."""
    known = {benchmark.script for benchmark in BENCHMARKS}
    found = [b for b in BENCHMARKS if b.script.startswith("-m ") or (root / b.script).is_file()]
    for script in sorted((root / "benchmarks").glob("*.py")):
        relative = script.relative_to(root).as_posix()
        if relative in known:
            continue
        if "__main__" in script.read_text(encoding="utf-8", errors="replace"):
            found.append(Benchmark(script.stem, relative, (), (), "discovered: default arguments"))
    return found


def _command(benchmark: Benchmark, quick: bool, out: Path) -> list[str] | None:
    arguments = benchmark.quick if quick else benchmark.full
    if arguments is None:
        return None
    head = benchmark.script.split() if benchmark.script.startswith("-m ") else [benchmark.script]
    return [sys.executable, *head, *(a.replace("{out}", str(out)) for a in arguments)]


@click.command()
@click.argument("names", nargs=-1)
@click.option("--quick", is_flag=True, help="A short run of each (a smoke test, not the numbers).")
@click.option("--list", "list_only", is_flag=True, help="List the benchmarks and their commands.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-out"),
    show_default=True,
    help="Directory for the JSON results and plots.",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="The source checkout (default: the one kvstrata was installed from).",
)
def bench(
    names: tuple[str, ...], quick: bool, list_only: bool, out: Path, root: Path | None
) -> None:
    """Run the benchmarks of docs/benchmarks.md (all, or the NAMES given), one after another."""
    checkout = find_root(root)
    available = discover(checkout)
    by_name = {benchmark.name: benchmark for benchmark in available}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise click.BadParameter(
            f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(by_name)}",
            param_hint="NAMES",
        )
    chosen = [by_name[name] for name in names] if names else available
    if list_only:
        for benchmark in available:
            command = _command(benchmark, quick, out)
            shown = "skipped with --quick" if command is None else " ".join(command[1:])
            click.echo(f"{benchmark.name:16} {benchmark.what}\n{'':16} {shown}")
        return
    out.mkdir(parents=True, exist_ok=True)
    outcomes: list[tuple[str, str, float]] = []
    for benchmark in chosen:
        command = _command(benchmark, quick, out.resolve())
        if command is None:
            outcomes.append((benchmark.name, "skipped", 0.0))
            continue
        click.echo(f"\n=== {benchmark.name}: {' '.join(command[1:])}", err=True)
        started = time.monotonic()
        status = subprocess.run(command, cwd=checkout, check=False).returncode
        outcomes.append(
            (benchmark.name, "ok" if status == 0 else f"exit {status}", time.monotonic() - started)
        )
    click.echo("\nbenchmark         result     seconds")
    for name, outcome, seconds in outcomes:
        click.echo(f"{name:17} {outcome:10} {seconds:7.1f}")
    if any(outcome not in ("ok", "skipped") for _, outcome, _ in outcomes):
        raise click.exceptions.Exit(1)
