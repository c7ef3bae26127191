"""Token Recycling: the target's own top-k candidates, kept in an adjacency matrix, draft a
static tree (Luo et al., 2024, "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling", ACL 2025, arXiv 2408.08696).

Defaults: ``candidates=8`` (the paper's k) per token; tree ``chain2``, not the paper's "2.2.2"
template (80 nodes, 6 levels): on a CPU every draft row costs a share of a forward, and on the
kernel runner the 2-node chain was the fastest of the templates on the Spec-Bench dev half,
while 2.2.2 accepts the most tokens per step (docs/bench.md has the sweep). ``tree="2.2.2"``
gives the paper's.

State: ``M`` [V, k] int64, zero-initialised, kept on the proposer across requests. Row ``t``
holds the k most likely next tokens the target predicted the last time it saw ``t``.

Draft: the template is a list of paths of child ranks (``[0, 1]`` = the 2nd candidate of the
1st candidate of the root), compiled once into parent indices in breadth-first order. The root
is the last committed token; level by level, a node's token is ``M[parent's token, rank]``.

Update (``observe``): after each verify step, for the root and for EVERY draft node - accepted
or not - ``M[token] = topk(target logits at that node, k)``: the candidates of the whole
forward are recycled. One topk over all rows.

Worked example, k=2, template ``[[0], [1], [0, 0]]``, M[5] = (7, 9), M[7] = (3, 4), root 5:
level 1 gives 7 (rank 0) and 9 (rank 1), level 2 gives M[7, 0] = 3 under node 0, so
``Draft(tokens=(7, 9, 3), parents=(-1, -1, 0))``.

Our one deviation, ``prune_unseen`` (default on, measured in docs/recycling.md): a row never
written is all zeros, so the paper drafts eight copies of token 0 under a token never seen
before. We draft no children under such a token (with its whole subtree), which saves target
work and cannot change the output: the verifier decides every token.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass

import torch

from specdecode import kernels
from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.proposer import Feedback, Proposer
from specdecode.registry import param, register


def _paper_222() -> tuple[tuple[int, ...], ...]:
    """The paper's default template "2.2.2" (80 nodes, depth 6): at depth d the first
    candidates branch widest, as listed in the official ``tree_template_.py``."""
    by_depth = [
        # depth 1: all 8 candidates of the root
        [[r] for r in range(8)],
        # depth 2: 8 under rank 0, then 4, 3, 2, 1, 1, 1, 1
        [[p, r] for p, width in enumerate((8, 4, 3, 2, 1, 1, 1, 1)) for r in range(width)],
        # depth 3
        [[0, 0, r] for r in range(8)] + [[0, 1, r] for r in range(3)]
        + [[0, 2, r] for r in range(2)] + [[0, r, 0] for r in range(3, 8)]
        + [[1, 0, 0], [1, 0, 1], [1, 1, 0]] + [[r, 0, 0] for r in range(2, 6)],
        # depth 4
        [[0, 0, 0, r] for r in range(5)] + [[0, 0, 1, 0], [0, 0, 1, 1]]
        + [[0, 0, r, 0] for r in range(2, 5)] + [[0, 1, 0, 0], [0, 2, 0, 0]]
        + [[r, 0, 0, 0] for r in range(1, 4)],
        # depth 5
        [[0, 0, 0, 0, r] for r in range(3)] + [[0, 0, 0, 1, 0], [0, 0, 0, 2, 0],
                                               [0, 0, 1, 0, 0], [0, 1, 0, 0, 0], [1, 0, 0, 0, 0]],
        # depth 6
        [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0]],
    ]
    return tuple(tuple(path) for level in by_depth for path in level)


#: how often the target's next token was the r-th candidate of its row (r = 0..7): SmolLM2-135M,
#: greedy, one Spec-Bench dev prompt per task, 128 tokens, 80-node tree, all depths pooled
#: (docs/recycling.md). The rest of the mass is a miss or a row never written.
RANK_ACCEPT = (0.42, 0.09, 0.06, 0.03, 0.02, 0.02, 0.02, 0.02)

#: template names: "2.2.2" (the paper's), "chain<D>" (the first candidate, D deep) and
#: "best<N>" (the N nodes most likely accepted under RANK_ACCEPT)
TEMPLATE_NAMES = ("2.2.2", "chain<D>", "best<N>")
MAX_TEMPLATE_NODES = 256


def best_tree(n: int, accept=RANK_ACCEPT) -> tuple[tuple[int, ...], ...]:
    """The ``n`` rank paths with the highest acceptance chance, a path's chance being the
    product of ``accept[rank]`` along it (Medusa's and Sequoia's static-tree construction).
    ``accept`` must not increase with rank, so a node is never likelier than its parent or its
    earlier sibling: best-first from the root's first child, each taken node offers its first
    child and its next sibling, and the taken set is always a tree. Ties go to the shorter,
    then smaller path."""
    def entry(path):
        return -math.prod(accept[r] for r in path), len(path), path

    frontier = [entry((0,))]
    taken: list[tuple[int, ...]] = []
    while frontier and len(taken) < n:
        path = heapq.heappop(frontier)[2]
        taken.append(path)
        heapq.heappush(frontier, entry(path + (0,)))
        if path[-1] + 1 < len(accept):
            heapq.heappush(frontier, entry(path[:-1] + (path[-1] + 1,)))
    return tuple(taken)


def template_paths(name: str) -> tuple[tuple[int, ...], ...]:
    """A template name -> its paths of child ranks."""
    if name == "2.2.2":
        return _paper_222()
    match = re.fullmatch(r"(chain|best)([0-9]+)", name)
    require(match is not None and 1 <= int(match[2]) <= MAX_TEMPLATE_NODES,
            f"unknown tree template {name!r}; choose 2.2.2, chain<D> or best<N> "
            f"(D, N in 1..{MAX_TEMPLATE_NODES}), e.g. chain4 or best16")
    size = int(match[2])
    if match[1] == "chain":
        return tuple((0,) * d for d in range(1, size + 1))
    return best_tree(size)


@dataclass(frozen=True)
class CompiledTemplate:
    """A template as tensors, nodes in breadth-first order (parents before children)."""

    parents: torch.Tensor  # [n] long, -1 = child of the root
    ranks: torch.Tensor  # [n] long, which of the parent's k candidates
    depths: torch.Tensor  # [n] long, 1 = child of the root
    #: levels[d - 1] = slice of the nodes at depth d
    levels: tuple[slice, ...]

    def __len__(self) -> int:
        return len(self.parents)


def compile_template(paths, candidates: int) -> CompiledTemplate:
    """Paths of child ranks -> parent indices; rejects templates that are not trees."""
    paths = [tuple(int(r) for r in p) for p in paths]
    require(len(paths) > 0, "the tree template is empty; give at least one path such as [0]")
    require(len(set(paths)) == len(paths), "the tree template lists a path twice")
    known = set(paths)
    for path in paths:
        require(len(path) > 0, "a tree template path is empty; the root is implicit")
        require(all(0 <= r < candidates for r in path),
                f"template path {list(path)} uses a rank outside 0..{candidates - 1}; raise "
                f"candidates or use smaller ranks")
        require(len(path) == 1 or path[:-1] in known,
                f"template path {list(path)} has no parent path {list(path[:-1])}; "
                "list every prefix of every path")
    # breadth-first: by depth, then by ranks, so a prefix of the nodes is a smaller tree
    paths.sort(key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
    depths = [len(p) for p in paths]
    levels, start = [], 0
    for d in range(1, max(depths) + 1):
        end = start + depths.count(d)
        levels.append(slice(start, end))
        start = end
    return CompiledTemplate(torch.tensor(parents, dtype=torch.long),
                            torch.tensor([p[-1] for p in paths], dtype=torch.long),
                            torch.tensor(depths, dtype=torch.long), tuple(levels))


def draft_tree(matrix: torch.Tensor, template: CompiledTemplate, root: int, max_depth: int,
               max_nodes: int, seen: torch.Tensor | None = None) -> Draft:
    """Breadth-first over ``template`` from ``root``: node i gets ``matrix[parent token,
    rank i]``. Nodes deeper than ``max_depth`` and past the first ``max_nodes`` are dropped; with
    ``seen`` [V] bool, so are the subtrees under tokens whose row was never written."""
    n = len(template)
    tokens = torch.empty(n, dtype=torch.long)
    parent_tokens = torch.full((n,), root, dtype=torch.long)  # [n], the root for level 1
    for level in template.levels:
        if level.start > 0:
            parent_tokens[level] = tokens[template.parents[level]]
        tokens[level] = matrix[parent_tokens[level], template.ranks[level]]
    keep = template.depths <= max_depth
    if seen is not None:
        keep &= seen[parent_tokens]
        for level in template.levels[1:]:
            keep[level] &= keep[template.parents[level]]
    # breadth-first order puts ancestors first, so the first max_nodes survivors form a tree
    keep &= torch.cumsum(keep, 0) <= max(max_nodes, 0)
    new_index = torch.cumsum(keep, 0) - 1
    parents = torch.where(template.parents >= 0, new_index[template.parents.clamp(min=0)], -1)
    return Draft(tokens[keep].tolist(), parents[keep].tolist())


@dataclass(frozen=True)
class RecyclingConfig:
    # not "top_k": specdecode.generate() routes that name to the sampling options
    candidates: int = param(8, "k, the candidate successors kept per token in the adjacency "
                               "matrix (paper: 8)", bounds=(1, 64),
                            # the int64 [V, candidates] successor matrix and its [V] row flags
                            memory=lambda candidates, vocab: vocab * (8 * candidates + 1))
    tree: str = param("chain2", "static tree template: 2.2.2 (the paper's, 80 nodes, depth 6), "
                                "chain<D> (the first candidate, D deep) or best<N> (the N nodes "
                                "most often accepted on SmolLM2); chain2 measured fastest on "
                                "the CPU kernel runner")
    prune_unseen: bool = param(True, "draft nothing under a token whose row was never written "
                                     "(ours; the paper drafts token 0 there)")

    def __post_init__(self):
        require(self.candidates >= 1, f"candidates must be >= 1, got {self.candidates}")
        ranks = max(r for path in template_paths(self.tree) for r in path) + 1
        require(self.candidates >= ranks,
                f"tree template {self.tree!r} uses {ranks} candidates per token but candidates "
                f"is {self.candidates}; set candidates >= {ranks}")


@register("recycling", RecyclingConfig,
          paper="Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696)",
          summary="the target's own top-k candidates from earlier steps, kept in a token "
                  "adjacency matrix across requests, fill a static 80-node tree")
class RecyclingProposer(Proposer):
    samples_drafts = False  # recycled top-k successors
    def __init__(self, config: RecyclingConfig, runner):
        super().__init__(config, runner)
        self.template = compile_template(template_paths(config.tree), config.candidates)
        #: M[t] = the top-k successors last predicted after token t (kept across requests)
        self.matrix = torch.zeros(runner.vocab_size, config.candidates, dtype=torch.long)
        #: whether row t was ever written (only read when prune_unseen is set)
        self.seen = torch.zeros(runner.vocab_size, dtype=torch.bool)

    def propose(self, context, budget):
        seen = self.seen if self.config.prune_unseen else None
        return draft_tree(self.matrix, self.template, int(context[-1]), budget.max_depth,
                          budget.max_nodes, seen)

    def observe(self, feedback: Feedback) -> None:
        if feedback.prefill:  # learns from verify steps only
            return
        # the accepted rows last, so that where a token sits on several rows the row of the
        # committed path writes its candidates (the last row of a token wins)
        accepted = [0] + [1 + i for i in feedback.accepted]
        taken = set(accepted)
        order = [i for i in range(feedback.logits.shape[0]) if i not in taken] + accepted
        tokens = (int(feedback.context[-1]),) + feedback.draft.tokens
        last = {tokens[i]: j for j, i in enumerate(order)}
        # one pass over the vocabulary a row (the kernels' top_probs: 0.15 ms for three rows of
        # 151,936 where torch's topk takes 0.42)
        _, top = kernels.top_probs(feedback.logits[order].float().contiguous(),
                                   self.config.candidates)
        rows = torch.tensor(list(last), dtype=torch.long)
        self.matrix[rows] = top[list(last.values())].to(self.matrix.device)
        self.seen[rows] = True
