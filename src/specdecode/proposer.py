"""The proposer interface: where draft tokens come from.

A proposer only proposes; it never decides what is accepted. Its lifecycle per request:
``set_sampling(params)`` -> ``couple(generator)`` -> ``start(prompt)`` ->
``observe(prefill feedback)`` -> (``propose(context, budget)`` -> ``observe(feedback)``)* ->
``finish(output)``.
What it reads from the target's passes besides the logits it declares in ``needs``; the engine
asks the runner for it and hands it over in :class:`Feedback`.
State that outlives a request (a global suffix tree, a token-recycling matrix) stays on the
instance, so one proposer serving many requests learns across them.

This module sits below both its users: the engine (which drives a proposer) and every method
in ``specdecode/proposers/`` (each a subclass).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.control import Budget, Controller
from specdecode.draft import Draft
from specdecode.models.base import NOTHING, ForwardOutput, Needs, Runner
from specdecode.sampling import GREEDY, NodeDistributions, SamplingParams


@dataclass(frozen=True)
class Feedback:
    """What one verify step saw: the draft, the target's logits over it, what was accepted.

    The prefill is fed back too, as a step with an empty draft whose context is the prompt
    (``prefill`` True): the target read every prompt token, and its logits row is the one
    after the last."""

    #: committed tokens before this step (prompt + output so far; the last one is the root)
    context: Sequence[int]
    draft: Draft
    #: target logits [1 + n, V]: row 0 after the root, row 1 + i after draft node i
    logits: torch.Tensor
    #: accepted draft node indices, a root-to-leaf path
    accepted: Sequence[int]
    #: tokens committed by this step: the accepted draft tokens and one bonus/recovered token
    tokens: Sequence[int]
    #: the target's pass, with the features the proposer's ``needs`` asked for
    target: ForwardOutput | None = None
    #: whether this is the prefill (nothing was drafted)
    prefill: bool = False

    @property
    def committed_rows(self) -> list[int]:
        """Rows of the target's features (one per token it read) whose tokens are now in the
        cache: every prompt token's after the prefill; the root's and the accepted nodes' after
        a verify step."""
        if self.prefill:
            return list(range(len(self.context)))
        return [0] + [1 + i for i in self.accepted]


def target_argmax(feedback: Feedback, rows: Sequence[int], sampling: SamplingParams,
                  prompt_len: int) -> list[int]:
    """The target's greedy prediction at each logits row in ``rows`` (row 0 = after the root),
    with the request's penalties applied along each node's own path, as the verifier does."""
    if not rows:
        return []
    if not sampling.adjusts_logits:
        return feedback.logits[list(rows)].argmax(-1).tolist()
    nodes = NodeDistributions(feedback.logits, sampling, feedback.context, prompt_len,
                              feedback.draft)
    return [nodes.argmax(row) for row in rows]


class Proposer(ABC):
    """Base class; subclasses set ``method_name`` through the registry decorator."""

    method_name: str = "?"
    #: what :meth:`observe` reads from the target's passes besides the logits
    needs: Needs = NOTHING
    #: whether it sizes its own drafts, pricing each of its parts' drafting (``auto``): no
    #: sizer caps them from outside (the library builds none for it, the server's scheduler
    #: hands it its whole budget), whose one acceptance and drafting time per method would
    #: price a lookup's draft by a draft model's seconds
    prices_own_drafting: bool = False
    #: whether its drafts at T > 0 can carry the distribution they were drawn from
    #: (``Draft.probs``), which the rejection rule verifies: a seeded request's tokens then follow
    #: its draft sizes, so it is sized as if alone (sizing.py), without its drafting's measured
    #: seconds. False where drafts carry none (lookups, Jacobi windows, early exits' chains):
    #: the verifier's deterministic walk commits ``ar``'s tokens whatever was drafted, and the
    #: drafting is priced as timed (an early exit's half-model pass is no free draft)
    samples_drafts: bool = True

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

    def couple(self, generator: torch.Generator) -> None:
        """The request's verifier generator (the engine's), given after :meth:`set_sampling`.
        A proposer that sends a sampled draft without probabilities may draw its tokens with
        the uniforms this generator will draw next, from a copy of its state, never drawing
        from it (drafting/session.py's coupled drafts): the verifier's walk commits ``ar``'s
        tokens whatever was drafted, and accepts a drafted token where the two draws agree.
        Nothing for the rest."""

    def start(self, prompt: Sequence[int]) -> None:
        """A request begins with ``prompt`` (token ids)."""

    def use_reference(self, tokens: Sequence[int]) -> None:
        """Text the request's answer is expected to repeat, given right after :meth:`start`
        (OpenAI's Predicted Outputs: a file to be rewritten with a few changes). A lookup may
        draft from it; the rest ignore it. Drafts are verified as any others: the output does
        not change."""

    @abstractmethod
    def propose(self, context: Sequence[int], budget: Budget) -> Draft:
        """Draft continuations of ``context`` (whose last token is the root)."""

    def draft_seconds(self, context: Sequence[int]) -> tuple[float, float]:
        """What drafting after ``context`` costs by the drafter's own row-cost curve, where it
        has one (a draft model): the seconds it must spend reading committed tokens it has not
        read, beyond what a step right after a draft reads (after steps without a draft, or
        before its first), and the seconds a draft level takes. (0, 0) where nothing is priced
        so: lookups and heads read the target's own passes, and the sizer times their
        drafting."""
        return 0.0, 0.0

    def observe(self, feedback: Feedback) -> None:
        """Learn from one verify step, or from the prefill (``feedback.prefill``)."""

    def finish(self, output: Sequence[int]) -> None:
        """The request ended with ``output`` (the new tokens)."""
