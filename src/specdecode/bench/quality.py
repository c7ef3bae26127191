"""Quality of a lossy method's output, against ``ar``'s (docs/lossy.md).

- ``token_agreement`` (:mod:`specdecode.agreement`): positions where the output equals
  ``ar``'s, over the longer one's length (1.0 only for identical outputs; a token dropped early
  shifts the rest and costs them all, as a reader would see it).
- whole-answer agreement: the share of question turns whose tokens equal ``ar``'s.
- ``math_correct``: the last number of the answer equals the reference's (GSM8K's ``#### N``).
- ``rouge_l``: ROUGE-L F1 (Lin, 2004) over lower-cased words, of a summary against ``ar``'s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from specdecode.agreement import token_agreement

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def math_correct(answer: str, reference: str) -> bool:
    """The answer's last number equals the reference's final one (after ``####`` where it has
    one)."""
    expected = last_number(reference.rsplit("####", 1)[-1])
    got = last_number(answer)
    return expected is not None and got is not None and abs(got - expected) < 1e-6


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(candidate: str, reference: str) -> float:
    c, r = candidate.lower().split(), reference.lower().split()
    if not c or not r:
        return float(c == r)
    common = _lcs(c, r)
    if common == 0:
        return 0.0
    precision, recall = common / len(c), common / len(r)
    return 2 * precision * recall / (precision + recall)


def best_exact(summary: dict, lossy: Sequence[str]) -> str | None:
    """The exact method with the best overall speedup over ``ar`` in this run (peers and
    ``ar`` itself excluded)."""
    exact = {n: e["overall"].get("speedup_vs_ar") or 0.0 for n, e in summary["methods"].items()
             if n != "ar" and n not in lossy and e["kind"] == "method"}
    return max(exact, key=exact.get) if exact else None


def lossy_summary(records: Sequence[dict], summary: dict, questions, tokenizer,
                  lossy: Sequence[str]) -> dict:
    """The lossy table: for ``ar``, the best exact method of the run and each lossy method,
    overall speed (from ``summary``), token-level and whole-answer agreement with ``ar``, the
    maths accuracy on the questions with a reference answer and the mean ROUGE-L of the
    summaries against ``ar``'s."""
    references = {q.question_id: q.reference for q in questions}
    ar = {(r["question_id"], r["turn"]): r for r in records if r["method"] == "ar"}
    texts: dict[tuple, str] = {}

    def text(r: dict) -> str:
        key = (r["method"], r["question_id"], r["turn"])
        if key not in texts:
            texts[key] = tokenizer.decode(r["token_ids"], skip_special_tokens=True)
        return texts[key]

    best = best_exact(summary, lossy)
    rows_of = ["ar"] + ([best] if best else []) + list(lossy)
    table = {}
    for name in rows_of:
        rows = [r for r in records if r["method"] == name and (r["question_id"], r["turn"]) in ar]
        paired = [(r, ar[(r["question_id"], r["turn"])]) for r in rows]
        maths = [math_correct(text(r), references[r["question_id"]][r["turn"]])
                 for r in rows if r["task"] == "math_reasoning"
                 and r["turn"] < len(references.get(r["question_id"], ()))]
        rouge = [rouge_l(text(r), text(a)) for r, a in paired if r["task"] == "summarization"]
        overall = summary["methods"][name]["overall"]
        table[name] = {
            "kind": "reference" if name == "ar" else
                    "lossy" if name in lossy else "best exact",
            "tokens_per_s": overall["tokens_per_s"],
            "speedup_vs_ar": overall["speedup_vs_ar"],
            "token_agreement": _mean([token_agreement(r["token_ids"], a["token_ids"])
                                      for r, a in paired]),
            "answer_agreement": _mean([r["token_ids"] == a["token_ids"] for r, a in paired]),
            "math_accuracy": _mean(maths) if maths else None,
            "math_questions": len(maths),
            "rouge_l_vs_ar": _mean(rouge) if rouge else None,
        }
    return {"best_exact": best, "methods": table}


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0

