"""CCD, coherent contextual decoding (2025, "Beyond Confidence: Coherent Contextual Decoding
for Diffusion Language Models"): a position is trusted when its prediction is *consistent
over the recent denoising steps*, not when one step's confidence is high (the paper shows the
consistency estimates the conditional mutual information between context and prediction), and
the number committed each step follows from that score instead of a fixed budget.

Here a masked position is committed when its argmax has been the same token for the last
``history`` steps and its probability, averaged over them, is at least ``threshold``; every
position passing commits (the adaptive budget), the most confident alone when none does. The
paper's mechanism is marked unverified in ../shared/PAPERS.md and its remasking of committed
positions (trajectory rectification) is not done: commits are final here. Defaults are ours."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView
from specdecode.errors import require
from specdecode.registry import param


@dataclass(frozen=True)
class CcdConfig:
    history: int = param(2, "steps a position's argmax must have held (ours)", bounds=(1, 64))
    threshold: float = param(0.6, "its mean probability over those steps (ours)", bounds=(0.0, 1.0))

    def __post_init__(self):
        require(self.history >= 1, f"history must be >= 1, got {self.history}")


@register_policy("ccd", CcdConfig,
                 paper="CCD, Beyond Confidence: Coherent Contextual Decoding (2025)",
                 summary="commit positions whose prediction held over recent steps (adaptive "
                         "count)")
class CoherentContextual(Policy):
    def start_block(self, offset: int) -> None:
        #: per step of this block: (argmax [B], its probability [B])
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def choose(self, view: StepView) -> dict[int, int]:
        top = view.probs.max(-1)
        self._seen = (self._seen + [(top.indices, top.values)])[-self.config.history:]
        if len(self._seen) < self.config.history:
            return view.commit([view.most_confident()])
        tokens = torch.stack([t for t, _ in self._seen])  # [h, B]
        held = (tokens == tokens[-1]).all(0)
        mean = torch.stack([p for _, p in self._seen]).mean(0)
        chosen = [i for i in view.masked if held[i] and float(mean[i]) >= self.config.threshold]
        return view.commit(chosen or [view.most_confident()])
