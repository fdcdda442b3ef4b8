"""Run the stateful suite against every known-bug patch in this folder; every one must be caught.

Each ``*.patch`` re-introduces one bug class (its first paragraph says which). For each, this script
copies the tree to a scratch folder, applies the patch there (a patch that does not apply is a failure,
never a skip), points ``kvstrata`` at the scratch copy, runs ``tests/stateful`` with the ``mutant``
Hypothesis profile (the gate's examples without the shrink phase) and stops at the first failure. A
header line ``Caught first by: tests/stateful/X.py`` runs that file first (the rest follow). The
real-Mooncake machines are left out unless the header has the line ``Real store: yes`` (a bug on the
real store's client path only).

Prints one line per mutant as it finishes (``NAME caught`` / ``NAME SURVIVED`` / ``NAME ERROR``, with
seconds) and last ``mutants: caught N of M``. Exit status 0 only if every mutant was caught. Mutants run
``--jobs`` at a time (default: the number of CPUs), each pytest with one torch/BLAS thread, so the
catalogue takes about 1/jobs of its serial time without oversubscribing the machine.

Usage: python tests/mutants/run.py [--jobs N] [NAME ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).resolve().parent
COPIED = ("model", "impl", "kvstrata", "tests", "pyproject.toml")


def prepare(scratch: Path, patch: Path) -> str | None:
    """Copy the tree into ``scratch`` and apply ``patch``; returns an error text or None."""
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, scratch / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy2(source, scratch / name)
    applied = subprocess.run(
        ["git", "apply", "--verbose", str(patch)],
        cwd=scratch,
        capture_output=True,
        text=True,
        check=False,
    )
    if applied.returncode != 0:
        return f"patch does not apply: {applied.stderr.strip()}"
    site = scratch / "_site" / "kvstrata"
    site.mkdir(parents=True)
    for package in ("model", "impl"):
        if (scratch / package).is_dir():
            (site / package).symlink_to(scratch / package, target_is_directory=True)
    # the public face and its subpackages (kvstrata.integrations, patched like the rest) move
    # beside the copied packages: a kvstrata/ folder left in the scratch root would shadow them
    face = scratch / "kvstrata"
    if face.is_dir():
        for entry in face.iterdir():
            if entry.name != "__pycache__":
                shutil.move(str(entry), str(site / entry.name))
        shutil.rmtree(face)
    return None


#: cheapest first: the page-hashing thread's machine, the model's own machines, then the L1/L2
#: differential, then the L3 one (which repeats the L1/L2 rules): a mutant stops at the first file
#: that catches it.
ORDER = (
    "test_hasher",
    "test_cache_model",
    "test_embedding",
    "test_hybrid",
    "test_radix_cache",
    "test_l3",
    "test_tp",  # last: only the TP mutants need it, and their headers name it
)


#: a patch's header may name the suite that catches it (``Caught first by: tests/stateful/X.py``): that
#: file runs first, the rest after it in ``ORDER`` (a wrong hint costs time, never a verdict)
HINT = "Caught first by:"
REAL_STORE = "Real store: yes"


def real_store(patch: Path) -> bool:
    """Whether a patch's header asks for the real-Mooncake machines too (``Real store: yes``): a bug
    only a real store's client path has. Every other mutant runs without them (they are slower and
    the in-memory machines cover the same cache paths)."""
    header = patch.read_text().split("\ndiff --git", 1)[0]
    return any(line.strip() == REAL_STORE for line in header.splitlines())


def first_file(patch: Path) -> str | None:
    """The stateful file a patch's header names as the one that catches it, if any."""
    header = patch.read_text().split("\ndiff --git", 1)[0]
    for line in header.splitlines():
        if line.startswith(HINT):
            return line.removeprefix(HINT).strip()
    return None


