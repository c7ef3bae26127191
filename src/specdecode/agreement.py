"""How far an output agrees with a reference output (``ar``'s), position by position: what
``specdecode generate --compare`` reports beside a method's output, and the bench's measure of
a lossy method (bench/quality.py, docs/lossy.md).
"""

from __future__ import annotations

from collections.abc import Sequence


def token_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Positions where ``tokens`` equals ``reference``, over the longer one's length: 1.0 only
    for identical outputs; a token dropped early shifts the rest and costs them all, as a reader
    would see it."""
    longest = max(len(tokens), len(reference))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(tokens, reference)) / longest
