"""SuffixDecoding: the suffix tree against brute-force counts, the drafting rules on hand-written
token arrays (tie-breaks, pruning, the factor * m budget, request vs global), the shared cache
(eviction, save/load, threads), and greedy exactness against ``ar``."""

from __future__ import annotations

import json
import math
import random
import threading
from fractions import Fraction

import pytest

from specdecode import registry
from specdecode.api import Decoder
from specdecode.control import Budget
from specdecode.errors import SpecDecodeError
from specdecode.proposer import Feedback
from specdecode.proposers.suffix import SuffixCache, SuffixConfig, SuffixProposer
from specdecode.suffix_tree import OPEN, SuffixTree

from conftest import repetitive_prompts


def substring_counts(seqs, depth):
    """Occurrences of every substring of length <= depth: what the tree's counts must be."""
    counts = {}
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + depth, len(seq)) + 1):
                key = tuple(seq[i:j])
                counts[key] = counts.get(key, 0) + 1
    return counts


def tree_strings(tree: SuffixTree) -> dict:
    """Every string the tree holds with its count, compressed edges and leaves expanded."""
    out = {}

    def walk(node, prefix):
        child = tree._child[node]
        while child >= 0:
            seq = tree._tokens[tree._ref[child]]
            start, length = tree._start[child], tree._length[child]
            key, k = prefix, 0
            while (start + k < len(seq) if length == OPEN else k < length) \
                    and len(key) < tree.max_depth:
                key += (seq[start + k],)
                out[key] = tree._count[child]
                k += 1
            if length != OPEN:
                assert k == length, "a real edge reaches below the depth cap"
                walk(child, key)
            child = tree._next[child]

    walk(0, ())
    return out


def speculate(tokens, max_spec_tokens=16, factor=1.0, offset=0.0, min_prob=0.1, tree=True,
              max_depth=64, depth=64, responses=()):
    """Draft for a request whose prompt is ``tokens``, after ``responses`` were cached."""
    cache = SuffixCache(depth, max_cached_requests=10)
    for i, response in enumerate(responses):
        cache.start_request(f"old{i}", [0])
        cache.stop_request(f"old{i}", response)
    cache.start_request("r", tokens)
    return cache.speculate("r", max_spec_tokens, factor, offset, min_prob, tree, max_depth)


# ---- the tree -------------------------------------------------------------------------------

def test_counts_equal_brute_force_through_inserts_extends_and_removals():
    rng = random.Random(0)
    for trial in range(150):
        depth = rng.choice([2, 3, 5, 64])
        vocab = rng.choice([1, 2, 3])  # tiny alphabets: many repeats, periodic sequences
        tree = SuffixTree(depth)
        seqs = {}
        for _ in range(rng.randint(1, 10)):
            if seqs and rng.random() < 0.25:
                sid = rng.choice(list(seqs))
                tree.remove(sid)
                del seqs[sid]
                continue
            sid = rng.randint(0, 3)
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            if sid not in seqs and rng.random() < 0.5:
                seqs[sid] = tokens  # a whole sequence at once (compressed edges)
                tree.insert(sid, tokens)
            else:
                seqs.setdefault(sid, []).extend(tokens)  # interleaved growth of several
                tree.extend(sid, tokens)
            assert tree_strings(tree) == substring_counts(seqs.values(), depth), trial
            assert tree.num_tokens == sum(map(len, seqs.values()))
            # no node leaks: every node but the root hangs on exactly one edge
            assert tree.num_nodes == len(tree._edges) + 1
            for sid, seq in seqs.items():
                # the active suffixes are exactly the context's matches that occur elsewhere too
                found = {m: tree.count_of(node) for m, node, _ in tree.matches(sid)}
                counts = substring_counts(seqs.values(), depth)
                expected = {m: counts[tuple(seq[-m:])] for m in range(1, min(depth, len(seq) + 1))
                            if counts.get(tuple(seq[-m:]), 0) >= 2}
                assert found == expected, (trial, sid)


