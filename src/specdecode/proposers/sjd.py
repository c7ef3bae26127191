"""Speculative Jacobi Decoding: Jacobi iteration with speculative sampling's probabilistic
acceptance, so sampled decoding stays exact (Teng et al., 2024, "Accelerating Auto-regressive
Text-to-Image Generation with Training-free Speculative Jacobi Decoding", ICLR 2025,
arXiv 2410.01699; code tyshiwo1/Accelerating-T2I-AR-with-SJD).

The window of :mod:`~specdecode.proposers.jacobi`, but every guess is *sampled* and keeps the
distribution q it was sampled from:

    update  after a verify step that accepted k tokens, the guess for each position after the
            bonus is drawn afresh from the target's (processed) distribution p at its row of
            that forward, and q <- p is recorded with it (SJD's Jacobi update of the
            unaccepted tokens)
    verify  the chain carries ``Draft.probs`` = the q's, so the verifier applies speculative
            sampling node by node: accept x with probability min(1, p(x) / q(x)), else sample
            from norm(max(0, p - q)) (SJD's acceptance rule, identical to Leviathan et al.'s)

Why this is exact although q was computed under a different prefix (the previous iteration's
guesses): speculative sampling needs only that, given everything the verifier conditions on,
the drafted x was drawn from the recorded q. Each guess is drawn from its own q by the
proposer's own generator, independently of the other guesses and of the verifier's random
numbers, so the rule returns exactly p whatever q is. Padding guesses (the positions no row
predicted yet; SJD initialises them randomly) repeat the newest guess and record q = one-hot:
a deterministic token with a point-mass q is accepted with probability p(x), which is exact too.

Greedy, SJD is Jacobi decoding (the verifier takes argmaxes; the draft carries no probs).
Defaults: W = 16 is the paper's window for images; text accepts far less per step, and on the
dev half the shortest real window (2) wasted fewest rows (docs/parallel-decoding.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.draft import Draft
from specdecode.proposer import Feedback
from specdecode.proposers.jacobi import JacobiProposer, check_window
from specdecode.registry import param, register
from specdecode.sampling import NodeDistributions, sample

#: added to the request seed for the guesses' generator, so they never repeat the verifier's
#: random stream (same offset idea as the draft model's)
GUESS_SEED_OFFSET = 0x5D1


@dataclass(frozen=True)
class SJDConfig:
    window: int = param(2, "W, tokens guessed per step (paper: 16 image tokens; text accepts "
                           "~1 per step, so the fewest rows pay: docs/parallel-decoding.md)",
                        bounds=(1, 64))

    def __post_init__(self):
        check_window(self.window)


@register("sjd", SJDConfig,
          paper="Speculative Jacobi Decoding (Teng et al., ICLR 2025, arXiv 2410.01699)",
          summary="Jacobi window whose guesses are sampled and verified by speculative "
                  "sampling, so sampled output keeps the target's distribution")
class SJDProposer(JacobiProposer):
    samples_drafts = True  # each guess drawn from the last pass
    def __init__(self, config: SJDConfig, runner):
        super().__init__(config, runner)
        #: q per guess: the distribution each guess was drawn from ([V] rows), sampled only
        self.guess_probs: list[torch.Tensor] = []
        self.generator = torch.Generator()

    def start(self, prompt):
        super().start(prompt)
        self.guess_probs = []
        if self.sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed((self.sampling.seed + GUESS_SEED_OFFSET) % 2**63)

    def propose(self, context, budget):
        size = self.window_size(budget)
        tokens = self.padded(context, size)
        if self.sampling.greedy or size == 0:
            return Draft.chain(tokens)
        rows = self.guess_probs[:size]
        # padding guesses are deterministic: a point mass on the repeated token
        pad = torch.zeros(size - len(rows), self.runner.vocab_size, dtype=torch.float64)
        pad[torch.arange(len(pad)), tokens[len(rows):]] = 1.0
        return Draft.chain(tokens, torch.cat([torch.stack(rows), pad]) if rows else pad)

    def observe(self, feedback: Feedback) -> None:
        if self.sampling.greedy:
            super().observe(feedback)
            return
        first = len(feedback.accepted) + 1
        nodes = NodeDistributions(feedback.logits, self.sampling, feedback.context,
                                  self._prompt_len, feedback.draft)
        self.guesses, self.guess_probs = [], []
        for row in range(first, len(feedback.draft) + 1):
            p = nodes.probs(row).double()
            self.guesses.append(self.draw(p))
            self.guess_probs.append(p)

    def draw(self, q: torch.Tensor) -> int:
        """A fresh guess from q (the tests replace this with a wrong rule that must fail)."""
        return sample(q, self.generator)

