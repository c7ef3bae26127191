"""When should ``auto`` ask its learned part for a draft? Every policy, replayed on one run.

    PYTHONPATH=src python scripts/auto_policy_replay.py                 # suffix + hydra, greedy
    PYTHONPATH=src python scripts/auto_policy_replay.py --learned-ms 0.4,0.25,0.1,0 --per-task 3

``auto:explore_every=1`` runs the dev half greedy with both parts drafting every step. Greedy,
the committed tokens are ``ar``'s whatever is sent, so each step's drafts (the model-free
part's, the learned part's, and their merged tree) are scored against them: how many tokens each
would have had accepted, and how many rows it would have sent. A policy (which steps also ask
the learned part) is then replayed on those steps and priced with a step model (the steps are
this run's: a policy sending other drafts would cut the answers into other steps, so a replay
estimates, it does not reproduce):

- ``--base-ms``: a step besides drafting and draft rows;
- ``--row-ms``: a draft row;
- ``--suffix-ms``: the model-free part's drafting and bookkeeping;
- ``--learned-ms``: the learned part's drafting when asked (several, comma-separated: each is
  priced on the same steps).

The defaults are a Zen 5's (both threads, SmolLM2-135M; docs/results/HISTORY.md, draft heads): a
verify row from the in-loop step profile (3.17 against 2.80 ms for 1.78 more rows), the parts'
milliseconds from the bench records. ``oracle`` picks, per step, whichever of the two choices
costs less per token: about the best a rule deciding before drafting could do.
"""

from __future__ import annotations

import argparse

import torch

from specdecode.api import Decoder
from specdecode.questions import load_questions, sample_per_task
from specdecode.draft import Draft
from specdecode.models.loading import load_model, make_runner
from specdecode.proposers import auto


def accepted(draft: Draft, tokens) -> int:
    """Draft tokens the greedy walk accepts along the committed ``tokens``."""
    node, matched = -1, 0
    for token in tokens:
        child = next((c for c in draft.children(node) if draft.tokens[c] == token), None)
        if child is None:
            break
        node, matched = child, matched + 1
    return matched


class Recorder:
    """Wraps ``AutoProposer._choose`` and ``observe``: each verify step's drafts by arm (the
    arms ``_choose`` weighed, its merged tree included), as (rows, depth, accepted), and under
    "confidence" the target's probability of the token it committed last before the step
    (known before drafting, at no cost)."""

    def __init__(self):
        self.steps: list[dict] = []
        self._drafts: dict[str, Draft] = {}
        self._confidence = None
        choose, observe = auto.AutoProposer._choose, auto.AutoProposer.observe
        recorder = self

        def recording_choose(proposer, drafts, rates, budget):
            scored_before = len(proposer._walks)
            best = choose(proposer, drafts, rates, budget)
            # the arm sent (unless none was) and the others, which auto scores as text comes
            arms = [(walk.record, walk.draft) for walk in proposer._walks[scored_before:]]
            if best[2] is not None:
                arms.append((best[2], best[0]))
            names = {id(record): name for record, name in zip(proposer.records, proposer.names)}
            names[id(proposer.merged_record)] = "merged"
            recorder._drafts = {names[id(record)]: draft for record, draft in arms}
            return best

        def recording_observe(proposer, feedback):
            if not feedback.prefill and recorder._drafts:
                step = {arm: (len(d), d.max_depth, accepted(d, feedback.tokens))
                        for arm, d in recorder._drafts.items()}
                step["confidence"] = recorder._confidence
                recorder.steps.append(step)
                recorder._drafts = {}
            last_row = 1 + feedback.accepted[-1] if feedback.accepted else 0
            probs = torch.softmax(feedback.logits[last_row].float(), -1)
            recorder._confidence = float(probs.max())
            return observe(proposer, feedback)

        auto.AutoProposer._choose = recording_choose
        auto.AutoProposer.observe = recording_observe


NOTHING = (0, 0, 0)


def sent(step, asked: bool, learned: str) -> tuple[int, int, int]:
    """What a step sends: suffix's draft, or with the learned part asked, the merged tree of
    both (the learned part's alone where suffix drafted nothing)."""
    suffix = step.get("suffix", NOTHING)
    if not asked:
        return suffix
    return step.get("merged") or (step.get(learned, NOTHING) if suffix[0] == 0 else suffix)


