"""Superposed Decoding's alternatives against sampled ``ar`` continuations (docs/lossy.md).

    python -m specdecode.bench.coverage --per-task 10 --tokens 16 --k 3

For each first turn of the chosen questions: ``ar``'s greedy continuation (the reference), the
``k`` drafts of ``superposed`` (one target forward a token for all of them) and ``k`` sampled
``ar`` continuations (temperature 1, seeded; ``k`` times the forwards). Reported for each
source: target forwards, wall time, prefix coverage (the share of prompts where some
alternative starts with the greedy continuation's first ``--prefix`` tokens), distinct
alternatives, and quality as the target judges it (mean per-token negative log-likelihood of
the best alternative and of all of them). A single sampled continuation is the same cost as
the superposed drafts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.draft import Draft


@torch.inference_mode()
def nll(runner, prompt: list[int], tokens: list[int]) -> float:
    """The target's mean negative log-likelihood per token of ``tokens`` after ``prompt``."""
    first = runner.prefill(prompt).logits[0]
    rows = [first]
    if len(tokens) > 1:
        out = runner.forward(tokens[0], Draft.chain(tokens[1:-1]) if len(tokens) > 2 else Draft.empty())
        runner.commit([])
        rows += list(out.logits[:len(tokens) - 1])
    logp = torch.log_softmax(torch.stack(rows).float(), -1)
    return float(-logp[torch.arange(len(tokens)), torch.tensor(tokens)].mean())


def measure(runner, tokenizer, eos, prompts: list[list[int]], tokens: int, k: int,
            prefix: int) -> dict:
    from specdecode.api import Decoder

    ar = Decoder(runner, tokenizer, "ar", eos)
    sup = Decoder(runner, tokenizer, "superposed", eos, n_drafts=k)
    sources = {"superposed": [], f"ar sampled x{k}": [], "ar sampled x1": [], "ar greedy": []}
    costs = {name: [0, 0.0] for name in sources}  # forwards, seconds
    references = []
    for n, ids in enumerate(prompts):
        t0 = time.perf_counter()
        greedy = ar.start(ids, tokens)
        reference = greedy.run()
        costs["ar greedy"][0] += greedy.stats.target_forwards
        costs["ar greedy"][1] += time.perf_counter() - t0
        references.append(reference)
        sources["ar greedy"].append([reference])
        t0 = time.perf_counter()
        drafts = sup.proposer.alternatives(ids, tokens, eos)
        costs["superposed"][1] += time.perf_counter() - t0
        costs["superposed"][0] += max(len(d) for d in drafts)  # one forward a token
        sources["superposed"].append(drafts)
        samples = []
        for s in range(k):
            t0 = time.perf_counter()
            gen = ar.start(ids, tokens, temperature=1.0, seed=1000 * n + s)
            samples.append(gen.run())
            for name in ([f"ar sampled x{k}"] + (["ar sampled x1"] if s == 0 else [])):
                costs[name][0] += gen.stats.target_forwards
                costs[name][1] += time.perf_counter() - t0
        sources[f"ar sampled x{k}"].append(samples)
        sources["ar sampled x1"].append(samples[:1])
    report = {}
    for name, per_prompt in sources.items():
        scores = [[nll(runner, ids, alt) for alt in alts if alt]
                  for ids, alts in zip(prompts, per_prompt)]
        report[name] = {
            "target_forwards": costs[name][0], "seconds": round(costs[name][1], 2),
            f"prefix{prefix}_coverage": round(statistics.mean(
                any(a[:prefix] == r[:prefix] for a in alts)
                for alts, r in zip(per_prompt, references)), 4),
            "distinct": round(statistics.mean(len({tuple(a) for a in alts})
                                              for alts in per_prompt), 3),
            "best_nll": round(statistics.mean(min(s) for s in scores), 4),
            "mean_nll": round(statistics.mean(statistics.mean(s) for s in scores), 4),
        }
    return report


def main() -> None:
    from specdecode.questions import load_questions, sample_per_task
    from specdecode.cli_options import add_model_arguments, load_target
    from specdecode.bench.runner import encode_messages

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-task", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=16, help="continuation length")
    parser.add_argument("--k", type=int, default=3, help="alternatives")
    parser.add_argument("--prefix", type=int, default=4)
    add_model_arguments(parser)
    args = parser.parse_args()
    runner, tokenizer, eos = load_target(args)
    questions = sample_per_task(load_questions(), args.per_task)
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": q.turns[0]}])
               for q in questions]
    print(json.dumps({"prompts": len(prompts), "tokens": args.tokens, "k": args.k,
                      **measure(runner, tokenizer, eos, prompts, args.tokens, args.k,
                                args.prefix)}, indent=2))


if __name__ == "__main__":
    main()
