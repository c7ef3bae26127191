"""The estimates that budget drafts by expected tokens per second: a runner's seconds per
forward by rows (:class:`RowCosts`) and a proposer's recent acceptance by draft depth
(:class:`Acceptance`). The server's goodput budgets (``server/goodput.py``) and the ``auto``
proposer (``proposers/auto.py``) both read them.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from specdecode.draft import Draft
from specdecode.errors import require

#: weight of old observations after each new one (a window of about 50 steps)
DECAY = 0.98
#: steps of evidence the method's estimate counts for in a sequence's (a new sequence
#: starts from its method's)
PRIOR_STEPS = 4.0
#: a level never drafted yet: its chance of acceptance relative to the level above (at depth 1:
#: its chance), and its rows, so a method is tried where drafts are cheap and learnt from; below
#: the deepest level seen, the ratio of the two deepest seen levels
UNSEEN_RATE = 0.5
UNSEEN_ROWS = 1.0


class RowCosts:
    """Seconds of one forward by the rows it runs: linear between measured points, and past the
    last with the last segment's slope."""

    def __init__(self, points: Mapping[int, float]):
        require(len(points) >= 2 and all(r > 0 and s > 0 for r, s in points.items()),
                f"a row-cost curve needs two or more points of positive rows and seconds, got "
                f"{dict(points)}")
        self.rows = sorted(points)
        self.seconds = [float(points[r]) for r in self.rows]

    def __call__(self, rows: float) -> float:
        r, s = self.rows, self.seconds
        if rows <= r[0]:
            return s[0]
        i = min(bisect.bisect_left(r, rows), len(r) - 1)
        slope = (s[i] - s[i - 1]) / (r[i] - r[i - 1])
        return s[i - 1] + slope * (rows - r[i - 1])

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.rows, self.seconds))


@dataclass
class Acceptance:
    """Decayed counts, by draft depth k (index k - 1): verify steps whose draft reached depth
    k, steps that accepted k or more tokens, draft rows at depth k."""

    offered: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    rows: list[float] = field(default_factory=list)

    def observe(self, draft: Draft, accepted: int) -> None:
        depth = draft.max_depth
        for counts in (self.offered, self.reached, self.rows):
            counts[:] = [c * DECAY for c in counts]
            counts.extend([0.0] * (depth - len(counts)))
        widths = [0] * depth
        for d in draft.depths:
            widths[d - 1] += 1
        for k in range(depth):
            self.offered[k] += 1
            self.reached[k] += k < accepted
            self.rows[k] += widths[k]

    def levels(self, max_depth: int, prior: Acceptance | None = None) -> list[tuple[float, float]]:
        """(chance of accepting depth k, rows at depth k) for k = 1..max_depth, each level's
        chance no higher than the one before (accepting k needs k - 1)."""
        out = []
        chance, ratio = 1.0, UNSEEN_RATE
        for k in range(max_depth):
            offered, reached, rows = self._at(k)
            if prior is not None and k < len(prior.offered) and prior.offered[k]:
                p_rate, p_rows = prior.level(k)
                offered, reached, rows = (offered + PRIOR_STEPS, reached + PRIOR_STEPS * p_rate,
                                          rows + PRIOR_STEPS * p_rows)
            # a level never drafted: the last level's chance, times its ratio to the one before
            # (the deepest seen levels say how fast acceptance falls off past them)
            rate, width = ((reached / offered, rows / offered) if offered
                           else (chance * ratio, UNSEEN_ROWS))
            if chance > 0 and offered:
                ratio = min(1.0, rate / chance) if k else rate
            chance = min(chance, rate)
            out.append((chance, max(width, 1.0)))
        return out

    def level(self, k: int) -> tuple[float, float]:
        offered, reached, rows = self._at(k)
        return (reached / offered, rows / offered) if offered else (UNSEEN_RATE ** (k + 1), UNSEEN_ROWS)

    def _at(self, k: int) -> tuple[float, float, float]:
        if k < len(self.offered):
            return self.offered[k], self.reached[k], self.rows[k]
        return 0.0, 0.0, 0.0
