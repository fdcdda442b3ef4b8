"""The public face (issue 15): ``from kvstrata import ...`` gives a scheduler everything it needs, from
any directory, in one module of at most 80 lines with an explicit ``__all__``; docs/scheduler.md imports
from nothing deeper; no module of ``model/`` or ``impl/`` imports one that imports it back."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvstrata

REPO = Path(__file__).resolve().parents[2]
ALLOWED_IN_DOCS = {"kvstrata", "torch", "torch.distributed", "numpy", "time"}


def test_the_face_is_small_and_exports_exactly_its_all() -> None:
    source = Path(kvstrata.__file__).read_text()
    assert len(source.splitlines()) <= 80
    assert len(set(kvstrata.__all__)) == len(kvstrata.__all__)
    for name in kvstrata.__all__:
        assert getattr(kvstrata, name) is not None, name
        assert name in dir(kvstrata)
    with pytest.raises(AttributeError, match="no attribute 'radix_cache'"):
        _ = kvstrata.radix_cache  # type: ignore[attr-defined]


def test_type_checkers_see_exactly_what_runs() -> None:
    """The TYPE_CHECKING imports name the same objects, from the same modules, as the lazy map."""
    tree = ast.parse(Path(kvstrata.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    seen = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert seen == kvstrata._WHERE
    for name, module in seen.items():
        assert getattr(kvstrata, name) is getattr(importlib.import_module(module), name)


def test_the_model_loads_without_the_implementation() -> None:
    code = (
        "import sys, kvstrata.model.keys, kvstrata.model.cache; "
        "bad = [m for m in ('torch', 'kvstrata.impl') if m in sys.modules]; print(bad)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_face_imports_from_any_directory(tmp_path: Path) -> None:
    code = (
        "import kvstrata, sys; "
        "from kvstrata import HierarchicalRadixCache, SchedulerCache, RadixCacheConfig; "
        "assert 'impl' not in kvstrata.__file__; print(len(kvstrata.__all__))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(kvstrata.__all__)


def _doc_imports(text: str) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    modules: list[str] = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules.append(node.module)
            elif isinstance(node, ast.Import):
                modules.extend(alias.name for alias in node.names)
    return modules


def test_the_scheduler_doc_imports_only_the_face() -> None:
    modules = _doc_imports((REPO / "docs" / "scheduler.md").read_text())
    assert "kvstrata" in modules
    assert set(modules) <= ALLOWED_IN_DOCS, sorted(set(modules) - ALLOWED_IN_DOCS)
    names = {
        alias.name
        for block in re.findall(
            r"```python\n(.*?)```", (REPO / "docs/scheduler.md").read_text(), re.DOTALL
        )
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.ImportFrom) and node.module == "kvstrata"
        for alias in node.names
    }
    assert names <= set(kvstrata.__all__), sorted(names - set(kvstrata.__all__))


def test_doc_import_scan_sees_a_deep_import() -> None:
    text = "```python\nfrom kvstrata.impl.cache import HierarchicalRadixCache\n```\n"
    assert not set(_doc_imports(text)) <= ALLOWED_IN_DOCS


# ---------------------------------------------------------------------------- import graph
def _module_name(path: Path) -> str:
    relative = path.relative_to(REPO).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts and parts[0] == "kvstrata":  # the face and its subpackages (kvstrata.integrations)
        parts.pop(0)
    return ".".join(["kvstrata", *parts])


def _guarded(tree: ast.Module) -> set[int]:
    """Ids of the import statements under ``if TYPE_CHECKING:`` (they never run)."""
    return {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for child in ast.walk(node)
    }


def import_graph(roots: tuple[str, ...] = ("kvstrata", "model", "impl")) -> dict[str, set[str]]:
    """Module -> the kvstrata modules it imports. ``TYPE_CHECKING`` imports count (a cycle in
    types is a cycle in the design); a run-time import of ``a.b.c`` also imports the packages
    ``a.b`` and ``a`` (their ``__init__`` runs first), except the importer's own packages."""
    files = [path for root in roots for path in (REPO / root).rglob("*.py")]
    modules = {_module_name(path): path for path in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        guarded = _guarded(tree)
        own = {name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)}
        edges: set[str] = set()
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:
                    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        package = package.rsplit(".", 1)[0]
                    base = f"{package}.{base}" if base else package
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            found = [target for target in targets if target in modules and target != name]
            if id(node) not in guarded:
                parents = {
                    target.rsplit(".", depth)[0]
                    for target in found
                    for depth in range(1, target.count(".") + 1)
                }
                found += [parent for parent in parents if parent in modules and parent not in own]
            edges.update(found)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert cycles(import_graph()) == []


def test_the_model_imports_nothing_of_the_implementation() -> None:
    for module, targets in import_graph().items():
        if module.startswith("kvstrata.model"):
            assert not {t for t in targets if t.startswith("kvstrata.impl")}, module


def test_the_library_never_imports_the_engine_plug_ins() -> None:
    """kvstrata.integrations sits on top: it imports the library, never the other way round."""
    graph = import_graph()
    assert "kvstrata.integrations.sglang" in graph
    for module, targets in graph.items():
        if module.startswith(("kvstrata.model", "kvstrata.impl")):
            assert not {t for t in targets if t.startswith("kvstrata.integrations")}, module


@pytest.mark.parametrize(
    "graph",
    [{"a": {"b"}, "b": {"a"}}, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]]) -> None:
    assert cycles(graph)


# ---------------------------------------------------------------------------- sizes
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 450, 400, 60
#: modules over a budget, each with its reason (docs/architecture.md, "Sizes, and the exceptions",
#: names every one of them: a test below checks it)
EXCEPTIONS = {
    "impl/storage/mooncake/cluster.py": "the local cluster: master, storage node and their processes",
}


def oversized() -> dict[str, list[str]]:
    """Module path -> what in it is over its budget."""
    found: dict[str, list[str]] = {}
    for root in ("kvstrata", "model", "impl"):
        for path in sorted((REPO / root).rglob("*.py")):
            source = path.read_text()
            over = []
            if len(source.splitlines()) > MODULE_LINES:
                over.append(f"module {len(source.splitlines())} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    size = (node.end_lineno or node.lineno) - node.lineno + 1
                    limit = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES
                    if size > limit:
                        over.append(f"{node.name} {size} lines")
            if over:
                found[path.relative_to(REPO).as_posix()] = over
    return found


def test_modules_classes_and_functions_keep_their_budget_or_say_why() -> None:
    over = oversized()
    assert set(over) <= set(EXCEPTIONS), {k: v for k, v in over.items() if k not in EXCEPTIONS}
    assert set(EXCEPTIONS) <= set(over), f"no longer over budget: {set(EXCEPTIONS) - set(over)}"


def test_every_size_exception_is_explained_in_the_architecture_doc() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc[doc.index("### Sizes, and the exceptions") :]
    for path in EXCEPTIONS:
        assert f"`{path}`" in section, path


def test_l3_reaches_the_tree_only_through_its_port() -> None:
    """impl/l3 imports nothing of impl/cache at run time, and under TYPE_CHECKING only the value
    types of ``impl/cache/node.py`` (what the port's signatures name)."""
    for path in (REPO / "impl" / "l3").rglob("*.py"):
        tree = ast.parse(path.read_text())
        guarded = _guarded(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "kvstrata.impl.cache"
            ):
                assert id(node) in guarded, f"{path.name} imports {node.module} at run time"
                assert node.module == "kvstrata.impl.cache.node", f"{path.name}: {node.module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvstrata.impl.cache") for a in node.names)
