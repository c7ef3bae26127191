"""ETE, explore-then-exploit (Fu, Huang et al. 2025, "From Bits to Rounds: Explore-Then-Exploit
for Diffusion Language Models", arXiv 2511.21103). The paper bounds the rounds a generation
needs by its total information (bits) over what one round may resolve: committing only
near-certain tokens spends almost no bits a round and wastes rounds. Each round here
*exploits* (commits every position at or above ``threshold``, as the threshold policy does)
and *explores*: it also commits further positions, least uncertain first, while the entropy
they add stays within ``bits_per_round``, so a round resolves a fixed budget of uncertainty,
and the committed guesses sharpen the remaining conditionals for the next round.

The paper's exact exploration rule was not captured (../shared/PAPERS.md marks it
unverified): the entropy budget is our reading of its bound, and its cross-block decoding is
not done (a block is finished before the next starts). ``bits_per_round`` 1.0 is ours."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.diffusion.policies.threshold import confident_or_best
from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView
from specdecode.errors import require
from specdecode.registry import param


@dataclass(frozen=True)
class EteConfig:
    threshold: float = param(0.9, "exploit: commit positions at least this confident",
                             bounds=(0.0, 1.0))
    bits_per_round: float = param(1.0, "explore: further entropy (bits) a round may commit (ours)",
                                  bounds=(0.0, 64.0))

    def __post_init__(self):
        require(self.bits_per_round >= 0, f"bits_per_round must be >= 0, got {self.bits_per_round}")


@register_policy("ete", EteConfig,
                 paper="ETE, From Bits to Rounds (Fu, Huang et al., arXiv 2511.21103)",
                 summary="commit the confident positions, then the least uncertain others "
                         "within an entropy budget per round")
class ExploreThenExploit(Policy):
    def choose(self, view: StepView) -> dict[int, int]:
        chosen = confident_or_best(view, self.config.threshold)
        probs = view.probs
        entropy = -(probs * torch.log2(probs.clamp_min(1e-30))).sum(-1)  # [B] bits
        spent = 0.0
        for i in sorted((i for i in view.masked if i not in chosen), key=lambda i: float(entropy[i])):
            spent += float(entropy[i])
            if spent > self.config.bits_per_round:
                break
            chosen.append(i)
        return view.commit(sorted(chosen))
