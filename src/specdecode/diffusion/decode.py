"""The block-diffusion decode loop: blocks left to right, each denoised until a policy has
committed every position.

```
model.prefill(prompt)
for each block of block_size positions:          # all mask tokens at first
    while the block has masked positions:
        logits = policy.denoise(model, block)    # ONE forward: [B, V], bidirectional block
        block[i] = t for i, t in policy.choose(view of logits)
    model.append(block)                          # causal rows join the cache
    stop at an end-of-sequence token
```

Defaults: ``block_size`` 32, the semi-autoregressive block length of LLaDA (Nie et al. 2025),
Fast-dLLM (Wu et al. 2025) and Prophet's code; BD3-LM (Arriola et al. 2025) trains blocks of
4 to 16, and a smaller block is the better choice for a weakly adapted model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from specdecode.diffusion.step import Policy, StepView
from specdecode.errors import SpecDecodeError, require

#: positions per block when none is asked for (see the module docstring)
DEFAULT_BLOCK_SIZE = 32


@dataclass
class DiffusionResult:
    """One generation: its tokens and how they were reached."""

    tokens: list[int]
    #: denoising forwards (a FreeDave verify forward of several states counts one)
    steps: int = 0
    #: every forward: prefill, denoising steps and block appends
    forwards: int = 0
    #: positions committed at each denoising step
    commits: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def steps_per_token(self) -> float:
        return self.steps / max(1, len(self.tokens))

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def diffuse(model, policy: Policy, prompt: Sequence[int], max_new_tokens: int,
            eos_ids: Sequence[int] = (), block_size: int = DEFAULT_BLOCK_SIZE,
            constraint=None) -> DiffusionResult:
    """Decode up to ``max_new_tokens`` tokens after ``prompt`` with ``policy``; the output ends
    at (and keeps) the first end-of-sequence token."""
    result = DiffusionResult([])
    for _ in diffuse_blocks(model, policy, prompt, max_new_tokens, eos_ids, block_size,
                            constraint, result):
        pass
    return result


def diffuse_blocks(model, policy: Policy, prompt: Sequence[int], max_new_tokens: int,
                   eos_ids: Sequence[int], block_size: int, constraint,
                   result: DiffusionResult) -> Iterator[list[int]]:
    """:func:`diffuse` a block at a time: yields each block's kept tokens as it is committed
    (the server streams them), filling ``result``."""
    require(max_new_tokens > 0, f"max_new_tokens must be positive, got {max_new_tokens}")
    require(block_size > 0, f"block_size must be positive, got {block_size}")
    require(len(prompt) > 0, "the prompt is empty; give at least one token")
    require(constraint is None or policy.follows_constraint,
            f"policy {type(policy).__name__} does not follow grammars; use the cfg policy for "
            "constrained output")
    began, first_forward = time.perf_counter(), model.forwards
    eos = tuple(eos_ids)
    policy.start(constraint)
    model.prefill(prompt)
    while len(result.tokens) < max_new_tokens:
        width = min(block_size, max_new_tokens - len(result.tokens))
        policy.start_block(len(result.tokens))
        block = _denoise_block(model, policy, width, eos, result)
        policy.block_done(block)
        ends = [i for i, token in enumerate(block) if token in eos]
        kept = block[:ends[0] + 1] if ends else block
        result.tokens += kept
        result.forwards = model.forwards - first_forward
        result.seconds = time.perf_counter() - began
        yield kept
        if ends or (constraint is not None and constraint.finished):
            break
        if len(result.tokens) < max_new_tokens:
            model.append(block)
    result.forwards = model.forwards - first_forward
    result.seconds = time.perf_counter() - began


def _denoise_block(model, policy: Policy, width: int, eos: tuple[int, ...],
                   result: DiffusionResult) -> list[int]:
    mask = model.mask_id
    block = [mask] * width
    step = 0
    while mask in block:
        before = model.forwards
        view = StepView(policy.denoise(model, block, step), list(block), mask, step, model, eos)
        chosen = policy.choose(view)
        result.steps += model.forwards - before
        if not chosen or any(block[i] != mask or not 0 <= i < width for i in chosen):
            raise SpecDecodeError(f"policy {type(policy).__name__} chose {sorted(chosen)}: it "
                                  f"must commit a non-empty set of masked positions "
                                  f"({view.masked})")
        for i, token in chosen.items():
            block[i] = int(token)
        result.commits.append(len(chosen))
        step += 1
    return block
