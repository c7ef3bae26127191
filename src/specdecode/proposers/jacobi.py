"""Jacobi decoding: the target refines a window of guessed future tokens as a fixed-point
iteration, with no draft model (Santilli et al., 2023, "Accelerating Transformer Inference for
Translation via Parallel Decoding", ACL 2023, arXiv 2305.10427; the baseline of Lookahead
decoding, Fu et al., 2024, arXiv 2402.02057).

Greedy decoding is the fixed point of ``y_j = argmax p(. | prefix, y_1 .. y_{j-1})`` for every
position j at once. One Jacobi iteration applies that update to a window of W guesses in one
forward; here the forward is the engine's verify step, so the window is a chain draft:

    window  y_1 .. y_W            guesses for the W positions after the root
    forward logits rows 0 .. W    row j predicts position j + 1 (row 0 sits on the root)
    verify  y_1 .. y_k accepted, the bonus b = argmax row k commits position k + 1
    update  next window = argmax rows k+1 .. W   (positions k+2 .. W+1: the Jacobi update
            of the guesses after the bonus), then padding up to W

Worked example, W = 3, root r, window (a, x, c); the target predicts a after r, b after a, c
after x and d after c: a is accepted, b is the bonus (x was wrong), and the next window is
(c, d, d): row 2 predicted c for the position after b (it saw x there, so c is a guess), row 3
predicted d, and the window is padded with its last guess.

The update needs nothing but ``Feedback.logits``; Jacobi keeps no state between requests.
Padding: Jacobi's initial guesses are arbitrary (Santilli et al. use pad tokens, Lookahead random
prompt tokens); we repeat the newest guess (the root before any forward), which keeps the draft a
deterministic function of the context. At T > 0 the draft is deterministic, so the verifier
samples the target at each node (ancestral sampling): exact, and a seeded run gives ``ar``'s
tokens. ``sjd`` is this window with speculative sampling's probabilistic acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.proposer import Feedback, Proposer, target_argmax
from specdecode.registry import param, register

#: longest window accepted; a window is one chain of verify rows, and rows cost target work
MAX_WINDOW = 64


def check_window(window: int) -> None:
    require(isinstance(window, int) and 1 <= window <= MAX_WINDOW,
            f"window must be an integer in 1..{MAX_WINDOW} (guessed tokens per step), "
            f"got {window!r}")


@dataclass(frozen=True)
class JacobiConfig:
    window: int = param(2, "W, tokens guessed and refined per step (one chain of verify rows); "
                           "on text Jacobi accepts barely more than one token per step "
                           "whatever W, so the smallest real window is the fastest "
                           "(docs/parallel-decoding.md has the sweep)", bounds=(1, 64))

    def __post_init__(self):
        check_window(self.window)


@register("jacobi", JacobiConfig,
          paper="Jacobi decoding (Santilli et al., ACL 2023, arXiv 2305.10427)",
          summary="the target refines a window of guessed future tokens by fixed-point "
                  "iteration, one verify step per iteration; no draft model")
class JacobiProposer(Proposer):
    samples_drafts = False  # guesses, not draws (sjd samples them)
    def __init__(self, config: JacobiConfig, runner):
        super().__init__(config, runner)
        #: guesses for the positions after the root, refined by every verify step
        self.guesses: list[int] = []
        self._prompt_len = 0

    def start(self, prompt):
        self.guesses = []
        self._prompt_len = len(prompt)

    def window_size(self, budget) -> int:
        return max(0, min(self.config.window, budget.max_depth, budget.max_nodes))

    def padded(self, context, size: int) -> list[int]:
        """The window's guesses, padded with the newest guess (or the root) up to ``size``."""
        guesses = self.guesses[:size]
        fill = guesses[-1] if guesses else int(context[-1])
        return guesses + [fill] * (size - len(guesses))

    def propose(self, context, budget):
        return Draft.chain(self.padded(context, self.window_size(budget)))

    def observe(self, feedback: Feedback) -> None:
        # rows k+1 .. n predict the positions after the bonus token: the Jacobi update
        first = len(feedback.accepted) + 1
        rows = range(first, len(feedback.draft) + 1)
        self.guesses = target_argmax(feedback, rows, self.sampling, self._prompt_len)
