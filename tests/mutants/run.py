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

A patch of the C kernels (``impl/*.c``, ``impl/*.h``) is built in the scratch copy
(``kvstrata.impl._native`` from pyproject.toml's ``ext-modules``, the copied module replaced), and
the copy must then import that module: a build that fails, or a kvstrata that falls back to the
portable kernels, is an ERROR, never a catch or a survivor.

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
    if touches_c(patch):
        problem = build_native(scratch)
        if problem:
            return problem
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


def touches_c(patch: Path) -> bool:
    """Whether ``patch`` changes a C source or header of the native kernels (``impl/*.c|h``)."""
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git a/impl/") and line.split()[2].endswith((".c", ".h")):
            return True
    return False


#: builds the scratch copy's ``kvstrata.impl._native`` from pyproject.toml's ext-modules into the
#: folder given as its one argument (setuptools' build_ext, the options the package build uses)
BUILD_NATIVE = """
import sys, tomllib
from pathlib import Path
from setuptools import Distribution, Extension
spec = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]
modules = []
for module in spec:
    options = {key.replace("-", "_"): value for key, value in module.items() if key != "optional"}
    options["define_macros"] = [tuple(pair) for pair in options.get("define_macros", [])]
    modules.append(Extension(**options))
out = sys.argv[1]
dist = Distribution({"ext_modules": modules, "script_name": "build", "script_args": [
    "build_ext", "--build-lib", out, "--build-temp", out + "/temp"]})
dist.parse_command_line()
dist.run_commands()
"""


def build_native(scratch: Path) -> str | None:
    """Build the patched C kernels in ``scratch`` and put the module in place of the copied one;
    an error text when the build fails."""
    out = scratch / "_build"
    built = subprocess.run(
        [sys.executable, "-c", BUILD_NATIVE, str(out)],
        cwd=scratch,
        capture_output=True,
        text=True,
        check=False,
    )
    modules = sorted((out / "kvstrata" / "impl").glob("_native*.so"))
    if built.returncode != 0 or len(modules) != 1:
        return f"the patched C kernels do not build: {(built.stderr or built.stdout)[-2000:]}"
    for old in (scratch / "impl").glob("_native*.so"):
        old.unlink()
    shutil.copy2(modules[0], scratch / "impl" / modules[0].name)
    shutil.rmtree(out)
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


#: prints where kvstrata.model and the native kernels in use come from ("" for none)
IMPORT_PROBE = (
    "import kvstrata.model as m; from kvstrata.impl.kernels import native_module as n; "
    "print(m.__file__); print(getattr(n(), '__file__', ''))"
)


def imports_scratch(scratch: Path, env: dict[str, str], *, native: bool = False) -> bool:
    """True if ``kvstrata.model`` resolves to the scratch copy (not the installed tree), and with
    ``native`` if the C kernels in use are the copy's too (a C mutant must run, not fall back)."""
    probe = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = probe.stdout.split("\n")
    if probe.returncode != 0 or not lines[0].startswith(str(scratch)):
        return False
    return not native or (len(lines) > 1 and lines[1].startswith(str(scratch)))


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
        if not imports_scratch(scratch, env, native=touches_c(patch)):
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
