"""Best-first growth of a draft tree from a draft cache's probabilities (DySpec, Xiong et al.,
2024; EAGLE-2's dynamic tree, Li et al., 2024), for ``dyspec`` and the head proposers.

Every candidate node is valued by the product of draft probabilities along its path, and the
most valuable candidate joins the tree until the node budget is placed (or the depth limit is
reached). A node's children are known only after the drafter has read the node, so growth runs
in rounds: place candidates while the best one has a read parent; when the best one needs a
draft forward, read the (up to ``expand_width``) most valuable unread nodes in one batched
forward, which is what bounds the draft's cost at a few forwards per step on CPU. Growth stops
when the best candidate's value falls below ``min_path_prob`` (draft confidence predicts
acceptance: an uncertain step sends a small tree or none). An unread node is valued by its own
value times the running mean of the best child's probability of the nodes read before
(:attr:`DraftSession.child_confidence`): a read whose children would all fall below the floor
costs a forward and places nothing, and where acceptance is low most reads would.

Siblings are drawn *without replacement* (RSD, Jeon et al., 2024): greedy decoding takes them
in order of draft probability; sampled decoding draws each, when it joins, from the draft
distribution processed like the target's less the siblings drawn before it (the order
Gumbel-top-k would give, drawn only as far as the tree takes it), and ``Draft.probs[i]`` is
the distribution node i was actually drawn from (the draft distribution with its earlier
siblings removed, renormalised), so the verifier's recursive rejection sampling keeps the
target's distribution exactly. For that, whether a sampled sibling joins the tree must not
depend on the token it turns out to be: a sibling candidate is valued before it is drawn, by
its parent's value times the expected draft probability of the next draw (sum of q(x)^2 over
the undrawn tokens, over their mass). Greedy values use the actual draft probabilities
(nothing random to bias).

A coupled tree (drafting/session.py) draws each node's first child at the uniform the
verifier will draw at that child's depth, so the tree holds the chain the verifier's walk
follows where the draft agrees, its later siblings as guesses where it does not; it goes
without probabilities and the walk commits ``ar``'s tokens whatever it holds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

import torch

from specdecode import kernels
from specdecode.control import Budget
from specdecode.draft import Draft
from specdecode.drafting.session import DraftSession
from specdecode.errors import require
from specdecode.sampling import sample


#: how fast :attr:`DraftSession.child_confidence` follows the nodes read (a read a node: about
#: the last ten reads, a few steps)
CONFIDENCE_RATE = 0.1
#: the lowest child confidence: above it a confident root child is still read, so the mean
#: keeps learning where drafts get easier
CONFIDENCE_FLOOR = 0.3


def check_tree(config) -> None:
    """The tree-growth settings every dynamic-tree config shares, checked with the fix named."""
    require(config.tree_nodes >= 1, f"tree_nodes must be >= 1, got {config.tree_nodes} (a draft "
                                    "of 0 nodes drafts nothing: use method 'ar')")
    require(config.max_depth >= 1, f"max_depth must be >= 1, got {config.max_depth}")
    require(config.expand_width >= 1, f"expand_width must be >= 1, got {config.expand_width}")
    require(config.max_forwards >= 0, f"max_forwards must be >= 0, got {config.max_forwards}")
    require(0 <= config.min_path_prob < 1,
            f"min_path_prob must be in [0, 1), got {config.min_path_prob}")


class _Ranked:
    """Greedy candidate children of a node the drafter has read: tokens in rank order with their
    draft probabilities, taken in that order."""

    def __init__(self, order: list[int], values: list[float]):
        self.order = order
        self.values = values
        self.taken = 0

    def next_weight(self) -> float:
        """The next sibling's draft probability (0 when none is left)."""
        return self.values[self.taken] if self.taken < len(self.order) else 0.0

    def take(self) -> tuple[int, None, float]:
        """The next sibling, None (no distribution is recorded greedy) and its probability."""
        self.taken += 1
        return self.order[self.taken - 1], None, self.values[self.taken - 1]

    def again(self) -> _Ranked:
        """The same ranking, none of it taken (one ranking shared by several nodes)."""
        return _Ranked(self.order, self.values)