def test_speculation_score_equals_brute_force():
    """Best draft score, source and match length over random contexts and caches, against the
    definition: per match length m, the best sum of the top-budget probabilities."""

    def reference(context, trees, depth, budget_tokens, factor, offset, min_prob, max_depth):
        best = (0.0, 0, 0, [])
        for rank, counts in trees:
            for m in range(1, min(depth - 1, len(context)) + 1):
                key = tuple(context[-m:])
                if key not in counts:
                    break
                total = counts[key]
                nodes = max(0, min(budget_tokens, math.floor(factor * m + offset + 1e-6)))
                levels = min(depth - m, max_depth)
                probs = sorted((Fraction(c, total) for s, c in counts.items()
                                if len(s) > m and s[:m] == key and len(s) - m <= levels
                                and c / total >= min_prob), reverse=True)
                score = sum(probs[:nodes])  # exact: equal scores must tie
                if score > 0 and (score, rank, m) > best[:3]:
                    best = (score, rank, m, probs[:nodes])
        return best

    rng = random.Random(1)
    for trial in range(120):
        depth, vocab = rng.choice([3, 5, 64]), rng.choice([2, 3, 4])
        cache = SuffixCache(depth, max_cached_requests=2)
        for r in range(rng.randint(0, 3)):
            cache.start_request(r, [0])
            cache.stop_request(r, [rng.randrange(vocab) for _ in range(rng.randint(1, 10))])
        cached = [cache.cached_response(r) for r in cache.cached_requests]
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        cache.start_request("x", context)
        for _ in range(4):
            args = (rng.choice([1, 3, 64]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, -1.0]),
                    rng.choice([0.0, 0.1, 0.4]))
            max_depth = rng.choice([1, 3, 64])
            draft = cache.speculate("x", *args, True, max_depth)
            trees = [(2, substring_counts([context], depth))]
            if cached:
                trees.append((1, substring_counts(cached, depth)))
            score, rank, m, probs = reference(context, trees, depth, *args, max_depth)
            assert draft.score == pytest.approx(float(score), abs=1e-12), trial
            assert (draft.match_len, {"request": 2, "global": 1, "": 0}[draft.source]) == (m, rank)
            assert all(-1 <= p < i for i, p in enumerate(draft.parents))
            # the draft's nodes are the best `nodes` continuations, each with its own probability
            assert sorted(draft.probs, reverse=True) == pytest.approx([float(p) for p in probs],
                                                                     abs=1e-12), trial
            if draft.token_ids:
                counts = dict(trees)[rank]
                key = tuple(context[-m:])
                for i, prob in enumerate(draft.probs):
                    path, j = [], i
                    while j >= 0:
                        path.append(draft.token_ids[j])
                        j = draft.parents[j]
                    continuation = key + tuple(reversed(path))
                    assert prob == pytest.approx(counts[continuation] / counts[key]), (trial, i)
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            cache.add_response("x", new)
            context += new


# ---- drafting rules on hand-written arrays --------------------------------------------------

def test_the_most_recent_child_wins_among_equal_counts():
    # "1 2" occurs three times (the context's own tail is one): followed once by 3, once by 4.
    # Every node below has probability 1/3; the more recent branch (4 1 2) comes first, then 3.
    # The budget is factor 2 * m 2 = 4 nodes.
    context = [1, 2, 3, 1, 2, 4, 1, 2]
    draft = speculate(context, factor=2.0)
    assert (draft.token_ids, draft.parents, draft.match_len) == ([4, 1, 2, 3], [-1, 0, 1, -1], 2)
    assert draft.probs == [1 / 3] * 4 and draft.score == pytest.approx(4 / 3)
    # path mode follows the same child and its continuation, as a chain
    path = speculate(context, factor=2.0, tree=False)
    assert (path.token_ids, path.parents) == ([4, 1, 2], [-1, 0, 1])


def test_the_more_frequent_child_beats_the_more_recent_one():
    # after 5: 6 twice, then 7 once (most recent); counts decide before recency
    draft = speculate([5, 6, 5, 6, 5, 7, 5], max_spec_tokens=1)
    assert draft.token_ids == [6]


