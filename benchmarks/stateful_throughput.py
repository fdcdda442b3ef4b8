"""Stateful-suite throughput: steps per second of every RuleBasedStateMachine in tests/stateful.

A step is one rule (initialize rules included) followed by the invariant checks, model and test oracle
together, exactly as the gate runs them. Generation only (no shrinking), derandomized, so runs are
comparable.

Usage: python benchmarks/stateful_throughput.py [--examples 100] [--steps 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, run_state_machine_as_test

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the machines import tests/support (pytest's pythonpath)
#: machines on a real Mooncake (named Mooncake*) run only inside pytest, which starts the cluster
NEEDS_A_STORE = "Mooncake"


def machines() -> list[type[RuleBasedStateMachine]]:
    found: list[type[RuleBasedStateMachine]] = []
    for path in sorted((REPO / "tests" / "stateful").glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        local = [
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and issubclass(value, RuleBasedStateMachine)
            and value.__module__ == module.__name__
        ]
        # leaves only: a base machine whose subclasses fix its parameters is not run on its own
        found.extend(
            m
            for m in local
            if not any(o is not m and issubclass(o, m) for o in local)
            and not m.__name__.startswith(NEEDS_A_STORE)
        )
    return found


def measure(machine: type[RuleBasedStateMachine], examples: int, steps: int) -> dict[str, float]:
    counter = {"steps": 0}

    class Counted(machine):  # type: ignore[valid-type, misc]
        @invariant()
        def _count_step(self) -> None:
            counter["steps"] += 1

    Counted.__name__ = machine.__name__
    config = settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    start = time.perf_counter()
    run_state_machine_as_test(Counted, settings=config)
    seconds = time.perf_counter() - start
    return {
        "steps": counter["steps"],
        "seconds": seconds,
        "steps_per_s": counter["steps"] / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    print(f"{'machine':32} {'steps':>8} {'seconds':>8} {'steps/s':>8}")
    for machine in machines():
        row = measure(machine, args.examples, args.steps)
        results[machine.__name__] = row
        print(
            f"{machine.__name__:32} {row['steps']:8.0f} {row['seconds']:8.1f} {row['steps_per_s']:8.0f}"
        )
    total_steps = sum(r["steps"] for r in results.values())
    total_seconds = sum(r["seconds"] for r in results.values())
    print(f"{'all':32} {total_steps:8.0f} {total_seconds:8.1f} {total_steps / total_seconds:8.0f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