def stateful_files(scratch: Path, first: str | None = None) -> list[str]:
    files = sorted((scratch / "tests" / "stateful").glob("test_*.py"))

    def rank(path: Path) -> tuple[int, int, str]:
        if first is not None and path.relative_to(scratch).as_posix() == first:
            return (-1, 0, path.name)
        hits = [i for i, prefix in enumerate(ORDER) if path.name.startswith(prefix)]
        return (0, hits[0] if hits else len(ORDER), path.name)

    return [str(path.relative_to(scratch)) for path in sorted(files, key=rank)]


def environment(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(scratch / "_site")
    env["HYPOTHESIS_PROFILE"] = "mutant"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # one thread per pytest: mutants run side by side, one per CPU
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = "1"
    return env


def imports_scratch(scratch: Path, env: dict[str, str]) -> bool:
    """True if ``kvstrata.model`` resolves to the scratch copy (not the installed tree)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import kvstrata.model as m; print(m.__file__)"],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return probe.returncode == 0 and probe.stdout.strip().startswith(str(scratch))


#: exceptions that mean a patch broke the code (or the test file) rather than re-introducing a bug
#: the suite detects: a run failing with one of them is an ERROR, never a catch
NOT_A_CATCH = ("ImportError", "ModuleNotFoundError", "SyntaxError", "IndentationError", "NameError")


def not_a_catch(stdout: str) -> str | None:
    """The line of pytest's output that shows a failure is no catch (see ``NOT_A_CATCH``): a
    short-summary line or a traceback's exception line naming one of them; ``None`` if none does."""
    for line in stdout.splitlines():
        summary = line.startswith(("FAILED ", "ERROR "))
        raised = line.startswith("E ") and line[1:].lstrip().startswith(NOT_A_CATCH)
        if raised or (summary and any(f" - {name}" in line for name in NOT_A_CATCH)):
            return line.strip()
    return None


def run_one(patch: Path) -> tuple[str, float, str]:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"kvstrata-mutant-{patch.stem}-") as tmp:
        scratch = Path(tmp).resolve()
        problem = prepare(scratch, patch)
        if problem:
            return "ERROR", time.monotonic() - start, problem
        env = environment(scratch)
        if not imports_scratch(scratch, env):
            return "ERROR", time.monotonic() - start, "kvstrata does not import from the copy"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                *stateful_files(scratch, first_file(patch)),
                *([] if real_store(patch) else ["-k", "not Mooncake"]),
                "-x",
                "-q",
                "-rfE",
                "--no-header",
                "-p",
                "no:cacheprovider",
            ],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    elapsed = time.monotonic() - start
    tail = "\n".join(result.stdout.strip().splitlines()[-3:])
    broken = not_a_catch(result.stdout)
    if broken:
        return "ERROR", elapsed, f"the suite failed, but not on the bug: {broken}"
    if result.returncode == 1:
        return "caught", elapsed, tail
    if result.returncode == 0:
        return "SURVIVED", elapsed, tail
    return "ERROR", elapsed, f"pytest exit {result.returncode}: {tail}\n{result.stderr[-2000:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's last lines")
    parser.add_argument(
        "-j", "--jobs", type=int, default=os.cpu_count() or 1, help="mutants run at a time"
    )
    args = parser.parse_args(argv)
    patches = sorted(MUTANTS.glob("*.patch"))
    if args.names:
        patches = [p for p in patches if p.stem in args.names]
        missing = set(args.names) - {p.stem for p in patches}
        if missing:
            print(f"unknown mutants: {', '.join(sorted(missing))}", file=sys.stderr)
            return 2
    if not patches:
        print("mutants: no patches found", file=sys.stderr)
        return 2
    caught = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        running = {pool.submit(run_one, patch): patch for patch in patches}
        for done in concurrent.futures.as_completed(running):
            patch = running[done]
            verdict, seconds, detail = done.result()
            print(f"{patch.stem} {verdict} ({seconds:.1f}s)", flush=True)
            if verdict != "caught" or args.verbose:
                print("    " + detail.replace("\n", "\n    "), flush=True)
            caught += verdict == "caught"
    print(f"mutants: caught {caught} of {len(patches)}")
    return 0 if caught == len(patches) else 1


if __name__ == "__main__":
    sys.exit(main())
