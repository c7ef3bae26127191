"""Clover: regressive lightweight speculative decoding (Xiao et al., 2024, "Clover: Regressive
Lightweight Speculative Decoding with Sequential Knowledge").

An augmenting block (a causal transformer layer over the target's final hidden states, run once
per committed token) adapts the features to drafting; one regressive block then drafts depth by
depth: the previous state fused with the drafted token's embedding (the regressive connection),
cross-attention to the augmented features of the context (the attention decoder), an MLP. Its
output scores the FR-Spec shortlist of the target's frozen LM head. The block's weights are
shared across depths (as Clover-2's RNN-style drafter), so drafts may be as deep as the tree
allows. Trained by teacher distillation: `specdecode train heads --kind clover`.

Defaults: a dynamic tree of at most 8 nodes, depth 6, 8 nodes read per call, at most 2 calls a
step after the first, growth stops below a path probability of 0.35 (Clover-1's candidate
pruning is replaced by EAGLE-2's best-first growth, draft_heads.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.proposers.draft_heads import HeadProposer, HeadTreeConfig
from specdecode.registry import register


@dataclass(frozen=True)
class CloverConfig(HeadTreeConfig):
    """clover's settings: those of every head method (proposers/draft_heads.py)."""


@register("clover", CloverConfig,
          paper="Clover (Xiao et al., 2024); FR-Spec shortlist (Zhao et al., 2025); EAGLE-2 "
                "dynamic tree (Li et al., 2024)",
          summary="augmenting block + regressive attention-decoder heads on the target's hidden "
                  "states; dynamic tree; exact with sampling")
class CloverProposer(HeadProposer):
    head_kind = "clover"
