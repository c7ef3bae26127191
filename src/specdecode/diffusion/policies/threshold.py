"""Confidence-threshold parallel unmasking (Wu et al. 2025, "Fast-dLLM: Training-free
Acceleration of Diffusion LLM by Enabling KV Cache and Parallel Decoding", arXiv 2505.22618):
each step commits every masked position whose argmax probability is at least ``threshold``,
or the single most confident one when none is. The usual parallel baseline."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView
from specdecode.errors import require
from specdecode.registry import param


@dataclass(frozen=True)
class ThresholdConfig:
    threshold: float = param(0.9, "commit positions whose argmax probability is at least this "
                                  "(Fast-dLLM's default 0.9)", bounds=(0.0, 1.0))

    def __post_init__(self):
        require(0.0 < self.threshold <= 1.0, f"threshold must be in (0, 1], got {self.threshold}")


def confident_or_best(view: StepView, threshold: float) -> list[int]:
    """Masked offsets at or above ``threshold``, or the most confident one alone."""
    above = [i for i in view.masked if float(view.confidence[i]) >= threshold]
    return above or [view.most_confident()]


@register_policy("threshold", ThresholdConfig, paper="Fast-dLLM (Wu et al. 2025, arXiv 2505.22618)",
                 summary="commit every position above a confidence threshold (at least one)")
class Threshold(Policy):
    def choose(self, view: StepView) -> dict[int, int]:
        return view.commit(confident_or_best(view, self.config.threshold))
