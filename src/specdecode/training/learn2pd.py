"""Train Learn2PD's filter for the diffusion policy ``learn2pd`` (Bao et al. 2025, arXiv
2509.25188): decode training prompts with the reference policy ``one_per_step``, label each
masked position at each step by whether its argmax then was its final token, and fit the tiny
MLP of ``diffusion/learn2pd_filter.py`` to those labels. The prompts are Spec-Bench dev first
turns past each task's first ``--holdout`` (the bench's slice); a minute or two on two cores.
The trajectories are the ``--dllm`` delta's (default: the one ``generate --diffusion`` picks),
since a filter learns when that model's predictions settle."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="the target ('smollm2' or a .gguf)")
    parser.add_argument("--prompts", type=int, default=24, help="training prompts")
    parser.add_argument("--holdout", type=int, default=10,
                        help="first questions of each task left out (the bench's dev slice)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="tokens decoded a prompt")
    parser.add_argument("--block-size", type=int, default=None,
                        help="positions per block (default: the dLLM's, else 32)")
    parser.add_argument("--mask-id", type=int, default=None,
                        help="the mask token id (default as `generate --diffusion`)")
    parser.add_argument("--dllm", default="auto", metavar="PATH",
                        help="the dLLM delta whose trajectories it learns: 'auto' (as "
                             "`generate --diffusion`), 'none' (the AR model as it is) or a file")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--data", default=None, help="Spec-Bench-format jsonl (default: dev half)")
    parser.add_argument("--out", required=True, help="where the filter is written (.pt)")


def run(args: argparse.Namespace) -> int:
    from specdecode.api import encode_prompt
    from specdecode.cli_options import load_diffusion_target
    from specdecode.diffusion.learn2pd_filter import train_filter, trajectories
    from specdecode.diffusion.model import DiffusionModel
    from specdecode.training.router import training_prompts

    runner, tokenizer, eos, mask, block = load_diffusion_target(
        argparse.Namespace(**vars(args), runner="native", weights="auto"))
    prompts = [encode_prompt(tokenizer, text)
               for _, text in training_prompts(args.data, args.holdout)[:args.prompts]]
    x, y = trajectories(DiffusionModel(runner, mask), prompts, args.gen_tokens, block or 32, eos)
    net = train_filter(x, y, args.epochs)
    accuracy = float(((net(x).squeeze(-1) > 0) == (y > 0.5)).float().mean())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), args.out)
    print(f"learn2pd filter: {len(y)} examples ({float(y.mean()):.0%} already final), training "
          f"accuracy {accuracy:.1%}, written to {args.out}")
    return 0
