"""DySpec: a dynamic draft tree grown greedily from a draft model's probabilities (Xiong et al.,
2024, "DySpec: Faster Speculative Decoding with Dynamic Token Tree Structure").

Draft probability predicts acceptance, so the tree is grown best-first: every candidate node
is valued by the product of draft probabilities along its path, and the most valuable
candidate joins the tree until ``tree_nodes`` nodes are placed (or ``max_depth`` is reached).
A node's children are known only after the draft model has read the node, so growth runs in
rounds: place candidates while the best one has a read parent; when the best one needs a draft
forward, read the (up to ``expand_width``) most valuable unread nodes in one batched forward,
which is what bounds the draft's cost at a few forwards per step on CPU.

Siblings are drawn *without replacement* (RSD, Jeon et al., 2024): greedy decoding takes them
in order of draft probability; sampled decoding draws them by Gumbel-top-k from the draft
distribution processed like the target's, and ``Draft.probs[i]`` is the distribution node i was
actually drawn from (the draft distribution with its earlier siblings removed, renormalised), so
the verifier's recursive rejection sampling keeps the target's distribution exactly. For that,
whether a sampled sibling joins the tree must not depend on the token it turns out to be: a
sibling candidate is valued before it is drawn, by its parent's value times the expected draft
probability of the next draw (sum of q(x)^2 over the undrawn tokens, over their mass). Greedy
values use the actual draft probabilities (nothing random to bias).

The same draft model and artifacts as ``draft_model`` (see draft_model.py), on the native
runner by default (int4 where its sizes allow), whose tree rows attend to their ancestors
through the same slot tables as the target's verify pass; ``draft_runner=hf`` runs it through
``transformers`` with a mask.
A node is worth its verify row only if it is likely to be accepted: ``min_path_prob`` stops the
growth when the best candidate's value falls below it (EAGLE-2's observation that draft
confidence predicts acceptance), so an uncertain step sends a small tree or none.
Defaults: 16 nodes (on a CPU each verify row costs a share of a one-token forward, so the
tree stays small; docs/native-runner.md has the row costs), depth 8, 4 nodes read per draft
forward (a small draft's forward costs nearly the same for 1 or 4 rows), at most 6 such forwards
a step (a weak draft's flat distributions otherwise take up to one forward per node), and growth
stops below a path probability of 0.2 (much faster than full trees on the dev half with the
native int4 draft, and as fast as higher floors; docs/draft-model.md#measured has the sweep).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch

from specdecode.control import Controller
from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.proposers.draft_model import DraftModelProposer, DraftSource
from specdecode.registry import param, register
from specdecode.sampling import NodeDistributions


@dataclass(frozen=True)
class DySpecConfig(DraftSource):
    tree_nodes: int = param(16, "draft tree size per verify step (node budget)")
    max_depth: int = param(8, "deepest draft node")
    expand_width: int = param(4, "most tree nodes the draft model reads in one forward")
    max_forwards: int = param(6, "most draft forwards per step after the catch-up (bounds the "
                                 "draft's cost like a 7-token chain; the tree placed so far is "
                                 "sent when they run out)")
    min_path_prob: float = param(0.2, "stop growing when the best candidate's path probability "
                                      "(its expected acceptance) is below this (0: fill the "
                                      "node budget; 0.2 is much faster than 0 on the dev "
                                      "half, docs/draft-model.md)")

    def __post_init__(self):
        super().__post_init__()
        check_tree(self)


def check_tree(config) -> None:
    """The tree-growth settings every dynamic-tree config shares, checked with the fix named."""
    require(config.tree_nodes >= 1, f"tree_nodes must be >= 1, got {config.tree_nodes} (a draft "
                                    "of 0 nodes drafts nothing: use method 'ar')")
    require(config.max_depth >= 1, f"max_depth must be >= 1, got {config.max_depth}")
    require(config.expand_width >= 1, f"expand_width must be >= 1, got {config.expand_width}")
    require(config.max_forwards >= 0, f"max_forwards must be >= 0, got {config.max_forwards}")
    require(0 <= config.min_path_prob < 1,
            f"min_path_prob must be in [0, 1), got {config.min_path_prob}")


class _Children:
    """The ranked candidate children of a node the draft model has read."""

    def __init__(self, order: torch.Tensor, q: torch.Tensor, sampled: bool):
        self.order = order.tolist()  # tokens, in the order siblings are drawn
        self.q = q  # [V] the node's draft distribution (values; the draws when sampled)
        self.sampled = sampled
        self.taken = 0
        self.drawn: list[int] = []

    def next_weight(self) -> float:
        """How likely the next sibling is to be the target's token, known before it is drawn."""
        if self.taken >= len(self.order):
            return 0.0
        if not self.sampled:
            return float(self.q[self.order[self.taken]])
        rest = self.q.clone()
        rest[self.drawn] = 0.0
        mass = float(rest.sum())
        return float((rest * rest).sum()) / mass if mass > 0 else 0.0

    def take(self) -> tuple[int, torch.Tensor | None]:
        """The next sibling and the distribution it was drawn from (None when greedy)."""
        token = self.order[self.taken]
        self.taken += 1
        drawn_from = None
        if self.sampled:
            drawn_from = self.q.clone()
            drawn_from[self.drawn] = 0.0
            drawn_from /= drawn_from.sum()
        self.drawn.append(token)
        return token, drawn_from


