"""How often a draft model's token is accepted at T > 0 under each way of drafting it, measured
exactly on the target's own sampled answers (no sampling noise): for each position of each
answer, with p the target's processed distribution and q the draft's,

- ``rejection``: sum_x min(p(x), q(x)), the chance speculative sampling accepts a token drawn
  from q with its probabilities (``draft_model``);
- ``coupled``: the chance the inverse-CDF draws of p and q at one shared uniform land on the
  same token, sum_x |[F_p(x-), F_p(x)] ∩ [F_q(x-), F_q(x)]| in token order (``coupled=true``,
  ``auto``'s draft model: drafting/session.py);
- ``apart``: sum_x q(x) p(x), the chance the verifier's walk lands on a token drawn from q apart
  from it and sent without probabilities.

Usage (the answers: a bench run's records at T > 0, e.g. ``specdecode bench ... --temperature
0.7 --seed 0 --out DIR``; the first record of ``ar`` per question and turn)::

    python scripts/coupling_agreement.py DIR/records.jsonl --model qwen2.5-coder-1.5b \\
        --draft qwen2.5-coder-0.5b --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from specdecode.draft import Draft
from specdecode.models import loading
from specdecode.sampling import SamplingParams, filtered_probs


def agreements(p: torch.Tensor, q: torch.Tensor) -> tuple[float, float, float]:
    """(rejection, coupled, apart) acceptance chances of one position's [V] distributions."""
    p, q = p.double(), q.double()
    fp, fq = p.cumsum(0), q.cumsum(0)
    low = torch.maximum(fp - p, fq - q)
    overlap = (torch.minimum(fp, fq) - low).clamp(min=0)
    return float(torch.minimum(p, q).sum()), float(overlap.sum()), float((p * q).sum())


def distributions(runner, prompt: list[int], answer: list[int], sampling) -> torch.Tensor:
    """The processed distribution before each answer token: [len(answer), V]."""
    rows = [runner.prefill(prompt).logits[-1]]
    # the root is the answer's first token; row i reads answer[i] and predicts answer[i + 1]
    rows.extend(runner.forward(answer[0], Draft.chain(answer[1:])).logits[:-1])
    runner.commit([])
    return torch.stack([filtered_probs(r.float(), sampling) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-answers", type=int, default=40)
    args = parser.parse_args()
    sampling = SamplingParams(temperature=args.temperature)
    target = loading.make_runner(loading.load_model(args.model), weights="int4")
    draft = loading.make_runner(loading.load_model(args.draft), weights="int4")
    answers = [r for r in map(json.loads, open(args.records)) if r["method"] == "ar"]
    by_task = defaultdict(lambda: torch.zeros(4, dtype=torch.float64))
    for record in answers[:args.max_answers]:
        prompt, answer = record["prompt_ids"], record["token_ids"]
        if len(answer) < 2:
            continue
        p = distributions(target, prompt, answer, sampling)
        q = distributions(draft, prompt, answer, sampling)
        for i in range(len(answer)):
            by_task[record["task"]] += torch.tensor((1.0, *agreements(p[i], q[i])))
    total = sum(by_task.values())
    print("| task | positions | rejection | coupled | apart |\n|---|---:|---:|---:|---:|")
    for task, sums in sorted(by_task.items()) + [("all", total)]:
        n = sums[0]
        print(f"| {task} | {int(n)} | {sums[1] / n:.3f} | {sums[2] / n:.3f} | {sums[3] / n:.3f} |")


if __name__ == "__main__":
    main()
