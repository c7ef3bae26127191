"""EAGLE-style feature drafting with EAGLE-3's recipe (Li et al., 2025, "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test"; the layer of EAGLE,
Li et al., 2024, and the dynamic tree of EAGLE-2, Li et al., 2024).

One decoder layer autoregresses on features. Its first input at each committed position t is
the target's hidden states after a low, a middle and a high layer (2, L // 2 and L - 3, as
EAGLE-3's code: 2, 15 and 27 of SmolLM2's 30), each normed, fused by a linear map to the
width, beside the embedding of token t + 1; the layer's output, normed and scored over the
FR-Spec shortlist of the target's frozen LM head, drafts token t + 2, and is itself the next
step's input beside the drafted token. The proposer declares those layers as its ``needs``, so
every verify pass returns their rows (other methods' passes are unchanged). The layer keeps
its own cache of the context's pairs (read once per committed token) and each tree node
attends to it and to its ancestors. Trained by `specdecode train heads --kind eagle` with
EAGLE-3's training-time test: unrolled on its own predictions (4 steps here, the paper's 7),
the distillation loss of step k weighted 0.8^k, no feature regression. An artifact written
before EAGLE-3 (no ``feature_layers`` in its settings) still loads and drafts as EAGLE-1 did,
from the final hidden states. The one shipped for SmolLM2 is EAGLE-3's, trained on a GPU
(docs/draft-heads.md).

Defaults: a dynamic tree of at most 8 nodes grown best-first by path probability, depth 6, 8
nodes read per layer call, at most 2 calls a step after the first, and growth stops below a path
probability of 0.2 (EAGLE-2 uses 60 nodes on a GPU, where rows are nearly free; on a CPU
every verify row and every layer call costs a share of a one-token forward: the figures are in
docs/draft-heads.md; 0.2 rather than the other heads' 0.35 since the head's GPU retraining,
whose probabilities are surer: 1.10x against 1.06x `ar` greedy, 1.05x against 1.03x
at T = 0.7).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.proposers.draft_heads import HeadProposer, HeadTreeConfig
from specdecode.registry import param, register


@dataclass(frozen=True)
class EagleConfig(HeadTreeConfig):
    """eagle's settings: those of every head method (proposers/draft_heads.py), a lower
    ``min_path_prob``."""

    min_path_prob: float = param(0.2, "stop growing when the best candidate's path probability "
                                      "(its expected acceptance) is below this", bounds=(0.0, 1.0))


@register("eagle", EagleConfig,
          paper="EAGLE-3 (Li et al., 2025) on EAGLE's layer with EAGLE-2's dynamic tree; FR-Spec "
                "shortlist (Zhao et al., 2025)",
          summary="one decoder layer autoregressing on the target's low, middle and high "
                  "layers' features; dynamic tree; exact with sampling")
class EagleProposer(HeadProposer):
    head_kind = "eagle"
