"""Token-level suffix trees with counts, and the cross-request suffix cache of SuffixDecoding
(Oliaro et al., 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", arXiv 2411.04975; reference code: snowflakedb/ArcticInference,
``arctic_inference/suffix_decoding/``). Written from the paper and that code's behaviour in pure
Python; nothing here needs torch. The proposer that uses it is ``proposers/suffix.py``.

**The tree.** A :class:`SuffixTree` holds every suffix of its sequences, cut at ``max_depth``
tokens (default 64). Node ``s`` stands for the token string ``s`` and its ``count`` is the number
of positions where ``s`` occurs (suffixes passing through or ending at it), so
``count(child) / count(node)`` is the empirical probability of the next token after ``s``.

**Compressed edges.** A plain trie of every suffix costs up to 64 nodes per token. Here an edge
carries a run of tokens (read from one of the sequences) over which the count does not change,
and a *leaf* holds one occurrence and reads the rest of its sequence, so a whole response costs
at most two nodes per token however much it repeats earlier ones (the bytes per token measured
are in docs/suffix.md). A leaf grows for free with its
sequence; appending a token to a request's tree touches only the suffixes that end on a real node
(ArcticInference's "active nodes": the places where the sequence is repeating itself).

**Matching.** After each appended token those active suffixes are exactly the nodes matching the
last m tokens of the sequence, for every useful m, so a request's own tree needs no search at all.
For the shared tree a request keeps its own list of matches and advances it token by token
(:meth:`SuffixTree.advance`), rebuilding it only when the shared tree has changed.

**Drafting** from a match of length m (:meth:`SuffixTree.draft`): a node's probability is
``count(node) / count(match)`` (the product of ``count(child) / count(parent)`` along its path,
telescoped); nodes below ``min_prob`` are pruned. Tree mode expands the most probable frontier
node first (best-first, as ArcticInference's heap); path mode follows the most frequent child.
Between nodes of equal probability the most recently seen occurrence comes first (recent text
predicts the continuation best, as in the ``ngram`` proposer).

**Choosing among matches** (:func:`best_draft`): every match length m of both trees is a
candidate with budget ``min(max_spec_tokens, floor(factor * m + offset))``; the highest score
(sum of node probabilities = expected accepted tokens) wins, ties to the request's own tree, then
to the longer match. The probabilities at one depth sum to at most 1, so a candidate's score is
at most its number of depth levels; candidates are tried best bound first and the search stops
as soon as no bound can beat the best score, which gives the same answer as trying them all.
Where neither tree has a draft, a corpus tree (:meth:`SuffixCache.use_corpus`: target-written
text given in advance) is tried the same way.

Worked example (per-request tree, context ``[1, 2, 3, 1, 2, 4, 1, 2]``, budget 4): the last two
tokens ``1 2`` occur three times (the context's own tail is one occurrence), followed once by
``3`` and once by ``4 1 2``; every one of those nodes has probability 1/3. Tree mode drafts the
more recent branch first, then the other: tokens ``[4, 1, 2, 3]``, parents ``[-1, 0, 1, -1]``,
score 4/3. Path mode drafts the chain ``[4, 1, 2]``.
"""

from __future__ import annotations

import heapq
import json
import math
import operator
import os
import threading
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.errors import SpecDecodeError, require

#: bump when the saved cache layout changes; load() refuses other versions
CACHE_FORMAT = "specdecode-suffix-cache"
CACHE_VERSION = 1


ROOT = 0
_NONE = -1
#: edge keys are ``parent << _SHIFT | token``: one int per edge, so the edge dict holds no objects
_SHIFT = 32
#: the length of a leaf's edge: its label runs on to the end of its sequence (and grows with it)
OPEN = 1 << 40


