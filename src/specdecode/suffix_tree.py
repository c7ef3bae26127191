"""Token-level suffix trees with counts (SuffixDecoding: Oliaro et al., 2024, "SuffixDecoding:
Extreme Speculative Decoding for Emerging AI Applications", arXiv 2411.04975; reference code:
snowflakedb/ArcticInference, ``arctic_inference/suffix_decoding/``). Written from the paper and
that code's behaviour in pure Python; nothing here needs torch. The cross-request cache built on
these trees is :mod:`specdecode.suffix_cache`; the proposer that uses it is
``proposers/suffix.py``.

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

Worked example (per-request tree, context ``[1, 2, 3, 1, 2, 4, 1, 2]``, budget 4): the last two
tokens ``1 2`` occur three times (the context's own tail is one occurrence), followed once by
``3`` and once by ``4 1 2``; every one of those nodes has probability 1/3. Tree mode drafts the
more recent branch first, then the other: tokens ``[4, 1, 2, 3]``, parents ``[-1, 0, 1, -1]``,
score 4/3. Path mode drafts the chain ``[4, 1, 2]``.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from specdecode.errors import require

ROOT = 0
_NONE = -1
#: edge keys are ``parent << _SHIFT | token``: one int per edge, so the edge dict holds no objects
_SHIFT = 32
#: token ids a tree can key: 0 .. TOKEN_LIMIT - 1
TOKEN_LIMIT = 1 << _SHIFT
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
