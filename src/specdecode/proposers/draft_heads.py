"""What the three draft-head methods share (hydra.py, clover.py, eagle.py): a trained head
network reads the target's own final hidden states and a dynamic tree is grown from its
probabilities, best-first by path probability under a node budget (EAGLE-2, Li et al., 2024;
the same growth rule as DySpec, with the same sampling: siblings drawn without replacement,
``Draft.probs`` recorded, so the recursive rejection rule keeps the target's distribution).

The proposer declares that it needs the target's final hidden states (or, for an EAGLE-3 head,
those of the layers it reads) and hands the draft cache (heads/drafter.py) those of every
committed position (``Feedback.committed_rows``): the
prompt's after the prefill, then the root's and the accepted nodes' rows of each verify pass.
The tree grows as drafting/tree.py grows it. Heads are trained by ``specdecode train heads
--kind KIND``; the default model's ship inside the package.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.control import Controller
from specdecode.drafting.session import CoupledDrafts, DraftSession, coupled_param
from specdecode.drafting.tree import check_tree, grow_tree
from specdecode.heads.artifact import load_heads
from specdecode.errors import require
from specdecode.heads.drafter import HeadDraftLM, target_features, target_needs
from specdecode.heads.native import DRAFT_WEIGHTS
from specdecode.proposer import Feedback, Proposer
from specdecode.registry import param


@dataclass(frozen=True)
class HeadTreeConfig:
    """The settings of the three head methods; each subclass documents its own defaults."""

    heads: str = param("auto", "trained heads: 'auto' (the newest artifact `specdecode train "
                               "heads` made for this target, or the one shipped for the default "
                               "model) or a path to one")
    tree_nodes: int = param(8, "draft tree size per verify step (node budget)", bounds=(1, 128))
    max_depth: int = param(6, "deepest draft node", bounds=(1, 32))
    expand_width: int = param(8, "most tree nodes the network reads in one call", bounds=(1, 64))
    max_forwards: int = param(2, "most network calls per step after the first", bounds=(1, 32))
    min_path_prob: float = param(0.35, "stop growing when the best candidate's path probability "
                                       "(its expected acceptance) is below this: an uncertain "
                                       "step sends a small tree or none (verify rows are not "
                                       "free on a CPU, docs/draft-heads.md)", bounds=(0.0, 1.0))
    draft_weights: str = param("int4", "the network's linear maps on the native kernels: int4 "
                                       "(as fast as int8 or faster, the same acceptance) | int8 "
                                       "| bf16, or fp32 (plain torch); the drafts may change, "
                                       "never the output")
    coupled: bool = coupled_param()

    def __post_init__(self):
        check_tree(self)
        require(self.draft_weights in DRAFT_WEIGHTS,
                f"unknown draft_weights {self.draft_weights!r}; known: {', '.join(DRAFT_WEIGHTS)}")


class HeadProposer(CoupledDrafts, Proposer):
    """Subclasses set ``head_kind`` (a network of heads/networks.py) and register."""

    head_kind = "?"
    #: the draft cache that runs the network
    draft_cache = HeadDraftLM

    def __init__(self, config, runner):
        super().__init__(config, runner)
        net, head_ids, source, self.artifact_config = load_heads(
            config.heads, runner, self.head_kind, runner.tables.input_embeddings())
        self.net = net
        # what the network reads is the artifact's: an EAGLE-3 head asks for three layers
        self.needs = target_needs(net)
        self.session = DraftSession(self.draft_cache(net, head_ids, runner, config.draft_weights))
        self.depth_limit = net.max_depth
        self.draft_source = source

    @property
    def lm(self) -> HeadDraftLM:
        """The draft cache: the head network and the features it has read."""
        return self.session.lm

    def make_controller(self) -> Controller:
        depth = self.config.max_depth
        if self.depth_limit is not None:
            depth = min(depth, self.depth_limit)
        return Controller(depth, self.config.tree_nodes)

    def start(self, prompt) -> None:
        self.session.start(prompt, self.sampling)
        self.lm.reset()

    def propose(self, context, budget):
        return grow_tree(self.session, context, budget, self.config)

    def observe(self, feedback: Feedback) -> None:
        self.lm.add_features(target_features(self.net, feedback.target, feedback.committed_rows))
        self.session.keep_accepted(feedback.accepted, feedback.draft)
