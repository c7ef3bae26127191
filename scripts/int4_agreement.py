"""How closely the int4 native runner follows the fp32 one (the drafter of method ``quantized``).

For the first ``--per-task`` questions of each task of the Spec-Bench dev half (first turns,
chat-templated), on the default model's GGUF file read as fp32 and as int4:

1. greedy ``ar`` on each runner for ``--max-new-tokens`` tokens: are the outputs identical?
2. teacher-forced top-1 agreement: prompt + fp32's greedy output is read by both runners in one
   prefill; at every position, is int4's argmax fp32's? Counted over the prompt positions and
   over the output positions separately. On the output positions fp32's argmax *is* the next
   token, so the output figure is the probability that int4 drafts the token fp32 accepts
   (greedy); the chain acceptance it implies is in docs/quantized.md.

    PYTHONPATH=src python scripts/int4_agreement.py --per-task 10 --max-new-tokens 128

Prints one JSON object (per task and overall).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdecode.api import Decoder
from specdecode.questions import load_questions, sample_per_task
from specdecode.models.base import Needs
from specdecode.models.loading import load_model, make_runner


def argmax_rows(runner, ids: list[int]) -> torch.Tensor:
    """The runner's argmax after every token of ``ids`` [len(ids)], from one prefill."""
    runner.cache.rewind(0)
    out = runner.prefill(ids, Needs(final_hidden=True))
    return runner.early_exit.head(out.final_hidden).argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()

    loaded = load_model(args.model)
    fp32 = make_runner(loaded, "native", "fp32")
    int4 = make_runner(loaded, "native", "int4")
    decoders = {name: Decoder(r, loaded.tokenizer, "ar") for name, r in
                (("fp32", fp32), ("int4", int4))}
    questions = sample_per_task(load_questions(), args.per_task)
    tasks: dict[str, dict] = {}
    t0 = time.time()
    for q in questions:
        ids = decoders["fp32"].encode(q.turns[0])
        out = {name: d.generate(ids, args.max_new_tokens).token_ids for name, d in decoders.items()}
        seq = ids + out["fp32"]
        a, b = argmax_rows(fp32, seq), argmax_rows(int4, seq)
        n = len(ids)
        # row i predicts seq[i + 1]: prompt rows 0 .. n-2, output rows n-1 .. len-2
        same = (a == b)[: len(seq) - 1]
        t = tasks.setdefault(q.task, dict(questions=0, identical=0, prompt_rows=0,
                                          prompt_agree=0, output_rows=0, output_agree=0))
        t["questions"] += 1
        t["identical"] += out["fp32"] == out["int4"]
        t["prompt_rows"] += n - 1
        t["prompt_agree"] += int(same[: n - 1].sum())
        t["output_rows"] += len(seq) - n
        t["output_agree"] += int(same[n - 1:].sum())
    total = {k: sum(t[k] for t in tasks.values()) for k in next(iter(tasks.values()))}
    for t in [*tasks.values(), total]:
        t["prompt_top1"] = round(t["prompt_agree"] / max(1, t["prompt_rows"]), 4)
        t["output_top1"] = round(t["output_agree"] / max(1, t["output_rows"]), 4)
    print(json.dumps({"per_task": tasks, "overall": total, "max_new_tokens": args.max_new_tokens,
                      "seconds": round(time.time() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
