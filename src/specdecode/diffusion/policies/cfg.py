"""Grammar-constrained diffusion decoding (after Mündler, Dekoninck, Vechev 2025, "Constrained
Decoding of Diffusion LLMs with Context-Free Grammars", arXiv 2508.10111): every committed
token keeps the output a prefix of some word of the grammar, so the finished output parses.

The paper commits the most confident (position, token) anywhere and checks that the partial
output, gaps and all, can still be completed (a CFG-intersect-regular emptiness test). This
policy takes the part of that which the grammar engine of the structured-output work
(``constraints.py``, llguidance) answers exactly: it commits only at the *frontier*, the first
masked position and a run after it. Each position's logits are masked to what the grammar
permits after the committed text and the run so far, and the masked argmax is committed; the
run goes on while the masked argmax is at least ``threshold`` probable (the frontier position
always commits). Positions past the run are never committed ahead of their left context, so
no token can be stranded. After an end-of-sequence token, or once the grammar is complete, the
rest of the block is filled with end-of-sequence tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView
from specdecode.errors import require
from specdecode.registry import param


@dataclass(frozen=True)
class CfgConfig:
    threshold: float = param(0.9, "a position after the frontier joins the run when its masked "
                                  "argmax is at least this probable")


@register_policy("cfg", CfgConfig, paper="Constrained Decoding of Diffusion LLMs with CFGs "
                                         "(Mündler et al., arXiv 2508.10111)",
                 summary="grammar masks (llguidance) over a run of positions from the frontier: "
                         "the output parses")
class GrammarConstrained(Policy):
    follows_constraint = True

    def start(self, constraint=None) -> None:
        require(constraint is not None, "the cfg policy needs a grammar: give --json-schema, "
                                        "--regex or --grammar")
        super().start(constraint)

    def choose(self, view: StepView) -> dict[int, int]:
        constraint = self.constraint
        eos = constraint.spec.vocabulary.eos_ids
        chosen: dict[int, int] = {}
        run: list[int] = []
        for i in range(view.masked[0], len(view.block)):
            if view.block[i] != view.mask_id:
                break
            allowed = constraint.allowed(run).clone()
            allowed[view.mask_id] = False
            logits = view.logits[i].masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(logits, -1)
            token = int(probs.argmax())
            if run and float(probs[token]) < self.config.threshold:
                break
            chosen[i] = token
            run.append(token)
            if token in eos:
                break
        constraint.commit(run)
        if run[-1] in eos or constraint.finished:
            chosen.update({i: eos[0] for i in view.masked if i not in chosen})
        return chosen
