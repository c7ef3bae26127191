"""FreeDave (arXiv 2510.00294, "Free Draft-and-Verification for Diffusion LLMs"; code
``generation/core.py``): lossless parallel decoding of ``one_per_step``'s output.

From one forward's predictions, draft the states ``one_per_step`` would reach in 1..K steps
*if the predictions did not change*: draft k has the k + 1 most confident masked positions
filled with their argmax. One forward runs every draft (each a copy of the block seeing only
itself: ``DiffusionModel.denoise_states``). Draft k is valid when ``one_per_step``, run on
draft k - 1's logits, commits exactly draft k's extra position and token; draft 0 is valid by
construction. The longest valid chain is accepted, and the last accepted draft's logits, from
the same forward, draft the next round: each forward commits at least one position, and the
output is token for token ``one_per_step``'s (the runner's rows are batch invariant, so a
state's logits are the same in a forward of many states as alone). ``draft_steps`` 8 is the
paper's default."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView
from specdecode.errors import require
from specdecode.registry import param


@dataclass(frozen=True)
class FreeDaveConfig:
    draft_steps: int = param(8, "draft states verified per forward (the paper's default)",
                             bounds=(1, 32))

    def __post_init__(self):
        require(self.draft_steps >= 1, f"draft_steps must be >= 1, got {self.draft_steps}")


def _drafts(view: StepView, count: int) -> list[list[int]]:
    """The states ``one_per_step`` reaches in 1..count steps if the predictions held."""
    order = sorted(view.masked, key=lambda i: (-float(view.confidence[i]), i))
    states, block = [], list(view.block)
    for i in order[:count]:
        block[i] = view.predicted[i]
        states.append(list(block))
    return states


def _accepted(drafts: list[list[int]], logits: list, view: StepView) -> int:
    """The last draft of the longest chain ``one_per_step`` confirms (draft 0 always is)."""
    accepted = 0
    while accepted + 1 < len(drafts):
        here = StepView(logits[accepted], drafts[accepted], view.mask_id, 0, view.model)
        i, following = here.most_confident(), drafts[accepted + 1]
        if following[i] == view.mask_id or here.predicted[i] != following[i]:
            break
        accepted += 1
    return accepted


@register_policy("freedave", FreeDaveConfig, paper="FreeDave (arXiv 2510.00294)", exact=True,
                 summary="draft the next states of one_per_step, verify them in one forward: "
                         "one_per_step's output in fewer forwards")
class FreeDave(Policy):
    def choose(self, view: StepView) -> dict[int, int]:
        """Runs the block to its end (each round's last logits draft the next round) and
        returns every commit."""
        start, mask = list(view.block), view.mask_id
        while len(view.masked) > 1:
            drafts = _drafts(view, min(self.config.draft_steps, len(view.masked)))
            # a draft with nothing masked needs no logits: it can only end the block
            open_drafts = [d for d in drafts if mask in d]
            logits = view.model.denoise_states(open_drafts)
            accepted = _accepted(drafts, logits, view)
            if accepted == len(open_drafts):  # the full block, confirmed
                return {i: drafts[accepted][i] for i, t in enumerate(start) if t == mask}
            view = StepView(logits[accepted], drafts[accepted], mask, 0, view.model)
        final = _drafts(view, 1)[0]
        return {i: final[i] for i, t in enumerate(start) if t == mask}
