"""Budget controllers: how much to speculate each verify step.

The engine asks the controller for a :class:`Budget` before every proposal and caps it by the
tokens left and the room left in the context; the proposer may draft less. Controllers learn from
:meth:`Controller.observe`, never from the loop itself.

Some controllers decide *inside* the drafting loop, token by token (a confidence threshold,
SpecDec++): their budget carries ``keep_drafting``, which a proposer that drafts one token at a
time (a draft model) calls after each drafted token with a :class:`DraftSignal`; drafting stops
at the first ``False`` (the token just drafted is kept: it is already paid for). Proposers that
draft all at once ignore it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftSignal:
    """What a token-by-token proposer knows about the token it has just drafted."""

    #: depth of the drafted token: 1 = the first draft token of this step
    depth: int
    #: the proposer's probability of the drafted token, q(x) (its max probability when greedy)
    prob: float
    #: the draft model's last hidden state [H] at the input that produced this token's
    #: distribution (the previous draft token; the root at depth 1), for SpecDec++'s head
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class Budget:
    #: deepest draft node allowed (tokens that can be accepted in one step)
    max_depth: int
    #: most draft nodes in one verify step (tree size)
    max_nodes: int
    #: asked after each drafted token whether to draft another; None = draft up to max_depth
    keep_drafting: Callable[[DraftSignal], bool] | None = dataclasses.field(
        default=None, compare=False)
    #: tokens the request may still commit (what a proposer that prices its own parts spreads
    #: a draft model's catch-up over, after its own estimate of those it will); None: not known
    tokens_left: float | None = dataclasses.field(default=None, compare=False)

    def capped(self, max_depth: int) -> Budget:
        return dataclasses.replace(self, max_depth=min(self.max_depth, max_depth))

    def capped_nodes(self, max_nodes: int) -> Budget:
        """At most ``max_nodes`` draft nodes (so at most that deep too)."""
        return dataclasses.replace(self, max_depth=min(self.max_depth, max_nodes),
                                   max_nodes=min(self.max_nodes, max_nodes))


class Controller:
    """Fixed budget: the proposer's own limits decide (the default for model-free proposers)."""

    def __init__(self, max_depth: int = 64, max_nodes: int = 128):
        self.fixed = Budget(max_depth, max_nodes)

    def budget(self) -> Budget:
        return self.fixed

    def observe(self, draft_size: int, accepted: int) -> None:
        """Feedback after each verify step; the fixed controller ignores it."""


class HeuristicLength(Controller):
    """The +2/-1 schedule of ``transformers``' assisted generation
    (``num_assistant_tokens_schedule="heuristic"``): after a step whose every draft token was
    accepted, draft 2 more next time; otherwise 1 fewer (at least 1). Per request, like
    transformers' "heuristic_transient"; ``longest`` caps the growth that transformers leaves
    unbounded, so one lucky stretch cannot make every later draft long."""

    def __init__(self, start: int = 5, longest: int = 16, max_nodes: int = 128):
        super().__init__(start, max_nodes)
        self.length = start
        self.longest = longest

    def budget(self) -> Budget:
        return Budget(self.length, self.fixed.max_nodes)

    def observe(self, draft_size: int, accepted: int) -> None:
        if draft_size == 0:
            return  # nothing was drafted (end of the request): no evidence either way
        if accepted == draft_size:
            self.length = min(self.length + 2, self.longest)
        else:
            self.length = max(1, self.length - 1)


class ConfidenceStop(Controller):
    """Stop drafting after a token whose draft probability is below ``threshold``
    (``transformers``' ``assistant_confidence_threshold``, default 0.4; its ROC-based retuning
    of the threshold during generation is not reproduced: the threshold stays fixed)."""

    def __init__(self, threshold: float = 0.4, max_depth: int = 16, max_nodes: int = 128):
        super().__init__(max_depth, max_nodes)
        self.threshold = threshold
        self.fixed = Budget(max_depth, max_nodes, self.keep_drafting)

    def keep_drafting(self, signal: DraftSignal) -> bool:
        return signal.prob >= self.threshold


class AcceptanceHead(torch.nn.Module):
    """SpecDec++'s acceptance-prediction head: residual blocks ``x + SiLU(W x)`` then one logit,
    on the draft model's last hidden state at a draft token; sigmoid = the predicted probability
    that the target accepts that token (given its draft prefix was accepted). The paper's head
    ends in two logits; their difference is this one logit."""

    def __init__(self, hidden_size: int, num_blocks: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Linear(hidden_size, hidden_size) for _ in range(num_blocks))
        self.out = torch.nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> acceptance logits [...]"""
        for block in self.blocks:
            hidden = hidden + torch.nn.functional.silu(block(hidden))
        return self.out(hidden).squeeze(-1)


class SpecDecPlusPlus(Controller):
    """SpecDec++ (Huang et al., 2024): stop when the predicted probability that at least one
    drafted token is rejected, ``1 - prod_i P(accept x_i)``, passes ``threshold`` (paper: 0.3;
    larger = longer drafts), within ``[min_depth, max_depth]`` (paper: 2..20).

    P(accept x_i) comes from :class:`AcceptanceHead` on the draft's hidden state *at* x_i, which
    is the hidden state that produces the next token's distribution: so at depth k the signal
    scores x_(k-1), and depth 1 (whose input is the already-verified root) adds nothing, exactly
    as the paper's implementation does.
    """

    def __init__(self, head: AcceptanceHead, threshold: float = 0.3, min_depth: int = 2,
                 max_depth: int = 16, max_nodes: int = 128):
        super().__init__(max_depth, max_nodes)
        self.head = head.eval()
        self.threshold = threshold
        self.min_depth = min_depth
        self.fixed = Budget(max_depth, max_nodes, self.keep_drafting)
        self._all_accepted = 1.0  # predicted P(every token drafted so far is accepted)

    @torch.inference_mode()
    def keep_drafting(self, signal: DraftSignal) -> bool:
        if signal.depth == 1:
            self._all_accepted = 1.0
        elif signal.hidden is not None:
            self._all_accepted *= float(torch.sigmoid(self.head(signal.hidden.float())))
        return signal.depth < self.min_depth or 1.0 - self._all_accepted <= self.threshold
