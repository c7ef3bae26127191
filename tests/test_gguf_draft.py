"""A GGUF file as the draft of ``draft_model`` and ``dyspec`` (as llama.cpp's ``-md``): tiny
random-weight files written here, one the target and others drafts, greedy output identical to
``ar``, seeded sampling repeating (coupled chains: ``ar``'s own answer), a draft of another
vocabulary or tokenizer refused, a missing file refused; and the real pair (Qwen2.5-Coder 1.5B
with its 0.5B draft) when installed (slow).

The files' vocabulary has 90 tokens and their embedding tables 96 rows (as Qwen2.5's tables are
wider than its tokenizer): a draft whose rows equal the target's is accepted.

Methods run as a :class:`Generation` of their proposer, each draft as long as the proposer makes
it (no draft sizing from measured costs), so that seeded runs repeat whatever the timing."""

from __future__ import annotations

import pytest
import torch

from specdecode.api import Decoder
from specdecode.draft import Draft
from specdecode.engine import Generation
from specdecode.drafting.artifacts import shortlist_ids
from specdecode.errors import SpecDecodeError
from specdecode.models import loading
from specdecode.models.llama import LlamaRunner
from specdecode.sampling import SamplingParams

from conftest import repetitive_prompts, write_gguf
from tiny_models import noisy_copy, tiny_llama

