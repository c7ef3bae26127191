"""DySpec: a dynamic draft tree grown greedily from a draft model's probabilities (Xiong et al.,
2024, "DySpec: Faster Speculative Decoding with Dynamic Token Tree Structure").

Draft probability predicts acceptance, so the tree is grown best-first by path probability
under a node budget, siblings drawn without replacement so that sampling stays exact
(drafting/tree.py has the rule).

The same drafts as ``draft_model`` (distilled artifacts, checkpoint folders, GGUF files and
named models; see draft_model.py), on the native runner by default (int4 where its sizes
allow), whose tree rows attend to their ancestors through the same slot tables as the target's
verify pass; ``draft_runner=hf`` runs a checkpoint's through ``transformers`` with a mask.
A node is worth its verify row only if it is likely to be accepted: ``min_path_prob`` stops the
growth when the best candidate's value falls below it (EAGLE-2's observation that draft
confidence predicts acceptance), so an uncertain step sends a small tree or none, and a node is
read (a draft forward) only where its children can be expected to reach that floor.
Defaults: 16 nodes (on a CPU each verify row costs a share of a one-token forward, so the
tree stays small; docs/native-runner.md has the row costs), depth 8, 4 nodes read per draft
forward (a small draft's forward costs nearly the same for 1 or 4 rows), at most 6 such forwards
a step (a weak draft's flat distributions otherwise take up to one forward per node), and growth
stops below a path probability of 0.2 (much faster than full trees on the dev half with the
native int4 draft, and as fast as higher floors; docs/draft-model.md#measured has the sweep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.control import Controller
from specdecode.drafting.artifacts import DraftSource, open_draft
from specdecode.drafting.session import CoupledDrafts, DraftSession, coupled_param
from specdecode.drafting.tree import check_tree, grow_tree
from specdecode.models.base import Runner
from specdecode.proposer import Feedback, Proposer
from specdecode.registry import param, register


@dataclass(frozen=True)
class DySpecConfig(DraftSource):
    tree_nodes: int = param(16, "draft tree size per verify step (node budget)", bounds=(1, 128))
    max_depth: int = param(8, "deepest draft node", bounds=(1, 32))
    expand_width: int = param(4, "most tree nodes the draft model reads in one forward",
                              bounds=(1, 64))
    max_forwards: int = param(6, "most draft forwards per step after the catch-up (bounds the "
                                 "draft's cost like a 7-token chain; the tree placed so far is "
                                 "sent when they run out)", bounds=(1, 32))
    min_path_prob: float = param(0.2, "stop growing when the best candidate's path probability "
                                      "(its expected acceptance) is below this (0: fill the "
                                      "node budget; 0.2 is much faster than 0 on the dev "
                                      "half, docs/draft-model.md)", bounds=(0.0, 1.0))
    coupled: bool = coupled_param()

    def __post_init__(self):
        super().__post_init__()
        check_tree(self)


@register("dyspec", DySpecConfig,
          paper="DySpec (Xiong et al., 2024); siblings without replacement as in RSD (Jeon et "
                "al., 2024)",
          summary="a draft model grows a tree best-first by path probability under a node "
                  "budget; exact with sampling")
class DySpecProposer(CoupledDrafts, Proposer):
    def __init__(self, config: DySpecConfig, runner: Runner,
                 draft_model: torch.nn.Module | None = None):
        """``draft_model``: a causal LM module to draft with instead of ``config.draft``."""
        super().__init__(config, runner)
        lm, loaded = open_draft(config, runner, draft_model)
        self.session = DraftSession(lm)
        self.draft_source = loaded.source

    @property
    def lm(self):
        """The draft cache."""
        return self.session.lm

    def make_controller(self) -> Controller:
        return Controller(self.config.max_depth, self.config.tree_nodes)

    def start(self, prompt) -> None:
        self.session.start(prompt, self.sampling)

    def propose(self, context, budget):
        return grow_tree(self.session, context, budget, self.config)

    def draft_seconds(self, context):
        return self.session.draft_seconds(context)

    def observe(self, feedback: Feedback) -> None:
        self.session.keep_accepted(feedback.accepted, feedback.draft)
