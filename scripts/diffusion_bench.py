"""Every diffusion policy on Spec-Bench dev first turns: denoising steps per token, tokens/s,
agreement with the one_per_step reference and with the AR model's greedy tokens, and maths
accuracy on the dev half's first maths questions beside ``ar``'s.

    PYTHONPATH=src python scripts/diffusion_bench.py [--per-task 1] [--limit N] [--tokens 32]
        [--block 16] [--policies a,b] [--filter FILE] [--dllm FILE] [--math N]
        [--math-tokens 128]

The target runs as a block-diffusion model (docs/diffusion.md): as it is, or with ``--dllm``
the delta of ``specdecode train dllm`` merged into fp32 weights (``ar`` then runs on the same
fp32 weights without the delta). ``learn2pd`` needs ``--filter`` (``specdecode train
learn2pd``); ``cfg`` needs a grammar and is left out.
"""

from __future__ import annotations

import argparse
import time

from specdecode.api import Decoder, encode_prompt, eos_ids
from specdecode.bench.datasets import load_questions, sample_per_task
from specdecode.bench.quality import math_correct, token_agreement
from specdecode.diffusion.cli import default_mask_id
from specdecode.diffusion.decode import diffuse
from specdecode.diffusion.dllm import dllm_runner
from specdecode.diffusion.model import DiffusionModel
from specdecode.diffusion.registry import get_policy, policy_names
from specdecode.models.loading import load_model, make_runner


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-task", type=int, default=1, help="questions per Spec-Bench task")
    parser.add_argument("--limit", type=int, default=None, help="at most this many questions")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens a question")
    parser.add_argument("--block", type=int, default=16, help="diffusion block size")
    parser.add_argument("--policies", default=None,
                        help="comma-separated policies besides one_per_step (default: all but cfg, learn2pd)")
    parser.add_argument("--filter", default=None, help="a Learn2PD filter (adds learn2pd)")
    parser.add_argument("--dllm", default=None, help="a dLLM delta (`specdecode train dllm`)")
    parser.add_argument("--math", type=int, default=0,
                        help="maths questions of the dev half (with reference answers) to score")
    parser.add_argument("--math-tokens", type=int, default=128, help="new tokens a maths answer")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    loaded = load_model("smollm2")
    eos = eos_ids(loaded, loaded.tokenizer)
    if args.dllm:
        runner, delta = dllm_runner(loaded, args.dllm)
        ar_runner, mask = make_runner(loaded, "native", "fp32"), int(delta.config["mask_id"])
    else:
        runner = ar_runner = make_runner(loaded, "native")
        mask = default_mask_id(loaded.tokenizer, runner.vocab_size)
    questions = load_questions()
    prompts = [encode_prompt(loaded.tokenizer, q.turns[0])
               for q in sample_per_task(questions, args.per_task)][:args.limit]
    maths = [q for q in questions if q.task == "math_reasoning" and q.reference][:args.math]
    ar = Decoder(ar_runner, loaded.tokenizer, "ar", eos)
    began = time.perf_counter()
    greedy = [ar.generate(p, args.tokens).token_ids for p in prompts]
    ar_rate = sum(map(len, greedy)) / (time.perf_counter() - began)
    solved = [ar.generate(encode_prompt(loaded.tokenizer, q.turns[0]), args.math_tokens).text
              for q in maths]
    names = (args.policies.split(",") if args.policies else
             [n for n in policy_names() if n not in ("cfg", "learn2pd")])
    # the reference first: the agreement column is measured against it
    names = ["one_per_step"] + [n for n in names if n != "one_per_step"]
    configs = {n: {} for n in names} | ({"learn2pd": {"filter": args.filter}} if args.filter else {})
    print(f"ar: {ar_rate:.1f} tokens/s, maths {accuracy(solved, maths)} ({len(prompts)} prompts, "
          f"{args.tokens} tokens, block {args.block}, {len(maths)} maths questions of "
          f"{args.math_tokens} tokens)\n\n| policy | steps/token | tokens/s | agrees with "
          "one_per_step | agrees with ar | maths |\n|---|---|---|---|---|---|")
    model = DiffusionModel(runner, mask)
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
        answers = [loaded.tokenizer.decode(diffuse(
            model, get_policy(name).make(config), encode_prompt(loaded.tokenizer, q.turns[0]),
            args.math_tokens, eos, args.block).tokens, skip_special_tokens=True) for q in maths]
        print(f"| {name} | {steps:.2f} | {rate:.1f} | {same:.0%} | {with_ar:.0%} | "
              f"{accuracy(answers, maths)} |", flush=True)


def accuracy(answers: list[str], questions) -> str:
    """Correct answers of ``questions`` (GSM8K's final number), or '-' without any."""
    if not questions:
        return "-"
    right = sum(math_correct(a, q.reference[0]) for a, q in zip(answers, questions))
    return f"{right}/{len(questions)}"


if __name__ == "__main__":
    main()
