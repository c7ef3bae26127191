"""No function in specdecode over ``LIMIT`` lines without a reason.

A function that long does several jobs; split it where that reads better. Where it does not
(a flat list of options, one table), or where the file is someone else's to change now, the
function goes in ``ALLOWED`` with the reason. The test fails on a new long function, and on an
``ALLOWED`` entry that is no longer long (so the list cannot go stale).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
#: lines from ``def`` to the function's last line, docstring and comments included
LIMIT = 60
#: "module:qualified name" -> why it stays long
ALLOWED: dict[str, str] = {}


def function_sizes(root: Path = ROOT) -> dict[str, int]:
    """``"module:Class.function"`` -> lines, for every function under ``root`` (nested ones
    too, counted on their own and inside their parent)."""
    sizes = {}
    for path in sorted((root / "specdecode").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

        def visit(node, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = prefix + child.name
                    sizes[f"{module}:{name}"] = child.end_lineno - child.lineno + 1
                    visit(child, name + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text(), str(path)), "")
    return sizes


def test_sizes_are_counted_from_def_to_the_last_line(tmp_path):
    package = tmp_path / "specdecode"
    package.mkdir()
    (package / "m.py").write_text("class A:\n    def f(self):\n        def g():\n"
                                  "            return 1\n        return g\n\n\ndef h(): pass\n")
    assert function_sizes(tmp_path) == {"specdecode.m:A.f": 4, "specdecode.m:A.f.g": 2,
                                        "specdecode.m:h": 1}


def test_no_long_function_without_a_reason():
    sizes = function_sizes()
    long = {name: n for name, n in sizes.items() if n > LIMIT}
    new = sorted(f"{name} ({n} lines)" for name, n in long.items() if name not in ALLOWED)
    assert not new, (f"functions over {LIMIT} lines: split them, or add them to ALLOWED with "
                     "the reason:\n" + "\n".join(new))
    stale = sorted(name for name in ALLOWED if name not in long)
    assert not stale, f"no longer over {LIMIT} lines (or gone): remove from ALLOWED: {stale}"
