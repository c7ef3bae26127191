"""Forward counts of ``quantized`` and ``hierspec`` on the default model's fp32 target, and the
decode time they project on idle row costs: a load-independent estimate for a shared machine.

For the first ``--per-task`` questions of each task (first turns, greedy), every forward of the
fp32 target and of the int4 copy is recorded with its row count (the prompt's prefill and the
int4 copy's read of the prompt, which take the prefill layers, left out). Projected decode time = sum of each forward's
cost at its row count, interpolated linearly in a row-cost table (default: the native runner's
per-forward latency on both cores of the idle Zen 5, docs/native-runner.md; replace with your own
``specdecode bench --runners`` numbers); ``ar`` = one fp32 row per token. Python overhead and
sampling are left out, so the projection is an upper bound of the speedup.

    PYTHONPATH=src python scripts/quantized_costs.py --per-task 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json

from specdecode.api import Decoder
from specdecode.questions import load_questions, sample_per_task
from specdecode.models.loading import load_model, make_runner

#: rows -> ms per forward, both cores, idle (docs/native-runner.md, "Both cores, 2 threads")
FP32_MS = {1: 12.6, 8: 18.9, 16: 27.2, 64: 80.1}
INT4_MS = {1: 2.6, 8: 3.7, 16: 6.1, 64: 19.7}


def cost(table: dict[int, float], rows: int) -> float:
    points = sorted(table)
    for lo, hi in zip(points, points[1:]):
        if rows <= hi:
            return table[lo] + (table[hi] - table[lo]) * (max(rows, lo) - lo) / (hi - lo)
    lo, hi = points[-2], points[-1]
    return table[hi] + (table[hi] - table[lo]) * (rows - hi) / (hi - lo)


def recorded(obj, name: str, rows_of, log: list[int]) -> None:
    """Wrap ``obj.name`` so that each call appends its row count to ``log`` (None: not logged)."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        rows = rows_of(*args, **kwargs)
        if rows is not None:
            log.append(rows)
        return inner(*args, **kwargs)

    setattr(obj, name, wrapper)


def int4_runner(proposer):
    return proposer.session.lm.runner.runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-task", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default="quantized,hierspec")
    args = parser.parse_args()

    loaded = load_model()
    fp32 = make_runner(loaded, "native", "fp32")
    target_rows: list[int] = []
    recorded(fp32, "forward", lambda root, draft, *_: len(draft) + 1, target_rows)
    questions = sample_per_task(load_questions(), args.per_task)
    report = {}
    for method in args.methods.split(","):
        decoder = Decoder(fp32, loaded.tokenizer, method)
        int4_rows: list[int] = []
        # the prompt's blocks take the prefill layers: that is prefill, not drafting
        recorded(int4_runner(decoder.proposer), "run",
                 lambda tokens, *_, prefill=False, **__: None if prefill else len(tokens), int4_rows)
        tokens = steps = 0
        target_ms = int4_ms = 0.0
        int4_calls = 0
        for q in questions:
            target_rows.clear()
            int4_rows.clear()
            result = decoder.generate(q.turns[0], args.max_new_tokens)
            tokens += len(result.token_ids)
            steps += len(target_rows)
            target_ms += sum(cost(FP32_MS, r) for r in target_rows)
            int4_calls += len(int4_rows)
            int4_ms += sum(cost(INT4_MS, r) for r in int4_rows)
        ar_ms = tokens * FP32_MS[1]
        report[method] = {
            "tokens": tokens, "target_forwards": steps, "tokens_per_target_forward":
            round(tokens / max(1, steps), 2), "int4_forwards": int4_calls,
            "int4_forwards_per_token": round(int4_calls / max(1, tokens), 2),
            "projected_ms_per_token": round((target_ms + int4_ms) / max(1, tokens), 2),
            "projected_speedup_vs_fp32_ar": round(ar_ms / max(1e-9, target_ms + int4_ms), 2),
        }
    print(json.dumps({"questions": len(questions), "max_new_tokens": args.max_new_tokens,
                      "methods": report}, indent=1))


if __name__ == "__main__":
    main()
