"""First-level acceptance of three multi-draft verifiers on the same draft distribution: SpecInfer
(recursive rejection over k i.i.d. drafts), SpecTr's K-SEQ (the same k i.i.d. drafts) and RSD
(recursive rejection over k drafts without replacement from the same q).

Target p: the default model's fp32 native runner; drafter q: its int4 copy (method
``quantized``); both processed at ``--temperature``. Contexts: the first turns of the first
``--per-task`` questions of each task of the Spec-Bench dev half, read teacher-forced (one
prefill each); every ``--stride``-th position is a test point. At each point, ``--trials`` times:
draw the drafts, run :func:`specdecode.verify.verify` over a depth-1 draft, count whether a
draft token was accepted. SpecInfer and SpecTr see identical drafts (same draws). Also printed:
sum_x min(p, q), one draft's acceptance probability.

    PYTHONPATH=src python scripts/multi_draft_acceptance.py --per-task 2 --k 2,4
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from specdecode.api import Decoder
from specdecode.draft import Draft
from specdecode.models.base import Needs
from specdecode.models.loading import load_model, make_runner
from specdecode.questions import load_questions, sample_per_task
from specdecode.sampling import SamplingParams
from specdecode.verify import verify


def all_logits(runner, ids: list[int]) -> torch.Tensor:
    """The runner's logits after every token of ``ids`` [len(ids), V], from one prefill."""
    runner.cache.rewind(0)
    out = runner.prefill(ids, Needs(final_hidden=True))
    return runner.early_exit.head(out.final_hidden)


def drafts(q: torch.Tensor, k: int, gen: torch.Generator) -> tuple[list[int], list[int], list]:
    """k i.i.d. draws from q, and k draws without replacement with each one's q renormalised
    over the tokens not yet drawn (Gumbel-top-k order)."""
    iid = torch.multinomial(q, k, replacement=True, generator=gen).tolist()
    gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=gen).clamp_min(1e-30)))
    order = (q.log() + gumbel).topk(k).indices.tolist()
    left, rows = q.clone(), []
    for token in order:
        rows.append(left / left.sum())
        left[token] = 0
    return iid, order, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-task", type=int, default=1)
    parser.add_argument("--k", default="2,4")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()

    loaded = load_model()
    fp32 = make_runner(loaded, "native", "fp32")
    int4 = make_runner(loaded, "native", "int4")
    encode = Decoder(fp32, loaded.tokenizer, "ar").encode
    params = SamplingParams(temperature=args.temperature)
    gen = torch.Generator().manual_seed(0)
    ks = [int(k) for k in args.k.split(",")]
    hits = {k: {"specinfer": 0, "spectr": 0, "rsd": 0} for k in ks}
    single, points = 0.0, 0
    for question in sample_per_task(load_questions(), args.per_task):
        ids = encode(question.turns[0])
        target, draft = all_logits(fp32, ids), all_logits(int4, ids)
        for row in range(0, len(ids) - 1, args.stride):
            p = (target[row] / args.temperature).softmax(-1)
            q = (draft[row] / args.temperature).softmax(-1)
            single += float(torch.minimum(p, q).sum())
            points += 1
            context = ids[: row + 1]
            for k in ks:
                logits = target[row].expand(1 + k, -1)  # rows after the nodes: unused at depth 1
                for _ in range(args.trials):
                    iid, order, rows = drafts(q, k, gen)
                    base = Draft(tuple(iid), (-1,) * k, q.expand(k, -1))
                    for name, d in (("specinfer", base),
                                    ("spectr", dataclasses.replace(base, sibling_rule="spectr")),
                                    ("rsd", Draft(tuple(order), (-1,) * k, torch.stack(rows)))):
                        result = verify(d, logits, params, context, len(context), gen)
                        hits[k][name] += len(result.accepted)
    trials = points * args.trials
    print(json.dumps({
        "temperature": args.temperature, "points": points, "trials_per_point": args.trials,
        "one_draft_sum_min_p_q": round(single / points, 4),
        "first_level_acceptance": {str(k): {n: round(v / trials, 4) for n, v in h.items()}
                                   for k, h in hits.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