TOKENS = [f"t{i}" for i in range(90)]
TREE = {"tree_nodes": 10, "max_depth": 5, "expand_width": 3, "min_path_prob": 0.0}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The target and its drafts: a noisy copy (agrees often: accepted tokens, cache reuse and
    rejections all happen), a different small model (rarely agrees), one of another vocabulary,
    one of another tokenizer."""
    folder = tmp_path_factory.mktemp("gguf-drafts")
    target = tiny_llama(seed=0)
    return {
        "target": write_gguf(target, folder / "target.gguf", tokens=TOKENS),
        "close": write_gguf(noisy_copy(target, 0.3, seed=1), folder / "close.gguf", tokens=TOKENS),
        "other": write_gguf(tiny_llama(seed=3, layers=1), folder / "other.gguf", tokens=TOKENS),
        "tied": write_gguf(tiny_llama(seed=5, layers=1, tie_embeddings=True),
                           folder / "tied.gguf", tokens=TOKENS),
        "narrow": write_gguf(tiny_llama(vocab_size=80, seed=2, layers=1), folder / "narrow.gguf",
                             tokens=TOKENS[:80]),
        "retokenized": write_gguf(tiny_llama(seed=4, layers=1), folder / "retokenized.gguf",
                                  tokens=TOKENS + ["x"] * 6),
    }


@pytest.fixture(scope="module")
def target(files):
    return LlamaRunner.from_gguf(files["target"], "int4")


def proposer(target, method, draft=None, **config):
    if draft is not None:
        config["draft"] = draft
    return Decoder(target, None, method, eos_token_ids=[], **config).proposer


def generation(target, proposer, prompt, n, **sampling) -> Generation:
    return Generation(target, proposer, prompt, n, SamplingParams(**sampling))


def ar(target, prompt, n):
    return generation(target, proposer(target, "ar"), prompt, n).run()


@pytest.mark.parametrize("method,config", [("draft_model", {}), ("dyspec", TREE)])
@pytest.mark.parametrize("which,weights", [("close", "auto"), ("other", "fp32")])
def test_greedy_identical_to_ar(target, files, method, config, which, weights):
    drafter = proposer(target, method, str(files[which]), draft_weights=weights, **config)
    assert drafter.draft_source == str(files[which])
    assert drafter.lm.runner.runner.weights == ("int4" if weights == "auto" else weights)
    accepted = 0
    for prompt in repetitive_prompts()[:3]:
        gen = generation(target, drafter, prompt, 32)
        assert gen.run() == ar(target, prompt, 32), (method, which, prompt)
        accepted += gen.stats.accepted_tokens
    if which == "close":
        assert accepted > 0  # the draft's cache stayed aligned through accepted tokens


@pytest.mark.parametrize("method,config", [("draft_model", {"controller": "confidence"}),
                                           ("dyspec", TREE)])
def test_seeded_sampling_repeats(target, files, method, config):
    drafter = proposer(target, method, str(files["close"]), **config)
    prompt = repetitive_prompts()[1]
    runs = [generation(target, drafter, prompt, 30, temperature=0.9, top_k=40, seed=seed).run()
            for seed in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def sampled_run(target, drafter, prompt, strip_probs=False):
    """(the seeded T = 0.9 answer, the draft tokens accepted a verify step, drafts that carried
    probabilities); ``strip_probs``: each draft sent without its probabilities, as ``auto``
    sends a draft drawn apart from the verifier."""
    propose, with_probs = drafter.propose, []

    def sent(context, budget):
        draft = propose(context, budget)
        with_probs.append(draft.probs is not None)
        return Draft(draft.tokens, draft.parents) if strip_probs else draft

    drafter.propose = sent
    try:
        gen = generation(target, drafter, prompt, 40, temperature=0.9, seed=7)
        tokens = gen.run()
    finally:
        del drafter.propose
    return tokens, gen.stats.mean_accepted - 1.0, sum(with_probs)


@pytest.mark.parametrize("method,config", [("draft_model", {}), ("dyspec", TREE)])
def test_coupled_drafts_leave_ars_answer_and_land_on_the_targets_tokens(target, files, method,
                                                                        config):
    """``coupled=true``: each drafted token (a tree: each node's first child) is drawn with the
    uniform the verifier will draw for it and sent without probabilities, so a seeded answer
    is ``ar``'s own whatever the draft; a draft equal to the target lands on its tokens, where
    the same draft's tokens drawn apart from the verifier are accepted with p(x) only."""
    prompts = repetitive_prompts()[:3]
    for which in ("target", "close", "other"):
        drafter = proposer(target, method, str(files[which]), coupled=True, **config)
        assert not drafter.samples_drafts
        for prompt in prompts:
            expected = generation(target, proposer(target, "ar"), prompt, 40, temperature=0.9,
                                  seed=7).run()
            tokens, _, with_probs = sampled_run(target, drafter, prompt)
            assert tokens == expected and with_probs == 0, (which, prompt)
    coupled = proposer(target, method, str(files["target"]), coupled=True, **config)
    apart = proposer(target, method, str(files["target"]), **config)
    rates = [(sampled_run(target, coupled, p)[1], sampled_run(target, apart, p, True)[1])
             for p in prompts]
    # (measured at T = 0.9 on this near-uniform target: a chain 4.57 tokens a step against
    # 0.00-0.03, a tree of ten nodes, wide on it, 0.95 against 0.22-0.30)
    assert all(mine >= 0.8 and theirs <= 0.5 for mine, theirs in rates), rates


@pytest.mark.parametrize("method,config", [("draft_model", {}), ("dyspec", TREE)])
@pytest.mark.parametrize("widen", [True, False])
def test_a_shortlisted_head_drafts_only_its_tokens_and_changes_no_output(target, files, method,
                                                                          config, widen):
    """``draft_vocab=48``: the draft's LM head scores the first 48 ids (FR-Spec) and, unless
    ``draft_vocab_context`` is false, the context's tokens outside them; its drafts hold no
    other token, greedy output is ``ar``'s, seeded sampling repeats."""
    drafter = proposer(target, method, str(files["close"]), draft_vocab=48,
                       draft_vocab_context=widen, **config)
    runner = drafter.lm.runner.runner
    assert drafter.lm.head_ids.tolist() == list(range(48))
    assert runner.cost_key() != proposer(target, method, str(files["close"]),
                                         **config).lm.runner.runner.cost_key()
    drafted, elsewhere = [], []
    for prompt in repetitive_prompts()[:3]:
        gen = generation(target, drafter, prompt, 32)
        gen.advance(gen.begin().run(target))
        while gen.finish_reason is None:
            call = gen.next_call()
            context = set(prompt) | set(gen.tokens)
            drafted.extend(call.draft.tokens)
            elsewhere.extend(t for t in call.draft.tokens if t >= 48 and t not in context)
            gen.advance(call.run(target))
        assert gen.tokens == ar(target, prompt, 32), (method, prompt)
    assert drafted and not elsewhere
    assert (max(drafted) >= 48) == widen  # the answers' own tokens past 48 were drafted
    prompt = repetitive_prompts()[1]
    runs = [generation(target, drafter, prompt, 24, temperature=0.9, seed=seed).run()
            for seed in (5, 5)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("which", ["close", "tied"])
def test_a_widened_shortlist_scores_the_contexts_tokens_as_the_whole_head_does(target, files,
                                                                              which):
    """The tokens a widened shortlist scores are the first 48 ids and its context's others, of
    the context it holds now (a context that forgets some forgets them too), each with the
    logit the whole vocabulary's head gives it (its own rows, or the embedding's when tied)."""
    def lm(vocab):
        return proposer(target, "draft_model", str(files[which]), draft_vocab=vocab,
                        draft_weights="fp32").lm

    widened, whole = lm(48), lm(0)
    first = repetitive_prompts()[4] + [60, 70, 80, 5, 6]
    for context in (first, first + [88, 7], first[:3] + [7, 8, 85, 9]):
        logits, _ = widened.catch_up(context)
        expected = sorted(set(range(48)) | set(context))
        assert widened.head_ids.tolist() == expected, context
        full, _ = whole.catch_up(context)
        torch.testing.assert_close(logits, full[widened.head_ids], rtol=1e-4, atol=1e-4)
    rows, _ = widened.feed([86, 3], [-1, 0])
    full_rows, _ = whole.feed([86, 3], [-1, 0])
    torch.testing.assert_close(rows, full_rows[:, widened.head_ids], rtol=1e-4, atol=1e-4)


def test_auto_given_a_draft_drafts_with_it_and_changes_no_output(target, files):
    """``auto -c draft=FILE.gguf`` (no parts named): suffix and draft_model (coupled), greedy
    and seeded sampled output ``ar``'s; without a draft, a target with no heads is told it may
    name one."""
    auto = proposer(target, "auto", str(files["close"]))
    assert auto.names == ["suffix", "draft_model"]
    for prompt in repetitive_prompts()[:2]:
        assert generation(target, auto, prompt, 24).run() == ar(target, prompt, 24), prompt
    # its draft model's chains are coupled to the verifier: a seeded answer is ar's own
    assert auto.parts[1].config.coupled
    prompt = repetitive_prompts()[1]
    expected = generation(target, proposer(target, "ar"), prompt, 40, temperature=0.9,
                          seed=7).run()
    tokens, _, with_probs = sampled_run(target, auto, prompt)
    assert tokens == expected and with_probs == 0
    # without a draft its default heads are asked for: none are trained for this target
    with pytest.raises(SpecDecodeError, match=r"no trained hydra heads.*-c draft=NAME"):
        proposer(target, "auto")


def test_the_shortlist_is_the_first_ids_and_the_control_tokens():
    normal, control, user = 1, 3, 4
    fields = {"tokenizer.ggml.token_type": [normal] * 90 + [control, user, normal] + [5] * 3}
    assert shortlist_ids(fields, 40, 96).tolist() == list(range(40)) + [90, 91]
    assert shortlist_ids(fields, 0, 96) is None and shortlist_ids(fields, 96, 96) is None
    assert shortlist_ids({}, 40, 96).tolist() == list(range(40))


def test_auto_requantises_a_drafts_every_matrix_to_int4(target, files):
    auto = proposer(target, "draft_model", str(files["close"])).lm.runner.runner
    kept = proposer(target, "draft_model", str(files["close"]),
                    draft_weights="int4").lm.runner.runner
    assert auto.weights == kept.weights == "int4"
    assert auto.cost_key() != kept.cost_key() and auto.layers is not kept.layers
    assert {type(layer.gate_up).__name__ for layer in auto.layers} == {"Int4Linear"}


def test_drafters_of_one_file_share_its_weights_not_their_caches(target, files):
    """A server's slots (and a bench's methods) each build a proposer: the draft's weights are
    read once, and each proposer drafts on a cache of its own, so one's steps between another's
    change no token."""
    first, second = (proposer(target, method, str(files["close"]), **config)
                     for method, config in (("draft_model", {}), ("dyspec", TREE)))
    runners = [p.lm.runner.runner for p in (first, second)]
    assert runners[0].layers is runners[1].layers and runners[0].head is runners[1].head
    assert runners[0].cache is not runners[1].cache
    prompts = repetitive_prompts()[:2]
    runs = [generation(target.replica(), p, prompt, 24)
            for p, prompt in zip((first, second), prompts)]
    steps = [iter(gen) for gen in runs]
    while steps:  # the two interleaved, a verify step each
        steps = [step for step in steps if next(step, None) is not None]
    for gen, prompt in zip(runs, prompts):
        assert gen.tokens == ar(target, prompt, 24)
    assert sum(gen.stats.accepted_tokens for gen in runs) > 0
    assert proposer(target, "draft_model", str(files["close"]),
                    draft_weights="fp32").lm.runner.runner.layers is not runners[0].layers


def test_a_named_model_is_its_file(target, files, monkeypatch):
    monkeypatch.setitem(loading.NAMED_MODELS, "tiny-draft", lambda: files["close"])
    drafter = proposer(target, "draft_model", "tiny-draft")
    assert drafter.draft_source == str(files["close"])
    prompt = repetitive_prompts()[0]
    assert generation(target, drafter, prompt, 16).run() == ar(target, prompt, 16)


def test_another_vocabulary_is_refused_naming_both_sizes(target, files):
    with pytest.raises(SpecDecodeError, match="draft model's vocabulary has 80 tokens but the "
                                              "target's has 96"):
        proposer(target, "draft_model", str(files["narrow"]))


def test_another_tokenizer_is_refused(target, files):
    with pytest.raises(SpecDecodeError, match=r"another tokenizer than the target target.gguf "
                                              r"\(tokenizer.ggml.tokens.count: 96 in the draft, "
                                              r"90 in the target\)"):
        proposer(target, "dyspec", str(files["retokenized"]))


def test_missing_file_and_hf_runner_are_refused(target, files, tmp_path):
    with pytest.raises(SpecDecodeError, match=r"draft GGUF file \S*nope.gguf does not exist"):
        proposer(target, "draft_model", str(tmp_path / "nope.gguf"))
    with pytest.raises(SpecDecodeError, match="runs on the native runner: drop -c draft_runner=hf"):
        proposer(target, "draft_model", str(files["close"]), draft_runner="hf")


@pytest.mark.slow
def test_real_pair_identical_to_ar():
    """Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) drafted by Qwen2.5-Coder-0.5B-Instruct, both on the
    native runner: 24 greedy tokens of two prompts, as ``ar``'s."""
    from specdecode.models.parted import PARTED_MODELS, is_assembled

    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        if not is_assembled(PARTED_MODELS[name]):
            pytest.skip(f"{name} is not installed: `{PARTED_MODELS[name].install_command}`")
    loaded = loading.load_model("qwen2.5-coder-1.5b")
    runner = loading.make_runner(loaded)
    drafter = proposer(runner, "draft_model", "qwen2.5-coder-0.5b")
    accepted = 0
    for question in ("Write a Python function that reverses a string.",
                     "What is the capital of France?"):
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                      add_generation_prompt=True)
        gen = generation(runner, drafter, prompt, 24)
        assert gen.run() == ar(runner, prompt, 24), question
        accepted += gen.stats.accepted_tokens
    assert accepted > 0
