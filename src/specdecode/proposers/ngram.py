"""Prompt lookup decoding: the longest n-gram that ends the context, found earlier in it,
proposes the tokens that followed it (Saxena, 2023, "Prompt Lookup Decoding"; the
``prompt_lookup_num_tokens`` mode of ``transformers``; vLLM's ``ngram`` proposer).

Tie-breaks, pinned by the tests: the longest n-gram wins; among matches of that length the most
recent one wins (recent text predicts the continuation best, e.g. a list being repeated);
a match whose continuation is empty (the suffix itself) is skipped. A request's predicted output
(OpenAI's ``prediction``) is searched before the context at each length: the client says the
answer repeats it.

Worked example, context ``[5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 7]`` with max_ngram 3: the 3-gram
``5 6 7`` occurs at 0 and 4; the most recent, at 4, proposes ``8, 5, 6, ...``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.proposer import Proposer
from specdecode.registry import param, register

NO_TOKENS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = param(3, "longest n-gram matched (transformers' default is 2; 3 finds "
                              "fewer but better matches on Spec-Bench)", bounds=(1, 16))
    min_ngram: int = param(1, "shortest n-gram matched", bounds=(1, 16))
    num_speculative_tokens: int = param(3, "draft length (transformers' default is 10; 3 was "
                                           "the fastest on the CPU kernel runner, "
                                           "docs/bench.md)", bounds=(1, 64))

    def __post_init__(self):
        require(self.min_ngram >= 1, f"min_ngram must be >= 1, got {self.min_ngram}")
        require(self.max_ngram >= self.min_ngram,
                f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})")
        require(self.num_speculative_tokens >= 1,
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")


def lookup(context: np.ndarray, max_ngram: int, min_ngram: int, length: int,
           reference: np.ndarray = NO_TOKENS) -> list[int]:
    """The continuation of the longest, most recent earlier match of the context's suffix; at
    each length, a match in ``reference`` (text the answer is expected to repeat) first."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        suffix = context[n_ctx - n:]
        for text in (reference, context):
            if len(text) <= n:
                continue
            # windows[i] = text[i:i+n] for every start i with a token after its window (in
            # the context, every window before the suffix itself)
            windows = np.lib.stride_tricks.sliding_window_view(text[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return text[start:start + length].tolist()
    return []


@register("ngram", NgramConfig, paper="Prompt Lookup Decoding (Saxena, 2023)",
          summary="longest matching n-gram in the context proposes what followed it (chain)")
class NgramProposer(Proposer):
    samples_drafts = False  # prompt lookups
    def __init__(self, config, runner):
        super().__init__(config, runner)
        self.reference = NO_TOKENS

    def start(self, prompt):
        self.reference = NO_TOKENS

    def use_reference(self, tokens):
        """A predicted output (:meth:`~specdecode.proposer.Proposer.use_reference`): matched
        before the context at each n-gram length."""
        self.reference = np.asarray(tokens, dtype=np.int64)

    def propose(self, context, budget):
        length = min(self.config.num_speculative_tokens, budget.max_depth)
        if length <= 0:
            return Draft.empty()
        tokens = lookup(np.asarray(context, dtype=np.int64), self.config.max_ngram,
                        self.config.min_ngram, length, self.reference)
        return Draft.chain(tokens)
