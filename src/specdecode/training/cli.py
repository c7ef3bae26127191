"""``specdecode train <what>``: one subcommand per trainer.

A trainer is a module exposing ``add_arguments(parser)`` and ``run(args) -> int``; adding one is
one entry in :data:`TRAIN_COMMANDS`. Trainer modules are imported only when ``train`` runs.
"""

from __future__ import annotations

import argparse
import importlib

#: subcommand -> (module, help)
TRAIN_COMMANDS: dict[str, tuple[str, str]] = {
    "exit-adapters": ("specdecode.training.exit_adapters",
                      "per-layer early-exit adapters for early_exit / del (self-distillation)"),
    "draft": ("specdecode.training.distill_draft",
              "a small draft model for draft_model / dyspec, distilled from the target"),
    "heads": ("specdecode.training.train_heads",
              "draft heads for hydra / clover / eagle, trained on the target's own features"),
    "data": ("specdecode.training.target_data",
             "target-written conversations, many per forward of the native runner, into a "
             "resumable JSON-lines shard"),
    "corpus": ("specdecode.training.corpus",
               "a corpus for suffix's global tree from target-written shards (`train data`)"),
    "router": ("specdecode.training.router",
               "the Arbitrage router (lossy): the target's advantage over the cheap draft per step"),
    "lora-drop": ("specdecode.training.lora_drop",
                  "LoRA-Drop's correctors (lossy): LoRA on the layers it skips, against the full model"),
    "lud": ("specdecode.training.lud",
            "LUD's delta (lossy): placeholder slots and LoRA that predict the following tokens"),
    "learn2pd": ("specdecode.training.learn2pd",
                 "Learn2PD's filter for the learn2pd diffusion policy (docs/diffusion.md)"),
    "dllm": ("specdecode.training.dllm",
             "the small dLLM: a LoRA delta adapting the target to block diffusion (docs/diffusion.md)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    for name, (module, help_text) in TRAIN_COMMANDS.items():
        trainer = importlib.import_module(module)
        cmd = sub.add_parser(name, help=help_text, description=(trainer.__doc__ or "").split("\n\n")[0])
        trainer.add_arguments(cmd)
        cmd.set_defaults(train=trainer.run)


def run(args: argparse.Namespace) -> int:
    return args.train(args)
