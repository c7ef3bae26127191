"""ADED: an adaptive tri-gram matrix stands in for the target, and a Monte-Carlo-tree-search
draft maker turns it into a draft tree (Liu, Lei, Zhang, Xu, 2024, "Adaptive Draft-Verification
for Efficient Large Language Model Decoding", arXiv 2407.12021; its code,
anonymous.4open.science/r/ADED-C7D5, was not reachable, so this follows the paper's text).

**The LLM representative.** A tri-gram matrix: ``counts[(a, b)][c]`` = how often c followed the
pair (a, b). It starts from the prompt (the paper warm-starts it from a corpus; we have none
offline, so every request's prompt and output feed it, and it is kept across requests) and is
updated online with every verified token, so it adapts to what the target actually writes. Its
normalised row is the prior ``P(c | a, b)``.

**The draft maker.** A search tree over continuations of the context, rooted at its last two
tokens, grown by ``simulations`` rounds of PUCT selection (the AlphaZero rule the paper uses):

    select  from the root, descend into the child maximising
            Q(child) + c_puct * P(child) * sqrt(N(node)) / (1 + N(child))
            (ties: the larger prior), until a node not yet expanded or the depth limit
    expand  give the leaf its ``branch`` most frequent successors under the tri-gram matrix
    value   the leaf's path probability, the product of the priors along it: the representative's
            estimate that the target accepts the whole path
    backup  N += 1 and the value is added to the running mean Q of every node on the path

The draft is the visited nodes: many visits where the representative is confident (deep chains),
a few sibling branches where it hesitates (exploration). The engine's tree verifier checks it; a
deterministic draft, so sampled decoding stays exact through ancestral sampling.

Our addition, ``learn_from_target`` (measured, docs/parallel-decoding.md): the target's argmax at
every draft node also counts as an observed tri-gram (pair = the node's last two tokens), as Token
Recycling does with its matrix, so rejected branches still teach the representative. Unverified
predictions only shape drafts; the verifier decides every token.

Worked example: counts {(1, 2): {3: 3, 4: 1}, (2, 3): {5: 2}}, context ending 1, 2. The first
simulation expands the root: 3 (P = 0.75) and 4 (P = 0.25). The second takes 3 (score 0.75
against 0.25) and expands it with 5 (P = 1, path probability 0.75); the third descends 3 -> 5.
Q(3) stays 0.75 while 4's exploration term grows as sqrt(N(root)): 4 is first visited in the
16th simulation, so 15 simulations draft the chain (3, 5) and 16 add the branch 4.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.proposer import Feedback, Proposer, target_argmax
from specdecode.registry import param, register


class TrigramMatrix:
    """``counts[(a, b)]`` = Counter of the tokens seen after the pair (a, b)."""

    def __init__(self):
        self.counts: dict[tuple[int, int], Counter] = {}

    def add(self, a: int, b: int, c: int) -> None:
        self.counts.setdefault((a, b), Counter())[c] += 1

    def add_text(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        for a, b, c in zip(tokens, tokens[1:], tokens[2:]):
            self.add(a, b, c)

    def successors(self, a: int, b: int, k: int) -> list[tuple[int, float]]:
        """The k most frequent tokens after (a, b) with their probabilities; ties go to the token
        seen first (Counter keeps insertion order and the sort is stable)."""
        row = self.counts.get((a, b))
        if not row:
            return []
        total = sum(row.values())
        return [(token, count / total) for token, count in
                sorted(row.items(), key=lambda item: -item[1])[:k]]


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    prior: float
    #: product of the priors from the root down to this node
    path_prob: float
    children: list[int] = field(default_factory=list)
    expanded: bool = False
    visits: int = 0
    value_sum: float = 0.0


def search(matrix: TrigramMatrix, context, simulations: int, branch: int, c_puct: float,
           max_depth: int, max_nodes: int) -> Draft:
    """PUCT search over the tri-gram matrix from the end of ``context``; the visited nodes,
    at most ``max_nodes`` of them (the most visited), form the draft."""
    if len(context) < 2 or max_depth <= 0 or max_nodes <= 0:
        return Draft.empty()
    nodes = [_Node(int(context[-1]), -1, 0, 1.0, 1.0)]
    pair_before = int(context[-2])

    def pair(index: int) -> tuple[int, int]:
        node = nodes[index]
        before = pair_before if node.parent < 0 else nodes[node.parent].token
        return before, node.token

    for _ in range(simulations):
        path = [0]
        node = nodes[0]
        while node.expanded and node.children:
            scale = c_puct * math.sqrt(node.visits)

            def score(child: int) -> tuple[float, float]:
                c = nodes[child]
                q = c.value_sum / c.visits if c.visits else 0.0
                return q + scale * c.prior / (1 + c.visits), c.prior

            path.append(max(node.children, key=score))
            node = nodes[path[-1]]
        if not node.expanded and node.depth < max_depth:
            node.expanded = True
            for token, prior in matrix.successors(*pair(path[-1]), branch):
                node.children.append(len(nodes))
                nodes.append(_Node(token, path[-1], node.depth + 1, prior,
                                   node.path_prob * prior))
        value = node.path_prob
        for index in path:
            nodes[index].visits += 1
            nodes[index].value_sum += value
    visited = [i for i in range(1, len(nodes)) if nodes[i].visits > 0]
    # a parent has at least its child's visits, and comes first among equals: a tree
    kept = sorted(sorted(visited, key=lambda i: (-nodes[i].visits, nodes[i].depth, i))[:max_nodes])
    new_index = {0: -1} | {old: new for new, old in enumerate(kept)}  # node 0 is the root
    return Draft(tuple(nodes[i].token for i in kept),
                 tuple(new_index[nodes[i].parent] for i in kept))


@dataclass(frozen=True)
class ADEDConfig:
    simulations: int = param(4, "PUCT rounds per step; each visits one leaf, so this also bounds "
                                "the draft tree (4 was fastest on dev, 24 accepted most: "
                                "docs/parallel-decoding.md)", bounds=(1, 256))
    branch: int = param(4, "successors expanded per node, the tri-gram matrix's top-k",
                        bounds=(1, 32))
    c_puct: float = param(1.0, "exploration weight of PUCT (AlphaZero's usual 1.0; the paper "
                               "gives no value we could read)", bounds=(0.0, 100.0))
    max_depth: int = param(12, "deepest draft node", bounds=(1, 64))
    learn_from_target: bool = param(False, "also count the target's argmax at every draft node "
                                           "as a tri-gram (ours, as in Token Recycling; off: it "
                                           "did not change tau on dev)")

    def __post_init__(self):
        require(isinstance(self.simulations, int) and 1 <= self.simulations <= 256,
                f"simulations must be an integer in 1..256, got {self.simulations!r}")
        require(isinstance(self.branch, int) and self.branch >= 1,
                f"branch must be an integer >= 1, got {self.branch!r}")
        require(math.isfinite(self.c_puct) and self.c_puct >= 0,
                f"c_puct must be a finite number >= 0, got {self.c_puct}")
        require(isinstance(self.max_depth, int) and self.max_depth >= 1,
                f"max_depth must be an integer >= 1, got {self.max_depth!r}")


@register("aded", ADEDConfig,
          paper="ADED (Liu, Lei, Zhang, Xu, 2024, arXiv 2407.12021)",
          summary="an adaptive tri-gram matrix, learnt online across requests, drafts a tree "
                  "by PUCT search")
class ADEDProposer(Proposer):
    samples_drafts = False  # n-gram lookups
    def __init__(self, config: ADEDConfig, runner):
        super().__init__(config, runner)
        #: kept across requests
        self.matrix = TrigramMatrix()
        self._prompt_len = 0

    def start(self, prompt):
        self._prompt_len = len(prompt)
        self.matrix.add_text(prompt)

    def propose(self, context, budget):
        config = self.config
        return search(self.matrix, context, config.simulations, config.branch, config.c_puct,
                      min(config.max_depth, budget.max_depth), budget.max_nodes)

    def observe(self, feedback: Feedback) -> None:
        if feedback.prefill:  # learns from verify steps only
            return
        context, draft = feedback.context, feedback.draft
        if self.config.learn_from_target and len(context) >= 2:
            # the pair before each row: (token before the node, the node's token); row 0 = root
            predicted = target_argmax(feedback, range(len(draft) + 1), self.sampling,
                                      self._prompt_len)
            tokens = (int(context[-1]),) + draft.tokens
            before = [int(context[-2])] + [tokens[p + 1] for p in draft.parents]
            for a, b, c in zip(before, tokens, predicted):
                self.matrix.add(a, b, c)
        # the verified tokens: every tri-gram that ends in one of them
        self.matrix.add_text(list(context[-2:]) + list(feedback.tokens))
