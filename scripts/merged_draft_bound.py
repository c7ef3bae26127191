"""How fast could the drafters we have make decoding if drafting cost nothing?

    PYTHONPATH=src python scripts/merged_draft_bound.py                       # the dev half, greedy
    PYTHONPATH=src python scripts/merged_draft_bound.py --temperature 0.7
    PYTHONPATH=src python scripts/merged_draft_bound.py --parts suffix+hydra --min-path-prob 0.1

Every part named by ``--parts`` drafts at every step, and ``auto`` sends the arm with the most
expected committed tokens (in practice the merged prefix tree of all the drafts), as it would if
drafting and verify rows were free (``AutoProposer._seconds`` priced at a constant: the one
change this script makes). The committed tokens are the target's either way (greedy: ``ar``'s;
T > 0: ``auto`` sends deterministic drafts, so seeded runs give ``ar``'s tokens too).

The bound charges each step what the target's side of it costs and nothing for the drafting:
the requests' decoding seconds (wall time less the prefill) less the proposer's seconds
(``GenerationStats.propose_s``: drafting and every part's bookkeeping), so the verify forward
of the merged tree, its verification and commit are timed for real. ``ar`` runs each turn just
before (the two interleaved turn by turn, as ``specdecode bench`` interleaves contenders). The
ratios are what the drafters' merged drafts give with the drafting free: what a proposer made of
them approaches as its drafting cost goes to zero, which pays its drafting on top. (Not a proof
that none beats them: one sending smaller trees saves rows and loses tokens; ``--min-path-prob``
moves that trade.)

Questions: the Spec-Bench dev half, ``--per-task`` a task, every turn, each carrying its own
earlier answers (as ``specdecode bench`` does), ``--max-new-tokens`` each.
"""

from __future__ import annotations

import argparse
import time

from specdecode.api import Decoder
from specdecode.questions import load_questions, sample_per_task
from specdecode.models.loading import load_model, make_runner
from specdecode.proposers.auto import AutoProposer


def run_turns(decoders: dict[str, Decoder], questions, max_new_tokens: int,
              temperature: float) -> dict[str, dict]:
    """Per decoder: prefill, decode and proposer seconds, verify steps, committed tokens and
    draft nodes over every turn of ``questions``, the decoders taking each turn in turn."""
    totals = {name: {"prefill_s": 0.0, "decode_s": 0.0, "propose_s": 0.0, "steps": 0,
                     "tokens": 0, "nodes": 0, "turns": 0} for name in decoders}
    for q in questions:
        histories = {name: [] for name in decoders}
        for turn, text in enumerate(q.turns):
            for name, decoder in decoders.items():
                history, total = histories[name], totals[name]
                history.append({"role": "user", "content": text})
                started = time.perf_counter()
                result = decoder.generate(history, max_new_tokens, temperature=temperature,
                                          seed=1000 * q.question_id + turn)
                wall = time.perf_counter() - started
                stats = result.stats
                total["prefill_s"] += stats.prefill_s
                total["decode_s"] += wall - stats.prefill_s
                total["propose_s"] += stats.propose_s
                total["steps"] += len(stats.accepted_lengths)
                total["tokens"] += sum(stats.accepted_lengths)
                total["nodes"] += stats.draft_tokens
                total["turns"] += 1
                history.append({"role": "assistant", "content": result.text})
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="suffix+hydra+eagle+deer")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--per-task", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--min-path-prob", type=float, default=None,
                        help="handed to the parts that grow trees by it (default: auto's)")
    args = parser.parse_args()

    loaded = load_model()
    runner = make_runner(loaded)
    questions = sample_per_task(load_questions(), args.per_task)
    free = dict(parts=args.parts, explore_every=1)
    if args.min_path_prob is not None:
        free["min_path_prob"] = args.min_path_prob
    decoders = {"ar": Decoder(runner, loaded.tokenizer, "ar"),
                "free": Decoder(runner, loaded.tokenizer, "auto", **free)}
    priced = AutoProposer._seconds
    AutoProposer._seconds = lambda self, nodes, drafting_s=0.0: 1.0  # rows and drafting free
    try:
        totals = run_turns(decoders, questions, args.max_new_tokens, args.temperature)
    finally:
        AutoProposer._seconds = priced

    ar, merged = totals["ar"], totals["free"]
    bound_decode = merged["decode_s"] - merged["propose_s"]
    accepted = merged["tokens"] / merged["steps"]
    rows = merged["nodes"] / merged["steps"]
    decode_ratio = ar["decode_s"] / bound_decode
    e2e_ratio = (ar["prefill_s"] + ar["decode_s"]) / (ar["prefill_s"] + bound_decode)
    print(f"{len(questions)} questions, {ar['turns']} turns, {args.max_new_tokens} tokens, "
          f"T = {args.temperature}; ar: {1e3 * ar['decode_s'] / ar['steps']:.2f} ms a decode "
          f"step, prefill {ar['prefill_s']:.1f} s of {ar['prefill_s'] + ar['decode_s']:.1f} s")
    print(f"parts {args.parts} (min_path_prob {args.min_path_prob or 'auto default'}), every "
          f"one drafting every step: {accepted:.3f} tokens a step, {rows:.2f} draft rows, "
          f"{1e3 * bound_decode / merged['steps']:.2f} ms a step besides the drafting "
          f"({1e3 * merged['propose_s'] / merged['steps']:.2f} ms); bound "
          f"{decode_ratio:.3f}x ar decoding, {e2e_ratio:.3f}x whole requests")


if __name__ == "__main__":
    main()
