"""Time-boxed random fuzzing of the stateful suites (SPEC §7).

Runs ``pytest tests/stateful`` with the ``fuzz`` Hypothesis profile again and again, each round with a
fresh random seed, until ``--seconds`` have passed. On a failure it prints the seed and the command that
replays it (Hypothesis also prints a ``@reproduce_failure`` blob) and exits 1.

Usage: python scripts/fuzz.py [--seconds 120] [--examples 300] [pytest args...]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="time box for the whole run")
    parser.add_argument("--examples", type=int, default=300, help="examples per test per round")
    parser.add_argument("pytest_args", nargs="*", default=["tests/stateful"])
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.seconds
    env = dict(os.environ, HYPOTHESIS_PROFILE="fuzz", KVSTRATA_FUZZ_EXAMPLES=str(args.examples))
    rounds = 0
    while time.monotonic() < deadline:
        seed = random.SystemRandom().randrange(2**32)
        rounds += 1
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "--no-header",
            "-p",
            "no:cacheprovider",
            f"--hypothesis-seed={seed}",
            *args.pytest_args,
        ]
        print(f"fuzz round {rounds}: seed {seed}", flush=True)
        started = time.monotonic()
        result = subprocess.run(command, cwd=REPO, env=env, check=False)
        if result.returncode != 0:
            print(
                f"\nfuzz: FAILED in round {rounds} with seed {seed}. Reproduce with:\n"
                f"  HYPOTHESIS_PROFILE=fuzz KVSTRATA_FUZZ_EXAMPLES={args.examples} "
                f"python -m pytest --hypothesis-seed={seed} {' '.join(args.pytest_args)}",
                flush=True,
            )
            return 1
        print(f"fuzz round {rounds}: passed in {time.monotonic() - started:.1f}s", flush=True)
    print(f"fuzz: {rounds} rounds passed in {args.seconds:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
