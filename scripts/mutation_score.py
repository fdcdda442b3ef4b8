"""Mutation score of the store key schema, the store-object code and the engines' key rule (issue 19,
item 7; issue 20, part 19).

Runs mutmut 3 over ``model/keys.py``, ``model/l3/objects.py``, ``impl/storage/objects.py`` and
``model/engines.py`` against a
fast selection of unit tests and prints, per file, how many mutants were killed, survived or timed out,
then every mutant that was not killed (``file:line``, the mutation, and its triage).

The repository is never touched: the tree is copied into a scratch folder laid out as the installed
package (``kvstrata/``, ``kvstrata/model``, ``kvstrata/impl`` with the built ``_native`` module), so
that mutmut's module names (taken from file paths) are the names the tests import; mutmut's
configuration is a ``setup.cfg`` written there. Every run starts from an empty scratch folder (no
cached verdicts) with the derandomized ``mutant`` Hypothesis profile, ``PYTHONHASHSEED=0`` and one
BLAS thread per worker, so two runs on the same tree give the same numbers.

A survivor is either listed in ``EQUIVALENT`` (a mutant no test can tell apart, with the reason) or
UNTRIAGED. Exit status: 0 when every survivor is triaged, 1 when one is not, 2 when the run failed.

Usage: python scripts/mutation_score.py [--jobs N] [--keep DIR] [--json FILE] [MUTANT ...]
(MUTANT: mutmut names or globs, e.g. 'kvstrata.model.keys.x_chain_page_hashes*'; default: all).
Needs mutmut (``pip install 'mutmut>=3.8,<4'``); takes about 20 minutes on two cores (too long for CI).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: the mutated files, as the repository names them
TARGETS = ("model/keys.py", "model/l3/objects.py", "impl/storage/objects.py", "model/engines.py")

#: the fast test selection: the unit tests that exercise the three files, less the Mooncake ones
#: (about 20 s in all)
TESTS = (
    "tests/unit/model/test_keys.py",
    "tests/unit/model/test_keys_mutants.py",
    "tests/unit/model/test_engines.py",
    "tests/unit/model/test_engines_mutants.py",
    "tests/stateful/test_engine_sharing.py",
    "tests/unit/model/test_cache.py",
    "tests/unit/model/test_hybrid.py",
    "tests/unit/impl/storage/test_memory_backend.py",
    "tests/unit/impl/storage/test_file_backend.py",
    "tests/unit/impl/storage/test_backend_contract.py",
    "tests/unit/impl/storage/test_objects_mutants.py",
)

#: repository folder -> its place in the installed package (pyproject.toml's package-dir)
PACKAGES = {"kvstrata": "kvstrata", "model": "kvstrata/model", "impl": "kvstrata/impl"}

#: how mutmut 3 reports a mutant (``mutmut results --all true``) -> the column it counts in
COLUMN = {
    "killed": "killed",
    "survived": "survived",
    "timeout": "timeout",
}

_ZIP_LAX = r"strict=(None|False)\)|, \)$"  # zip(..., strict=True) made lax: None, False, or dropped

#: the survivors no test can kill, each (function, original line(s), regex the mutated line(s) match,
#: why no test can tell the mutant from the code)
EQUIVALENT: tuple[tuple[str, str, str, str], ...] = (
    (
        "Namespace.seed",
        '+ struct.pack("<Q", len(extra))',
        r'"<q"',
        "a length is >= 0 and < 2**63: '<q' and '<Q' pack it to the same 8 bytes",
    ),
    (
        "Namespace.seed",
        '+ struct.pack("<Q", len(salt))',
        r'"<q"',
        "a length is >= 0 and < 2**63: '<q' and '<Q' pack it to the same 8 bytes",
    ),
    (
        "_segment",
        'return quote(value, safe="")',
        r'safe="XXXX"',
        "quote() never escapes 'X' (unreserved): the safe set is unchanged",
    ),
    (
        "Shard.replicated",
        "return cls(tp_rank=None, tp_size=1, pp_rank=pp_rank, pp_size=pp_size)",
        r"^return cls\(tp_rank=None, pp_rank=pp_rank, pp_size=pp_size\)$",
        "1 is tp_size's default",
    ),
    (
        "KeySpace.key",
        "prefix = self._prefixes.get((namespace, pool, component))  # inline: the hot path",
        r"prefix = (None|self\._prefixes\.get\(None\))  #",
        "a miss falls to _prefix, whose own lookup in the same memo finds the prefix: the same key "
        "and no render, only slower",
    ),
    *(
        (
            function,
            old,
            new,
            "a miss recomputes the prefixes through _prefix, whose memo holds each of them: the "
            "same strings and no render, only slower",
        )
        for function in ("KeySpace.component_keys", "KeySpace.rendered")
        for old, new in (
            (
                "prefixes = self._component_prefixes.get(slot)",
                r"prefixes = (None|self\._component_prefixes\.get\(None\))",
            ),
            ("self._component_prefixes[slot] = prefixes", r"= None$"),
        )
    ),
    (
        "ObjectBackend.__init__",
        "self._object_nbytes = 0",
        r"= (None|1)$",
        "read only by exists/put/get, after _checked has required an attached pool, and attach "
        "sets it",
    ),
    (
        "ObjectBackend.put",
        "for page, index in zip(pages[:admitted], host_indices[:admitted], strict=True):",
        _ZIP_LAX.replace("$", ":$"),
        "check_batch has made pages and host_indices the same length, and both are cut at admitted",
    ),
    (
        "ObjectBackend.get",
        "for page, index in zip(pages[:admitted], host_indices[:admitted], strict=True):",
        _ZIP_LAX.replace("$", ":$"),
        "check_batch has made pages and host_indices the same length, and both are cut at admitted",
    ),
    (
        "ObjectBackend._put_page",
        "(key, np.ascontiguousarray(_object_view(host, obj, index)).reshape(-1).data)",
        r"\.reshape\(-2\)",
        "numpy reads any negative size as 'infer this dimension': reshape(-2) is reshape(-1)",
    ),
    (
        "page_objects",
        "out = tuple(zip(keys.components, keys.page_keys(namespace, page), strict=True))",
        _ZIP_LAX.replace("$", r"\)$"),
        "page_keys renders one key per component of keys.components: the lengths always match",
    ),
    (
        "page_objects",
        "out += tuple(zip(components, side_page_keys(keys, namespace, pool, page), strict=True))",
        _ZIP_LAX.replace("$", r"\)$"),
        "side_page_keys renders one key per object of side_components: the lengths always match",
    ),
    (
        "state_objects",
        "out += tuple(zip(components, side_page_keys(keys, namespace, pool, page), strict=True))",
        _ZIP_LAX.replace("$", r"\)$"),
        "side_page_keys renders one key per object of side_components: the lengths always match",
    ),
    (
        "model_slug",
        'slug = _SLUG_CHARS.sub("_", name.strip().lower()).strip("_")[:_SLUG_LENGTH].rstrip("_")',
        r'\.(strip|rstrip)\("XX_XX"\)',
        "after lower() and the substitution the text holds only [a-z0-9_]: no 'X' to strip",
    ),
    (
        "_dtype_slug",
        'return _SLUG_CHARS.sub("_", value.strip().removeprefix("torch.").lower()).strip("_")',
        r'\.strip\("XX_XX"\)$',
        "after lower() and the substitution the text holds only [a-z0-9_]: no 'X' to strip",
    ),
)


def equivalent(mutant: Mutant) -> str | None:
    """Why ``mutant`` is equivalent, if ``EQUIVALENT`` says it is."""
    for function, old, new, reason in EQUIVALENT:
        if mutant.function == function and mutant.old == old and re.search(new, mutant.new):
            return reason
    return None


@dataclass
class Mutant:
    name: str
    status: str
    path: str = ""
    line: int = 0
    function: str = ""
    old: str = ""
    new: str = ""
    verdict: str = ""


def layout(scratch: Path) -> None:
    """Copy the tree into ``scratch`` as the installed package, plus the tests and pyproject."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source, target in PACKAGES.items():
        shutil.copytree(REPO / source, scratch / target, ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(REPO / "tests", scratch / "tests", ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", scratch / "pyproject.toml")
    if not list((scratch / "kvstrata/impl").glob("_native*.so")):
        # a wheel-style install keeps the built module elsewhere; without it the portable
        # kernels run (same results, slower)
        spec = importlib.util.find_spec("kvstrata.impl._native")
        if spec is not None and spec.origin:
            shutil.copy2(spec.origin, scratch / "kvstrata/impl" / Path(spec.origin).name)
    lines = ["[mutmut]", "source_paths=kvstrata", "only_mutate="]
    lines += [f"    {PACKAGES[t.split('/', 1)[0]]}/{t.split('/', 1)[1]}" for t in TARGETS]
    lines += ["pytest_add_cli_args_test_selection="]
    lines += [f"    {test}" for test in TESTS if (scratch / test).exists()]
    lines += [
        "pytest_add_cli_args=",
        "    -p",
        "    no:cacheprovider",
        # the Mooncake backend is no ObjectBackend, and its tests start a real cluster per worker
        "    -k",
        "    not mooncake",
        # torch is not fork-safe once its thread pool runs: fork workers from a server that has
        # only collected the tests (a plain fork from the stats run hangs some workers)
        "process_isolation=forkserver",
        # wall limit per mutant: (tests' clean time + 5 s) * 5; no mutant here loops for ever
        "timeout_multiplier=5",
        "timeout_constant=5",
        "use_git_change_detection=false",
        "",
    ]
    (scratch / "setup.cfg").write_text("\n".join(lines))


def environment(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MUTANT_UNDER_TEST")}
    env["HYPOTHESIS_PROFILE"] = (
        "mutant"  # the ci profile's examples, no shrinking (tests/conftest.py)
    )
    env["PYTHONHASHSEED"] = "0"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # subprocesses of tests import the mutated copy; the folder must exist before mutmut starts,
    # or the interpreter caches "no such path" for it and imports the installed tree instead
    (scratch / "mutants").mkdir(exist_ok=True)
    env["PYTHONPATH"] = str(scratch / "mutants")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = "1"
    return env


def mutmut_command() -> list[str]:
    found = Path(sys.executable).parent / "mutmut"
    if found.exists():
        return [str(found)]
    which = shutil.which("mutmut")
    if which is None:
        raise SystemExit("mutmut is not installed: pip install 'mutmut>=3.8,<4'")
    return [which]


def mutmut(scratch: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*mutmut_command(), *args],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def repo_path(module: str) -> str:
    """``kvstrata.model.keys`` -> ``model/keys.py``."""
    parts = module.split(".")
    if parts[0] == "kvstrata" and len(parts) > 1 and parts[1] in ("model", "impl"):
        parts = parts[1:]
    return "/".join(parts) + ".py"


def split_name(name: str) -> tuple[str, str]:
    """A mutmut name -> (module, function qualname): ``kvstrata.model.keys.xǁShardǁreplicated__mutmut_7``
    -> (``kvstrata.model.keys``, ``Shard.replicated``)."""
    mangled = name.partition("__mutmut_")[0]
    module, _, function = mangled.rpartition(".")
    if function.startswith("xǁ"):
        cls, _, method = function[2:].partition("ǁ")
        return module, f"{cls}.{method}"
    return module, function.removeprefix("x_")


def function_start(source: str, qualname: str) -> int:
    """First line (a decorator's, if any) of ``qualname`` in ``source``; 0 if not found."""
    tree = ast.parse(source)
    scope: list[ast.stmt] = tree.body
    *outer, last = qualname.split(".")
    for cls in outer:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls]
        if not found:
            return 0
        scope = found[0].body
    for node in scope:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == last:
            return min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return 0


_HUNK = re.compile(r"@@ -(\d+)")


def describe(mutant: Mutant, diff: str, source: str) -> None:
    """Fill in ``mutant``'s line and mutation from ``mutmut show``'s diff (of the function alone)."""
    old: list[str] = []
    new: list[str] = []
    offset = 0
    line = 0
    for text in diff.splitlines():
        if text.startswith(("---", "+++", "#")):
            continue
        hunk = _HUNK.match(text)
        if hunk:
            offset = int(hunk.group(1))
            continue
        if text.startswith("-"):
            line = line or offset
            old.append(text[1:].strip())
            offset += 1
        elif text.startswith("+"):
            new.append(text[1:].strip())
        elif text.startswith(" "):
            offset += 1
    start = function_start(source, mutant.function)
    mutant.line = start + line - 1 if start and line else 0
    lines = source.splitlines()
    if old and not (0 < mutant.line <= len(lines) and lines[mutant.line - 1].strip() == old[0]):
        matches = [i + 1 for i, text in enumerate(lines) if text.strip() == old[0]]
        mutant.line = min(matches, key=lambda i: abs(i - mutant.line)) if matches else 0
    mutant.old = " ".join(old)
    mutant.new = " ".join(new)


def results(scratch: Path, env: dict[str, str]) -> list[Mutant]:
    listed = mutmut(scratch, env, "results", "--all", "true")
    if listed.returncode != 0:
        raise SystemExit(f"mutmut results failed:\n{listed.stdout}\n{listed.stderr}")
    mutants = []
    for text in listed.stdout.splitlines():
        name, sep, status = text.strip().rpartition(": ")
        if not sep or "__mutmut_" not in name:
            continue
        module, function = split_name(name)
        mutant = Mutant(name=name, status=status, path=repo_path(module), function=function)
        if status != "killed":
            shown = mutmut(scratch, env, "show", name)
            describe(mutant, shown.stdout, (REPO / mutant.path).read_text())
            reason = equivalent(mutant)
            if status == "survived":
                mutant.verdict = f"equivalent: {reason}" if reason else "UNTRIAGED"
        mutants.append(mutant)
    return mutants


def report(mutants: list[Mutant], seconds: float) -> bool:
    """Print the counts per file and the mutants not killed; True if every survivor is triaged."""
    width = max(len(t) for t in TARGETS)
    header = f"{'file':<{width}}  killed  survived  timeout  other  total  score"
    print(header)
    print("-" * len(header))
    totals: Counter[str] = Counter()
    for target in TARGETS:
        counts = Counter(COLUMN.get(m.status, "other") for m in mutants if m.path == target)
        total = sum(counts.values())
        totals.update(counts)
        detected = counts["killed"] + counts["timeout"]
        score = f"{100 * detected / total:.1f}%" if total else "-"
        print(
            f"{target:<{width}}  {counts['killed']:>6}  {counts['survived']:>8}  "
            f"{counts['timeout']:>7}  {counts['other']:>5}  {total:>5}  {score:>5}"
        )
    total = sum(totals.values())
    detected = totals["killed"] + totals["timeout"]
    score = f"{100 * detected / total:.1f}%" if total else "-"
    print(
        f"{'all':<{width}}  {totals['killed']:>6}  {totals['survived']:>8}  "
        f"{totals['timeout']:>7}  {totals['other']:>5}  {total:>5}  {score:>5}"
    )
    print(f"\n(score: killed + timeout over total; {seconds / 60:.1f} min)")
    standing = sorted((m for m in mutants if m.status != "killed"), key=lambda m: (m.path, m.line))
    if standing:
        print("\nnot killed:")
    for m in standing:
        print(f"  {m.path}:{m.line}  [{m.status}] {m.function}  ({m.name.rpartition('__')[2]})")
        print(f"      - {m.old}\n      + {m.new}")
        if m.verdict:
            print(f"      {m.verdict}")
    untriaged = [m for m in standing if m.verdict == "UNTRIAGED"]
    if untriaged:
        print(
            f"\n{len(untriaged)} survivor(s) UNTRIAGED: add a test that kills each, or an EQUIVALENT entry"
        )
    return not untriaged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutmut mutant names or globs (default: all)")
    parser.add_argument(
        "-j", "--jobs", type=int, default=os.cpu_count() or 1, help="mutants at a time"
    )
    parser.add_argument("--keep", type=Path, help="run in this (new) folder and keep it")
    parser.add_argument("--json", type=Path, help="also write every mutant's result here")
    args = parser.parse_args(argv)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvstrata-mutmut-") as tmp:
        scratch = args.keep.resolve() if args.keep else Path(tmp).resolve()
        if args.keep:
            scratch.mkdir(parents=True)  # a new folder: cached verdicts would break reproducibility
        layout(scratch)
        env = environment(scratch)
        print(f"mutmut in {scratch} ({args.jobs} workers)", flush=True)
        ran = mutmut(scratch, env, "run", "--max-children", str(args.jobs), *args.names)
        (scratch / "mutmut-run.log").write_text(ran.stdout + ran.stderr)
        if ran.returncode != 0:
            tail = (ran.stdout + ran.stderr).replace("\r", "\n").strip().splitlines()[-40:]
            print("mutmut run failed:\n" + "\n".join(tail), file=sys.stderr)
            return 2
        mutants = results(scratch, env)
    if args.names:
        mutants = [m for m in mutants if m.status != "not checked"]
    if args.json:
        args.json.write_text(json.dumps([asdict(m) for m in mutants], indent=1, ensure_ascii=False))
    return 0 if report(mutants, time.monotonic() - start) else 1


if __name__ == "__main__":
    sys.exit(main())
