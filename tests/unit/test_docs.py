"""docs/model.md shows the lifecycle tables the code runs on (scripts/gen_model_doc.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvstrata.model.lifecycles import ALL_LIFECYCLES

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gen_model_doc.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_model_doc", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


gen = _load_script()


def test_model_doc_is_current() -> None:
    diff = gen.check()
    assert not diff, "docs/model.md is out of date; run scripts/gen_model_doc.py\n" + "".join(diff)


def test_every_lifecycle_row_is_drawn_and_listed() -> None:
    section = gen.render_section()
    for lifecycle in ALL_LIFECYCLES:
        assert f"### {lifecycle.name}" in section
        assert f"[*] --> {lifecycle.initial.name}" in section
        for state, event, target in lifecycle.rows():
            assert f"{state.name} --> {target.name}: {event.name}" in section
            assert f"| `{state.name}` | `{event.name}` | `{target.name}` |" in section


def test_check_detects_a_stale_section_and_main_repairs_it(tmp_path: Path) -> None:
    doc = tmp_path / "model.md"
    doc.write_text(f"# title\n\n{gen.BEGIN}\nstale\n{gen.END}\n\nafter\n", encoding="utf-8")
    assert gen.check(doc)
    assert gen.main(["--check", "--path", str(doc)]) == 1
    assert gen.main(["--path", str(doc)]) == 0
    assert gen.check(doc) == []
    assert gen.main(["--check", "--path", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# title\n\n") and text.endswith(f"{gen.END}\n\nafter\n")


@pytest.mark.parametrize(
    "text",
    ["no markers\n", "<!-- END GENERATED: lifecycles -->\n<!-- BEGIN GENERATED: lifecycles -->\n"],
)
def test_missing_or_swapped_markers_are_refused(tmp_path: Path, text: str) -> None:
    doc = tmp_path / "model.md"
    doc.write_text(text, encoding="utf-8")
    with pytest.raises(gen.MarkerError):
        gen.check(doc)
    assert gen.main(["--check", "--path", str(doc)]) == 2
    assert doc.read_text(encoding="utf-8") == text
