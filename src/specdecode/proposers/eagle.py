"""EAGLE-style feature drafting (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty"; the dynamic tree of EAGLE-2, Li et al., 2024).

One decoder layer autoregresses on the target's features: the pair (feature at t, embedding of
token t + 1) predicts the feature at t + 1, whose score over the FR-Spec shortlist of the
target's frozen LM head drafts token t + 2; the predicted feature and the drafted token feed the
next step. The layer keeps its own cache of the context's pairs (the true features, read once
per committed token) and each tree node attends to it and to its ancestors. Trained on the
target's conversations by feature regression plus distillation (EAGLE's losses), unrolled over
its own predictions for the deeper steps (HASS / EAGLE-3's training-time test): `specdecode
train heads --kind eagle`.

Defaults: a dynamic tree of at most 8 nodes grown best-first by path probability, depth 6, 8
nodes read per layer call, at most 2 calls a step after the first, and growth stops below a path
probability of 0.35 (EAGLE-2 uses 60 nodes on a GPU, where rows are nearly free; on this CPU a
verify row costs about a fifth of a one-token forward and a layer call about a third: measured
in docs/draft-heads.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.proposers.draft_heads import (HeadProposer, check_tree, heads_param,
                                              min_path_prob_param)
from specdecode.registry import param, register


@dataclass(frozen=True)
class EagleConfig:
    heads: str = heads_param()
    tree_nodes: int = param(8, "draft tree size per verify step (node budget)")
    max_depth: int = param(6, "deepest draft node")
    expand_width: int = param(8, "most tree nodes the layer reads in one call")
    max_forwards: int = param(2, "most layer calls per step after the first")
    min_path_prob: float = min_path_prob_param()

    def __post_init__(self):
        check_tree(self)


@register("eagle", EagleConfig,
          paper="EAGLE (Li et al., 2024) with EAGLE-2's dynamic tree; FR-Spec shortlist (Zhao et "
                "al., 2025)",
          summary="one decoder layer autoregressing on the target's features; dynamic tree; "
                  "exact with sampling")
class EagleProposer(HeadProposer):
    head_kind = "eagle"
