"""The suffix corpus: target-written text drafted from beside the global tree. Drafting rules on
hand-written token arrays (its place among the trees, untouched by eviction and save), the file
(round trip, the target check, clear errors), `train corpus`, and greedy exactness with it."""

from __future__ import annotations

import json

import pytest

from specdecode.api import Decoder
from specdecode.errors import SpecDecodeError
from specdecode.suffix_corpus import corpus_tree, read_corpus, save_corpus
from specdecode.suffix_cache import SuffixCache
from specdecode.suffix_tree import SuffixTree

from conftest import repetitive_prompts


def tree_of(sequences, depth=64) -> SuffixTree:
    tree = SuffixTree(depth)
    for k, sequence in enumerate(sequences):
        tree.insert(k, sequence)
    return tree


def speculate(cache: SuffixCache, context, **kw):
    cache.start_request("r", context)
    try:
        return cache.speculate("r", **kw)
    finally:
        cache.stop_request("r", [])


def test_the_corpus_drafts_when_no_response_has_been_cached():
    cache = SuffixCache(64)
    assert speculate(cache, [1, 2, 3]).token_ids == []
    cache.use_corpus(tree_of([[1, 2, 3, 4, 5, 6]]))
    draft = speculate(cache, [1, 2, 3])
    assert (draft.token_ids, draft.source, draft.score) == ([4, 5, 6], "corpus", 3.0)


def test_the_corpus_drafts_only_where_the_request_and_the_global_tree_have_nothing():
    cache = SuffixCache(64)
    cache.use_corpus(tree_of([[1, 2, 3, 4, 5, 6, 7]]))  # every continuation probability 1
    cache.add_cached("a", [1, 2, 3, 7, 8, 9])
    cache.add_cached("b", [1, 2, 3, 8, 9, 9])  # globally 7 or 8 after "1 2 3", 1/2 each
    draft = speculate(cache, [1, 2, 3])  # the corpus would score 3
    assert (draft.token_ids, draft.source, draft.score) == ([8, 9, 9], "global", 1.5)
    # the request's own text repeats "4 5" (then 9 4, 1/2 each), the corpus would score 2
    own = speculate(cache, [4, 5, 9, 4, 5])
    assert (own.token_ids, own.source, own.score) == ([9, 4], "request", 1.0)
    # nothing in the request or the served responses follows "4 5" here: the corpus does
    fallback = speculate(cache, [4, 5])
    assert (fallback.token_ids, fallback.source) == ([6, 7], "corpus")


def test_the_corpus_follows_a_growing_request():
    cache = SuffixCache(64)
    cache.use_corpus(tree_of([[40, 41, 42, 43, 44]]))
    cache.start_request("a", [50, 51])
    drafts = []
    for tokens in ([], [40], [41], [7]):  # each match length m drafts m tokens (factor 1)
        cache.add_response("a", tokens)
        draft = cache.speculate("a")
        drafts.append((draft.token_ids, draft.match_len, draft.source))
    assert drafts == [([], 0, ""), ([41], 1, "corpus"), ([42, 43], 2, "corpus"), ([], 0, "")]


def test_the_corpus_is_neither_evicted_nor_saved(tmp_path):
    cache = SuffixCache(16, max_cached_requests=1)
    cache.use_corpus(tree_of([[1, 2, 3, 4]], depth=16))
    for i in range(3):
        cache.add_cached(i, [9, 9, i])
    assert cache.cached_requests == [2]
    assert speculate(cache, [1, 2, 3]).token_ids == [4]
    cache.save(tmp_path / "cache.json")
    saved = json.loads((tmp_path / "cache.json").read_text())
    assert [r["tokens"] for r in saved["responses"]] == [[9, 9, 2]]
    assert SuffixCache.load(tmp_path / "cache.json").corpus is None
    with pytest.raises(SpecDecodeError, match="same depth"):
        cache.use_corpus(tree_of([[1, 2]], depth=8))


