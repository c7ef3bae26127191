"""Several conversations packed one after another into one training sequence
(``train heads --pack``): where each begins, and which rows stay inside their own conversation.
"""

from __future__ import annotations

import torch


def packed(sequences: list[list[int]]) -> tuple[list[int], list[int]]:
    """Several conversations' tokens one after another, and where each begins: what the
    networks that take ``starts`` train on in one step (``train heads --pack``)."""
    starts, tokens = [], []
    for ids in sequences:
        starts.append(len(tokens))
        tokens.extend(ids)
    return tokens, starts


def segments(n: int, starts, device=None) -> torch.Tensor:
    """Each of ``n`` packed positions' conversation (0 .. len(starts) - 1)."""
    marks = torch.zeros(n, dtype=torch.long, device=device)
    marks[torch.tensor(starts[1:], dtype=torch.long, device=device)] = 1
    return marks.cumsum(0)


def packed_rows(n: int, starts, depth: int, rows: torch.Tensor) -> torch.Tensor | None:
    """Which rows of depth ``depth``, at the positions ``rows`` (0, 1, ...; deer's anchors),
    score a token of their own conversation (t and t + depth + 1 in one), for ``n`` packed
    positions; None: all (one conversation)."""
    if starts is None or len(starts) == 1:
        return None
    segment = segments(n, starts)
    return segment[rows] == segment[rows + depth + 1]
