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
probability of 0.35 (EAGLE-2 uses 60 nodes on a GPU, where rows are nearly free; on a CPU
every verify row and every layer call costs a share of a one-token forward: the figures are in
docs/draft-heads.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.proposers.draft_heads import HeadProposer, HeadTreeConfig
from specdecode.registry import register


@dataclass(frozen=True)
class EagleConfig(HeadTreeConfig):
    """eagle's settings: those of every head method (proposers/draft_heads.py)."""


@register("eagle", EagleConfig,
          paper="EAGLE (Li et al., 2024) with EAGLE-2's dynamic tree; FR-Spec shortlist (Zhao et "
                "al., 2025)",
          summary="one decoder layer autoregressing on the target's features; dynamic tree; "
                  "exact with sampling")
class EagleProposer(HeadProposer):
    head_kind = "eagle"