def test_corpus_file_round_trip_and_refusals(tmp_path):
    sequences = [[5, 6, 7, 8], [9, 10], [5, 6, 11]]
    path = save_corpus(tmp_path / "c.safetensors", sequences, "fp-a", {"shards": ["s.jsonl"]})
    assert read_corpus(path, "fp-a") == sequences
    assert read_corpus(path, None) == sequences  # a replay without a model: no target check
    with pytest.raises(SpecDecodeError, match="another target model"):
        read_corpus(path, "fp-b")
    with pytest.raises(SpecDecodeError, match="specdecode train corpus"):
        corpus_tree(str(tmp_path / "missing.safetensors"), None, 64)
    assert corpus_tree("none", None, 64) is None
    assert corpus_tree("auto", None, 64) is None  # no runner: no target to look one up for
    tree = corpus_tree(str(path), None, 64)
    assert tree is corpus_tree(str(path), None, 64)  # built once, shared
    assert tree.num_tokens == 9 and tree.max_depth == 64
    with pytest.raises(SpecDecodeError, match="at least one sequence"):
        save_corpus(tmp_path / "empty.safetensors", [], "fp-a", {})


def test_auto_takes_the_newest_corpus_for_the_target(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runner = Decoder(tiny_model, None, "ar", eos_token_ids=[]).runner
    folder = tmp_path / "specdecode" / "artifacts"
    save_corpus(folder / "other.safetensors", [[1, 2, 3]], "another-model", {})
    assert corpus_tree("auto", runner, 64) is None  # another target's corpus is skipped
    save_corpus(folder / "mine.safetensors", [[1, 2, 3, 4]], runner.fingerprint(), {})
    assert corpus_tree("auto", runner, 64).num_tokens == 4


def test_greedy_identical_to_ar_with_a_corpus(tiny_model, tmp_path):
    ar = Decoder(tiny_model, None, "ar", eos_token_ids=[])
    prompts = repetitive_prompts()[:3]
    outputs = [ar.start(p, max_new_tokens=24).run() for p in prompts]
    path = save_corpus(tmp_path / "c.safetensors", outputs, ar.runner.fingerprint(), {})
    accepted = {}
    for corpus in ("none", str(path)):
        # no global tree: whatever beats the request's own text comes from the corpus
        suffix = Decoder(tiny_model, None, "suffix", eos_token_ids=[], corpus=corpus,
                         max_cached_requests=0)
        accepted[corpus] = 0
        for prompt, expected in zip(prompts, outputs):
            generation = suffix.start(prompt, max_new_tokens=24)
            assert generation.run() == expected, (corpus, prompt)
            accepted[corpus] += generation.stats.accepted_tokens
    assert accepted[str(path)] > accepted["none"]


def test_a_corpus_for_another_target_is_refused(tiny_model, tmp_path):
    path = save_corpus(tmp_path / "c.safetensors", [[1, 2, 3]], "another-model", {})
    with pytest.raises(SpecDecodeError, match="another target model"):
        Decoder(tiny_model, None, "suffix", eos_token_ids=[], corpus=str(path))


@pytest.mark.slow
def test_train_corpus_writes_the_shards_conversations(tmp_path, real_model, capsys):
    from specdecode.cli import main
    from specdecode.models.hf import HFRunner

    shard = tmp_path / "shard.jsonl"
    rows = [{"index": i, "settings": "s", "prompt_len": 2, "ids": ids}
            for i, ids in enumerate([[1, 2, 3, 4], [5, 6, 7], [8, 9]])]
    shard.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"index": 3, "cut')
    out = tmp_path / "corpus.safetensors"
    argv = ["train", "corpus", "--data", str(shard), "--out", str(out)]
    assert main(argv + ["--max-tokens", "7"]) == 0
    fingerprint = HFRunner(real_model.model).fingerprint()
    assert read_corpus(out, fingerprint) == [[1, 2, 3, 4], [5, 6, 7]]  # whole conversations
    assert json.loads(capsys.readouterr().out)["tokens"] == 7
    assert main(argv) == 0
    assert read_corpus(out, fingerprint) == [r["ids"] for r in rows]  # the cut line left out
    rows[0]["ids"] = [1, 2, 10 ** 6]
    shard.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(argv) == 2
    assert "beyond smollm2's vocabulary" in capsys.readouterr().err


def test_auto_hands_its_corpus_to_the_suffix_part(tiny_model, tmp_path):
    from specdecode.proposers.auto import AutoConfig, AutoProposer

    runner = Decoder(tiny_model, None, "ar", eos_token_ids=[]).runner
    path = save_corpus(tmp_path / "c.safetensors", [[1, 2, 3]], runner.fingerprint(), {})
    auto = AutoProposer(AutoConfig(parts="suffix,ngram", corpus=str(path)), runner)
    assert auto.parts[0].cache.corpus is not None and auto.parts[0].cache.corpus.num_tokens == 3
    assert AutoProposer(AutoConfig(parts="suffix,ngram"), runner).parts[0].cache.corpus is None
