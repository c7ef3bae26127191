"""Window-Diffusion (Jan 2026, "windowed token pruning and caching for diffusion LMs"; code
github.com/vhicrgit/Window-Diffusion): a window slides over the undecoded region. Each step
only the *active* positions (the first ``inner`` from the frontier, the first masked position)
are recomputed and give logits; positions up to ``outer`` from the frontier are a *buffer*,
attended to through the keys and values written when they were last computed, refreshed by a
full pass every ``refresh`` steps; positions past the buffer (the far field) are neither run
nor seen. Unmasking inside the active window follows the confidence threshold (Fast-dLLM's
0.9; Window-Diffusion keeps its model's usual rule).

Window-Diffusion decodes a whole answer as one region (LLaDA, Dream); here the region is the
block, so the window matters with large blocks (``--block-size 128`` or more): with blocks of
``inner`` positions or fewer every step is a full one. The rows just left of the frontier
(one, the row that predicts it) are recomputed too: the paper's post-decode transient.
Defaults are the paper code's (``i_win_size`` 32, ``o_win_size`` 128, ``refresh_cycle`` 32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView
from specdecode.errors import require
from specdecode.registry import param


@dataclass(frozen=True)
class WindowConfig:
    inner: int = param(32, "active positions recomputed each step (i_win_size)", bounds=(1, 256))
    outer: int = param(128, "positions attended to, the buffer's edge (o_win_size)",
                       bounds=(1, 1024))
    refresh: int = param(32, "steps between full passes that refresh the buffer (refresh_cycle)",
                         bounds=(1, 1024))
    threshold: float = param(0.9, "commit active positions at least this confident",
                             bounds=(0.0, 1.0))

    def __post_init__(self):
        require(1 <= self.inner <= self.outer, "need 1 <= inner <= outer")
        require(self.refresh >= 1, f"refresh must be >= 1, got {self.refresh}")


@register_policy("window", WindowConfig, paper="Window-Diffusion (2026, github.com/vhicrgit/"
                                               "Window-Diffusion)",
                 summary="recompute a window after the frontier, cache a buffer, prune the rest")
class WindowDiffusion(Policy):
    def denoise(self, model, block: list[int], step: int) -> torch.Tensor:
        c = self.config
        frontier = block.index(model.mask_id)
        see = min(len(block), frontier + c.outer)
        if step == 0:  # a new block: none of its slots is written yet
            self._written = 0
        # a refresh runs the window's whole reach, a step between refreshes the active rows
        # and any slots the growing reach has not written yet
        first, last = (0, see) if step % c.refresh == 0 else \
            (max(0, frontier - 1), min(see, frontier + c.inner))
        rows = sorted(set(range(first, last)) | set(range(self._written, see)))
        self._written = max(self._written, see)
        logits, self._active = model.denoise_rows(block, rows, see)
        self._active = [i for i in self._active if frontier <= i < frontier + c.inner]
        return logits

    def choose(self, view: StepView) -> dict[int, int]:
        active = [i for i in self._active if view.block[i] == view.mask_id]
        above = [i for i in active if float(view.confidence[i]) >= self.config.threshold]
        return view.commit(above or [max(active, key=lambda i: (float(view.confidence[i]), -i))])
