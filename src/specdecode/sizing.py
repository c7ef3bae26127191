"""Drafts sized by what a row costs: how deep and how wide each verify step's draft may be.

A forward of R rows costs c(R), the runner's row-cost curve (models/row_costs.py: measured once
per model file, format, CPU and thread count). A draft to depth d commits 1 + q_1 + ... + q_d
tokens in expectation, where q_k is the chance that the verify step accepts k or more draft
tokens, and pays the rows it puts at depths 1..d and the proposer's drafting. A draft model
that did not draft for a while (or has not read the prompt yet) must first read the tokens it
skipped: that catch-up, priced by the draft's own row-cost curve, is paid once and spread over
the request's remaining steps (:func:`catch_up_share`). Each step the draft is capped at the
depth and node count that maximise

    goodput = expected committed tokens / (c(rows) + drafting seconds + the step's other seconds)

The other seconds are learnt as a fixed part and a part a draft row
(:class:`~specdecode.estimates.StepOverhead`): the curve is measured after a one-token prompt,
so a draft row's attention over a long context, like the verification of its token, is priced
there.

:func:`allocate` does this for any number of sequences sharing one forward (the server's packed
forwards, server/goodput.py) and :class:`SequenceSizer` for one request (the library, the CLI
and the bench): one mechanism. Depth 0 is plain autoregressive decoding, so a method whose
drafts do not pay on this model and machine stops drafting. Where the allocation sends a
sequence nothing, :func:`learning_cap`, in every path, sends a small draft so that its method's
estimate can learn (what a draft is worth is learnt only from drafts sent): a request's first
``FIRST_DRAFTS`` drafts are a token each where a token would pay at the upper confidence bound
of its method's first-token acceptance (:func:`first_draft`: sure to be accepted before any
draft; on the prior of a level never drafted, the allocation may send none, and a few early
misses must not stop a good draft model for good, whose explores cost too much to bring it
back); otherwise, after ``EXPLORE_EVERY`` steps or more (doubled for each draft in a row whose
first token was rejected, at most ``EXPLORE_BACKOFF`` times: a method that never pays on a
text costs a quarter as much), once such a draft would cost at most ``EXPLORE_SHARE`` of the
steps since the last, one small draft, so its estimate can recover when the text starts to
repeat (:func:`explore_cap`). A sequence whose last
``DEEPEN_AFTER`` drafts were accepted whole drafts a level deeper than its allocation
(:func:`deepened`), so that a request easier than its method's record learns its deeper levels.
Estimates are each request's own recent steps (:class:`specdecode.estimates.Acceptance`) with
its method's as the prior (SmartSpec, Liu et al. 2024, "Optimizing Speculative Decoding for
Serving Large Language Models Using Goodput", chooses a batch's draft length the same way).

A seeded sampled request of a method whose drafts carry probabilities (the rejection rule's
draws follow the draft: :attr:`~specdecode.proposer.Proposer.samples_drafts`) sizes its drafts
from the curve and its own acceptance alone, without the seconds measured as it runs, without
its method's record of earlier requests and, in a server, without the load, so that it repeats:
its draft sizes, and so its random draws, then depend on nothing that varies between runs (the
tokens it expects to add, over which a catch-up is spread, are as many as it has written:
:func:`~specdecode.estimates.expected_left_alone`; the catch-up is priced as if its draft had
read nothing before the request: :meth:`~specdecode.drafting.session.DraftSession.draft_seconds`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.estimates import (DECAY, Acceptance, AnswerLengths, RowCosts, StepOverhead,
                                  expected_left_alone)
from specdecode.models.base import Runner

#: how drafts are budgeted: "goodput" (this module) or "full" (as the proposers make them)
DRAFT_BUDGETS = ("goodput", "full")
#: draft levels past the deepest its method has drafted that a request may try
EXPLORE_LEVELS = 4
#: steps without a draft after which one small draft is sent anyway (at most EXPLORE_NODES
#: nodes: on the 1.5B model a 5-row forward costs about 1.25 rows, a whole 16-node draft 2.6)
EXPLORE_EVERY = 16
EXPLORE_NODES = 4
#: the most of a request's decoding seconds its explore drafts may cost (their verify rows, the
#: drafting and a draft model's catch-up): a lookup, whose draft costs only its rows, explores
#: every EXPLORE_EVERY idle steps where a few rows cost little more than one; a draft model,
#: whose explore pays for a forward a token and for reading every token it skipped, waits longer
EXPLORE_SHARE = 0.05
#: the most times the steps between explores double: each draft in a row whose first token was
#: rejected doubles them (a method that never pays on this text, Jacobi's guesses on prose,
#: costs a quarter of EXPLORE_SHARE after two, not the whole of it), and an accepted one
#: brings them back to EXPLORE_EVERY
EXPLORE_BACKOFF = 2
#: drafts each request sends a token at a time where the allocation sends none and a token
#: would pay at the upper bound of its method's first-token acceptance (a draft model whose
#: first four drafts missed three times would otherwise never draft again, on any text: its
#: explores cost more than EXPLORE_SHARE where reading a skipped token is dear)
FIRST_DRAFTS = 4
#: drafts accepted whole in a row after which a sequence's draft goes a level deeper than its
#: allocation: a level is learnt only from drafts that reach it, and a request whose drafts
#: are accepted more often than its method's (a predicted output, a file edited again) would
#: otherwise keep its method's record for the levels below the ones it drafts
DEEPEN_AFTER = 4
#: a sequence's own steps that tried a level (decayed) from which they decide whether it
#: deepens to it
DEEPEN_EVIDENCE = 0.5
#: weight of the newest step in the decayed means of drafting and overhead seconds
RECENT = 0.1


@dataclass(frozen=True)
class Candidate:
    """One decoding sequence of the next forward: its draft levels (chance, rows) in depth
    order, the seconds its proposer takes to draft at all, and the seconds each level adds
    (a draft model drafts a token a forward; a lookup's draft costs the same at any depth)."""

    levels: Sequence[tuple[float, float]]
    draft_s: float = 0.0
    level_s: float = 0.0


def allocate(candidates: Sequence[Candidate], costs: RowCosts, fixed_rows: int,
             overhead_s: float = 0.0, row_s: float = 0.0) -> list[tuple[int, int]]:
    """Each candidate's (max depth, max draft rows) for the next forward. ``fixed_rows``: the
    rows it runs anyway (every candidate's root, prompt parts); ``overhead_s``: the step's
    seconds besides the forward; ``row_s``: the seconds each draft row adds besides the
    forward's curve (:class:`~specdecode.estimates.StepOverhead`)."""
    gain = float(len(candidates))
    rows = float(fixed_rows)
    spent = overhead_s
    best, best_at = gain / (costs(rows) + spent), 0
    order: list[tuple[int, int]] = []
    heap = [(-levels[0][0] / levels[0][1], i, 0)
            for i, c in enumerate(candidates) if (levels := c.levels) and levels[0][0] > 0]
    heapq.heapify(heap)
    drafting = set()
    while heap:
        _, i, k = heapq.heappop(heap)
        chance, width = candidates[i].levels[k]
        gain += chance
        rows += width
        if i not in drafting:
            drafting.add(i)
            spent += candidates[i].draft_s
        spent += candidates[i].level_s + row_s * width
        order.append((i, k))
        goodput = gain / (costs(rows) + spent)
        if goodput > best:
            best, best_at = goodput, len(order)
        if k + 1 < len(candidates[i].levels) and candidates[i].levels[k + 1][0] > 0:
            nxt = candidates[i].levels[k + 1]
            heapq.heappush(heap, (-nxt[0] / nxt[1], i, k + 1))
    depth = [0] * len(candidates)
    width = [0.0] * len(candidates)
    for i, k in order[:best_at]:
        depth[i] = k + 1
        width[i] += candidates[i].levels[k][1]
    return [(d, max(d, round(w))) for d, w in zip(depth, width)]


def catch_up_share(catch_up_s: float, tokens_left: int,
                   levels: Sequence[tuple[float, float]]) -> float:
    """A proposer's catch-up seconds (:meth:`~specdecode.proposer.Proposer.draft_seconds`)
    spread over the steps left to a request of ``tokens_left`` tokens: the catch-up is paid
    once, and the draft then drafts from its cache at a step's usual cost (each step commits 1
    plus the chances of ``levels`` in expectation). A draft model far behind a long prompt
    near the end of a short answer does not catch up."""
    steps = tokens_left / (1.0 + sum(chance for chance, _ in levels))
    return catch_up_s / max(1.0, steps)


def method_sizing(method, runner: Runner, draft_budget: str = "goodput") -> DraftSizing | None:
    """The sizing of a registered ``method``'s drafts on ``runner`` for ``draft_budget``; None
    where nothing is sized (``full``; ``ar`` and lossy methods send no drafts to size) or the
    method sizes its own (:attr:`~specdecode.proposer.Proposer.prices_own_drafting`)."""
    require(draft_budget in DRAFT_BUDGETS,
            f"draft_budget must be one of {', '.join(DRAFT_BUDGETS)}, got {draft_budget!r}")
    if (draft_budget != "goodput" or method.lossy or method.name == "ar"
            or method.proposer.prices_own_drafting):
        return None
    from specdecode.models.row_costs import cached_row_costs

    return DraftSizing(RowCosts(cached_row_costs(runner)), method.proposer.samples_drafts)


class DraftTime:
    """A proposer's drafting seconds as a line in the depth it drafts to, fitted by decayed
    least squares (``DECAY`` a step): a fixed part and a part per level."""

    def __init__(self):
        self.sums = [0.0] * 5  # weight, depth, depth^2, seconds, depth x seconds

    def observe(self, depth: int, seconds: float) -> None:
        for i, value in enumerate((1.0, depth, depth * depth, seconds, depth * seconds)):
            self.sums[i] = self.sums[i] * DECAY + value

    @property
    def timed(self) -> bool:
        """Whether a draft has been timed yet."""
        return self.sums[0] > 0

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds a level), neither negative. Where the depths seen do not
        spread enough to tell the two apart, all of it a level: a proposer that drafts a
        token a forward then sizes a shorter draft by what it saves (a lookup's seconds are
        small either way)."""
        n, d, dd, t, dt = self.sums
        if n == 0 or d == 0:
            return 0.0, 0.0
        spread = n * dd - d * d
        if spread <= 0.25 * n * n:  # depths within about one level of each other
            return 0.0, t / d
        per_level = max(0.0, (n * dt - d * t) / spread)
        return max(0.0, (t - per_level * d) / n), per_level

    def priced(self, level_s: float, use_timings: bool = True) -> tuple[float, float]:
        """(fixed seconds, seconds a level) of the next draft: the fitted :meth:`line` once a
        draft has been timed (and ``use_timings``), else ``level_s`` a level (the drafter's
        own row-cost curve's: :meth:`~specdecode.proposer.Proposer.draft_seconds`)."""
        return self.line() if use_timings and self.timed else (0.0, level_s)


class DraftSizing:
    """One method's sizing on one runner, shared by its requests: the runner's row-cost curve,
    the method's acceptance by depth (each new request's prior), its drafting seconds by depth
    and a step's seconds besides the forward and the drafting (a fixed part and a part a draft
    row)."""

    def __init__(self, costs: RowCosts, samples_drafts: bool = True):
        self.costs = costs
        #: the method's drafts can carry probabilities (a seeded request's tokens follow its
        #: draft sizes: :attr:`~specdecode.proposer.Proposer.samples_drafts`)
        self.samples_drafts = samples_drafts
        self.acceptance = Acceptance()
        self.draft_time = DraftTime()
        self.overhead = StepOverhead()
        self.lengths = AnswerLengths()

    def sequence(self, sampling) -> SequenceSizer:
        """The sizer of one request of ``sampling`` (a seeded sampled one whose tokens follow
        its draft sizes is sized repeatably: see the module docstring)."""
        return SequenceSizer(self, repeatable=sampling.repeats and self.samples_drafts)


def deepened(cap: tuple[int, int], acceptance: Acceptance, max_depth: int,
             max_nodes: int) -> tuple[int, int]:
    """An allocation's (depth, rows) ``cap``, a level and a row deeper where its sequence's
    last DEEPEN_AFTER drafts were accepted whole (``acceptance``), its budget allows, and its
    own steps do not say that the next level fails (DEEPEN_EVIDENCE steps or more that tried
    it, accepted less than half the time: a drafter right exactly one token ahead tries its
    second level about once in 50 steps, not once in 5)."""
    depth, rows = cap
    if not depth or acceptance.whole < DEEPEN_AFTER or depth >= max_depth or rows >= max_nodes:
        return cap
    tried, reached = acceptance.given(depth)
    if tried >= DEEPEN_EVIDENCE and reached < tried / 2:
        return cap
    return depth + 1, rows + 1


def explore_due(idle: int, missed: int, every: int = EXPLORE_EVERY) -> bool:
    """Whether a sequence ``idle`` steps without a draft explores: after ``every`` steps,
    doubled for each of the last ``missed`` drafts whose first token was rejected (at most
    EXPLORE_BACKOFF times)."""
    return idle >= every << min(missed, EXPLORE_BACKOFF)


def explore_cap(costs: RowCosts, base_rows: int, max_depth: int, max_nodes: int, idle: int,
                draft_s: float = 0.0, level_s: float = 0.0, every: int = EXPLORE_EVERY,
                row_s: float = 0.0, missed: int = 0) -> tuple[int, int] | None:
    """The small draft (depth, nodes) a sequence that has not drafted for ``idle`` steps sends
    anyway, so that its acceptance estimate can recover (a method's estimate learns only from
    drafts sent: one that fell to nothing would keep it from drafting for good); None before
    it is due (:func:`explore_due`: ``every`` steps, more after ``missed`` drafts missed in a
    row), or while the draft would cost more than EXPLORE_SHARE of the steps: its rows beside
    the ``base_rows`` the forward runs anyway, ``row_s`` a row besides the curve
    (:class:`~specdecode.estimates.StepOverhead`), ``draft_s`` (drafting, a catch-up) and
    ``level_s`` a level."""
    if not explore_due(idle, missed, every):
        return None
    depth, nodes = min(max_depth, EXPLORE_NODES), min(max_nodes, EXPLORE_NODES)
    if depth <= 0:
        return None
    explore_s = (costs(base_rows + nodes) - costs(base_rows) + row_s * nodes + draft_s
                 + level_s * depth)
    return (depth, nodes) if explore_s <= EXPLORE_SHARE * idle * costs(1) else None


def first_draft(costs: RowCosts, base_rows: int, max_depth: int, max_nodes: int,
                tokens_left: int, draft_s: float = 0.0, level_s: float = 0.0,
                catch_up_s: float = 0.0, chance: float = 1.0,
                row_s: float = 0.0) -> tuple[int, int] | None:
    """The one-token draft a request sends for its first FIRST_DRAFTS drafts where the
    allocation sends none, if a token accepted with ``chance`` (an upper bound on its method's
    first-token acceptance, :meth:`~specdecode.estimates.Acceptance.first_bound`; 1 before any
    draft) would pay for itself: what its drafts are worth is learnt only from drafts sent, and
    on the prior of a level never drafted (``UNSEEN_RATE``) a draft model whose token costs a
    large share of a target forward would never send its first (the 0.5B drafting for the 1.5B
    on two AVX2 cores: 40%, while it agrees with the 1.5B about three times in four). Its
    price: its row beside the ``base_rows`` and ``row_s`` (what a draft row adds besides the
    curve, :class:`~specdecode.estimates.StepOverhead`), ``draft_s`` (drafting), a level, and its
    ``catch_up_s`` spread over the ``tokens_left`` as the allocation spreads it
    (:func:`catch_up_share`); sent where that is less than ``chance`` one-row forwards, which
    the token it commits when accepted saves (so a draft model behind a long prompt near the
    end of a request does not try: reading it would not be repaid). None otherwise, or where
    nothing may be drafted."""
    if min(max_depth, max_nodes) <= 0:
        return None
    first_s = (costs(base_rows + 1) - costs(base_rows) + row_s + draft_s + level_s
               + catch_up_share(catch_up_s, tokens_left, [(1.0, 1.0)]))
    return (1, 1) if first_s < chance * costs(1) else None


def learning_cap(costs: RowCosts, base_rows: int, max_depth: int, max_nodes: int,
                 own_drafts: int, record: Acceptance, idle: int, tokens_left: int,
                 draft_s: float = 0.0, level_s: float = 0.0, catch_up_s: float = 0.0,
                 every: int = EXPLORE_EVERY, row_s: float = 0.0,
                 missed: int = 0) -> tuple[int, int] | None:
    """The small draft a sequence sends where the allocation sends none, so that its method's
    estimate can learn: a first draft (:func:`first_draft`) while the request has sent
    (``own_drafts``) fewer than FIRST_DRAFTS drafts and one pays at the upper bound of the
    first-token acceptance of ``record`` (its method's drafts, the request's among them), else
    an explore (:func:`explore_cap`, after ``idle`` steps without a draft and more after
    ``missed`` drafts missed in a row, the catch-up paid whole), each draft row priced
    ``row_s`` besides the curve; None where neither is due.
    Every path sizes through it: a request's :class:`SequenceSizer`, the server's scheduler
    and ``auto``'s parts."""
    if own_drafts < FIRST_DRAFTS:
        first = first_draft(costs, base_rows, max_depth, max_nodes, tokens_left, draft_s,
                            level_s, catch_up_s, record.first_bound(), row_s)
        if first is not None:
            return first
    return explore_cap(costs, base_rows, max_depth, max_nodes, idle, draft_s + catch_up_s,
                       level_s, every, row_s, missed)


class SequenceSizer:
    """Caps one request's drafts, step by step (the engine asks :meth:`cap` before drafting
    and tells :meth:`observe` after verifying)."""

    def __init__(self, sizing: DraftSizing, repeatable: bool = False):
        self.sizing = sizing
        #: sized from the curve and its own acceptance only (no seconds, no method record)
        self.repeatable = repeatable
        self.acceptance = Acceptance()
        #: steps since the last draft sent
        self.idle = 0
        #: the catch-up seconds of the draft last allowed (0: it read nothing it had skipped)
        self.catch_up_s = 0.0

    def cap(self, max_depth: int, max_nodes: int, catch_up_s: float = 0.0,
            level_s: float = 0.0, tokens_left: int = 1, generated: int = 0) -> tuple[int, int]:
        """(max depth, max draft nodes) for the next draft, within the budget's.
        ``catch_up_s``, ``level_s``: the proposer's drafting by its drafter's row-cost curve
        (:meth:`~specdecode.proposer.Proposer.draft_seconds`). The catch-up is priced by
        :func:`catch_up_share` over the tokens the request can be expected to add after the
        ``generated`` ones, at most its ``tokens_left``, by its method's recent answers and
        its own length (:class:`~specdecode.estimates.AnswerLengths`; an explore draft pays it
        whole); the seconds a level, until the proposer's drafting has been timed. A seeded
        sampled request reads neither timings nor other answers (it expects to add as many
        tokens as it has written, :func:`~specdecode.estimates.expected_left_alone`)."""
        sizing = self.sizing
        self.catch_up_s = 0.0
        if catch_up_s:  # (computed only where a catch-up is priced)
            tokens_left = (expected_left_alone(generated, tokens_left) if self.repeatable
                           else sizing.lengths.expected_left(generated, tokens_left))
        prior = None if self.repeatable else sizing.acceptance
        seen = max(len(self.acceptance.offered), len(prior.offered) if prior else 0)
        deepest = min(max_depth, max_nodes, seen + EXPLORE_LEVELS)
        if deepest <= 0:
            return 0, 0
        draft_s, level_s = sizing.draft_time.priced(level_s, use_timings=not self.repeatable)
        levels = self.acceptance.levels(deepest, prior)
        candidate = Candidate(levels, draft_s + catch_up_share(catch_up_s, tokens_left, levels),
                              level_s)
        overhead_s, row_s = (0.0, 0.0) if self.repeatable else sizing.overhead.line
        depth, rows = deepened(allocate([candidate], sizing.costs, 1, overhead_s, row_s)[0],
                               self.acceptance, max_depth, max_nodes)
        if not depth:
            depth, rows = learning_cap(sizing.costs, 1, max_depth, max_nodes,
                                       self.acceptance.drafts,
                                       self.acceptance if prior is None else prior,
                                       self.idle, tokens_left, draft_s, level_s,
                                       catch_up_s, row_s=row_s,
                                       missed=self.acceptance.missed) or (0, 0)
        if depth:
            self.catch_up_s = catch_up_s
        return depth, min(rows, max_nodes)

    def finish(self, length: int) -> None:
        """The request ended (by an end token, a stop or its budget) after ``length`` tokens."""
        self.sizing.lengths.observe(length)

    def observe(self, draft: Draft, accepted: int, draft_s: float, step_s: float) -> None:
        """After a verify step: its draft, the draft tokens accepted, the seconds drafting took
        and the whole step's."""
        sizing = self.sizing
        if len(draft):
            self.idle = 0
            self.acceptance.observe(draft, accepted)
            sizing.acceptance.observe(draft, accepted)
            if not self.catch_up_s:  # a step that read skipped tokens is no sample of drafting
                sizing.draft_time.observe(draft.max_depth, draft_s)
        else:
            self.idle += 1
        sizing.overhead.observe(len(draft), step_s - sizing.costs(1 + len(draft)) - draft_s)