@register("dyspec", DySpecConfig,
          paper="DySpec (Xiong et al., 2024); siblings without replacement as in RSD (Jeon et "
                "al., 2024)",
          summary="a draft model grows a tree best-first by path probability under a node "
                  "budget; exact with sampling")
class DySpecProposer(DraftModelProposer):
    def make_controller(self) -> Controller:
        return Controller(self.config.max_depth, self.config.tree_nodes)

    def _children(self, logits: torch.Tensor, path: list[int], limit: int) -> _Children:
        full = self.lm.full_logits(logits[None])
        node = NodeDistributions(full, self.sampling, path, self._prompt_len, Draft.empty())
        if self.sampling.greedy:
            q = node.penalised(0).softmax(-1)
            order = q.topk(min(limit, int((q > 0).sum()))).indices
            return _Children(order, q, False)
        q = node.probs(0)
        # Gumbel-top-k: sorting log q + Gumbel noise draws without replacement from q
        noise = -torch.log(-torch.log(torch.rand(q.shape, generator=self.generator,
                                                 dtype=torch.float64).clamp_min(1e-300)))
        keys = torch.where(q > 0, q.double().log() + noise, float("-inf"))
        order = keys.topk(min(limit, int((q > 0).sum()))).indices
        return _Children(order, q, True)

    def propose(self, context, budget):
        budget_nodes = min(self.config.tree_nodes, budget.max_nodes)
        max_depth = min(self.config.max_depth, budget.max_depth)
        if budget_nodes <= 0 or max_depth <= 0:
            self._nodes = ([], [], [])
            return Draft.empty()
        logits, _ = self.lm.catch_up(context)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[torch.Tensor] = []
        values: list[float] = []
        rows: list[int | None] = []
        paths: list[list[int]] = []
        children = {-1: self._children(logits, list(context), budget_nodes)}
        tie = itertools.count()
        # entries: (-value, tie, node, read): read = node's children are ranked (take the next
        # one); unread = the node must be fed to the draft model first (value: an upper bound)
        heap = [(-children[-1].next_weight(), next(tie), -1, True)]
        forwards = 0
        while heap and len(tokens) < budget_nodes:
            value, _, node, read = heap[0]
            if -value <= 0 or -value < self.config.min_path_prob:
                break
            if read:
                heapq.heappop(heap)
                ranked = children[node]
                parent_value = 1.0 if node < 0 else values[node]
                token, drawn_from = ranked.take()
                tokens.append(token)
                parents.append(node)
                values.append(parent_value * float(ranked.q[token]))
                rows.append(None)
                paths.append(([] if node < 0 else paths[node]) + [token])
                if drawn_from is not None:
                    probs.append(drawn_from)
                new = len(tokens) - 1
                heapq.heappush(heap, (-parent_value * ranked.next_weight(), next(tie), node, True))
                depth = len(paths[new])
                if depth < max_depth:
                    heapq.heappush(heap, (-values[new], next(tie), new, False))
                continue
            if forwards == self.config.max_forwards:
                break
            forwards += 1
            # read the most valuable unread nodes that could still join, in one forward
            room = budget_nodes - len(tokens)
            unread = [e for e in heapq.nsmallest(room, heap) if not e[3]][: self.config.expand_width]
            feed = [e[2] for e in unread]
            heap = [e for e in heap if e[3] or e[2] not in feed]
            heapq.heapify(heap)
            first_row = len(self.lm.tree_tokens)
            out, _ = self.lm.feed([tokens[n] for n in feed],
                                  [-1 if parents[n] < 0 else rows[parents[n]] for n in feed])
            for j, n in enumerate(feed):
                rows[n] = first_row + j
                children[n] = self._children(out[j], list(context) + paths[n], room)
                heapq.heappush(heap, (-values[n] * children[n].next_weight(), next(tie), n, True))
        self._nodes = (tokens, parents, rows)
        return Draft(tuple(tokens), tuple(parents), torch.stack(probs) if probs else None)
