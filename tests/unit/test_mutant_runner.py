"""tests/mutants/run.py's handling of C mutants (issue 20, part 27): a patch of the C kernels is
built in the scratch copy, the copy then runs that build, and a patch that does not build is an
error (never a catch or a survivor)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
MUTANTS = REPO / "tests" / "mutants"


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutant_runner", MUTANTS / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_patches_of_the_c_kernels_are_built(runner: ModuleType) -> None:
    native = sorted(MUTANTS.glob("native_*.patch"))
    assert len(native) >= 6
    assert all(runner.touches_c(patch) for patch in native)
    assert not runner.touches_c(MUTANTS / "impl_key_join_components_swapped.patch")
    assert not runner.touches_c(MUTANTS / "double_tag.patch")


def test_a_c_mutant_runs_its_own_build_in_the_copy(runner: ModuleType, tmp_path: Path) -> None:
    patch = MUTANTS / "native_key_hex_made_once.patch"
    assert runner.prepare(tmp_path, patch) is None
    env = runner.environment(tmp_path)
    assert runner.imports_scratch(tmp_path, env, native=True)
    probe = (
        "from kvstrata.impl import kernels; from kvstrata.model.keys import content_hash as h; "
        "print(len(set(kernels.join_keys(('k/',), [h(b'1'), h(b'2')]))))"
    )
    keys = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert keys.stdout.strip() == "1", keys  # the bug is live: two pages, one key
    here = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert here.stdout.strip() == "2", here  # and this checkout's own module is untouched


def test_a_c_mutant_that_does_not_build_is_an_error(runner: ModuleType, tmp_path: Path) -> None:
    text = (MUTANTS / "native_key_hex_made_once.patch").read_text()
    broken = tmp_path / "broken.patch"
    broken.write_text(text.replace("static char hex[2 * DIGEST];", "static char hex[2 * DIGEST]"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    problem = runner.prepare(scratch, broken)
    assert problem is not None and "do not build" in problem
