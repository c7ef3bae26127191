"""DEER: draft with a block diffusion model, verify autoregressively (Cheng et al., 2025, "DEER:
Draft with Diffusion, Verify with Autoregressive Models", arXiv 2512.15176), with the drafter
conditioned on the target's features as in DFlash (block diffusion drafting with the target's
hidden states as context).

The drafter (heads/networks.py, ``DeerDrafter``) is one decoder layer of the target's width
whose input is the root's embedding and ``block`` mask rows (each row its own mask vector, with
the root's embedding and the last committed position's fused features, each through its own
map, added to every row: with one layer, a row otherwise learns them only through attention);
they attend to each other both ways and to keys and values made from the target's features of
every committed position (a low and a middle layer's outputs and the final hidden states, each
normed, concatenated and projected). ONE forward gives a distribution per block position, scored through the FR-Spec
shortlist of the target's frozen LM head like the other heads. Nothing is autoregressive on
the draft side, so a whole block costs one small forward whatever its length; the price is
that position k does not see what was drafted before it.

The draft is a tree (default) grown best-first by path probability from the per-position
distributions (node at depth d: its children are ranked by block position d + 1's
distribution; the growth and the sampling rules of the other heads, so T > 0 records
``Draft.probs`` and stays exact; drafting/tree.py's ``grow_block_tree`` ranks each position
once for every node of its depth), or a chain of each position's argmax (greedy) or draw.
DEER regenerates the block from the new prefix after each verification ("reliable block
regeneration"), as here: every step drafts afresh from the committed context.

Trained by ``specdecode train heads --kind deer``: every position of the target's own
conversations is an anchor, the block after it all masked, and each mask row learns the
target's distribution there (KL, over the shortlist): DEER's first stage, AR-style
continuation distillation, with its second stage's (and DFlash's) loss decaying along the
block (row k weighted 0.8^k). The second stage's suffix masking (blocks partly unmasked) is not
done: drafting always sees an all-masked block.

Defaults: a block of 8 (DEER drafts up to 32 on a GPU; here a verify row costs about a fifth of
a one-token forward and the deeper positions are rarely right), a tree of at most 16 nodes,
growth stops below a path probability of 0.15 (a node costs no drafter call, the block's rows
all scored by the one forward, but its verify row, and at T > 0 its draw: 0.05 sent 6 rows a
step at T = 0.7 for 1.44 tokens, 0.15 sends 2.6 for 1.30 and made 0.84x -> 0.93x `ar`, greedy
0.92x -> 0.95x, docs/results/HISTORY.md).

``-c drafter=dllm``: DEER's own drafter, a dLLM, instead of the learned network: the project's
small dLLM (the target adapted by the ``specdecode train dllm`` LoRA delta, ``-c dllm=auto`` or
a file; ``dllm_weights`` fp32 by default) keeps the committed context in its own KV cache and
denoises the block of ``max_depth`` masks after the root in one forward per step
(drafting/dllm_draft.py); the chain and the tree are built from its per-position distributions
as above. Measured on SmolLM2 with the shipped delta (docs/diffusion.md, "The dLLM as deer's
drafter"): 2.66 tokens per verify step against 1.13 for the learned network, but a full-size
forward a step, so slower than ``ar`` on a CPU (0.61x with ``dllm_weights=int8``, 0.23 to
0.29x in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.draft import Draft
from specdecode.drafting.dllm_draft import open_dllm
from specdecode.drafting.session import DraftSession
from specdecode.drafting.tree import grow_block_tree
from specdecode.errors import require
from specdecode.heads.drafter import BlockDraftLM
from specdecode.models.quant import check_format
from specdecode.proposer import Feedback, Proposer
from specdecode.proposers.draft_heads import HeadProposer, HeadTreeConfig
from specdecode.registry import param, register
from specdecode.sampling import sample

SHAPES = ("tree", "chain")
#: what drafts the block: the learned network (heads/networks.py) or the dLLM
#: (drafting/dllm_draft.py)
DRAFTERS = ("heads", "dllm")


@dataclass(frozen=True)
class DeerConfig(HeadTreeConfig):
    shape: str = param("tree", "tree: best-first by path probability over the block's "
                               "per-position distributions; chain: each position's top token "
                               "(greedy) or draw")
    tree_nodes: int = param(16, "draft size per verify step (node budget)", bounds=(1, 128))
    max_depth: int = param(8, "deepest draft node (at most the trained block)", bounds=(1, 32))
    expand_width: int = param(16, "with penalties (each node ranked on its own path): tree "
                                  "nodes ranked per growth round", bounds=(1, 64))
    max_forwards: int = param(16, "with penalties: most growth rounds per step after the "
                                  "first (each only ranks block rows already scored)",
                              bounds=(1, 32))
    min_path_prob: float = param(0.15, "stop growing (a chain: stop) below this path "
                                       "probability of the draft", bounds=(0.0, 1.0))
    drafter: str = param("heads", "what drafts the block: heads (the learned network on the "
                                  "target's features, `heads`) or dllm (the target adapted into "
                                  "a block-diffusion model, `dllm`: a full-size forward)")
    dllm: str = param("auto", "drafter=dllm: the dLLM delta, 'auto' (the newest `specdecode "
                              "train dllm` made for this target, or the shipped one) or a file")
    dllm_weights: str = param("fp32", "drafter=dllm: the dLLM's format on the native runner: "
                                      "fp32 (the delta exactly) | bf16 | int8 | int4 (rounded); "
                                      "the drafts may change, never the output")

    def __post_init__(self):
        super().__post_init__()
        require(self.shape in SHAPES, f"unknown shape {self.shape!r}; known: {', '.join(SHAPES)}")
        require(self.drafter in DRAFTERS,
                f"unknown drafter {self.drafter!r}; known: {', '.join(DRAFTERS)}")
        check_format(self.dllm_weights)


@register("deer", DeerConfig,
          paper="DEER (Cheng et al., 2025) with DFlash's feature conditioning; FR-Spec shortlist "
                "(Zhao et al., 2025); EAGLE-2 dynamic tree (Li et al., 2024)",
          summary="block diffusion drafter on the target's multi-layer features (drafter=dllm: "
                  "the small dLLM): a whole block in one forward; tree or chain; exact with "
                  "sampling")
class DeerProposer(HeadProposer):
    head_kind = "deer"
    draft_cache = BlockDraftLM

    def __init__(self, config, runner):
        if config.drafter == "heads":
            super().__init__(config, runner)
            return
        # the dLLM reads tokens, not the target's features: no heads, nothing asked of the target
        Proposer.__init__(self, config, runner)
        lm, self.draft_source = open_dllm(runner, config.dllm, config.max_depth,
                                          config.dllm_weights)
        self.session = DraftSession(lm)
        self.depth_limit = None

    def observe(self, feedback: Feedback) -> None:
        if self.config.drafter == "heads":
            super().observe(feedback)
        else:
            self.session.keep_accepted(feedback.accepted, feedback.draft)

    def propose(self, context, budget):
        if self.config.shape == "tree":
            return grow_block_tree(self.session, context, budget, self.config)
        return self._chain(context, budget)

    def _chain(self, context, budget) -> Draft:
        """Each block position's top token (greedy) or a draw from its distribution processed
        like the target's (recorded in ``probs``), while the path probability stays at or
        above ``min_path_prob``. A sampled position is valued before it is drawn (the expected
        draft probability of its draw, sum of q^2): whether it joins must not depend on the
        token it turns out to be, or the rejection rule would not keep the target's
        distribution."""
        length = min(self.config.max_depth, budget.max_depth, budget.max_nodes,
                     self.depth_limit or self.config.max_depth)
        self.session.nodes = ([], [], [])
        if length <= 0:
            return Draft.empty()
        self.session.begin_draft()
        self.lm.catch_up(context)
        block = self.lm.block_logits()[:length]
        if self.sampling.greedy and not self.sampling.adjusts_logits:
            return self._greedy_chain(block)
        tokens, probs, path_prob = [], [], 1.0
        for depth, logits in enumerate(block, 1):
            node = self.session.node(logits, list(context) + tokens)
            if self.sampling.greedy:
                token = node.argmax(0)
                path_prob *= float(node.penalised(0).softmax(-1)[token])
            else:
                q = node.probs(0)
                path_prob *= float((q * q).sum())
            if path_prob < self.config.min_path_prob:
                break
            if not self.sampling.greedy:
                # coupled: at the verifier's own uniform for this depth
                token = sample(q, self.session.generator, self.session.coupled_uniform(depth))
                if not self.session.coupled:
                    probs.append(q)
            tokens.append(token)
        self.session.nodes = (tokens, list(range(-1, len(tokens) - 1)), [None] * len(tokens))
        return Draft.chain(tokens, torch.stack(probs) if probs else None)

    def _greedy_chain(self, block: torch.Tensor) -> Draft:
        """Greedy without penalties: each row's top shortlist token, the whole block in a few
        tensor operations (what the loop above computes, without a [V] row per position)."""
        top = block.float().softmax(-1).max(-1)
        keep = int((top.values.cumprod(0) >= self.config.min_path_prob).sum())
        ids = top.indices[:keep]
        tokens = (ids if self.lm.head_ids is None else self.lm.head_ids[ids]).tolist()
        self.session.nodes = (tokens, list(range(-1, keep - 1)), [None] * keep)
        return Draft.chain(tokens)
