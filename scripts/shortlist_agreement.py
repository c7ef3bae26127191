"""How often a GGUF draft's argmax is the target's next token, with the whole head, the
shortlisted head and the shortlist widened by the context's tokens (``draft_vocab_context``).

    PYTHONPATH=src python scripts/shortlist_agreement.py \
        docs/results/qwen-coder-1.5b-zen5-greedy/records.jsonl --draft qwen2.5-coder-0.5b

Reads the ``ar`` turns of a bench report's records (their prompt and answer tokens), runs the
draft (the native runner, its layers requantised to int4 as a GGUF draft's are by default)
over each prompt and answer once, and counts, per task, the answer positions where the draft's
top token is the answer's next token: over the whole vocabulary, over the first ``--vocab`` ids
and the control tokens (``shortlist_ids``), and over those and every token of the context so
far (the prompt and the answer's earlier tokens) outside them, the tokens a drafting request's
widened shortlist holds. Every kind is scored by the one whole head, in the file's own blocks
(a drafting request scores its shortlist's rows requantised to int4 and the context's added
rows in float32, so a few close argmaxes may fall otherwise). Teacher-forced and greedy: no
timing, the same numbers on every machine.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from specdecode.drafting.artifacts import gguf_draft_file, shortlist_ids
from specdecode.models.gguf_reader import GGUFFile
from specdecode.models.llama import LlamaRunner
from specdecode.models.llama_drafter import LlamaDrafter

KINDS = ("whole head", "shortlist", "widened")


def agreement(drafter: LlamaDrafter, inside: torch.Tensor, prompt: list[int],
              answer: list[int]) -> tuple[int, int, int]:
    """Positions of ``answer`` each kind of head predicts (its argmax after the tokens
    before it)."""
    drafter.rewind(0)
    logits = drafter.lm_head(drafter.extend(prompt + answer[:-1])[len(prompt) - 1:])
    target = torch.tensor(answer)
    whole = int((logits.argmax(-1) == target).sum())
    shortlist = int((logits.masked_fill(~inside, float("-inf")).argmax(-1) == target).sum())
    allowed = inside.clone()
    allowed[torch.tensor(prompt)] = True
    widened = 0
    for i, token in enumerate(answer):
        widened += int(logits[i].masked_fill(~allowed, float("-inf")).argmax()) == token
        allowed[token] = True  # the answer's tokens join the context as they are written
    return whole, shortlist, widened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", help="a bench report's records.jsonl (its ar turns)")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b",
                        help="the draft: a named model or a .gguf file")
    parser.add_argument("--vocab", type=int, default=32768, help="the shortlist's first ids")
    args = parser.parse_args()

    path = gguf_draft_file(args.draft)
    if path is None:
        parser.error(f"--draft {args.draft}: give a named model or a .gguf file")
    runner = LlamaRunner.from_gguf(path, "int4", max_context=8192, requantise=True)
    inside = torch.zeros(runner.vocab_size, dtype=torch.bool)
    inside[shortlist_ids(GGUFFile(path).fields, args.vocab, runner.vocab_size)] = True
    drafter = LlamaDrafter(runner)
    counts = collections.defaultdict(lambda: [0, 0, 0, 0])
    with open(args.records) as lines:
        for record in map(json.loads, lines):
            if record["method"] != "ar" or len(record["token_ids"]) < 2:
                continue
            row = counts[record["task"]]
            row[0] += len(record["token_ids"])
            for k, agreed in enumerate(agreement(drafter, inside, record["prompt_ids"],
                                                 record["token_ids"])):
                row[k + 1] += agreed
    counts["all"] = [sum(row[k] for row in list(counts.values())) for k in range(4)]
    print(f"{'task':16s} {'positions':>9s} " + " ".join(f"{k:>10s}" for k in KINDS))
    for task, (n, *agreed) in counts.items():
        print(f"{task:16s} {n:9d} " + " ".join(f"{a / n:10.1%}" for a in agreed))


if __name__ == "__main__":
    main()
