"""The loop itself, with oracle drafters that know the reference output: one that always
agrees, one that never does, one that agrees in part, trees hiding the right path among wrong
branches, drafts crossing end-of-sequence, drafts cut by max_new_tokens, empty drafts."""

from __future__ import annotations

import pytest

from specdecode.control import Budget
from specdecode.draft import Draft
from specdecode.engine import Generation
from specdecode.models.hf import HFRunner
from specdecode.proposer import Proposer
from specdecode.proposers.ar import Autoregressive, ArConfig

from conftest import repetitive_prompts

MAX_NEW = 24


class Oracle(Proposer):
    """Drafts from a known reference continuation, spoiled according to ``mode``."""

    def __init__(self, runner, prompt, truth, mode, length=5, vocab=96):
        super().__init__(None, runner)
        self.prompt_len, self.truth, self.mode = len(prompt), truth, mode
        self.length, self.vocab = length, vocab
        self.observed = 0

    def wrong(self, token):
        return (token + 1) % self.vocab

    def propose(self, context, budget: Budget):
        done = len(context) - self.prompt_len  # tokens already generated
        right = list(self.truth[done:done + self.length])
        # past the reference's end (it stopped at EOS or the limit): draft beyond it anyway
        right += [7] * (self.length - len(right))
        if self.mode == "agree":
            return Draft.chain(right)
        if self.mode == "never":
            return Draft.chain([self.wrong(t) for t in right])
        if self.mode == "partial":
            cut = done % (self.length + 1)
            return Draft.chain(right[:cut] + [self.wrong(t) for t in right[cut:]])
        if self.mode == "tree":
            # the right path is the LAST branch at each level, behind wrong siblings
            wrong = [self.wrong(t) for t in right]
            return Draft.from_paths([wrong, right[:2] + wrong[2:], right])
        if self.mode == "empty":
            return Draft.empty()
        raise AssertionError(self.mode)

    def observe(self, feedback):
        self.observed += 1


@pytest.fixture(scope="module")
def runner(tiny_model):
    return HFRunner(tiny_model)


def reference(runner, prompt, max_new=MAX_NEW, eos=()):
    gen = Generation(runner, Autoregressive(ArConfig(), runner), prompt, max_new, eos_token_ids=eos)
    return gen.run(), gen


@pytest.mark.parametrize("mode", ["agree", "never", "partial", "tree", "empty"])
@pytest.mark.parametrize("prompt", repetitive_prompts())
def test_oracle_drafts_match_ar(runner, prompt, mode):
    truth, _ = reference(runner, prompt)
    proposer = Oracle(runner, prompt, truth, mode)
    gen = Generation(runner, proposer, prompt, MAX_NEW)
    assert gen.run() == truth
    stats = gen.stats
    assert stats.new_tokens == len(truth)
    assert sum(stats.accepted_lengths) + 1 == len(truth)  # +1: the prefill's token
    assert stats.target_forwards == len(stats.accepted_lengths) + 1
    if mode == "agree":
        assert stats.mean_accepted > 4  # 5-token drafts, all accepted, bonus added
    if mode in ("never", "empty"):
        assert stats.mean_accepted == 1.0


def test_always_agreeing_chain_uses_few_forwards(runner):
    prompt = repetitive_prompts()[0]
    truth, _ = reference(runner, prompt)
    gen = Generation(runner, Oracle(runner, prompt, truth, "agree", length=5), prompt, MAX_NEW)
    gen.run()
    # 1 prefill token, then 6 tokens per step (5 accepted + bonus), the last step capped
    assert gen.stats.target_forwards == 1 + -(-(MAX_NEW - 1) // 6)


@pytest.mark.parametrize("mode", ["agree", "tree", "partial"])
def test_draft_crossing_end_of_sequence(runner, mode):
    prompt = repetitive_prompts()[1]
    full, _ = reference(runner, prompt)
    eos = full[6]  # pretend the token at position 6 is end-of-sequence
    truth, gen_ar = reference(runner, prompt, eos=[eos])
    assert truth == full[: full.index(eos) + 1] and gen_ar.finish_reason == "stop"
    # the oracle drafts past EOS (it knows the EOS-free continuation)
    gen = Generation(runner, Oracle(runner, prompt, full, mode), prompt, MAX_NEW, eos_token_ids=[eos])
    assert gen.run() == truth
    assert gen.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_draft_cut_by_max_new_tokens(runner, max_new):
    prompt = repetitive_prompts()[2]
    truth, _ = reference(runner, prompt, max_new=MAX_NEW)
    gen = Generation(runner, Oracle(runner, prompt, truth, "agree", length=10), prompt, max_new)
    assert gen.run() == truth[:max_new]
    assert gen.finish_reason == "length"


def test_streaming_chunks_concatenate_to_tokens(runner):
    prompt = repetitive_prompts()[3]
    truth, _ = reference(runner, prompt)
    gen = Generation(runner, Oracle(runner, prompt, truth, "partial"), prompt, MAX_NEW)
    chunks = list(gen)
    assert [t for c in chunks for t in c] == truth
    assert all(chunks)


def test_stopping_early_calls_finish(runner):
    prompt = repetitive_prompts()[0]
    finished = []

    class Recorder(Autoregressive):
        def finish(self, output):
            finished.append(list(output))

    gen = Generation(runner, Recorder(ArConfig(), runner), prompt, MAX_NEW)
    it = iter(gen)
    next(it), next(it)
    it.close()
    assert finished == [gen.tokens] and len(gen.tokens) == 2


def test_runner_commit_keeps_only_accepted_rows(runner):
    prompt = repetitive_prompts()[0]
    truth, _ = reference(runner, prompt)
    runner.prefill(prompt)
    draft = Draft.from_paths([[1, 2], [truth[1], truth[2]]])
    runner.forward(truth[0], draft)
    runner.commit([2, 3])
    assert runner.cache_len == len(prompt) + 3
    # the next plain step must see exactly prompt + truth[:3]
    logits = runner.forward(truth[3], Draft.empty()).logits
    assert int(logits[0].argmax()) == truth[4]


def test_stats_count_only_tokens_committed_before_end_of_sequence(runner):
    prompt = repetitive_prompts()[1]
    full, _ = reference(runner, prompt)
    eos = full[6]
    gen = Generation(runner, Oracle(runner, prompt, full, "agree", length=10), prompt, MAX_NEW,
                     eos_token_ids=[eos])
    tokens = gen.run()
    assert sum(gen.stats.accepted_lengths) + 1 == len(tokens) == gen.stats.new_tokens
