"""Superposed Decoding: k drafts from one forward per token (Shen et al., 2024, "Superposed
Decoding: Multiple Generations from a Single Autoregressive Inference Pass", arXiv 2405.18400).

Lossy by design: the drafts are not samples of the model, and the answer is not ``ar``'s. It is
for autocomplete, where several alternatives for the price of one are worth more than one exact
continuation; one answer alone is no faster than ``ar``.

Each step feeds ONE row whose input embedding is the superposition of the live drafts' last
tokens, ``sum_i w_i E(x_i)`` with ``w`` the drafts' normalised probabilities, so all drafts share
one KV cache. The model's ``n_token_sample`` most likely next tokens are scored for every draft
by interpolating geometrically with that draft's n-gram distribution,
``log p = (1 - alpha) log p_model + alpha log p_ngram``, where ``p_ngram`` mixes the orders
``2..6`` with ``ngram_weights``. The ``n_drafts`` best of the ``n_drafts x
n_token_sample`` extensions by summed score are the next drafts (beam-style); a draft that ends
with end-of-sequence leaves the beam as finished.

Difference from the paper: its n-gram models come from a large corpus (RedPajama); none ships
here, so they are counted from the request's prompt (in-context n-grams, as prompt lookup
does). Such n-grams are sparse, so ``p_ngram`` is backed off to the model's distribution
(``NGRAM_SHARE`` of the n-grams', the rest the model's), and a context matching no n-gram
keeps the model's log-probability alone, where the paper penalises it: against a
prompt's few n-grams the penalty would fall on nearly every step and only favour copying. Defaults are the paper's (``params/*.json`` of its code): 3 drafts, 9 tokens, alpha
0.54, weights 0.01/0.04/0.15/0.18/0.12. The answer (what ``generate`` returns) is the draft with
the best summed score; :meth:`Superposed.alternatives` returns all ``n_drafts``. Decoding stops
at ``max_new_tokens`` or once a finished draft outranks every live one (beam search's rule).
Needs the native runner (it feeds embeddings, not token ids).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specdecode.engine import GenerationStats
from specdecode.errors import require
from specdecode.lossy.base import LossyMethod
from specdecode.models.base import Runner
from specdecode.models.kv_cache import AttentionPlan
from specdecode.registry import param, register
from specdecode.sampling import SamplingParams


#: share of the in-context n-gram distribution in ``p_ngram`` (the rest is the model's):
#: an even back-off, so a token the prompt never continued with loses at most log 2 * alpha
NGRAM_SHARE = 0.5


@dataclass(frozen=True)
class SuperposedConfig:
    n_drafts: int = param(3, "drafts kept and superposed at each step (paper: 3)", bounds=(1, 16))
    n_token_sample: int = param(9, "the model's most likely next tokens each draft may extend "
                                   "with (paper: 9)", bounds=(1, 64))
    alpha: float = param(0.54, "weight of the n-gram log-probability in the geometric "
                               "interpolation (paper: 0.54)", bounds=(0.0, 1.0))
    ngram_weights: tuple = param((0.01, 0.04, 0.15, 0.18, 0.12),
                                 "mixture weights of the 2..6-gram distributions (paper's)")

    def __post_init__(self):
        require(self.n_drafts >= 1, f"n_drafts must be >= 1, got {self.n_drafts}")
        require(self.n_token_sample >= 1,
                f"n_token_sample must be >= 1, got {self.n_token_sample}")
        require(0.0 <= self.alpha < 1.0, f"alpha must be in [0, 1), got {self.alpha}")
        require(len(self.ngram_weights) >= 1 and all(w >= 0 for w in self.ngram_weights)
                and sum(self.ngram_weights) > 0,
                f"ngram_weights must be non-negative with a positive sum, got {self.ngram_weights}")


class NgramTable:
    """Counts of the n-grams (n = 2 .. len(weights) + 1) of a token sequence, and the mixed
    distribution of the next token after a context. N-grams holding a token of ``skip`` are
    not counted: a chat-templated prompt ends its user turn with end-of-sequence, which would
    otherwise teach every draft to stop where the question did."""

    def __init__(self, tokens: Sequence[int], weights: Sequence[float],
                 skip: frozenset[int] = frozenset()):
        self.weights = tuple(weights)
        self.counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        tokens = list(tokens)
        for n in range(2, len(self.weights) + 2):
            for i in range(len(tokens) - n + 1):
                gram = tokens[i:i + n]
                if not skip.intersection(gram):
                    self.counts[tuple(gram[:-1])][gram[-1]] += 1

    def probs(self, context: Sequence[int]) -> dict[int, float] | None:
        """{token: mixed probability} after ``context``; None when no order matches."""
        mixed: dict[int, float] = defaultdict(float)
        total = 0.0
        for order, weight in enumerate(self.weights, start=1):  # context of `order` tokens
            if len(context) < order or weight == 0:
                continue
            following = self.counts.get(tuple(context[-order:]))
            if not following:
                continue
            size = sum(following.values())
            for token, count in following.items():
                mixed[token] += weight * count / size
            total += weight
        if total == 0:
            return None
        return {token: p / total for token, p in mixed.items()}


@dataclass
class _Draft:
    tokens: list[int]
    #: summed interpolated log-probability of ``tokens``
    score: float



@register("superposed", SuperposedConfig,
          paper="Superposed Decoding (Shen et al., 2024; arXiv 2405.18400)",
          summary="LOSSY, for autocomplete: k drafts from one forward per token over the "
                  "superposition of their last tokens' embeddings, n-gram filtered; the answer "
                  "is the best draft", lossy=True)
class Superposed(LossyMethod):
    def __init__(self, config: SuperposedConfig, runner: Runner):
        from specdecode.models.llama import LlamaRunner

        require(isinstance(runner, LlamaRunner),
                "superposed feeds input embeddings, which only the native runner takes; use "
                "--runner native (a Llama-family model)")
        super().__init__(config, runner)

    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               eos: frozenset[int], stats: GenerationStats) -> Iterator[list[int]]:
        ranked = self.run_drafts(prompt_ids, max_new_tokens, eos, stats)
        yield ranked[0].tokens

    def alternatives(self, prompt_ids: Sequence[int], max_new_tokens: int,
                     eos_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """The ``n_drafts`` drafts, best first (by summed score)."""
        drafts = self.run_drafts(prompt_ids, max_new_tokens, frozenset(eos_token_ids),
                                 GenerationStats(), to_the_end=True)
        return [d.tokens for d in drafts[:self.config.n_drafts]]

    @torch.inference_mode()
    def run_drafts(self, prompt_ids: Sequence[int], max_new_tokens: int, eos: frozenset[int],
                   stats: GenerationStats, to_the_end: bool = False) -> list[_Draft]:
        """Every draft at the end (live and finished), best summed score first. ``to_the_end``:
        go on to ``max_new_tokens`` even once a finished draft leads."""
        c, runner = self.config, self.runner
        table = NgramTable(prompt_ids, c.ngram_weights, eos)
        prompt = list(prompt_ids)
        logp = torch.log_softmax(runner.prefill(prompt).logits[0].float(), -1)
        stats.target_forwards += 1
        live, finished = [_Draft([], 0.0)], []
        while True:
            live, done = self._extend(live, logp, table, prompt, eos)
            finished += done
            stats.accepted_lengths.append(1)
            longest = max(len(d.tokens) for d in live + finished)
            # a finished draft's score stays, a live one's only falls: once a finished draft
            # leads, it is the answer (beam search's early stop)
            best_live = max((d.score for d in live), default=-math.inf)
            leads = finished and max(d.score for d in finished) >= best_live
            if longest >= max_new_tokens or not live or (leads and not to_the_end):
                break
            logp = self._superposed_step(live)
            stats.target_forwards += 1
        return sorted(live + finished, key=lambda d: -d.score)

    def _superposed_step(self, live: list[_Draft]) -> torch.Tensor:
        """One forward of the drafts' superposed last tokens; log-probabilities [V]."""
        loop = self.runner.layer_loop
        scores = torch.tensor([d.score for d in live])
        weights = torch.softmax(scores, 0)  # the drafts' normalised probabilities
        last = torch.tensor([d.tokens[-1] for d in live])
        x = (weights[:, None] * loop.embedding.rows(last)).sum(0, keepdim=True)  # [1, H]
        loop.cache.check_room(1, "one superposed token")
        hidden, _ = loop.run_embedded(x, AttentionPlan.chain(loop.cache.length, 1))
        loop.cache.append(1)
        return torch.log_softmax(loop.logits(hidden)[0], -1)

    def _extend(self, live: list[_Draft], logp: torch.Tensor, table: NgramTable,
                prompt: list[int], eos: frozenset[int]
                ) -> tuple[list[_Draft], list[_Draft]]:
        """The next live drafts and those that just finished."""
        c = self.config
        top = torch.topk(logp, min(c.n_token_sample, len(logp)))
        candidates = list(zip(top.indices.tolist(), top.values.tolist()))
        scored = []
        for draft in live:
            ngram = table.probs(prompt + draft.tokens)
            for token, model_logp in candidates:
                if ngram is None:  # no order matches: the model alone
                    step = model_logp
                else:  # the n-gram distribution backed off to the model's
                    p = NGRAM_SHARE * ngram.get(token, 0.0) + (1 - NGRAM_SHARE) * math.exp(model_logp)
                    step = (1 - c.alpha) * model_logp + c.alpha * math.log(p)
                scored.append(_Draft(draft.tokens + [token], draft.score + step))
        scored.sort(key=lambda d: -d.score)
        chosen = scored[:c.n_drafts]
        return ([d for d in chosen if d.tokens[-1] not in eos],
                [d for d in chosen if d.tokens[-1] in eos])