def replay(steps, ask, args) -> tuple[float, float]:
    """(tokens a step, ms a token) of the policy ``ask(step) -> bool``."""
    tokens = ms = 0.0
    for step in steps:
        asked = ask(step)
        rows, _, took = sent(step, asked, args.learned)
        tokens += 1 + took
        ms += (args.base_ms + args.suffix_ms + args.row_ms * rows
               + (args.learned_ms if asked else 0.0))
    return tokens / len(steps), ms / tokens


def report(steps, policies, args) -> None:
    """Each policy's tokens a step and ms a token, and the per-step oracle's, under ``args``'
    step model."""
    _, alone = replay(steps, policies["suffix alone"], args)
    print(f"{len(steps)} verify steps; step model: {args.base_ms} ms + {args.row_ms} a draft row "
          f"+ {args.suffix_ms} suffix + {args.learned_ms} {args.learned} when asked")
    for name, ask in policies.items():
        per_step, per_token = replay(steps, ask, args)
        print(f"  {name:44s} {per_step:.3f} tokens a step, {per_token:.3f} ms a token, "
              f"{alone / per_token:.3f}x suffix alone")
    oracle_tokens = oracle_ms = 0.0
    for step in steps:
        per_step, per_token = min(replay([step], lambda s: False, args),
                                  replay([step], lambda s: True, args), key=lambda c: c[1])
        oracle_tokens += per_step
        oracle_ms += per_step * per_token
    print(f"  {'oracle (the cheaper per token, each step)':44s} {oracle_tokens / len(steps):.3f} "
          f"tokens a step, {oracle_ms / oracle_tokens:.3f} ms a token, "
          f"{alone / (oracle_ms / oracle_tokens):.3f}x suffix alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learned", default="hydra")
    parser.add_argument("--per-task", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--base-ms", type=float, default=3.30)
    parser.add_argument("--row-ms", type=float, default=0.21)
    parser.add_argument("--suffix-ms", type=float, default=0.17)
    parser.add_argument("--learned-ms", default="0.40",
                        help="comma-separated: the learned part's drafting ms, each priced")
    args = parser.parse_args()
    learned_costs = [float(ms) for ms in args.learned_ms.split(",")]

    recorder = Recorder()
    loaded = load_model()
    decoder = Decoder(make_runner(loaded), loaded.tokenizer, "auto",
                      parts=f"suffix+{args.learned}", explore_every=1)
    for q in sample_per_task(load_questions(), args.per_task):
        history = []
        for text in q.turns:
            history.append({"role": "user", "content": text})
            result = decoder.generate(history, args.max_new_tokens)
            history.append({"role": "assistant", "content": result.text})
    steps = recorder.steps

    def depth(step):
        return step.get("suffix", NOTHING)[1]

    policies = {
        "suffix alone": lambda step: False,
        f"{args.learned} every step": lambda step: True,
        f"{args.learned} where suffix drafts nothing": lambda step: depth(step) == 0,
        f"{args.learned} where suffix drafts depth <= 1": lambda step: depth(step) <= 1,
        f"{args.learned} where suffix drafts depth <= 2": lambda step: depth(step) <= 2,
    }
    for args.learned_ms in learned_costs:
        report(steps, policies, args)
    print("by the depth of suffix's draft: steps, suffix's accepted tokens, what asking "
          f"{args.learned} adds (tokens, rows)")
    for d in range(5):
        group = [s for s in steps if min(depth(s), 4) == d]
        if not group:
            continue
        alone = [sent(s, False, args.learned) for s in group]
        asked = [sent(s, True, args.learned) for s in group]
        base = sum(a[2] for a in alone)
        gained = sum(a[2] for a in asked) - base
        rows = sum(a[0] for a in asked) - sum(a[0] for a in alone)
        print(f"  depth {d}{'+' if d == 4 else ''}: {len(group)} steps, {base / len(group):.3f}, "
              f"+{gained / len(group):.3f} tokens, +{rows / len(group):.2f} rows")
    print("by the target's probability of the token it committed last: steps, what asking "
          f"{args.learned} adds (tokens, rows)")
    for tenth in range(10):
        group = [s for s in steps if min(int(10 * s["confidence"]), 9) == tenth]
        if not group:
            continue
        alone = [sent(s, False, args.learned) for s in group]
        asked = [sent(s, True, args.learned) for s in group]
        gained = sum(a[2] for a in asked) - sum(a[2] for a in alone)
        rows = sum(a[0] for a in asked) - sum(a[0] for a in alone)
        print(f"  {tenth / 10:.1f}-{(tenth + 1) / 10:.1f}: {len(group)} steps, "
              f"+{gained / len(group):.3f} tokens, +{rows / len(group):.2f} rows")


if __name__ == "__main__":
    main()
