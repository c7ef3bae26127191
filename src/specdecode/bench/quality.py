"""Quality of a lossy method's output, against ``ar``'s (docs/lossy.md).

- ``token_agreement``: positions where the output equals ``ar``'s, over the longer one's
  length (1.0 only for identical outputs; a token dropped early shifts the rest and costs them
  all, as a reader would see it).
- whole-answer agreement: the share of question turns whose tokens equal ``ar``'s.
- ``math_correct``: the last number of the answer equals the reference's (GSM8K's ``#### N``).
- ``rouge_l``: ROUGE-L F1 (Lin, 2004) over lower-cased words, of a summary against ``ar``'s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def token_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    longest = max(len(tokens), len(reference))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(tokens, reference)) / longest


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
