"""ParallelBench's lesson, measurable without a trained model (Kang et al. 2025,
"ParallelBench: Understanding the Trade-offs of Parallel Decoding in Diffusion LLMs",
arXiv 2510.04767).

The paper's point: a masked-diffusion model gives each masked position its *marginal* given
what is committed, and committing several positions in one step draws them as if independent,
so tasks whose output tokens depend on each other fail as parallelism grows, even for a model
whose every conditional is exact. Its synthetic list tasks make that analytic; the generators
here follow its description (no code or data taken):

- ``copy``: repeat the input list (each token determined: no dependency, parallel is safe);
- ``replace``: the input list with exactly one item replaced by one of a few others (which one
  is free: the positions depend on each other);
- ``shuffle``: a permutation of the input list (each item exactly once).

:class:`OracleTask` plays the model: its logits at every masked position are the exact
conditional marginals of a uniform distribution over the task's valid outputs, given the
block's committed tokens (enumerated). A policy that fails on it fails because of its
parallelism alone; ``scripts/parallelbench.py`` sweeps it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import torch

from specdecode.errors import require

#: token ids: 0 unused, 1 the mask, items from 2 on
MASK_ID = 1
FIRST_ITEM = 2
TASKS = ("copy", "replace", "shuffle")


def valid_outputs(task: str, items: Sequence[int], spare: Sequence[int]) -> list[tuple[int, ...]]:
    """Every correct output for the input list ``items`` (``spare``: the items ``replace`` may
    put in)."""
    require(task in TASKS, f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    items = tuple(items)
    if task == "copy":
        return [items]
    if task == "replace":
        return [items[:i] + (s,) + items[i + 1:] for i in range(len(items)) for s in spare]
    return sorted(set(itertools.permutations(items)))


def make_instance(task: str, length: int, vocab_items: int, rng: random.Random
                  ) -> tuple[list[int], list[tuple[int, ...]]]:
    """(input list, its valid outputs): ``length`` distinct items drawn from ``vocab_items``."""
    require(2 <= length <= 7 and vocab_items >= length + 2,
            "give 2..7 items and at least two spare item ids")
    pool = list(range(FIRST_ITEM, FIRST_ITEM + vocab_items))
    rng.shuffle(pool)
    items, spare = pool[:length], pool[length:length + 2]
    return items, valid_outputs(task, items, spare)


class OracleTask:
    """The diffusion model's interface (``diffusion.model.DiffusionModel``) over one task
    instance: exact conditional marginals, no network."""

    def __init__(self, outputs: list[tuple[int, ...]], vocab_size: int):
        self.outputs = torch.tensor(outputs)  # [O, L]
        self.vocab_size = vocab_size
        self.mask_id = MASK_ID
        self.forwards = 0

    def prefill(self, prompt: Sequence[int]) -> None:
        self.forwards += 1

    def append(self, tokens: Sequence[int]) -> None:
        self.forwards += 1

    def denoise(self, block: Sequence[int]) -> torch.Tensor:
        return self.denoise_states([block])[0]

    def denoise_states(self, states: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        self.forwards += 1
        return [self._marginals(state) for state in states]

    def _marginals(self, block: Sequence[int]) -> torch.Tensor:
        """Log-probabilities [L, V] of each position's token over the valid outputs that agree
        with the committed positions (an inconsistent block: uniform, it cannot recover)."""
        state = torch.tensor(list(block))
        known = state != MASK_ID
        fits = (self.outputs[:, known] == state[known]).all(1)
        counts = torch.zeros(len(block), self.vocab_size)
        if fits.any():
            for column in range(len(block)):
                counts[column].index_add_(0, self.outputs[fits, column],
                                          torch.ones(int(fits.sum())))
        else:
            counts += 1.0
        probs = counts / counts.sum(-1, keepdim=True)
        return probs.clamp_min(1e-6).log()


def failure_rate(policy, task: str, length: int, instances: int = 50, seed: int = 0
                 ) -> tuple[float, float]:
    """(share of outputs that are wrong, mean positions committed a step) of ``policy`` on
    ``instances`` instances of ``task``, the whole output one block."""
    from specdecode.diffusion.decode import diffuse

    rng = random.Random(seed)
    wrong, tokens, steps = 0, 0, 0
    for _ in range(instances):
        items, outputs = make_instance(task, length, length + 4, rng)
        oracle = OracleTask(outputs, FIRST_ITEM + length + 4)
        result = diffuse(oracle, policy, items, length, (), length)
        wrong += tuple(result.tokens) not in set(outputs)
        tokens, steps = tokens + len(result.tokens), steps + result.steps
    return wrong / instances, tokens / steps
