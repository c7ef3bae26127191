"""Prophet ("Diffusion Language Models Know the Answer Before Decoding", 2025; code
github.com/pixeli99/Prophet, ``generate_earlyexit.py``): decode one position a step, and each
step measure how settled the answer is by the gap between the top-1 and top-2 logits. When the gap,
averaged over the masked positions, reaches a threshold that falls as the block progresses
(7.5 in the first third of its steps, 5.0 in the second, 2.5 after: the paper's), go all in:
commit every masked position of the block to its argmax at once.

Here the all-in commit ends the current block (Prophet decodes LLaDA's whole answer as one
region; a block-diffusion model has the next block still to start), and the gap is averaged
over the block's masked positions rather than Prophet's five-position answer region (no task
format says where an answer starts)."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView
from specdecode.registry import param


@dataclass(frozen=True)
class ProphetConfig:
    early_gap: float = param(7.5, "logit gap to go all in during the block's first third",
                             bounds=(0.0, 100.0))
    middle_gap: float = param(5.0, "logit gap during the second third", bounds=(0.0, 100.0))
    late_gap: float = param(2.5, "logit gap in the last third", bounds=(0.0, 100.0))


@register_policy("prophet", ProphetConfig,
                 paper="Prophet: Diffusion LMs Know the Answer Before Decoding (2025)",
                 summary="one token a step until the top-1/top-2 logit gap says the block has "
                         "converged, then commit it all")
class Prophet(Policy):
    def choose(self, view: StepView) -> dict[int, int]:
        masked = view.masked
        top2 = view.logits[masked].topk(2, dim=-1).values  # [M, 2]
        gap = float((top2[:, 0] - top2[:, 1]).mean())
        progress = view.step / len(view.block)
        c = self.config
        needed = (c.early_gap if progress < 1 / 3 else
                  c.middle_gap if progress < 2 / 3 else c.late_gap)
        return view.commit(masked if gap >= needed else [view.most_confident()])
