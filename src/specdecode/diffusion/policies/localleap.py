"""LocalLeap (Kong et al. 2025, "Local Determinism Propagation", arXiv
2510.07081): positions of high confidence (anchors, at least
``anchor_threshold``) are committed, and so are masked positions within ``radius`` of an anchor
whose confidence passes a lower, relaxed threshold: certainty spreads to neighbours, and only
to near ones. No anchor: the most confident position alone.

The anchor threshold 0.9 is the paper's; its radius and relaxed threshold were not captured
(../shared/PAPERS.md), so 2 and 0.7 here are ours."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView
from specdecode.errors import require
from specdecode.registry import param


@dataclass(frozen=True)
class LocalLeapConfig:
    anchor_threshold: float = param(0.9, "confidence that makes a position an anchor (paper)",
                                    bounds=(0.0, 1.0))
    relaxed_threshold: float = param(0.7, "confidence a neighbour of an anchor needs (ours)",
                                     bounds=(0.0, 1.0))
    radius: int = param(2, "how far from an anchor a neighbour may be, in positions (ours)",
                        bounds=(0, 64))

    def __post_init__(self):
        require(self.relaxed_threshold <= self.anchor_threshold,
                "relaxed_threshold must not exceed anchor_threshold")
        require(self.radius >= 0, f"radius must be >= 0, got {self.radius}")


@register_policy("localleap", LocalLeapConfig, paper="LocalLeap (Kong et al. 2025, arXiv 2510.07081)",
                 summary="commit confident anchors and their near neighbours above a relaxed "
                         "threshold")
class LocalLeap(Policy):
    def choose(self, view: StepView) -> dict[int, int]:
        c = self.config
        conf = [float(view.confidence[i]) for i in range(len(view.block))]
        anchors = [i for i in view.masked if conf[i] >= c.anchor_threshold]
        if not anchors:
            return view.commit([view.most_confident()])
        near = [i for i in view.masked
                if conf[i] >= c.relaxed_threshold and any(abs(i - a) <= c.radius for a in anchors)]
        return view.commit(sorted(set(anchors) | set(near)))
