"""What a policy sees at one denoising step (:class:`StepView`) and the policy interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class StepView:
    """One denoising step of one block. Positions are offsets in the block."""

    #: logits of every position of the block [B, V] (committed positions' too)
    logits: torch.Tensor
    #: the block's tokens now (``mask_id`` where not committed)
    block: list[int]
    mask_id: int
    #: denoising steps already run on this block
    step: int
    #: the model, for policies that run forwards of their own (FreeDave's drafts)
    model: object
    eos_ids: tuple[int, ...] = ()

    @cached_property
    def masked(self) -> list[int]:
        """Offsets still masked, in order."""
        return [i for i, token in enumerate(self.block) if token == self.mask_id]

    @cached_property
    def probs(self) -> torch.Tensor:
        """Softmax of the logits [B, V], with the mask id excluded (it is never an output)."""
        logits = self.logits.clone()
        logits[:, self.mask_id] = float("-inf")
        return torch.softmax(logits, -1)

    @cached_property
    def predicted(self) -> list[int]:
        """The argmax token of every position (never the mask id)."""
        return self.probs.argmax(-1).tolist()

    @cached_property
    def confidence(self) -> torch.Tensor:
        """The argmax's probability per position [B]; -1 at committed positions, so a max over
        it picks a masked one."""
        conf = self.probs.max(-1).values.clone()
        done = torch.ones(len(self.block), dtype=torch.bool)
        done[self.masked] = False
        conf[done] = -1.0
        return conf

    def most_confident(self) -> int:
        """The masked offset of highest confidence (the lowest offset among equals):
        ``one_per_step``'s choice."""
        return int(self.confidence.argmax())

    def commit(self, offsets) -> dict[int, int]:
        """{offset: predicted token} for ``offsets``."""
        return {int(i): self.predicted[int(i)] for i in offsets}


class Policy(ABC):
    """Decides, each step, which masked positions of the block to commit, and to what.

    :meth:`choose` returns {offset: token}, a non-empty subset of the masked offsets. A policy
    object serves one generation at a time; :meth:`start` begins one (``constraint``: the
    request's :class:`~specdecode.constraints.Constraint` or None) and :meth:`start_block`
    each block."""

    #: whether :meth:`choose` applies the request's constraint (only the grammar policy does)
    follows_constraint = False

    def __init__(self, config):
        self.config = config
        self.constraint = None

    def start(self, constraint=None) -> None:
        self.constraint = constraint

    def start_block(self, offset: int) -> None:
        """A new block begins at output offset ``offset``."""

    def denoise(self, model, block: list[int], step: int) -> torch.Tensor:
        """The step's forward: logits [B, V] of every position (a policy that caches part of
        the block, Window-Diffusion's, runs less)."""
        return model.denoise(block)

    @abstractmethod
    def choose(self, view: StepView) -> dict[int, int]:
        """The positions of the block to commit this step, with their tokens."""

    def block_done(self, block: list[int]) -> None:
        """The block is committed with these tokens (the constraint follows them)."""
