"""Sampling options, applied to the target's logits at every draft node with that node's context.

The options keep the meanings users know from ``transformers`` and the OpenAI API, applied in
the order both use: penalties, then temperature, then top-k, top-p and min-p.

- ``repetition_penalty`` (CTRL / transformers): every token present anywhere in the context
  (prompt and output) has its logit divided by the penalty if positive, multiplied if negative.
- ``presence_penalty`` / ``frequency_penalty`` (OpenAI): subtract ``presence`` once and
  ``frequency`` per occurrence, counting the generated tokens only (as OpenAI and vLLM do).

A draft node deep in a tree is penalised with the committed tokens *plus the path to it*, so
every node sees exactly the distribution plain decoding would have used there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.draft import Draft
from specdecode.errors import require


@dataclass(frozen=True)
class SamplingParams:
    #: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature)
    temperature: float = 0.0
    #: keep the k most likely tokens; 0 = off
    top_k: int = 0
    #: nucleus: keep the smallest set whose probability reaches top_p; 1.0 = off
    top_p: float = 1.0
    #: drop tokens less likely than min_p times the most likely one; 0.0 = off
    min_p: float = 0.0
    #: > 1 discourages tokens already in the context; 1.0 = off
    repetition_penalty: float = 1.0
    #: subtracted once from the logit of every token already generated; 0.0 = off
    presence_penalty: float = 0.0
    #: subtracted per occurrence of a token already generated; 0.0 = off
    frequency_penalty: float = 0.0
    #: seeds this request's own random generator; None = nondeterministic
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value),
                f"{name} must be a finite number, got {value!r}",
            )
        require(self.temperature >= 0,
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        require(isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
                and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        require(self.repetition_penalty > 0,
                f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty}")
        require(-2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2] (OpenAI's range), got {self.presence_penalty}")
        require(-2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2] (OpenAI's range), got {self.frequency_penalty}")
        require(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
                f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def generator(self) -> torch.Generator:
        """One generator per request: seeded runs repeat, whatever other requests do."""
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


GREEDY = SamplingParams()


def _apply_penalties(logits: torch.Tensor, params: SamplingParams, context: Sequence[int],
                     prompt_len: int, draft: Draft) -> torch.Tensor:
    """logits [1 + n, V]; row r is penalised with the committed context plus row r's path."""
    rows, vocab = logits.shape
    # paths[r] = draft tokens from the root down to row r (row 0 = root: empty path)
    path_tokens = torch.zeros(rows, vocab, dtype=torch.float32)
    for i, parent in enumerate(draft.parents):
        if parent >= 0:
            path_tokens[i + 1] = path_tokens[parent + 1]
        path_tokens[i + 1, draft.tokens[i]] += 1
    # context ends with the root (committed, KV not yet cached): it counts like any output
    output = torch.bincount(torch.tensor(context[prompt_len:], dtype=torch.long),
                            minlength=vocab)[:vocab].float()
    output_counts = output.unsqueeze(0) + path_tokens  # [rows, V]
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(context[:prompt_len]), dtype=torch.long)] = True
        present = seen.unsqueeze(0) | (output_counts > 0)
        penalised = torch.where(logits > 0, logits / params.repetition_penalty,
                                logits * params.repetition_penalty)
        logits = torch.where(present, penalised, logits)
    if params.frequency_penalty or params.presence_penalty:
        logits = (logits - params.frequency_penalty * output_counts
                  - params.presence_penalty * (output_counts > 0).float())
    return logits


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on logits [rows, V]; removed tokens get -inf."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        threshold = params.min_p * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def processed_logits(logits: torch.Tensor, params: SamplingParams, context: Sequence[int],
                     prompt_len: int, draft: Draft) -> torch.Tensor:
    """Penalised logits [1 + n, V] (greedy decodes their argmax)."""
    if params.has_penalties:
        return _apply_penalties(logits, params, context, prompt_len, draft)
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams, context: Sequence[int],
                 prompt_len: int, draft: Draft) -> torch.Tensor:
    """The target's sampling distribution [1 + n, V] at the root and at every draft node."""
    logits = processed_logits(logits.float(), params, context, prompt_len, draft)
    return _filter(logits, params).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw from probs [V] using exactly one uniform number, so a seeded run draws
    the same random stream whatever the drafts were."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = probs.double().cumsum(0)
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    index = min(index, probs.shape[0] - 1)
    # never land on a zero-probability token at a float boundary
    if probs[index] <= 0:
        index = int(torch.argmax(probs))
    return index


def uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))
