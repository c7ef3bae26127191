"""PEARL (``pearl``, one core each for drafter and target) against sequential draft-then-verify
(``quantized``, both cores for whichever model runs) with the same int4 drafter and the same fp32
target, greedy, on the first ``--per-task`` questions of each task of the Spec-Bench dev half
(first turns, chat-templated), after fp32 ``ar`` for reference.

Per method: tokens per second of decoding (prefill left out), mean tokens per target pass, and
the mutual waiting: sequentially the target waits while the drafter drafts (the engine's
``propose_s``) and the drafter waits while the target verifies (``verify_s``); under PEARL the
target waits only where the drafter has not finished its round when the verify is done
(``PearlStats.target_wait_s``), the drafter where it finished first (``drafter_wait_s``). Every
output is checked against fp32 ``ar``'s.

    PYTHONPATH=src python scripts/pearl_overlap.py --per-task 1 --max-new-tokens 64

Prints one JSON object. The bound shared memory bandwidth sets: scripts/pearl_bound.py.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from specdecode.api import Decoder
from specdecode.questions import load_questions, sample_per_task
from specdecode.models.loading import load_model, make_runner


def run(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Decode every prompt; the summed engine timings and what was generated."""
    totals = {"tokens": 0, "decode_s": 0.0, "target_passes": 0, "propose_s": 0.0,
              "verify_s": 0.0}
    outputs = []
    for ids in prompts:
        generation = decoder.start(ids, max_new_tokens)
        outputs.append(generation.run())
        s = generation.stats
        totals["tokens"] += s.new_tokens
        totals["decode_s"] += s.total_s - s.prefill_s
        totals["target_passes"] += s.target_forwards - 1  # the prefill's pass made one token
        totals["propose_s"] += s.propose_s
        totals["verify_s"] += s.verify_s
    totals["outputs"] = outputs
    return totals


def summary(name: str, totals: dict, reference: list[list[int]], proposer) -> dict:
    tokens = totals["tokens"]
    row = {"method": name, "identical_to_ar": totals["outputs"] == reference,
           "tokens": tokens, "tokens_per_s": round(tokens / totals["decode_s"], 2),
           "tokens_per_target_pass": round((tokens - len(reference)) / max(1, totals["target_passes"]), 2)}
    stats = getattr(proposer, "stats", None)
    if name.startswith("pearl"):
        row.update(target_waits_s=round(stats.target_wait_s, 3),
                   drafter_waits_s=round(stats.drafter_wait_s, 3),
                   drafter_busy_s=round(stats.drafter_busy_s, 3),
                   pre_verify_rounds=stats.pre_verify_rounds,
                   post_verify_rounds=stats.post_verify_rounds,
                   ahead_kept=stats.ahead_kept, ahead_discarded=stats.ahead_discarded)
    elif name != "ar":
        # one thread at a time: each model idles while the other computes
        row.update(target_waits_s=round(totals["propose_s"], 3),
                   drafter_waits_s=round(totals["verify_s"], 3))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-task", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default="quantized,pearl",
                        help="comma-separated METHOD[:key=value...] run after ar")
    parser.add_argument("--threads", type=int, default=0,
                        help="OpenMP threads of this (the target's) thread; 0: torch's default. "
                             "pearl takes the drafter's from them (at least 1 each)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model()
    target = make_runner(loaded, "native", "fp32")
    threads = torch.get_num_threads()
    ar = Decoder(target, loaded.tokenizer, "ar")
    prompts = [ar.encode(q.turns[0]) for q in sample_per_task(load_questions(), args.per_task)]
    reference = run(ar, prompts, args.max_new_tokens)
    rows = [summary("ar", reference, reference["outputs"], None)]
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # each as it comes: runs are long
    for spec in args.methods.split(","):
        method, *pairs = spec.split(":")
        config = dict(pair.split("=", 1) for pair in pairs)
        decoder = Decoder(target, loaded.tokenizer, method, **config)
        rows.append(summary(spec, run(decoder, prompts, args.max_new_tokens),
                            reference["outputs"], decoder.proposer))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"threads": threads, "prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