def test_children_are_ranked_again_after_the_tree_changes():
    # the ranking of a node's children is kept between drafts; new sequences must reorder it
    tree = SuffixTree(8)
    tree.insert("a", [5, 6, 1])
    tree.insert("b", [5, 7, 1])
    root_match = tree.advance([], [5])[0]
    first = tree.draft(root_match[1], root_match[2], 1, 1, 0.0)
    assert first.token_ids == [7]  # equal counts: the newer wins
    tree.insert("c", [5, 6, 2])
    root_match = tree.advance([], [5])[0]
    assert tree.draft(root_match[1], root_match[2], 1, 1, 0.0).token_ids == [6]  # 2 of 3
    tree.insert("d", [5, 8, 2])
    root_match = tree.advance([], [5])[0]
    again = tree.draft(root_match[1], root_match[2], 4, 1, 0.0)
    assert again.token_ids == [6, 8, 7] and again.probs == [0.5, 0.25, 0.25]


def test_the_longest_match_wins_among_equal_scores():
    # "2", "1 2" and "7 1 2" each occur twice, followed by 3 (probability 1/2); with a
    # one-token budget every match scores 1/2 and the longest (m = 3) wins
    draft = speculate([7, 1, 2, 3, 7, 1, 2], max_spec_tokens=1)
    assert (draft.token_ids, draft.match_len, draft.score) == ([3], 3, 0.5)


def test_a_higher_score_beats_a_longer_match():
    # the long match "9 1 2" has one earlier occurrence (followed by 3: probability 1/2); the
    # short match "2" is followed by 5 in four of its five occurrences (4/5)
    draft = speculate([2, 5, 2, 5, 2, 5, 2, 5, 9, 1, 2, 3, 9, 1, 2], max_spec_tokens=1)
    assert (draft.token_ids, draft.match_len) == ([5], 1)
    assert draft.score == pytest.approx(4 / 6)


def test_tokens_below_min_token_prob_are_pruned():
    # after 5: 7 nine times, 8 once, and the tail: 8 has probability 1/11 < 0.1
    context = [5, 7] * 9 + [5, 8, 5]
    kept = speculate(context, factor=2.0, max_depth=1)  # budget 2 nodes, depth 1
    assert kept.token_ids == [7] and kept.probs == [9 / 11]
    both = speculate(context, factor=2.0, max_depth=1, min_prob=0.09)
    assert both.token_ids == [7, 8] and both.parents == [-1, -1]


def test_the_draft_budget_is_factor_times_match_length_plus_offset():
    passage = list(range(10, 30))
    context = passage + [99] + passage[:5]  # the last 5 tokens match the passage's start
    assert speculate(context).token_ids == passage[5:10]                     # 1.0 * 5
    assert speculate(context, factor=2.0).token_ids == passage[5:15]         # 2.0 * 5
    assert speculate(context, offset=-2.0).token_ids == passage[5:8]         # 5 - 2
    assert speculate(context, factor=2.0, max_spec_tokens=4).token_ids == passage[5:9]
    assert speculate(context, factor=0.5).token_ids == passage[5:7]          # floor(2.5)
    assert speculate(context, max_depth=2).token_ids == passage[5:7]        # the engine's cap
    # the tree depth caps match + draft: at depth 8 the 5-token match drafts at most 3 tokens,
    # so the 3-token match, with room for 5, wins
    capped = speculate(context, factor=2.0, depth=8)
    assert (capped.token_ids, capped.match_len) == (passage[5:10], 3)


def test_the_bounded_search_drafts_from_few_matches(monkeypatch):
    # a 40-token passage copied again: every m up to 40 matches, but after the first draft
    # (16 tokens at probability 1/2) no other match's bound can beat it
    passage = list(range(100, 160))
    calls = []
    original = SuffixTree.draft

    def counted(self, *args):
        calls.append(args)
        return original(self, *args)

    monkeypatch.setattr(SuffixTree, "draft", counted)
    draft = speculate(passage + [1] + passage[:40])
    assert draft.token_ids == passage[40:56] and draft.match_len == 40
    assert len(calls) == 1


