"""Run one of this tree's benchmark scripts against another checkout's library (an A/B of code).

    git worktree add /tmp/before <commit>
    cp impl/_native*.so /tmp/before/impl/          # the same C module (or build it there)
    python benchmarks/against.py /tmp/before benchmarks/l3_throughput.py --sizes 64 --repeats 1

The script is the same on both sides; only ``kvstrata``, ``kvstrata.impl`` and ``kvstrata.model``
come from the other tree. It works with the editable install ``scripts/setup`` makes (``pip install
-e``): that install's import finder is pointed at the other tree for this process only. Alternate
the two sides run by run: this machine's speed drifts between runs (docs/benchmarks.md).

Exit status: the script's own; 2 when the tree or the editable install is missing.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

FINDER = "__editable___kvstrata_0_1_0_finder"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python benchmarks/against.py TREE SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    tree, script = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    if not (tree / "impl").is_dir() or not (tree / "model").is_dir() or not script.is_file():
        print(f"against: {tree} is not a kvstrata checkout or {script} is missing", file=sys.stderr)
        return 2
    try:
        finder = importlib.import_module(FINDER)
    except ImportError:
        print(
            "against: needs the editable install of scripts/setup (pip install -e)", file=sys.stderr
        )
        return 2
    finder.MAPPING.update(
        {
            "kvstrata": str(tree / "kvstrata"),
            "kvstrata.impl": str(tree / "impl"),
            "kvstrata.model": str(tree / "model"),
        }
    )
    sys.argv = [str(script), *argv[2:]]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