class SuffixTree:
    """Every suffix (cut at ``max_depth`` tokens) of a set of token sequences, with occurrence
    counts. :meth:`insert` adds a whole sequence, :meth:`extend` appends to a growing one,
    :meth:`remove` drops one; ``version`` changes whenever the tree does.

    Layout: nodes are integer ids into parallel ``array`` columns and edges live in one dict of
    ints, so the tree holds no Python object per node (about 170 bytes a node) and the garbage
    collector never walks it (a tree of node objects made every full collection, with torch
    loaded, pause for most of a second). Node 0 is the root. Node ``n``'s edge is labelled
    ``tokens[ref[n]][start[n]:start[n] + length[n]]`` and every position on it has the count of
    ``n``. A *leaf* (``length == OPEN``) holds one occurrence and reads the rest of its sequence.

    :meth:`insert` walks each suffix down compressed edges and splits one edge where it leaves
    the tree, so a response costs at most two nodes per token however much it repeats earlier
    ones. :meth:`extend` (the request's own tree, one token at a time) extends the suffixes that
    end on a real node by one token each, with one-token nodes: cheap to grow, and that tree is
    dropped with its request. ``ref`` always names the newest occurrence, so FIFO eviction of the
    oldest sequence never leaves a node reading a removed one.
    """

    def __init__(self, max_depth: int = 64):
        require(max_depth >= 2, f"max_depth must be >= 2 (a match plus one token), got {max_depth}")
        self.max_depth = max_depth
        # one column per node field; index = node id
        self._count = array("q", [0])   # occurrences of every string on the node's edge
        self._last = array("q", [0])    # tick of the newest occurrence (ties between siblings)
        self._token = array("q", [-1])  # first token of the edge
        self._ref = array("q", [-1])    # the edge label's sequence (a handle) ...
        self._start = array("q", [0])   # ... and position there: its newest occurrence
        self._length = array("q", [0])  # edge length, OPEN for a leaf
        self._child = array("q", [-1])  # first child (children form a doubly linked list)
        self._next = array("q", [-1])   # next sibling
        self._prev = array("q", [-1])   # previous sibling
        self._edges: dict[int, int] = {}  # parent << _SHIFT | token -> child
        self._free: list[int] = []        # ids of deleted nodes, reused first
        # sequences by handle (small ints); nodes refer to handles, callers to seq ids
        self._handles: dict[Hashable, int] = {}
        self._tokens: dict[int, array] = {}
        # per sequence: suffixes that end the sequence on a real node and can still grow, as
        # parallel lists of start positions and nodes (ArcticInference's "active nodes")
        self._starts: dict[int, list[int]] = {}
        self._nodes: dict[int, list[int]] = {}
        self._next_handle = 0
        self._tick = 0
        self.version = 0
        # children ranked for drafting, by node, valid for one version (see _continuations)
        self._ranked: dict[int, list] = {}
        self._ranked_version = -1

    def sequence(self, seq_id, start: int = 0) -> list[int]:
        """The tokens of ``seq_id`` from ``start`` (negative: from the end)."""
        return self._tokens[self._handles[seq_id]][start:].tolist()

    def length(self, seq_id) -> int:
        return len(self._tokens[self._handles[seq_id]])

    @property
    def num_tokens(self) -> int:
        return self._count[ROOT]

    @property
    def num_nodes(self) -> int:
        return len(self._count) - len(self._free)

    # ---- nodes ----------------------------------------------------------------------------

    def _add_child(self, parent: int, token: int, count: int, ref: int, start: int, length: int,
                   last: int) -> int:
        """A new node under ``parent``, linked at the head of its children."""
        if self._free:
            node = self._free.pop()
            self._count[node], self._last[node], self._token[node] = count, last, token
            self._ref[node], self._start[node], self._length[node] = ref, start, length
            self._child[node] = _NONE
        else:
            node = len(self._count)
            for column, value in ((self._count, count), (self._last, last), (self._token, token),
                                  (self._ref, ref), (self._start, start),
                                  (self._length, length), (self._child, _NONE),
                                  (self._next, _NONE), (self._prev, _NONE)):
                column.append(value)
        self._link(parent, node)
        return node

    def _link(self, parent: int, node: int) -> None:
        self._edges[parent << _SHIFT | self._token[node]] = node
        head = self._child[parent]
        self._next[node] = head
        self._prev[node] = _NONE
        if head >= 0:
            self._prev[head] = node
        self._child[parent] = node

    def _unlink(self, parent: int, node: int) -> None:
        del self._edges[parent << _SHIFT | self._token[node]]
        before, after = self._prev[node], self._next[node]
        if before >= 0:
            self._next[before] = after
        else:
            self._child[parent] = after
        if after >= 0:
            self._prev[after] = before

    def _split(self, parent: int, node: int, k: int, depth: int) -> int:
        """Cut ``node``'s edge after ``k`` tokens: a new node takes the first ``k`` (with the
        same count and label), ``node`` keeps the rest below it. ``depth``: the depth of the
        edge's first token. Returns the new node; the caller counts the new occurrence in."""
        ref, start = self._ref[node], self._start[node]
        self._unlink(parent, node)
        head = self._add_child(parent, self._token[node], self._count[node], ref, start, k,
                               self._last[node])
        seq = self._tokens[ref]
        if self._length[node] != OPEN:
            self._length[node] -= k
        elif start + k >= len(seq) or depth + k > self.max_depth:
            # a leaf with nothing past the cut: its occurrence now ends on the new node
            self._free_node(node)
            if start + k == len(seq) and depth + k <= self.max_depth:
                # ... at the end of its sequence: should that sequence grow, the new node is
                # where its suffix continues
                self._starts[ref].append(start - depth + 1)
                self._nodes[ref].append(head)
            return head
        self._start[node] = start + k
        self._token[node] = seq[start + k]
        self._link(head, node)
        return head

    def _free_node(self, node: int) -> None:
        self._count[node] = 0
        self._ref[node] = _NONE
        self._free.append(node)

    # ---- building -------------------------------------------------------------------------

    def _new_sequence(self, seq_id: Hashable) -> int:
        handle = self._handles[seq_id] = self._next_handle
        self._next_handle += 1
        self._tokens[handle] = array("q")
        self._starts[handle] = []
        self._nodes[handle] = []
        return handle

    def insert(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Add the complete sequence ``tokens`` as ``seq_id`` (which must be new)."""
        require(seq_id not in self._handles, f"sequence {seq_id!r} is already in the tree")
        handle = self._new_sequence(seq_id)
        seq = self._tokens[handle]
        seq.extend(map(int, tokens))
        count, last, ref, start, length = (self._count, self._last, self._ref, self._start,
                                           self._length)
        get, cap, size = self._edges.get, self.max_depth, len(seq)
        count[ROOT] += size
        for i in range(size):
            self._tick += 1
            tick = self._tick
            end = min(i + cap, size)  # this suffix, cut at the tree depth
            node, pos = ROOT, i
            while pos < end:
                child = get(node << _SHIFT | seq[pos])
                if child is None:
                    # the rest of this suffix is new: a leaf reading this sequence
                    self._add_child(node, seq[pos], 1, handle, pos, OPEN, tick)
                    break
                label, at, edge = self._tokens[ref[child]], start[child], length[child]
                if edge == OPEN:
                    edge = min(len(label) - at, cap - (pos - i))
                n = min(edge, end - pos)
                if seq[pos:pos + n] == label[at:at + n]:
                    same = n
                else:
                    same = 1  # the first tokens match: the edge is keyed by it
                    while seq[pos + same] == label[at + same]:
                        same += 1
                if same != length[child]:
                    # the suffix leaves the edge (or ends) inside it: cut the edge there
                    child = self._split(node, child, same, pos - i + 1)
                count[child] += 1
                last[child], ref[child], start[child] = tick, handle, pos
                node, pos = child, pos + same
            else:
                # the suffix ends on a real node; if it ends the sequence below the depth cap,
                # extend() would continue it from there
                if end == size and pos - i < cap:
                    self._starts[handle].append(i)
                    self._nodes[handle].append(node)
        self.version += 1

    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new sequence if unknown)."""
        handle = self._handles.get(seq_id)
        if handle is None:
            handle = self._new_sequence(seq_id)
        seq, starts, nodes = self._tokens[handle], self._starts[handle], self._nodes[handle]
        count, last, ref, start, length = (self._count, self._last, self._ref, self._start,
                                           self._length)
        get, cap = self._edges.get, self.max_depth
        for token in map(int, tokens):
            n = len(seq)
            seq.append(token)
            self._tick += 1
            tick = self._tick
            count[ROOT] += 1
            starts.append(n)  # the suffix that starts at the new token
            nodes.append(ROOT)
            kept_starts, kept_nodes = [], []
            for begin, node in zip(starts, nodes):
                depth = n - begin + 1  # depth of the new token in this suffix
                child = get(node << _SHIFT | token)
                if child is None:
                    # first occurrence of this string: a leaf reading this sequence
                    self._add_child(node, token, 1, handle, n, OPEN, tick)
                    continue
                if length[child] != 1:
                    # a leaf reached a second time, or a longer edge: take its first token apart
                    child = self._split(node, child, 1, depth)
                count[child] += 1
                last[child], ref[child], start[child] = tick, handle, n
                if depth < cap:
                    kept_starts.append(begin)
                    kept_nodes.append(child)
            starts[:] = kept_starts
            nodes[:] = kept_nodes
        self.version += 1

    def remove(self, seq_id: Hashable) -> None:
        """Drop sequence ``seq_id``: undo its counts and delete the nodes only it used."""
        handle = self._handles.pop(seq_id)
        seq = self._tokens[handle]
        del self._starts[handle], self._nodes[handle]
        count, edges, cap = self._count, self._edges, self.max_depth
        count[ROOT] -= len(seq)
        still_reading = []  # nodes whose label is read from this sequence
        for i in range(len(seq)):
            end = min(i + cap, len(seq))
            node, pos = ROOT, i
            while pos < end:
                child = edges[node << _SHIFT | seq[pos]]
                if count[child] == 1:
                    # only this suffix passes here, so below is a single chain: free it all
                    self._unlink(node, child)
                    while child >= 0:
                        below = self._child[child]
                        if below >= 0:
                            del edges[child << _SHIFT | self._token[below]]
                        self._free_node(child)
                        child = below
                    break
                count[child] -= 1
                if self._ref[child] == handle:
                    still_reading.append(child)
                node, pos = child, pos + self._length[child]
        # Labels name their newest occurrence, so removing the oldest sequence (FIFO) leaves no
        # reader; after an out-of-order removal its tokens stay for the nodes that read them.
        if not any(count[n] > 0 and self._ref[n] == handle for n in still_reading):
            del self._tokens[handle]
        self.version += 1

    # ---- matching -------------------------------------------------------------------------

    def matches(self, seq_id: Hashable) -> list[tuple[int, int, int]]:
        """Matches ``(m, node, k)`` of the last m tokens of ``seq_id`` that occur elsewhere too
        (the sequence's own tail always matches but has no continuation)."""
        handle = self._handles[seq_id]
        n = len(self._tokens[handle])
        count, length = self._count, self._length
        return [(n - begin, node, length[node])
                for begin, node in zip(self._starts[handle], self._nodes[handle])
                if count[node] > 1]  # count 1 after a removal: only the context's own

    def step(self, node: int, k: int, token: int) -> tuple[int, int] | None:
        """Follow ``token`` from the position ``k`` tokens into ``node``'s edge."""
        if k < self._length[node]:
            seq = self._tokens[self._ref[node]]
            at = self._start[node] + k
            if at < len(seq) and seq[at] == token:
                return node, k + 1
            return None
        child = self._edges.get(node << _SHIFT | token)
        return None if child is None else (child, 1)

    def advance(self, matches: list, tokens: Sequence[int]) -> list:
        """Matches ``(m, node, k)`` of a context's last m tokens, moved on by ``tokens``.
        Matches as deep as ``max_depth`` are dropped: nothing can follow them."""
        cap, step = self.max_depth, self.step
        for token in tokens:
            moved = []
            for m, node, k in matches:
                if m + 1 < cap:
                    nxt = step(node, k, token)
                    if nxt is not None:
                        moved.append((m + 1, nxt[0], nxt[1]))
            nxt = step(ROOT, 0, token)
            if nxt is not None:
                moved.append((1, nxt[0], nxt[1]))
            matches = moved
        return matches

    def count_of(self, node: int) -> int:
        return self._count[node]

    def remaining(self, node: int, k: int) -> int:
        """Tokens that can follow the position (unbounded unless it is in a leaf)."""
        if self._length[node] != OPEN:
            return 1 << 30
        return len(self._tokens[self._ref[node]]) - self._start[node] - k

    # ---- drafting -------------------------------------------------------------------------

    def _continuations(self, node: int, k: int) -> list[tuple[int, int, int]]:
        """``(token, node, k)`` one token on from a position: the edge's next token, or the
        children at the edge's end, most frequent first (then the newest). Shared: do not
        change the list."""
        if k < self._length[node]:
            seq = self._tokens[self._ref[node]]
            at = self._start[node] + k
            return [(seq[at], node, k + 1)] if at < len(seq) else []
        if self._ranked_version != self.version:
            self._ranked.clear()
            self._ranked_version = self.version
        ranked = self._ranked.get(node)
        if ranked is None:
            # a node of a large tree (a corpus, a long-lived global tree) may have hundreds of
            # children and drafting reads the same few again and again: rank them once per
            # version, most frequent first (then the newest), so a draft stops at the first
            # child below its probability floor
            count, last, token, after = self._count, self._last, self._token, self._next
            children = []
            child = self._child[node]
            while child >= 0:
                children.append((count[child], last[child], token[child], child))
                child = after[child]
            if len(children) > 1:
                children.sort(reverse=True)  # ticks differ, so the tokens never decide
            ranked = self._ranked[node] = [(t, c, 1) for _, _, t, c in children]
        return ranked

    def draft(self, node: int, k: int, max_nodes: int, max_depth: int, min_prob: float,
              tree: bool = True) -> SuffixDraft:
        """The draft below one match: tree mode (best-first by probability) or path mode (the
        most frequent continuation, as a chain)."""
        if max_nodes <= 0 or max_depth <= 0:
            return SuffixDraft()
        count, last = self._count, self._last
        total = count[node]
        tokens: list[int] = []
        parents: list[int] = []
        counts: list[int] = []
        if not tree:
            while len(tokens) < min(max_nodes, max_depth):
                options = self._continuations(node, k)
                if not options:
                    break
                token, node, k = max(options, key=lambda o: (count[o[1]], last[o[1]]))
                if count[node] / total < min_prob:
                    break
                parents.append(len(tokens) - 1)
                tokens.append(token)
                counts.append(count[node])
        else:
            # heap items (-count, -last, order, token, node, k, parent index, depth): the most
            # probable first, then the most recent occurrence, then the first pushed
            heap: list = []
            order = 0

            def push(at_node: int, at_k: int, parent: int, depth: int) -> None:
                nonlocal order
                for token, child, child_k in self._continuations(at_node, at_k):
                    if count[child] / total < min_prob:
                        break  # ranked by count: the rest are rarer still
                    heapq.heappush(heap, (-count[child], -last[child], order, token, child,
                                          child_k, parent, depth))
                    order += 1

            push(node, k, -1, 1)
            while heap and len(tokens) < max_nodes:
                neg_count, _, _, token, child, child_k, parent, depth = heapq.heappop(heap)
                parents.append(parent)
                tokens.append(token)
                counts.append(-neg_count)
                if depth < max_depth:
                    push(child, child_k, len(tokens) - 1, depth + 1)
        return SuffixDraft(tokens, parents, [c / total for c in counts], sum(counts) / total)


@dataclass
class SuffixDraft:
    """A draft tree from a suffix tree: nodes in topological order (``parents[i] < i``)."""

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    #: estimated probability of each node: count(node) / count(match)
    probs: list[float] = field(default_factory=list)
    #: sum of probs: the expected number of accepted tokens
    score: float = 0.0
    #: length of the context suffix that was matched
    match_len: int = 0
    #: "request" (the request's own prompt and output), "global" (earlier responses) or
    #: "corpus" (target-written text given in advance)
    source: str = ""


def spec_budget(match_len: int, max_spec_tokens: int, factor: float, offset: float) -> int:
    """Draft tokens allowed for a match of ``match_len`` tokens: longer matches earn longer
    drafts (the paper's MAX_SPEC = alpha * p)."""
    # the epsilon keeps e.g. 0.1 * 30 = 3.0000000000000004 from flooring below 3
    return max(0, min(max_spec_tokens, math.floor(factor * match_len + offset + 1e-6)))


def best_draft(candidates: list[tuple[str, SuffixTree, list, bool]], max_spec_tokens: int,
               factor: float, offset: float, min_prob: float, tree: bool,
               max_depth: int) -> SuffixDraft:
    """The best draft over every match of every tree.

    ``candidates``: ``(source, tree, matches, holds_context)`` in order of preference: among
    equal scores the earlier source wins (the request's own tree before the global one), then
    the longer match, as in ArcticInference. ``holds_context``: the tree contains the context
    itself, whose own occurrence of every match has no continuation.
    """
    options = []
    for index, (source, suffix_tree, matches, holds_context) in enumerate(candidates):
        rank = len(candidates) - index
        cap = suffix_tree.max_depth
        for m, node, k in matches:
            nodes = spec_budget(m, max_spec_tokens, factor, offset)
            depth = min(max_depth, cap - m)
            # probabilities at one depth sum to at most 1 (to (count - 1) / count when one
            # occurrence is the context's own), so the score is at most that times the depth
            levels = min(nodes, depth, suffix_tree.remaining(node, k))
            bound = float(levels)
            if holds_context:
                total = suffix_tree.count_of(node)
                bound = levels * (total - 1) / total
            if bound > 0:
                options.append((bound, rank, m, source, suffix_tree, node, k, nodes, depth))
    options.sort(key=lambda o: o[:3], reverse=True)
    best = SuffixDraft()
    best_key = (0.0, 0, 0)
    for bound, rank, m, source, suffix_tree, node, k, nodes, depth in options:
        if (bound, rank, m) <= best_key:
            break  # sorted by bound: nothing left can beat the best
        draft = suffix_tree.draft(node, k, nodes, depth, min_prob, tree)
        if draft.score > 0 and (draft.score, rank, m) > best_key:
            best, best_key = draft, (draft.score, rank, m)
            best.match_len, best.source = m, source
    return best


#: default bound on responses kept in the global tree (see SuffixCache)
DEFAULT_MAX_CACHED_REQUESTS = 1000


def _token_ids(tokens, what: str) -> list[int]:
    """Validate token ids at the cache's boundary."""
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError:
        raise SpecDecodeError(f"{what} must be a sequence of integer token ids") from None
    # the tree keys an edge by parent << 32 | token
    require(all(0 <= t < 1 << _SHIFT for t in ids),
            f"{what} has token ids outside 0 .. 2**32 - 1; give vocabulary ids")
    return ids


def _check_id(req_id) -> None:
    require(isinstance(req_id, (int, str)) and not isinstance(req_id, bool),
            f"request ids must be int or str (they are saved as JSON), got {req_id!r}")


class _Follow:
    """A request's matches in a shared tree, valid for that tree's ``version`` and the request's
    first ``synced`` tokens."""

    __slots__ = ("matches", "version", "synced")

    def __init__(self):
        self.matches: list = []
        self.version = -1
        self.synced = 0


class _Request:
    """An active request: its own tree (prompt + output so far) and its matches in the global
    tree and in the corpus."""

    __slots__ = ("tree", "prompt_len", "in_global", "in_corpus")

    def __init__(self, tree: SuffixTree, prompt_len: int):
        self.tree = tree
        self.prompt_len = prompt_len
        self.in_global = _Follow()
        self.in_corpus = _Follow()


class SuffixCache:
    """SuffixDecoding's memory: a suffix tree per active request over its prompt and output,
    and one global suffix tree over earlier responses, shared by every request.

    Lifecycle, named after request events as in ArcticInference::

        cache.start_request(rid, prompt)                 # the request's own tree
        cache.add_response(rid, new_tokens)              # after every verify step
        draft = cache.speculate(rid, max_spec_tokens=32) # best of both trees
        cache.stop_request(rid)                          # its response joins the global tree
        cache.evict(rid)                                 # drop a cached response early

    The global tree keeps at most ``max_cached_requests`` responses and evicts the oldest first
    (FIFO). A stored token costs at most two nodes in this pure-Python tree, however
    repetitive, so the default of 1000 responses bounds it to a few hundred MB (bytes per token
    measured in docs/suffix.md); ArcticInference's C++ tree affords 100000. 0 disables the
    global tree. One lock guards every method, so threads serving different requests may share a
    cache.
    :meth:`save` / :meth:`load` keep the cached responses in a versioned JSON file.
    """

    def __init__(self, max_tree_depth: int = 64,
                 max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS):
        require(isinstance(max_tree_depth, int) and max_tree_depth >= 2,
                f"max_tree_depth must be an integer >= 2, got {max_tree_depth!r}")
        require(isinstance(max_cached_requests, int) and max_cached_requests >= 0,
                f"max_cached_requests must be an integer >= 0 (0 disables the global tree), "
                f"got {max_cached_requests!r}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self._lock = threading.Lock()
        self._global = SuffixTree(max_tree_depth)
        self._requests: dict[int | str, _Request] = {}
        #: cached response ids in insertion order (dicts keep it): the FIFO eviction order
        self._cached: dict[int | str, None] = {}
        self._next_id = 0
        #: a fixed tree of target-written text, drafted from where the request's tree and the
        #: global one have nothing (read only, so several caches may share it): use_corpus
        self.corpus: SuffixTree | None = None

    # ---- inspection -----------------------------------------------------------------------

    @property
    def active_requests(self) -> list:
        with self._lock:
            return list(self._requests)

    @property
    def cached_requests(self) -> list:
        """Ids of the responses in the global tree, oldest first."""
        with self._lock:
            return list(self._cached)

    @property
    def num_cached_tokens(self) -> int:
        with self._lock:
            return self._global.num_tokens

    def cached_response(self, req_id) -> list[int]:
        with self._lock:
            require(req_id in self._cached, f"request {req_id!r} has no cached response")
            return list(self._global.sequence(req_id))

    def new_request_id(self) -> int:
        """An integer id that no active or cached request uses."""
        with self._lock:
            while self._next_id in self._requests or self._next_id in self._cached:
                self._next_id += 1
            self._next_id += 1
            return self._next_id - 1

    # ---- request lifecycle ----------------------------------------------------------------

    def start_request(self, req_id: int | str, prompt: Sequence[int]) -> None:
        """Begin a request: build its own tree over ``prompt``."""
        _check_id(req_id)
        ids = _token_ids(prompt, "prompt")
        tree = SuffixTree(self.max_tree_depth)
        tree.insert(0, ids)  # outside the lock: nothing shared yet
        with self._lock:
            require(req_id not in self._requests,
                    f"request {req_id!r} is already active; stop it first or use a new id")
            self._requests[req_id] = _Request(tree, len(ids))

    def add_response(self, req_id: int | str, tokens: Sequence[int]) -> None:
        """Append newly committed output tokens to the request's tree."""
        ids = _token_ids(tokens, "tokens")
        with self._lock:
            self._active(req_id).tree.extend(0, ids)

    def speculate(self, req_id: int | str, max_spec_tokens: int = 32,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                  min_token_prob: float = 0.1, tree: bool = True,
                  max_depth: int | None = None) -> SuffixDraft:
        """Draft a continuation of the request's prompt + output so far (see the module
        docstring): the best of every match in its own tree and in the global tree; only where
        neither has one, the best in the corpus."""
        depth = self.max_tree_depth if max_depth is None else max_depth
        settings = (max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree,
                    depth)
        with self._lock:
            request = self._active(req_id)
            candidates = [("request", request.tree, request.tree.matches(0), True)]
            if self._global.num_tokens:
                candidates.append(("global", self._global,
                                   self._matches_in(self._global, request.in_global, request),
                                   False))
            draft = best_draft(candidates, *settings)
            if draft.score == 0 and self.corpus is not None:
                # a last resort: general text of the target's, where the request's own text and
                # the served responses have nothing. Letting it compete on score instead drafted
                # more nodes for fewer accepted tokens (docs/suffix.md)
                draft = best_draft([("corpus", self.corpus, self._matches_in(
                    self.corpus, request.in_corpus, request), False)], *settings)
            return draft

    def stop_request(self, req_id: int | str, response: Sequence[int] | None = None) -> None:
        """End a request. Its response (``response`` if given, else the tokens added with
        :meth:`add_response`) joins the global tree, evicting the oldest ones beyond the bound."""
        ids = None if response is None else _token_ids(response, "response")
        with self._lock:
            request = self._active(req_id)
            del self._requests[req_id]
            if ids is None:
                ids = request.tree.sequence(0, request.prompt_len)
            self._cache_response(req_id, ids)

    def add_cached(self, req_id: int | str, response: Sequence[int]) -> None:
        """Put a finished response straight into the global tree (one generated elsewhere,
        e.g. by another server replica), evicting the oldest ones beyond the bound."""
        _check_id(req_id)
        ids = _token_ids(response, "response")
        with self._lock:
            require(req_id not in self._requests, f"request {req_id!r} is active; stop it instead")
            self._cache_response(req_id, ids)

    def use_corpus(self, corpus: SuffixTree | None) -> None:
        """Draft from ``corpus`` where the request's own tree and the global tree have nothing:
        a tree built once over target-written text (:mod:`specdecode.suffix_corpus`), the warm
        start of a global tree that has seen few responses. It is never changed, evicted or
        saved, so the FIFO bound and :meth:`save` concern the served responses only."""
        require(corpus is None or corpus.max_depth == self.max_tree_depth,
                f"the corpus tree has max_tree_depth {corpus and corpus.max_depth} but the "
                f"cache {self.max_tree_depth}; build both with the same depth")
        with self._lock:
            self.corpus = corpus

    def evict(self, req_id: int | str) -> None:
        """Drop a cached response from the global tree."""
        with self._lock:
            require(req_id in self._cached, f"request {req_id!r} has no cached response to evict")
            self._evict(req_id)

    # ---- persistence ----------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the cached responses (oldest first) to a versioned JSON file, atomically."""
        with self._lock:
            data = {
                "format": CACHE_FORMAT,
                "version": CACHE_VERSION,
                "max_tree_depth": self.max_tree_depth,
                "max_cached_requests": self.max_cached_requests,
                "responses": [{"id": rid, "tokens": self._global.sequence(rid)}
                              for rid in self._cached],
            }
            path = Path(path)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(data, separators=(",", ":")))
            os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike, max_cached_requests: int | None = None) -> SuffixCache:
        """Rebuild a cache from :meth:`save`'s file (the global tree is rebuilt from the stored
        responses; no code is ever unpickled). ``max_cached_requests`` overrides the stored
        bound; the oldest responses beyond it are dropped."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise SpecDecodeError(f"cannot read suffix cache {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise SpecDecodeError(f"suffix cache {path} is not valid JSON: {exc}") from None
        require(isinstance(data, dict) and data.get("format") == CACHE_FORMAT,
                f"{path} is not a specdecode suffix cache (no format {CACHE_FORMAT!r})")
        require(data.get("version") == CACHE_VERSION,
                f"suffix cache {path} has version {data.get('version')!r}; this specdecode reads "
                f"version {CACHE_VERSION}: rebuild the cache")
        responses = data.get("responses")
        require(isinstance(responses, list), f"suffix cache {path} has no 'responses' list")
        if max_cached_requests is None:
            max_cached_requests = data.get("max_cached_requests")
        cache = cls(data.get("max_tree_depth"), max_cached_requests)
        for entry in responses:
            require(isinstance(entry, dict) and "id" in entry and "tokens" in entry,
                    f"suffix cache {path} has a malformed response entry")
            _check_id(entry["id"])
            require(isinstance(entry["tokens"], list),
                    f"suffix cache {path}: a response's tokens must be a list")
            cache._cache_response(entry["id"], _token_ids(entry["tokens"], "cached response"))
        return cache

    # ---- internals (callers hold the lock) -------------------------------------------------

    def _active(self, req_id) -> _Request:
        request = self._requests.get(req_id)
        require(request is not None,
                f"request {req_id!r} is not active; call start_request({req_id!r}, prompt) first")
        return request

    @staticmethod
    def _matches_in(shared: SuffixTree, follow: _Follow, request: _Request) -> list:
        """The request's matches in a shared tree, brought up to date."""
        length = request.tree.length(0)
        cap = shared.max_depth
        new = length - follow.synced
        if follow.version != shared.version or new >= cap:
            # the shared tree changed (or we are far behind): match the last tokens afresh
            follow.matches = shared.advance([], request.tree.sequence(0, 1 - cap))
        elif new:
            follow.matches = shared.advance(follow.matches,
                                            request.tree.sequence(0, follow.synced))
        follow.version = shared.version
        follow.synced = length
        return follow.matches

    def _cache_response(self, req_id, ids: list[int]) -> None:
        if self.max_cached_requests == 0 or not ids:
            return
        if req_id in self._cached:
            self._evict(req_id)  # an id used again: its newest response replaces the old one
        self._global.insert(req_id, ids)
        self._cached[req_id] = None
        while len(self._cached) > self.max_cached_requests:
            self._evict(next(iter(self._cached)))

    def _evict(self, req_id) -> None:
        del self._cached[req_id]
        self._global.remove(req_id)