def test_a_context_with_no_earlier_match_drafts_nothing():
    draft = speculate([1, 2, 3, 4])
    assert draft.token_ids == [] and draft.score == 0.0 and draft.source == ""


# ---- request tree vs global tree ------------------------------------------------------------

def test_global_tree_drafts_from_earlier_responses():
    draft = speculate([1, 2, 3], responses=[[1, 2, 3, 4, 5, 6]])
    # one earlier occurrence and none in the request: probability 1 for each token
    assert (draft.token_ids, draft.source, draft.score) == ([4, 5, 6], "global", 3.0)


def test_a_reference_drafts_as_the_request_s_own_text():
    """A predicted output (``add_reference``) is matched and drafted from in the request's tree;
    the response continues the prompt, never the reference."""
    cache = SuffixCache(max_tree_depth=8, max_cached_requests=0)
    cache.start_request("r", [1, 2, 3])
    assert cache.speculate("r").token_ids == []
    cache.add_reference("r", [5, 1, 2, 3, 7, 8, 9])
    draft = cache.speculate("r")  # "1 2 3" matched in the reference: 3 tokens (factor 1)
    assert (draft.token_ids, draft.source) == ([7, 8, 9], "request")
    cache.add_response("r", [7, 8])
    assert cache.speculate("r").token_ids == [9]


def test_higher_score_wins_between_the_trees_and_ties_go_to_the_request():
    context = [1, 2, 3, 9, 1, 2, 3]  # in the request: "1 2 3" -> 9 1 2, probability 1/2 each
    responses = [[1, 2, 3, 4], [1, 2, 3, 7]]  # globally: 4 or 7, probability 1/2 each
    draft = speculate(context, responses=responses)
    assert (draft.token_ids, draft.source, draft.score) == ([9, 1, 2], "request", 1.5)
    # two tokens each: request 9 1 and global 4 | 7 both score 1.0; the request wins the tie
    tie = speculate(context, max_spec_tokens=2, responses=responses)
    assert (tie.token_ids, tie.source, tie.score) == ([9, 1], "request", 1.0)
    # one global answer (probability 1) beats the request's 1/2
    single = speculate(context, responses=[[1, 2, 3, 4, 5, 6]])
    assert (single.token_ids, single.source) == ([4, 5, 6], "global")


def test_global_matches_follow_the_request_and_changes_of_the_global_tree():
    cache = SuffixCache(64, max_cached_requests=10)
    cache.start_request("a", [50, 51])
    assert cache.speculate("a").token_ids == []
    cache.start_request("b", [0])
    cache.stop_request("b", [40, 41, 42, 43, 44])  # the global tree changes mid-request
    cache.add_response("a", [40])
    assert cache.speculate("a").token_ids == [41]         # m = 1: budget 1
    cache.add_response("a", [41])
    assert cache.speculate("a").token_ids == [42, 43]     # m = 2: budget 2
    cache.add_response("a", [7])
    assert cache.speculate("a").token_ids == []
    cache.stop_request("a")
    assert cache.cached_response("a") == [40, 41, 7]       # the response, not the prompt


# ---- the shared cache -----------------------------------------------------------------------

def test_fifo_eviction_bounds_the_global_tree():
    cache = SuffixCache(16, max_cached_requests=3)
    responses = {i: [i, i + 1, 7, 8, 9, i] for i in range(5)}
    for i, response in responses.items():
        cache.start_request(i, [1, 2])
        cache.add_response(i, response)
        cache.stop_request(i)
    assert cache.cached_requests == [2, 3, 4]
    assert cache.num_cached_tokens == 18
    fresh = SuffixCache(16, max_cached_requests=3)
    for i in (2, 3, 4):
        fresh.start_request(i, [1])
        fresh.stop_request(i, responses[i])
    # eviction freed every node the evicted responses used
    assert cache._global.num_nodes == fresh._global.num_nodes
    assert tree_strings(cache._global) == tree_strings(fresh._global)
    cache.evict(3)
    assert cache.cached_requests == [2, 4]
    with pytest.raises(SpecDecodeError, match="no cached response"):
        cache.evict(3)
    off = SuffixCache(16, max_cached_requests=0)
    off.start_request("x", [1])
    off.stop_request("x", [1, 2, 3])
    assert off.cached_requests == [] and off.num_cached_tokens == 0


