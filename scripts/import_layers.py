"""Order specdecode's modules by layer and count the imports that point up.

The layers are tests/test_import_graph.py's ``LAYERS`` (DESIGN.md's, lowest first), and so is
the graph: every import counts, at any level. An import points up when the imported module's
layer is above the importer's; that test fails on any. This prints the count and each one, so
the figure can be compared across commits (``git worktree`` or an exported tree: the script
reads the ``src`` beside it).

    python scripts/import_layers.py            # the count, then each import that points up
    python scripts/import_layers.py --layers   # also every module with its layer
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_import_graph import PACKAGE, graph, layer_of, up_imports  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", action="store_true", help="list every module by layer")
    args = parser.parse_args(argv)
    edges = graph()
    modules = sorted((m for m in edges if m != PACKAGE), key=lambda m: (layer_of(m), m))
    if args.layers:
        for m in modules:
            print(f"{layer_of(m)}  {m}")
        print()
    up = up_imports(edges)
    imports = sum(len(edges[m]) for m in modules)
    print(f"{len(modules)} modules, {imports} imports between them, {len(up)} pointing up")
    for m, n in up:
        print(f"  {m} ({layer_of(m)}) -> {n} ({layer_of(n)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
