"""No import cycles between the modules of specdecode, and no import that points up its layers.

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

#: DESIGN.md's layers, lowest first; a name is a module or a package of specdecode (without the
#: prefix), and a module is in the layer of the longest name that is it or a package above it.
#: An import points up when the imported module's layer is above the importer's: a lower part
#: that needs a higher one to load (the runtime reading the trainers' files, the server using
#: the CLI as a library). The commands of ``bench`` and ``train`` are in their packages' layers.
LAYERS: list[tuple[str, ...]] = [
    # what every part shares: errors, drafts, sampling, verification, the registry, artifacts
    ("errors", "draft", "infill_sampler", "sampling", "verify", "control", "estimates",
     "constraints", "detokenize", "fim", "registry", "cache", "artifacts", "agreement",
     "questions"),
    ("kernels", "models"),
    # the proposer interface and draft sizing, below the loop that drives them
    ("proposer", "sizing", "prompt_logprobs"),
    ("engine",),
    # the methods and what they share
    ("drafting", "heads", "suffix_tree", "suffix_cache", "suffix_corpus", "proposers", "lossy",
     "diffusion"),
    ("api",),
    # the options several commands share
    ("cli_options",),
    ("training",),
    ("bench", "server"),
    # the ``specdecode`` command, with diffusion/cli.py, its ``generate --diffusion`` branch
    ("cli", "model_cli", "chat_cli", "__main__", "diffusion.cli"),
]


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


def layer_of(module: str) -> int:
    """The layer of the longest ``LAYERS`` name that is ``module`` or a package above it."""
    name = module.removeprefix(PACKAGE + ".")
    best, rank = -1, None
    for level, names in enumerate(LAYERS):
        for entry in names:
            if (name == entry or name.startswith(entry + ".")) and len(entry) > best:
                best, rank = len(entry), level
    assert rank is not None, f"{module} is in no layer: add it (or its package) to LAYERS"
    return rank


def up_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import whose target is in a higher layer (the package
    ``specdecode`` itself, its version and exports, is in none)."""
    return sorted((m, n) for m, targets in edges.items() if m != PACKAGE for n in targets
                  if n != PACKAGE and layer_of(n) > layer_of(m))


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


def test_no_import_points_up_the_layers():
    found = up_imports(graph())
    assert not found, ("imports pointing up the layers (move what the lower module needs below "
                       "it; LAYERS lists the order):\n"
                       + "\n".join(f"{m} ({layer_of(m)}) -> {n} ({layer_of(n)})" for m, n in found))
