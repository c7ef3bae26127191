"""Hydra: sequentially dependent draft heads (Ankner et al., 2024, "Hydra: Sequentially-Dependent
Draft Heads for Medusa Decoding").

Head k reads the target's last feature and the embeddings of the k tokens after it (the root and
the tokens drafted on the path so far), so each head knows what the earlier heads drafted, which
Medusa's independent heads do not. Each head is a projection of that concatenation and Medusa's
residual SiLU block; every head scores the FR-Spec shortlist of the target's frozen LM head
(Hydra gives each head its own copy of the LM head: a fifth of the model here). Trained by
teacher distillation on the target's own conversations (Hydra++'s loss): `specdecode train heads
--kind hydra`.

Defaults: 4 heads (the paper's), so drafts are at most 4 deep; a dynamic tree of at most 8 nodes
(EAGLE-2's growth, see draft_heads.py; the paper's static tree needs rows as cheap as a GPU's), 8
nodes read per head call, at most 4 calls a step, growth stops below a path probability of 0.35.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.proposers.draft_heads import HeadProposer, HeadTreeConfig
from specdecode.registry import param, register


@dataclass(frozen=True)
class HydraConfig(HeadTreeConfig):
    max_depth: int = param(4, "deepest draft node (at most the number of trained heads)",
                           bounds=(1, 32))
    max_forwards: int = param(4, "most head calls per step after the first", bounds=(1, 32))


@register("hydra", HydraConfig,
          paper="Hydra (Ankner et al., 2024); FR-Spec shortlist (Zhao et al., 2025); EAGLE-2 "
                "dynamic tree (Li et al., 2024)",
          summary="sequentially dependent draft heads on the target's last hidden state; "
                  "dynamic tree; exact with sampling")
class HydraProposer(HeadProposer):
    head_kind = "hydra"
