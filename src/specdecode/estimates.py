"""The estimates that budget drafts by expected tokens per second: a runner's seconds per
forward by rows (:class:`RowCosts`), a proposer's recent acceptance by draft depth
(:class:`Acceptance`), a step's seconds besides its forward and its drafting
(:class:`StepOverhead`) and the tokens a request has left (:class:`AnswerLengths`). The
server's goodput budgets (``server/goodput.py``), the sizing of one request's drafts
(``sizing.py``) and the ``auto`` proposer (``proposers/auto.py``) read them.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specdecode.draft import Draft
from specdecode.errors import require

#: weight of old observations after each new one (a window of about 50 steps)
DECAY = 0.98
#: steps of evidence the method's estimate counts for in a sequence's, at most (a new
#: sequence starts from its method's; a level the method has drafted less counts for less)
PRIOR_STEPS = 4.0
#: a level never drafted yet: its chance of acceptance relative to the level above (at depth 1:
#: its chance), and its rows, so a method is tried where drafts are cheap and learnt from; below
#: the deepest level seen, the ratio of the two deepest seen levels
UNSEEN_RATE = 0.5
UNSEEN_ROWS = 1.0
#: steps of evidence below which a level's chance given the one above leans on that one's
MIN_EVIDENCE = 1.0
#: the normal quantile of the upper confidence bound on a first token's chance
#: (:meth:`Acceptance.first_bound`): one-sided 95%
FIRST_BOUND_Z = 1.645
#: a method's recent answers whose lengths say how many tokens a request has left
LENGTHS_KEPT = 32
#: the tokens a request that knows only itself expects to add before it has written as many
#: (:func:`expected_left_alone`)
UNSEEN_ANSWER = 32
#: steps whose seconds besides the forward and the drafting the overhead line is fitted to
OVERHEAD_STEPS = 64
#: draft rows grouped for that fit, each group from its first row count to the next group's
#: (each group's median seconds is one point of the line; groups double in width, to the 256
#: draft rows of a server's packed forward): a group counts from MIN_GROUP steps on, so one
#: step the machine stalled moves nothing
ROW_GROUP_STARTS = (0, 1, 2, 3, 5, 9, 17, 33, 65, 129)
MIN_GROUP = 3
#: the line is refitted every this many steps (a fit over 64 steps moves little in 8, and
#: refitting each step cost 0.04 ms of a 3.5 ms step)
REFIT_EVERY = 8


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
    k, those of them that accepted the k - 1 tokens above it (so that depth k was tried), steps
    that accepted k or more tokens, draft rows at depth k.

    A level's chance is the chain of the chances of each level given the one above
    (reached / tried): a request and its method's record may differ in how often they accept
    the first token and still share how fast acceptance falls off below it, and the record's
    chance given the level above is what a request whose drafts are accepted more often than
    its method's can borrow for the levels it has not drafted yet (with the record's
    unconditional chances, a request of predicted text after requests of fresh text would
    price its second level by the others' and never send it)."""

    offered: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    rows: list[float] = field(default_factory=list)
    #: verify steps with a draft observed, not decayed
    drafts: int = 0
    #: those of them that accepted the draft's first token, not decayed
    firsts: int = 0
    #: drafts accepted whole in a row, up to the last one observed
    whole: int = 0
    #: drafts whose first token was rejected in a row, up to the last one observed
    missed: int = 0

    def observe(self, draft: Draft, accepted: int) -> None:
        depth = draft.max_depth
        self.drafts += depth > 0
        self.firsts += depth > 0 and accepted > 0
        if depth:
            self.whole = self.whole + 1 if accepted >= depth else 0
            self.missed = self.missed + 1 if accepted == 0 else 0
        for counts in (self.offered, self.tried, self.reached, self.rows):
            counts[:] = [c * DECAY for c in counts]
            counts.extend([0.0] * (depth - len(counts)))
        widths = [0] * depth
        for d in draft.depths:
            widths[d - 1] += 1
        for k in range(depth):
            self.offered[k] += 1
            self.tried[k] += k <= accepted
            self.reached[k] += k < accepted
            self.rows[k] += widths[k]

    def levels(self, max_depth: int, prior: Acceptance | None = None) -> list[tuple[float, float]]:
        """(chance of accepting depth k, rows at depth k) for k = 1..max_depth: the product of
        each level's chance given the level above, its own counts joined by PRIOR_STEPS of
        ``prior``'s; a level neither has tried takes the deepest tried level's (UNSEEN_RATE
        before any), so each level's chance is no higher than the one before."""
        out = []
        chance, given = 1.0, UNSEEN_RATE
        for k in range(max_depth):
            offered, tried, reached, rows = self._at(k)
            if prior is not None:
                p_offered, p_tried, p_reached, p_rows = prior._at(k)
                if p_tried:  # the record counts for as many steps as it holds, at most
                    weight = min(PRIOR_STEPS, p_tried)
                    tried, reached = tried + weight, reached + weight * p_reached / p_tried
                if p_offered:
                    offered, rows = offered + PRIOR_STEPS, rows + PRIOR_STEPS * p_rows / p_offered
            # evidence short of a step is made up by the level above's chance: a level whose
            # steps have decayed to a trace does not keep their chance at full weight
            filler = max(0.0, MIN_EVIDENCE - tried)
            given = min(1.0, (reached + filler * given) / (tried + filler))
            chance *= given
            out.append((chance, max(rows / offered if offered else UNSEEN_ROWS, 1.0)))
        return out

    def first_bound(self) -> float:
        """An upper confidence bound on the chance that a draft's first token is accepted:
        Wilson's score interval (FIRST_BOUND_Z) over every draft observed, not decayed; 1
        before any. A few misses leave it high (one of four accepted: 0.64), many bring it to
        the observed rate, so a drafter is ruled out only on evidence enough."""
        n = self.drafts
        if not n:
            return 1.0
        z2 = FIRST_BOUND_Z * FIRST_BOUND_Z
        rate = self.firsts / n
        spread = FIRST_BOUND_Z * math.sqrt(rate * (1.0 - rate) / n + z2 / (4.0 * n * n))
        return min(1.0, (rate + z2 / (2.0 * n) + spread) / (1.0 + z2 / n))

    def given(self, k: int) -> tuple[float, float]:
        """(steps that tried depth k + 1, steps that accepted it), this record's alone."""
        return self._at(k)[1:3]

    def _at(self, k: int) -> tuple[float, float, float, float]:
        if k < len(self.offered):
            return self.offered[k], self.tried[k], self.reached[k], self.rows[k]
        return 0.0, 0.0, 0.0, 0.0


