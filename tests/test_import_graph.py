"""No import cycles between the modules of specdecode.

Every import counts, at any level (inside functions and ``if TYPE_CHECKING:`` blocks too): an
import moved into a function to dodge a cycle still ties the two files together. Shared types
belong in a module below both users. A module's edge goes to the module it names
(``from specdecode.models import llama`` names ``specdecode.models.llama``), not to the packages
above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "specdecode"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The specdecode modules ``name`` (at ``path``) imports, at any level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` names a module where one exists, else a name in pkg
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                         for alias in node.names)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imported(name, path, known) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component of
    more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [shortest_cycle(edges, component) for component in components]


def shortest_cycle(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_graph_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The checker itself: a cycle closed by an import inside a function is found and named."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from specdecode.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("import specdecode.a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    edges = graph()
    assert edges["specdecode.a"] == {"specdecode.sub.b"}
    assert edges["specdecode.sub.b"] == {"specdecode.a"}
    assert cycles(edges) == [["specdecode.a", "specdecode.sub.b", "specdecode.a"]]


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, ("import cycles (move what both sides share into a module below them):\n"
                       + "\n".join(" -> ".join(cycle) for cycle in found))
