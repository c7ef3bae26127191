"""The proposer interface: where draft tokens come from.

A proposer only proposes; it never decides what is accepted. Its lifecycle per request:
``set_sampling(params)`` -> ``start(prompt)`` -> (``propose(context, budget)`` ->
``observe(feedback)``)* -> ``finish(output)``.
State that outlives a request (a global suffix tree, a token-recycling matrix) stays on the
instance, so one proposer serving many requests learns across them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.control import Budget, Controller
from specdecode.draft import Draft
from specdecode.models.base import Runner
from specdecode.sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class Feedback:
    """What one verify step saw: the draft, the target's logits over it, what was accepted."""

    #: committed tokens before this step (prompt + output so far; the last one is the root)
    context: Sequence[int]
    draft: Draft
    #: target logits [1 + n, V]: row 0 after the root, row 1 + i after draft node i
    logits: torch.Tensor
    #: accepted draft node indices, a root-to-leaf path
    accepted: Sequence[int]
    #: tokens committed by this step: the accepted draft tokens and one bonus/recovered token
    tokens: Sequence[int]


class Proposer(ABC):
    """Base class; subclasses set ``method_name`` through the registry decorator."""

    method_name: str = "?"

    def __init__(self, config, runner: Runner):
        self.config = config
        self.runner = runner
        self.sampling: SamplingParams = GREEDY

    def make_controller(self) -> Controller:
        """The budget controller this method uses by default (fixed: the proposer's own limits)."""
        return Controller()

    def set_sampling(self, sampling: SamplingParams) -> None:
        """The request's sampling options, given just before :meth:`start`. Proposers that draw
        their drafts from a model (draft models) sample from the same processed distribution as
        the target, and record it in ``Draft.probs`` for the verifier."""
        self.sampling = sampling

    def start(self, prompt: Sequence[int]) -> None:
        """A request begins with ``prompt`` (token ids)."""

    @abstractmethod
    def propose(self, context: Sequence[int], budget: Budget) -> Draft:
        """Draft continuations of ``context`` (whose last token is the root)."""

    def observe(self, feedback: Feedback) -> None:
        """Learn from one verify step."""

    def finish(self, output: Sequence[int]) -> None:
        """The request ended with ``output`` (the new tokens)."""
