"""One token per step: the reference policy. Each denoising step commits the masked position
whose argmax is most probable (the lowest offset among equals) to its argmax: LLaDA's
low-confidence remasking at one token per step (Nie et al. 2025, "Large Language Diffusion
Models"), the *static* decoding FreeDave reproduces (arXiv 2510.00294). Every other policy's
agreement is measured against it."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView


@dataclass(frozen=True)
class OnePerStepConfig:
    """No settings: one position a step, the most confident."""


@register_policy("one_per_step", OnePerStepConfig,
                 paper="LLaDA (Nie et al. 2025), low-confidence remasking, one token a step",
                 summary="the reference: each step commits the single most confident position")
class OnePerStep(Policy):
    def choose(self, view: StepView) -> dict[int, int]:
        return view.commit([view.most_confident()])
