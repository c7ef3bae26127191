"""The Draft: a tree of candidate tokens stored as parent indices.

Every proposer returns one; the runner runs one target forward over it; the verifier walks it.
A chain is the tree whose parents are ``[-1, 0, 1, ...]``; an empty draft is plain decoding.

    tokens[i]   candidate token at node i
    parents[i]  index of node i's parent, -1 = child of the root (the pending token, i.e. the
                last committed token whose KV entry is not yet in the cache)
    probs       optional [n, V] tensor: probs[i] is the proposer's distribution q from which
                tokens[i] was drawn (the next-token distribution at node i's parent). None for a
                deterministic proposer. I.i.d. siblings share the same q; siblings drawn without
                replacement each record q with the earlier siblings removed.

Nodes are topologically ordered: ``parents[i] < i``. This lets the runner build the tree
attention mask in one pass and the verifier walk depth by depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

#: sampled acceptance rules for siblings with probabilities (see verify.py)
SIBLING_RULES = ("recursive", "spectr")


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: torch.Tensor | None = None
    # How good the proposer thinks this draft is (expected accepted tokens); lets drafts from
    # several sources compete (SuffixDecoding's per-request vs global tree).
    score: float = 0.0
    # The sampled acceptance rule for siblings with probabilities (verify.py): "recursive"
    # (SpecInfer / RSD recursive rejection) or "spectr" (SpecTr's K-SEQ; i.i.d. siblings only).
    sibling_rule: str = "recursive"
    _children_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if len(self.tokens) != len(self.parents):
            raise ValueError(
                f"Draft has {len(self.tokens)} tokens but {len(self.parents)} parents; "
                "give one parent index per token"
            )
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(
                    f"Draft node {i} has parent {p}; parents must satisfy -1 <= parents[i] < i "
                    "(nodes in topological order)"
                )
        if self.sibling_rule not in SIBLING_RULES:
            raise ValueError(f"unknown sibling_rule {self.sibling_rule!r}; known: "
                             f"{', '.join(SIBLING_RULES)}")
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(
                f"Draft probs has {self.probs.shape[0]} rows for {len(self.tokens)} nodes"
            )

    # ---- constructors ---------------------------------------------------------------------

    @classmethod
    def empty(cls) -> Draft:
        return cls()

    @classmethod
    def chain(cls, tokens, probs: torch.Tensor | None = None, score: float = 0.0) -> Draft:
        tokens = list(tokens)
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), probs, score)

    @classmethod
    def from_paths(cls, paths, score: float = 0.0) -> Draft:
        """Merge token paths (each a list of tokens from the root) into a prefix tree."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, ...], int] = {}
        for path in paths:
            parent = -1
            for d in range(len(path)):
                key = tuple(path[: d + 1])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(path[d])
                    parents.append(parent)
                parent = index[key]
        return cls(tuple(tokens), tuple(parents), None, score)

    # ---- structure ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """depth[i] = 1 for children of the root, 2 for their children, ..."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return tuple(depth)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (-1 = root) in index order, which is the verifier's order."""
        if not self._children_cache:
            table: dict[int, list[int]] = {}
            for i, p in enumerate(self.parents):
                table.setdefault(p, []).append(i)
            self._children_cache.update(table)
        return self._children_cache.get(node, [])

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool: row r may attend to column c. Row/column 0 is the root (pending
        token); row i+1 is node i. Each node sees the root, its ancestors and itself."""
        n = len(self.tokens)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[0, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return mask

    def position_offsets(self) -> torch.Tensor:
        """[n+1] long: position of each row relative to the root's position."""
        return torch.tensor((0,) + self.depths, dtype=torch.long)

    def truncated(self, max_depth: int, max_nodes: int | None = None) -> Draft:
        """Drop nodes deeper than ``max_depth`` and all nodes past the first ``max_nodes``
        (in topological order, so a kept node's ancestors are kept too)."""
        limit = len(self.tokens) if max_nodes is None else max(0, max_nodes)
        if self.max_depth <= max_depth and len(self.tokens) <= limit:
            return self
        keep: list[int] = []
        new_index: dict[int, int] = {-1: -1}
        for i, (p, d) in enumerate(zip(self.parents, self.depths)):
            if d <= max_depth and p in new_index and len(keep) < limit:
                new_index[i] = len(keep)
                keep.append(i)
        probs = None if self.probs is None else self.probs[keep]
        return Draft(
            tuple(self.tokens[i] for i in keep),
            tuple(new_index[self.parents[i]] for i in keep),
            probs,
            self.score,
            self.sibling_rule,
        )