class _Drawn:
    """Sampled candidate children of a node the drafter has read: each drawn as it joins from
    the node's draft distribution less the siblings drawn before it (sampling without
    replacement, RSD)."""

    def __init__(self, small: torch.Tensor, ids: torch.Tensor | None, q: torch.Tensor,
                 generator: torch.Generator, limit: int, first_u: float | None = None):
        """At most ``limit`` siblings from ``small`` [V'], the draft distribution on the tokens
        ``ids`` (None: every token), which is ``q`` [V] on the vocabulary; the first drawn at
        the uniform ``first_u`` where given (a coupled draft's, session.py), the others with
        ``generator``."""
        self.small, self.ids, self.q, self.generator = small, ids, q, generator
        self.first_u = first_u
        self.available = min(limit, int((small > 0).sum()))
        self.drawn: list[int] = []  # indices into small
        # the undrawn tokens' mass and sum of squares, less each drawn sibling's share
        self._mass, self._squares = float(small.sum()), float((small * small).sum())

    def next_weight(self) -> float:
        """How likely the next sibling is to be the target's token, known before it is drawn."""
        if len(self.drawn) >= self.available or self._mass <= 1e-12:
            return 0.0
        return max(self._squares, 0.0) / self._mass

    def take(self) -> tuple[int, torch.Tensor, float]:
        """The next sibling, the distribution it was drawn from and its draft probability."""
        rest, drawn_from = self.small, self.q
        if self.drawn:  # the earlier siblings' tokens out
            rest, drawn_from = rest.clone(), drawn_from.clone()
            rest[self.drawn] = 0.0
            drawn_from[self.drawn if self.ids is None else self.ids[self.drawn]] = 0.0
        index = sample(rest, self.generator, None if self.drawn else self.first_u)
        prob = float(self.small[index])
        self.drawn.append(index)
        self._mass -= prob
        self._squares -= prob * prob
        token = index if self.ids is None else int(self.ids[index])
        return token, drawn_from / drawn_from.sum(), prob


_Children = _Ranked | _Drawn


def rank_children(session: DraftSession, logits: torch.Tensor, context: Sequence[int],
                  paths: Sequence[Sequence[int]], limit: int) -> list[_Children]:
    """The ranked candidate children (at most ``limit`` each) of nodes the drafter has read,
    from their shortlist logits [k, V']; ``paths[j]``: node j's path after the committed
    ``context``."""
    sampling, head_ids = session.sampling, getattr(session.lm, "head_ids", None)
    if sampling.greedy and not sampling.adjusts_logits:
        return _shortlist_children(logits, head_ids, limit)
    return [_node_children(session, row, [*context, *path], limit, len(path) + 1)
            for row, path in zip(logits, paths)]


def _node_children(session: DraftSession, logits: torch.Tensor, path: Sequence[int],
                   limit: int, depth: int) -> _Children:
    """The candidate children, at ``depth``, of a node whose committed context plus path is
    ``path``."""
    shortlisted = None if session.sampling.greedy else session.shortlist_probs(logits)
    if shortlisted is not None:
        small, q = shortlisted
        return _Drawn(small, session.lm.head_ids, q, session.generator, limit,
                      session.coupled_uniform(depth))
    node = session.node(logits, path)  # the vocabulary's logits [V]: only where needed
    if session.sampling.greedy:
        q = node.penalised(0).softmax(-1)
        top = q.topk(min(limit, int((q > 0).sum())))
        return _Ranked(top.indices.tolist(), top.values.tolist())
    q = node.probs(0)
    return _Drawn(q, None, q, session.generator, limit, session.coupled_uniform(depth))


