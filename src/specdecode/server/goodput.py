"""Draft budgets by goodput: how many draft rows each sequence of a packed forward may send.

A packed forward of R rows costs c(R) (the runner's row-cost curve, measured at start-up by
:func:`specdecode.models.row_costs.measure_row_costs`). A sequence drafting to depth d commits
1 + q_1 + ... + q_d tokens in expectation, where q_k is the chance that its verify step accepts
k or more draft tokens, and pays the rows its drafts put at depths 1..d. Each step the
scheduler picks every sequence's depth to maximise

    goodput = expected committed tokens of all sequences / (c(rows of all sequences) + overhead)

greedily: the draft levels of all sequences in order of expected tokens per row (a sequence's
levels in depth order), keeping the prefix of that order with the best goodput. Depth 0 for
everyone is plain autoregressive decoding, so speculation is kept only where it is expected to
pay: at low load the drafts stay as the proposers make them; as the batch grows and rows stop
being nearly free, they shrink, down to none (vLLM's and SGLang's users see the opposite:
throughput falling at high batch with drafts kept at full size). Estimates come from the
sequence's own recent verify steps, with its method's as the prior (SmartSpec, Liu et al.
2024, "Optimizing Speculative Decoding for Serving Large Language Models Using Goodput",
chooses one draft length for the batch the same way).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdecode.errors import require
from specdecode.estimates import RowCosts
from specdecode.models.base import Runner

#: how drafts are budgeted: "goodput" (this module) or "full" (as the proposers make them)
DRAFT_BUDGETS = ("goodput", "full")


@dataclass(frozen=True)
class Batching:
    """The server's batching settings (``serve --draft-budget --max-draft-rows
    --prefill-rows``)."""

    #: "goodput": drafts capped each step by expected tokens per second of the forward;
    #: "full": drafts as the proposers make them, at any load
    draft_budget: str = "goodput"
    #: most draft rows one sequence sends in one step (bounds a step's rows and memory)
    max_draft_rows: int = 64
    #: most prompt rows one step prefills, all new sequences together (one part at least)
    prefill_rows: int = 256
    #: the runner's forward seconds by rows, where known (None: measured at start-up)
    row_curve: Mapping[int, float] | None = None

    def __post_init__(self):
        require(self.draft_budget in DRAFT_BUDGETS,
                f"draft budget must be one of {', '.join(DRAFT_BUDGETS)}, got {self.draft_budget!r}")
        require(self.max_draft_rows >= 0, f"max draft rows must be >= 0, got {self.max_draft_rows}")
        require(self.prefill_rows > 0, f"prefill rows must be > 0, got {self.prefill_rows}")

    def row_costs(self, runner: Runner) -> RowCosts | None:
        """The runner's row-cost curve (measured now unless given), where drafts are budgeted by goodput
        over packed forwards (None otherwise)."""
        if self.draft_budget != "goodput" or not runner.packs_calls:
            return None
        if self.row_curve is not None:
            return RowCosts(self.row_curve)
        from specdecode.models.row_costs import measure_row_costs

        return RowCosts(measure_row_costs(runner))


@dataclass(frozen=True)
class Candidate:
    """One decoding sequence of the next forward: its draft levels (chance, rows) in depth
    order, and the seconds its proposer takes to draft at all."""

    levels: Sequence[tuple[float, float]]
    draft_s: float = 0.0


def allocate(candidates: Sequence[Candidate], costs: RowCosts, fixed_rows: int,
             overhead_s: float = 0.0) -> list[tuple[int, int]]:
    """Each candidate's (max depth, max draft rows) for the next forward. ``fixed_rows``: the
    rows it runs anyway (every candidate's root, prompt parts); ``overhead_s``: the step's
    seconds besides the forward."""
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
