"""Every diffusion policy on Spec-Bench dev first turns: denoising steps per token, tokens/s,
agreement with the one_per_step reference and with the AR model's greedy tokens.

    PYTHONPATH=src python scripts/diffusion_bench.py [--per-task 1] [--limit N] [--tokens 32]
        [--block 16] [--policies a,b] [--filter FILE]

The target runs as a block-diffusion model (docs/diffusion.md); ``learn2pd`` needs
``--filter`` (``specdecode train learn2pd``), ``cfg`` a grammar and is left out.
"""

from __future__ import annotations

import argparse
import time

from specdecode.api import Decoder, encode_prompt, eos_ids
from specdecode.bench.datasets import load_questions, sample_per_task
from specdecode.bench.quality import token_agreement
from specdecode.diffusion.cli import default_mask_id
from specdecode.diffusion.decode import diffuse
from specdecode.diffusion.model import DiffusionModel
from specdecode.diffusion.registry import get_policy, policy_names
from specdecode.models.loading import load_model, make_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-task", type=int, default=1, help="questions per Spec-Bench task")
    parser.add_argument("--limit", type=int, default=None, help="at most this many questions")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens a question")
    parser.add_argument("--block", type=int, default=16, help="diffusion block size")
    parser.add_argument("--policies", default=None,
                        help="comma-separated policies besides one_per_step (default: all but cfg, learn2pd)")
    parser.add_argument("--filter", default=None, help="a Learn2PD filter (adds learn2pd)")
    args = parser.parse_args()
    loaded = load_model("smollm2")
    runner = make_runner(loaded, "native")
    eos = eos_ids(loaded, loaded.tokenizer)
    prompts = [encode_prompt(loaded.tokenizer, q.turns[0])
               for q in sample_per_task(load_questions(), args.per_task)][:args.limit]
    ar = Decoder(runner, loaded.tokenizer, "ar", eos)
    began = time.perf_counter()
    greedy = [ar.generate(p, args.tokens).token_ids for p in prompts]
    ar_rate = sum(map(len, greedy)) / (time.perf_counter() - began)
    model = DiffusionModel(runner, default_mask_id(loaded.tokenizer, runner.vocab_size))
    names = (args.policies.split(",") if args.policies else
             [n for n in policy_names() if n not in ("cfg", "learn2pd")])
    # the reference first: the agreement column is measured against it
    names = ["one_per_step"] + [n for n in names if n != "one_per_step"]
    configs = {n: {} for n in names} | ({"learn2pd": {"filter": args.filter}} if args.filter else {})
    print(f"ar: {ar_rate:.1f} tokens/s ({len(prompts)} prompts, {args.tokens} tokens, block "
          f"{args.block})\n\n| policy | steps/token | tokens/s | agrees with one_per_step | "
          "agrees with ar |\n|---|---|---|---|---|")
    reference = None
    for name, config in configs.items():
        results = [diffuse(model, get_policy(name).make(config), p, args.tokens, eos, args.block)
                   for p in prompts]
        outputs = [r.tokens for r in results]
        reference = reference or outputs
        steps = sum(r.steps for r in results) / sum(len(r.tokens) for r in results)
        rate = sum(len(r.tokens) for r in results) / sum(r.seconds for r in results)
        same = sum(map(token_agreement, outputs, reference)) / len(prompts)
        with_ar = sum(map(token_agreement, outputs, greedy)) / len(prompts)
        print(f"| {name} | {steps:.2f} | {rate:.1f} | {same:.0%} | {with_ar:.0%} |")


if __name__ == "__main__":
    main()