def _shortlist_children(logits: torch.Tensor, head_ids: torch.Tensor | None,
                        limit: int) -> list[_Ranked]:
    """Greedy children without penalties, every node of a drafter call at once (no
    distributions built per node): ranked within the shortlist, the same ranking and (up to
    rounding) the same probabilities as over the whole vocabulary, whose other tokens have
    probability 0, at a sixth of the work; or over the whole vocabulary (``head_ids`` None)."""
    limit = min(limit, logits.shape[-1])
    if kernels.available():  # one kernel call: a softmax and a top-k cost 40 us at 4 nodes
        probs, indices = kernels.top_probs(logits.float().contiguous(), limit)
    else:
        probs, indices = logits.float().softmax(-1).topk(limit, -1)
    orders = (indices if head_ids is None else head_ids[indices]).tolist()
    values = probs.tolist()
    children = []
    for order, value in zip(orders, values):
        kept = sum(1 for v in value if v > 0)  # never a token of probability 0
        children.append(_Ranked(order[:kept], value[:kept]))
    return children


def grow_tree(session: DraftSession, context: Sequence[int], budget: Budget, settings,
              ranking: Callable[[int], _Children] | None = None) -> Draft:
    """A draft tree after ``context`` from ``session``'s drafter, best-first under the node
    and depth budget; ``settings``: a config with ``tree_nodes``, ``max_depth``,
    ``expand_width``, ``max_forwards`` and ``min_path_prob`` (see :func:`check_tree`). The
    session records each node's tree row, for :meth:`DraftSession.keep_accepted`.
    ``ranking(depth)``: the candidate children of any node at ``depth`` (0: the root's), for a
    drafter that scores every depth in the forward of ``catch_up`` (:func:`grow_block_tree`):
    a node is then ranked as it is reached, with no drafter call."""
    budget_nodes = min(settings.tree_nodes, budget.max_nodes)
    max_depth = min(settings.max_depth, budget.max_depth)
    if budget_nodes <= 0 or max_depth <= 0:
        session.nodes = ([], [], [])
        return Draft.empty()
    session.begin_draft()
    logits, _ = session.catch_up(context)
    # a drafter that ranks every depth without reading (ranking) values a node's children
    # by the node's own value, their bound: its reads cost nothing
    tree = _Growth(session, context, max_depth,
                   1.0 if ranking is not None else session.child_confidence)
    tree.rank(-1, ranking(0) if ranking is not None else
              rank_children(session, logits[None], context, [[]], budget_nodes)[0])
    # entries: (-value, tie, node, read): read = node's children are ranked (take the next
    # one); unread = the node must be fed to the drafter first (value: an estimate)
    forwards = 0
    while tree.heap and len(tree.tokens) < budget_nodes:
        value, _, node, read = tree.heap[0]
        if -value <= 0 or -value < settings.min_path_prob:
            break
        if read or ranking is not None:
            heapq.heappop(tree.heap)
            if read:
                tree.place_child(node)
            else:
                tree.rank(node, ranking(len(tree.paths[node])))
            continue
        if forwards == settings.max_forwards:
            break
        forwards += 1
        tree.read_best(budget_nodes - len(tree.tokens), settings.expand_width)
    session.nodes = (tree.tokens, tree.parents, tree.rows)
    # learned after the growth, so the sampled tree's shape never follows its own draws
    for best_child in tree.read_best_children:
        session.child_confidence = max(
            CONFIDENCE_FLOOR, session.child_confidence
            + CONFIDENCE_RATE * (best_child - session.child_confidence))
    probs = torch.stack(tree.probs) if tree.probs and not session.coupled else None
    return Draft(tuple(tree.tokens), tuple(tree.parents), probs)


