"""The cross-request suffix cache of SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975;
reference code: snowflakedb/ArcticInference): a suffix tree per active request over its prompt
and output, one global tree over earlier responses, and the choice of the best draft among
every match of those trees. The trees are :mod:`specdecode.suffix_tree`'s; the proposer that
uses this cache is ``proposers/suffix.py``.

**Choosing among matches** (:func:`best_draft`): every match length m of both trees is a
candidate with budget ``min(max_spec_tokens, floor(factor * m + offset))``; the highest score
(sum of node probabilities = expected accepted tokens) wins, ties to the request's own tree, then
to the longer match. The probabilities at one depth sum to at most 1, so a candidate's score is
at most its number of depth levels; candidates are tried best bound first and the search stops
as soon as no bound can beat the best score, which gives the same answer as trying them all.
Where neither tree has a draft, a corpus tree (:meth:`SuffixCache.use_corpus`: target-written
text given in advance) is tried the same way.
"""

from __future__ import annotations

import json
import math
import operator
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from specdecode.errors import SpecDecodeError, require
from specdecode.suffix_tree import TOKEN_LIMIT, SuffixDraft, SuffixTree

#: bump when the saved cache layout changes; load() refuses other versions
CACHE_FORMAT = "specdecode-suffix-cache"
CACHE_VERSION = 1


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
#: the id of a request's reference text in its tree (its prompt and output are sequence 0)
REFERENCE = 1


def _token_ids(tokens, what: str) -> list[int]:
    """Validate token ids at the cache's boundary."""
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError:
        raise SpecDecodeError(f"{what} must be a sequence of integer token ids") from None
    # the tree keys an edge by parent << 32 | token
    require(all(0 <= t < TOKEN_LIMIT for t in ids),
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

    def add_reference(self, req_id: int | str, tokens: Sequence[int]) -> None:
        """Text the request's answer is expected to repeat (a predicted output): a sequence of
        its own in the request's tree, which the request's tail is matched in and drafts from,
        as in its prompt."""
        ids = _token_ids(tokens, "reference")
        with self._lock:
            self._active(req_id).tree.insert(REFERENCE, ids)

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