def test_request_lifecycle_errors_name_the_fix():
    cache = SuffixCache()
    with pytest.raises(SpecDecodeError, match="not active; call start_request"):
        cache.speculate("nope")
    cache.start_request("a", [1, 2])
    with pytest.raises(SpecDecodeError, match="already active"):
        cache.start_request("a", [1])
    with pytest.raises(SpecDecodeError, match="integer token ids"):
        cache.add_response("a", [1.5])
    for bad in (-1, 1 << 32):
        with pytest.raises(SpecDecodeError, match="outside 0"):
            cache.add_response("a", [bad])
    with pytest.raises(SpecDecodeError, match="int or str"):
        cache.start_request(("tuple", 1), [1])
    with pytest.raises(SpecDecodeError, match="max_cached_requests"):
        SuffixCache(max_cached_requests=-1)
    assert cache.new_request_id() not in cache.active_requests


def test_save_and_load_round_trip(tmp_path):
    cache = SuffixCache(32, max_cached_requests=5)
    for rid, response in [(7, [1, 2, 3, 4]), ("chat-1", [3, 4, 5, 6, 3, 4]), (9, [8, 8, 8])]:
        cache.start_request(rid, [0])
        cache.stop_request(rid, response)
    path = tmp_path / "suffix.json"
    cache.save(path)
    loaded = SuffixCache.load(path)
    assert (loaded.max_tree_depth, loaded.max_cached_requests) == (32, 5)
    assert loaded.cached_requests == [7, "chat-1", 9]
    assert [loaded.cached_response(r) for r in loaded.cached_requests] == \
        [cache.cached_response(r) for r in cache.cached_requests]
    assert tree_strings(loaded._global) == tree_strings(cache._global)
    for c in (cache, loaded):
        c.start_request("q", [3, 4])
    assert loaded.speculate("q") == cache.speculate("q")
    # a smaller bound keeps the newest responses
    assert SuffixCache.load(path, max_cached_requests=2).cached_requests == ["chat-1", 9]
    assert loaded.new_request_id() not in (7, 9)


@pytest.mark.parametrize("content, message", [
    ("not json", "not valid JSON"),
    (json.dumps({"format": "other"}), "not a specdecode suffix cache"),
    (json.dumps({"format": "specdecode-suffix-cache", "version": 99}), "version 99"),
    (json.dumps({"format": "specdecode-suffix-cache", "version": 1, "max_tree_depth": 64,
                 "max_cached_requests": 5, "responses": [{"id": 1, "tokens": ["a"]}]}),
     "integer token ids"),
])
def test_load_rejects_bad_files(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SpecDecodeError, match=message):
        SuffixCache.load(path)
    with pytest.raises(SpecDecodeError, match="cannot read"):
        SuffixCache.load(tmp_path / "missing.json")


def test_threads_sharing_one_cache():
    cache = SuffixCache(16, max_cached_requests=8)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(15):
                rid = cache.new_request_id()
                cache.start_request(rid, [rng.randrange(5) for _ in range(10)])
                for _ in range(8):
                    draft = cache.speculate(rid)
                    assert all(-1 <= p < i for i, p in enumerate(draft.parents))
                    cache.add_response(rid, [rng.randrange(5) for _ in range(rng.randint(1, 3))])
                cache.stop_request(rid)
        except Exception as exc:  # surfaced below: a thread's assertion does not fail pytest
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(cache.cached_requests) == 8 and cache.active_requests == []
    responses = [cache.cached_response(r) for r in cache.cached_requests]
    assert tree_strings(cache._global) == substring_counts(responses, 16)


# ---- the proposer ---------------------------------------------------------------------------