def grow_block_tree(session: DraftSession, context: Sequence[int], budget: Budget,
                    settings) -> Draft:
    """:func:`grow_tree` for a drafter that scores every depth of the draft in one forward
    (``deer``'s block: a node at depth d is scored by block row d whatever its path): the
    same best-first growth and sampling rules, with each depth's ranking made once (greedy:
    every node of a depth has the same ranked children; sampled: the same distribution, and
    each node its own draws from it) and no drafter call after the first. With penalties
    (each node's distribution reads its own path) or a cut that reads token ids, or sampled
    over a drafter's whole vocabulary, the drafter is asked node by node."""
    head_ids = getattr(session.lm, "head_ids", None)
    sampled = not session.sampling.greedy
    if session.sampling.reads_token_ids or (sampled and head_ids is None):
        return grow_tree(session, context, budget, settings)
    limit = min(settings.tree_nodes, budget.max_nodes)
    depths: dict[int, object] = {}  # each depth's ranking (greedy) or distributions (sampled)

    def ranking(depth: int) -> _Children:
        block = session.lm.block_logits()  # scored by grow_tree's catch_up
        if sampled:
            if depth not in depths:
                depths[depth] = session.shortlist_probs(block[depth])
            small, q = depths[depth]
            return _Drawn(small, head_ids, q, session.generator, limit,
                          session.coupled_uniform(depth + 1))
        if not depths:
            depths.update(enumerate(_shortlist_children(block[:settings.max_depth], head_ids,
                                                        limit)))
        return depths[depth].again()
    return grow_tree(session, context, budget, settings, ranking)


class _Growth:
    """A tree while it grows: its nodes, their values and tree rows, the candidates' heap."""

    def __init__(self, session: DraftSession, context: Sequence[int], max_depth: int,
                 child_confidence: float):
        self.session = session
        self.context = context  # read only: no copy of a long context a step
        self.max_depth = max_depth
        self.child_confidence = child_confidence  # an unread node's value: its own times this
        self.read_best_children: list[float] = []  # each node read: its best child's weight
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.values: list[float] = []
        self.rows: list[int | None] = []  # each node's tree row in the drafter (None: unread)
        self.paths: list[list[int]] = []
        self.children: dict[int, _Children] = {}
        self.heap: list[tuple[float, int, int, bool]] = []
        self._tie = itertools.count()

    def push(self, neg_value: float, node: int, read: bool) -> None:
        heapq.heappush(self.heap, (neg_value, next(self._tie), node, read))

    def rank(self, node: int, children: _Children) -> None:
        """``node``'s (-1: the root's) ranked children, its entry now valued by the next one."""
        self.children[node] = children
        self.push(-(1.0 if node < 0 else self.values[node]) * children.next_weight(), node, True)

    def place_child(self, node: int) -> None:
        """Place the next ranked child of ``node`` (-1: the root)."""
        ranked = self.children[node]
        parent_value = 1.0 if node < 0 else self.values[node]
        token, drawn_from, prob = ranked.take()
        self.tokens.append(token)
        self.parents.append(node)
        self.values.append(parent_value * prob)
        self.rows.append(None)
        self.paths.append(([] if node < 0 else self.paths[node]) + [token])
        if drawn_from is not None:
            self.probs.append(drawn_from)
        new = len(self.tokens) - 1
        self.push(-parent_value * ranked.next_weight(), node, True)
        if len(self.paths[new]) < self.max_depth:
            self.push(-self.values[new] * self.child_confidence, new, False)

    def read_best(self, room: int, width: int) -> None:
        """Read the most valuable unread nodes that could still join (at most ``width``) in
        one drafter call, and rank their children."""
        unread = [e for e in heapq.nsmallest(room, self.heap) if not e[3]][:width]
        feed = [e[2] for e in unread]
        self.heap = [e for e in self.heap if e[3] or e[2] not in feed]
        heapq.heapify(self.heap)
        lm = self.session.lm
        first_row = len(lm.tree_tokens)
        out, _ = lm.feed([self.tokens[n] for n in feed],
                         [-1 if self.parents[n] < 0 else self.rows[self.parents[n]] for n in feed])
        ranked = rank_children(self.session, out, self.context, [self.paths[n] for n in feed],
                               room)
        for j, n in enumerate(feed):
            self.rows[n] = first_row + j
            self.read_best_children.append(ranked[j].next_weight())
            self.rank(n, ranked[j])
