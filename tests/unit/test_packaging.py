"""The distribution: kvstrata.model and kvstrata.impl import from a built wheel, and never as bare
top-level names."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import kvstrata.impl
import kvstrata.model

REPO = Path(__file__).resolve().parents[2]


def test_model_has_no_heavy_or_impl_imports() -> None:
    """model/ depends on attrs and transitions only (and the standard library)."""
    code = (
        "import sys, kvstrata.model.cache, kvstrata.model.embedding, kvstrata.model.hybrid;"
        "bad = [m for m in ('torch', 'numpy', 'mooncake', 'kvstrata.impl') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_packages_are_not_importable_as_bare_names() -> None:
    assert kvstrata.model.__name__ == "kvstrata.model"
    assert kvstrata.impl.__name__ == "kvstrata.impl"
    assert "model" not in sys.modules and "impl" not in sys.modules


@pytest.mark.slow
def test_wheel_installs_and_imports(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(REPO),
        ],
        check=True,
    )
    (wheel,) = dist.glob("kvstrata-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvstrata/model/py.typed" in names and "kvstrata/impl/py.typed" in names
    assert "kvstrata/__init__.py" in names and "kvstrata/py.typed" in names  # the public face
    sources = [
        f"kvstrata/{path.relative_to(REPO).as_posix()}"
        for folder in ("model", "impl")
        for path in (REPO / folder).rglob("*.py")
    ]
    missing = sorted(set(sources) - set(names))
    assert not missing, f"modules missing from the wheel (pyproject packages?): {missing}"
    assert not any(name.startswith(("model/", "impl/", "tests/")) for name in names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*install, "--no-deps", str(wheel)], check=True)
    subprocess.run([*install, "attrs", "transitions"], check=True)
    probe = (
        "import kvstrata.model.cache as c, kvstrata.impl.errors as e, kvstrata.model.keys as k;"
        "import kvstrata;"
        "print(c.__file__); print(e.__file__); print(kvstrata.__file__);"
        "assert issubclass(e.MisuseError, e.KvStrataError);"
        "assert kvstrata.WritePolicy is c.WritePolicy and kvstrata.KeySpace is k.KeySpace"
    )
    result = subprocess.run(
        [str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    for line in result.stdout.splitlines():
        assert str(env_dir) in line, f"imported from outside the scratch venv: {line}"