def test_registered_with_validated_config():
    method = registry.get("suffix")
    assert method.proposer is SuffixProposer and method.config is SuffixConfig
    defaults = {name: value for name, value, _ in method.defaults()}
    assert defaults["max_tree_depth"] == 64 and defaults["min_token_prob"] == 0.1
    assert defaults["max_spec_factor"] == 1.0 and defaults["mode"] == "tree"
    for bad, message in [({"min_token_prob": 1.5}, "min_token_prob"),
                         ({"mode": "beam"}, "'tree' or 'path'"),
                         ({"max_tree_depth": 1}, "max_tree_depth"),
                         ({"max_spec_tokens": 0}, "max_spec_tokens"),
                         ({"max_spec_factor": -1}, "max_spec_factor"),
                         ({"max_cached_requests": -1}, "max_cached_requests")]:
        with pytest.raises(SpecDecodeError, match=message):
            method.make_config(bad)
    with pytest.raises(SpecDecodeError, match="same depth"):
        SuffixProposer(SuffixConfig(), None, global_cache=SuffixCache(max_tree_depth=8))


def test_proposer_without_a_model_respects_the_budget():
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=4.0, max_spec_tokens=16), None)
    passage = list(range(10, 40))
    context = passage + [99] + passage[:6]
    proposer.start(context)
    assert draft_tokens(proposer.propose(context, Budget(64, 128))) == passage[6:22]  # 16 cap
    assert draft_tokens(proposer.propose(context, Budget(3, 128))) == passage[6:9]
    assert draft_tokens(proposer.propose(context, Budget(64, 5))) == passage[6:11]
    # observe() extends the request's tree; the next proposal continues from there
    draft = proposer.propose(context, Budget(2, 128))
    proposer.observe(Feedback(tuple(context), draft, None, (0, 1), (16, 17, 18)))
    assert draft_tokens(proposer.propose(context + [16, 17, 18], Budget(2, 128))) == [19, 20]
    assert proposer.last_draft.source == "request"
    proposer.finish([16, 17, 18])
    assert proposer.cache.cached_response(proposer.cache.cached_requests[-1]) == [16, 17, 18]
    # used without start(): it begins from the context it is given
    fresh = SuffixProposer(SuffixConfig(), None)
    assert draft_tokens(fresh.propose(context, Budget(64, 128))) == passage[6:12]


def draft_tokens(draft):
    assert draft.probs is None and all(-1 <= p < i for i, p in enumerate(draft.parents))
    return list(draft.tokens)


@pytest.fixture(scope="module")
def ar_outputs(tiny_model):
    ar = Decoder(tiny_model, None, "ar", eos_token_ids=[])
    return [(p, ar.start(p, max_new_tokens=24).run()) for p in repetitive_prompts()[:3]]


@pytest.mark.parametrize("config", [{}, {"mode": "path"}, {"max_spec_factor": 4.0,
                                                          "min_token_prob": 0.0}])
def test_greedy_identical_to_ar_on_a_tiny_model(tiny_model, ar_outputs, config):
    suffix = Decoder(tiny_model, None, "suffix", eos_token_ids=[], **config)
    drafted = 0
    # twice over the prompts: the second pass drafts from the global tree
    for prompt, expected in ar_outputs * 2:
        generation = suffix.start(prompt, max_new_tokens=24)
        assert generation.run() == expected, prompt
        drafted += generation.stats.accepted_tokens
    assert drafted > 0  # the drafts were used, not just empty
    assert len(suffix.proposer.cache.cached_requests) == 2 * len(ar_outputs)


def test_end_of_sequence_cuts_the_cached_response(tiny_model):
    prompt = repetitive_prompts()[0]
    full = Decoder(tiny_model, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
    eos = full[10]
    expected = full[:full.index(eos) + 1]
    suffix = Decoder(tiny_model, None, "suffix", eos_token_ids=[eos])
    for _ in range(2):
        assert suffix.start(prompt, 24).run() == expected
    cache = suffix.proposer.cache
    assert cache.cached_response(cache.cached_requests[-1]) == expected
