"""SuffixDecoding: draft trees from suffix trees over the request's own text and over earlier
responses (Oliaro, Jia, Campos, Qiao; Snowflake; 2024, "SuffixDecoding: Extreme Speculative
Decoding for Emerging AI Applications", arXiv 2411.04975; reference code
snowflakedb/ArcticInference ``arctic_inference/suffix_decoding/``).

Model-free: each step matches the last m tokens of the context (m = 1 .. max_tree_depth - 1) in
two suffix trees with counts, the request's own (prompt + output so far) and a global one over
earlier responses, drafts from every match up to ``min(max_spec_tokens,
floor(max_spec_factor * m + max_spec_offset))`` tokens, and keeps the draft with the highest
score (sum of estimated token probabilities). The data structure and a worked example are in
:mod:`specdecode.suffix_tree`, the choice among matches and its tie-breaks in
:mod:`specdecode.suffix_cache`.

Defaults are the paper's / ArcticInference's (``max_tree_depth=64``, ``max_spec_factor=1.0``,
``max_spec_offset=0``, ``min_token_prob=0.1``, tree drafts), except ``max_spec_tokens=32``
(the paper bounds a draft by alpha * match length and the tree depth only; with depth 64 and
factor 1 a chain cannot exceed 32 tokens anyway, so 32 drafts as the paper does while capping a
tree's verify cost; on the dev data it matched 64 and beat ArcticInference's 16 on second turns
that rework the first, tau 10.3 vs 8.7) and ``max_cached_requests=1000`` (a pure-Python tree
costs more memory per token than the reference's C++ one; see :class:`SuffixCache`).

With ``corpus`` a third tree, built once over target-written text (``specdecode train corpus``,
:mod:`specdecode.suffix_corpus`), drafts where neither of the two has a draft: the global tree's
warm start.

Several proposers (one per server worker or request) may share one :class:`SuffixCache`, so what
one request generates helps the next; without one a proposer makes its own. ``runner`` may be
None: nothing here touches the model, so a simulator can replay recorded outputs through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.proposer import Proposer
from specdecode.registry import param, register
from specdecode.suffix_corpus import corpus_tree
from specdecode.suffix_cache import DEFAULT_MAX_CACHED_REQUESTS, SuffixCache
from specdecode.suffix_tree import SuffixDraft

__all__ = ["SuffixCache", "SuffixConfig", "SuffixProposer"]


@dataclass(frozen=True)
class SuffixConfig:
    # startup only (max_tree_depth, max_cached_requests): they size the global tree every
    # request of a server shares
    max_tree_depth: int = param(64, "longest suffix stored in the trees, and so the longest "
                                    "match + draft (paper: 64)", startup_only=True)
    max_spec_tokens: int = param(32, "most draft tokens per step (with depth 64 and factor 1 a "
                                     "chain cannot exceed 32; tuned on dev: = 64, > 16)",
                                 bounds=(1, 128))
    max_spec_factor: float = param(1.0, "draft at most factor * match length + offset tokens: "
                                         "longer matches earn longer drafts (paper's alpha: 1.0)",
                                   bounds=(0.0, 16.0))
    max_spec_offset: float = param(0.0, "added to factor * match length; negative values cut "
                                         "short-match drafts (paper: 0)", bounds=(-64.0, 64.0))
    min_token_prob: float = param(0.1, "prune draft tokens whose estimated probability "
                                       "(count ratio along the path) is below this (paper: 0.1)",
                                  bounds=(0.0, 1.0))
    mode: str = param("tree", "'tree': best-first draft tree by path probability; 'path': "
                              "follow the most frequent child (a chain)")
    max_cached_requests: int = param(DEFAULT_MAX_CACHED_REQUESTS,
                                     "earlier responses kept in the global tree, oldest evicted "
                                     "first; 0 disables it (bounds memory, docs/suffix.md)",
                                     startup_only=True)
    corpus: str = param("none", "target-written text that drafts where the request and the "
                                "global tree have nothing: a `specdecode train corpus` file, "
                                "'auto' (the newest for the target, if any) or 'none' "
                                "(docs/suffix.md)")

    def __post_init__(self):
        require(self.max_tree_depth >= 2,
                f"max_tree_depth must be >= 2 (a match plus one token), got {self.max_tree_depth}")
        require(self.max_spec_tokens >= 1,
                f"max_spec_tokens must be >= 1, got {self.max_spec_tokens}")
        require(math.isfinite(self.max_spec_factor) and self.max_spec_factor >= 0,
                f"max_spec_factor must be a finite number >= 0, got {self.max_spec_factor}")
        require(math.isfinite(self.max_spec_offset),
                f"max_spec_offset must be a finite number, got {self.max_spec_offset}")
        require(0.0 <= self.min_token_prob <= 1.0,
                f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        require(self.mode in ("tree", "path"),
                f"mode must be 'tree' or 'path', got {self.mode!r}")
        require(bool(self.corpus), "corpus must be 'auto', 'none' or a corpus file, got ''")
        require(self.max_cached_requests >= 0,
                f"max_cached_requests must be >= 0 (0 disables the global tree), "
                f"got {self.max_cached_requests}")


@register("suffix", SuffixConfig,
          paper="SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975)",
          summary="suffix trees over the request and earlier responses propose a draft tree; "
                  "model-free, learns across requests")
class SuffixProposer(Proposer):
    samples_drafts = False  # suffix-tree lookups
    def __init__(self, config: SuffixConfig, runner=None, global_cache: SuffixCache | None = None):
        super().__init__(config, runner)
        if global_cache is None:
            global_cache = SuffixCache(config.max_tree_depth, config.max_cached_requests)
        require(global_cache.max_tree_depth == config.max_tree_depth,
                f"the shared SuffixCache has max_tree_depth {global_cache.max_tree_depth} but "
                f"the config asks for {config.max_tree_depth}; build both with the same depth")
        self.cache = global_cache
        corpus = corpus_tree(config.corpus, runner, config.max_tree_depth)
        if corpus is not None and global_cache.corpus is not corpus:
            require(global_cache.corpus is None,
                    "the shared SuffixCache already drafts from another corpus; give every "
                    "proposer that shares it the same corpus setting")
            global_cache.use_corpus(corpus)
        #: the last draft with its match length and source ("request" or "global"), for stats
        self.last_draft = SuffixDraft()
        self._request: int | None = None
        self._length = 0  # tokens of the current request already in its tree
        self._last_token = -1

    def start(self, prompt):
        self._stop()
        self._request = self.cache.new_request_id()
        self.cache.start_request(self._request, prompt)
        self._length = len(prompt)
        self._last_token = int(prompt[-1]) if len(prompt) else -1

    def use_reference(self, tokens):
        if self._request is not None and len(tokens):
            self.cache.add_reference(self._request, tokens)

    def propose(self, context, budget):
        n = len(context)
        if (self._request is None or n < self._length
                or (self._length and int(context[self._length - 1]) != self._last_token)):
            # used without start(), or handed another context: begin afresh from this one
            self.start(context)
        elif n > self._length:
            # tokens the tree has not seen: the prefill's first token, or a caller without observe
            self._add(context[self._length:])
        nodes = min(self.config.max_spec_tokens, budget.max_nodes)
        if nodes <= 0 or budget.max_depth <= 0 or n == 0:
            return Draft.empty()
        config = self.config
        draft = self.cache.speculate(self._request, nodes, config.max_spec_factor,
                                     config.max_spec_offset, config.min_token_prob,
                                     config.mode == "tree", budget.max_depth)
        self.last_draft = draft
        return Draft(tuple(draft.token_ids), tuple(draft.parents), None, draft.score)

    def observe(self, feedback):
        if self._request is not None and feedback.tokens:
            self._add(feedback.tokens)

    def finish(self, output):
        self._stop(output)

    def _add(self, tokens) -> None:
        self.cache.add_response(self._request, tokens)
        self._length += len(tokens)
        self._last_token = int(tokens[-1])

    def _stop(self, output=None) -> None:
        """End the current request; its response (``output`` if given) joins the global tree."""
        if self._request is not None:
            self.cache.stop_request(self._request, output)
            self._request = None
