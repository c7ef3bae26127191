"""Draft budgets by goodput: how many draft rows each sequence of a packed forward may send
(the allocation itself, one mechanism for one sequence and for many, is
:func:`specdecode.sizing.allocate`).

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

from collections.abc import Mapping
from dataclasses import dataclass

from specdecode.errors import require
from specdecode.estimates import RowCosts
from specdecode.models.base import Runner
from specdecode.sizing import DRAFT_BUDGETS



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
    #: the runner's forward seconds by rows, where known (None: measured at start-up, once for
    #: a model file, format, CPU and thread count: models/row_costs.py)
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
        from specdecode.models.row_costs import DEFAULT_ROWS, cached_row_costs

        return RowCosts(cached_row_costs(runner, DEFAULT_ROWS))