class AnswerLengths:
    """The lengths of a method's recent answers (the last ``LENGTHS_KEPT``), for the tokens a
    request can be expected to add: a draft model that must first read a long prompt repays
    that only over the tokens still to come, and the request's budget says little of them
    where answers end early (RAG and QA answers of 20 to 60 tokens under a budget of 128)."""

    def __init__(self):
        self._recent: deque[int] = deque(maxlen=LENGTHS_KEPT)

    def observe(self, length: int) -> None:
        """An answer ended after ``length`` tokens (by its end token, a stop or its budget)."""
        self._recent.append(length)

    def expected_left(self, generated: int, left: int) -> float:
        """The tokens a request that has ``generated`` tokens and may add ``left`` more can be
        counted on to add: the lower quartile of what the recent answers longer than
        ``generated`` added past it (at most ``left`` each); ``left`` where none was longer,
        since nothing seen says that it ends soon. Not their mean: a catch-up is paid before
        any of its return, and an answer shorter than counted on loses it whole where a longer
        one adds only a step's margin a step; and a record of mixed requests (RAG's 20-token
        answers after maths answers of 128) has a mean that long answers pull above most answers.
        On the 1.5B with the 0.5B as draft (Spec-Bench's dev half, greedy, on a Zen 4) the mean
        had the draft read 700-800-token RAG prompts to draft answers of 16-58 tokens. At most
        what the request says of itself (:func:`expected_left_alone`: as many as it has
        written, at least ``UNSEEN_ANSWER``): a record of long answers lags a run of short
        ones (RAG after maths at T = 0.7 on a Zen 5: ``auto``'s draft model read four 700-800-
        token passages to draft answers of 20-52 tokens, each request 0.79-0.90x ``ar``)."""
        alone = expected_left_alone(generated, left)
        longer = sorted(min(n - generated, left) for n in self._recent if n > generated)
        return min(alone, max(1.0, float(longer[len(longer) // 4]))) if longer else alone


def expected_left_alone(generated: int, left: int) -> float:
    """The tokens a request that may add ``left`` more can be expected to add knowing only
    itself (a seeded request, sized without other requests so that it repeats): as many as
    the ``generated`` ones (an answer that has run for n tokens is about as likely to run n
    more as to stop), at least ``UNSEEN_ANSWER``, at most ``left``. Its budget would say
    more: a draft model that reads an 800-token RAG passage to draft a 20-token answer under
    a budget of 128 costs the request a fifth of its time."""
    return float(min(left, max(generated, UNSEEN_ANSWER)))


class StepOverhead:
    """A step's seconds besides its forward (the row-cost curve) and its drafting, as a fixed
    part and a part per draft row: verification, the LM head's rows and the proposer's
    bookkeeping grow with the rows, and so does the draft rows' attention over a long context,
    which the curve (measured after a one-token prompt) does not see. :attr:`line` is a
    least-squares line through the median seconds of each group of row counts over the last
    ``OVERHEAD_STEPS`` steps (medians, so that a step the machine stalled, which on a shared
    machine can take twice a forward, does not set the price of every row; that group's
    median alone while one group has enough steps; nothing before)."""

    def __init__(self):
        #: the recent steps' (row group, draft rows, seconds)
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=OVERHEAD_STEPS)
        #: (fixed seconds, seconds a draft row)
        self.line = (0.0, 0.0)
        self._unfitted = 0  # steps recorded since the line was last fitted

    def observe(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` draft rows took ``seconds`` besides its forward and drafting (a
        negative figure, the curve's noise, counts as 0); the line is refitted every
        ``REFIT_EVERY`` steps."""
        self._recent.append((bisect.bisect_right(ROW_GROUP_STARTS, rows) - 1, rows,
                             max(0.0, seconds)))
        self._unfitted += 1
        if self._unfitted < REFIT_EVERY:
            return
        self._unfitted = 0
        # each group's rows and seconds in one pass, as lists (fmean and median over
        # generators of pairs cost 60 us a step)
        groups: list[tuple[list[int], list[float]]] = [([], []) for _ in ROW_GROUP_STARTS]
        for group, n, rest in self._recent:
            groups[group][0].append(n)
            groups[group][1].append(rest)
        # (mean rows, median seconds, steps) of each group with enough steps
        self.line = _line([(sum(rows) / len(rows), statistics.median(rests), len(rows))
                           for rows, rests in groups if len(rows) >= MIN_GROUP])


def _line(points: Sequence[tuple[float, float, int]]) -> tuple[float, float]:
    """(intercept, slope), both at least 0, of the least-squares line through ``points`` (x,
    y, weight); (the weighted mean of y, 0) for one x; (0, 0) for none."""
    weight = sum(w for _, _, w in points)
    if not weight:
        return 0.0, 0.0
    mean_x = sum(x * w for x, _, w in points) / weight
    mean_y = sum(y * w for _, y, w in points) / weight
    spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    if spread < 1e-9:
        return mean_y, 0.0
    slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread)
    return max(0.0, mean_y - slope * mean_x), slope
