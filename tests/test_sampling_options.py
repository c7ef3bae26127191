"""Sampling options and seeds.

- top-k / top-p / min-p / temperature / repetition penalty give the same filtered distribution
  as ``transformers``' logits processors, on random logits, ties and a flat 49152-token row;
- every node of a tree is processed with its own context (the committed tokens plus its path);
- a seeded request repeats, one generator per request, and the deterministic walk draws exactly
  one uniform per committed token: so every registered proposer whose drafts carry no
  probabilities gives, at a fixed seed, exactly the tokens of ``ar`` at that seed, with every
  sampling option set. Proposers whose drafts carry ``Draft.probs`` (a draft model) change which
  random numbers are drawn, so they match ``ar`` in distribution only
  (tests/test_sampling_stats.py); here they must repeat under a seed. Which kind a proposer is,
  is read from its drafts;
- drafts the target never produces change nothing, with or without probabilities;
- bad options are clear errors from ``SamplingParams``, the API and the CLI.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import specdecode
from specdecode import registry
from specdecode.api import Decoder
from specdecode.cli import main
from specdecode.draft import Draft
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.hf import HFRunner
from specdecode.proposer import Proposer
from specdecode.proposers.ar import ArConfig, Autoregressive
from specdecode.sampling import NodeDistributions, SamplingParams
from specdecode.verify import verify

from conftest import repetitive_prompts
from test_exactness import tiny_overrides
from test_sampling_stats import reference_probs
from tiny_models import noisy_copy

#: a bias that changes greedy and sampled outputs of the tiny target (a JSON-style key, an int
#: key; test_logit_bias_changes_the_output holds it to that)
BIAS = {"7": 3.0, 11: -100.0, 40: 1.5}
#: every option at once (the registry-wide and oracle tests)
ALL_OPTIONS = dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                   presence_penalty=0.3, frequency_penalty=0.2, logit_bias=BIAS)
#: llama.cpp's reading of them: the penalties over the last tokens, temperature after the cuts
LLAMA_OPTIONS = dict(temperature=0.8, top_k=12, top_p=0.9, repetition_penalty=1.3,
                     presence_penalty=0.3, frequency_penalty=0.2, penalty_last_n=6,
                     temperature_last=True)


def transformers_probs(logits, ids, params: SamplingParams) -> torch.Tensor:
    """transformers' processors in generate()'s order: the reference with nothing generated yet,
    so no presence/frequency penalties (transformers has none)."""
    return reference_probs(logits, ids, (), params).float()


def ours(logits, context, params, prompt_len=None):
    prompt_len = len(context) if prompt_len is None else prompt_len
    return NodeDistributions(logits[None], params, context, prompt_len, Draft.empty()).probs(0)


# ---- the same filtered distribution as transformers ------------------------------------------

@pytest.mark.parametrize("options", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=10),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=0.6, top_k=30, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_p=0.5, repetition_penalty=1.4),
    dict(temperature=0.5, top_k=5, repetition_penalty=0.8),
    # a bias on ids the context holds: it comes before the repetition penalty, as there
    dict(temperature=0.9, repetition_penalty=1.5,
         logit_bias={i: (i % 7 - 3) * 1.5 for i in range(0, 200, 3)}),
])
def test_filters_match_transformers(options):
    params = SamplingParams(**options)
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(200, generator=gen) * (1 + trial % 4)
        context = torch.randint(0, 200, (15,), generator=gen).tolist()
        torch.testing.assert_close(ours(logits, context, params),
                                   transformers_probs(logits, context, params),
                                   atol=1e-6, rtol=1e-5)


def test_top_k_keeps_tokens_tied_with_the_kth_like_transformers():
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.5])
    params = SamplingParams(temperature=1.0, top_k=2)
    got = ours(logits, [0], params)
    assert (got > 0).tolist() == [True, True, True, True, False, False]
    torch.testing.assert_close(got, transformers_probs(logits, [0], params))


@pytest.mark.parametrize("top_p", [0.5, 0.95, 0.999])
def test_nucleus_without_a_full_sort_on_a_flat_full_vocabulary(top_p):
    """Flat logits at V=49152 put thousands of tokens in the nucleus: the partial sort must
    grow until it covers top_p, then agree with transformers' full sort."""
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(1)) * 0.5
    params = SamplingParams(temperature=1.0, top_p=top_p)
    got = ours(logits, [0], params)
    want = transformers_probs(logits, [0], params)
    assert int((got > 0).sum()) > 1000
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-4)


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(8)
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    # prompt [1, 2, 2], output [2, 3, 3, 3]
    nodes = NodeDistributions(logits[None], params, [1, 2, 2, 2, 3, 3, 3], 3, Draft.empty())
    got = nodes.penalised(0)
    want = torch.zeros(8)
    want[2] = -0.5 - 0.25 * 1
    want[3] = -0.5 - 0.25 * 3
    torch.testing.assert_close(got, want)


def test_logit_bias_adds_to_the_logits_of_its_ids():
    logits = torch.zeros(8)
    nodes = NodeDistributions(logits[None], SamplingParams(logit_bias={"3": 2.5, 6: -100}),
                              [1, 2], 2, Draft.empty())
    want = torch.zeros(8)
    want[3], want[6] = 2.5, -100
    torch.testing.assert_close(nodes.penalised(0), want)
    assert nodes.argmax(0) == 3


@pytest.mark.parametrize("sampled", [False, True])
def test_logit_bias_changes_the_output(target, sampled):
    """The registry-wide cases' bias is not a no-op on the tiny target: with it ar writes
    other tokens, and a banned token never appears."""
    options = dict(temperature=0.8, seed=11) if sampled else {}
    prompt = repetitive_prompts()[1]
    plain = Decoder(target, None, "ar", eos_token_ids=[]).start(prompt, NEW_TOKENS, **options).run()
    biased = Decoder(target, None, "ar", eos_token_ids=[]).start(
        prompt, NEW_TOKENS, logit_bias=BIAS, **options).run()
    assert biased != plain
    assert 11 not in biased
    banned = Decoder(target, None, "ar", eos_token_ids=[]).start(
        prompt, NEW_TOKENS, logit_bias={t: -100 for t in set(plain)}, **options).run()
    assert not set(banned) & set(plain)


def test_logit_bias_past_the_vocabulary_is_refused(target):
    with pytest.raises(SpecDecodeError, match=r"logit_bias names token 96, outside the model's "
                                              r"vocabulary \(ids 0..95\)"):
        specdecode.generate(target, None, [1, 2, 3], method="ngram", max_new_tokens=4,
                            logit_bias={96: 1.0})


def test_tiny_temperatures_decode_greedily_without_overflow(tiny_model):
    prompt = repetitive_prompts()[0]
    greedy = Decoder(tiny_model, None, "ngram", eos_token_ids=[]).start(prompt, 16).run()
    for temperature in (1e-6, 1e-30):
        tokens = Decoder(tiny_model, None, "ngram", eos_token_ids=[]).start(
            prompt, 16, temperature=temperature, seed=0).run()
        assert tokens == greedy


# ---- every node with its own context ---------------------------------------------------------

def test_tree_nodes_are_processed_with_their_own_paths():
    """Branches holding different tokens, so each node's penalties differ; each row must equal
    the processing of that row's explicit context (plain decoding at that node)."""
    vocab = 12
    context, prompt_len = [3, 4, 5, 6, 5, 7], 4  # prompt [3, 4, 5, 6], output [5, 7]
    draft = Draft.from_paths([[7, 7, 8], [7, 9, 9], [1, 7], [2]])
    logits = torch.randn(len(draft) + 1, vocab, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05, repetition_penalty=1.5,
                            presence_penalty=0.4, frequency_penalty=0.3)
    nodes = NodeDistributions(logits, params, context, prompt_len, draft)
    for row in range(len(draft) + 1):
        path = [draft.tokens[i] for i in draft.path_to(row - 1)] if row else []
        explicit = context + path
        # plain decoding at that node: the same code, one row, an empty draft
        plain = NodeDistributions(logits[row:row + 1], params, explicit, prompt_len, Draft.empty())
        torch.testing.assert_close(nodes.penalised(row), plain.penalised(0), atol=0, rtol=0)
        torch.testing.assert_close(nodes.probs(row), plain.probs(0), atol=0, rtol=0)
        # and an independent implementation (transformers' processors)
        want = reference_probs(logits[row], context[:prompt_len], tuple(explicit[prompt_len:]),
                               params)
        torch.testing.assert_close(nodes.probs(row).double(), want, atol=1e-6, rtol=1e-5)
        if row:  # the path matters: processing with the committed tokens alone differs
            committed_only = NodeDistributions(logits[row:row + 1], params, context, prompt_len,
                                               Draft.empty()).penalised(0)
            assert not torch.equal(nodes.penalised(row), committed_only)


# ---- random numbers --------------------------------------------------------------------------

def advanced(seed: int, draws: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        torch.rand((), generator=gen, dtype=torch.float64)
    return gen.get_state()


@pytest.mark.parametrize("draft", [Draft.empty(), Draft.chain([1, 2, 3]),
                                   Draft.from_paths([[1, 2], [3, 4], [1, 5]])],
                         ids=["empty", "chain", "tree"])
def test_deterministic_walk_draws_one_uniform_per_committed_token(draft):
    vocab = 6
    logits = torch.randn(len(draft) + 1, vocab, generator=torch.Generator().manual_seed(3))
    # make node 0's token likely so some draws accept it
    logits[0, 1] += 4
    params = SamplingParams(temperature=1.0)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        result = verify(draft, logits, params, [0], 1, gen)
        assert torch.equal(gen.get_state(), advanced(seed, len(result.tokens)))


def test_rejection_draws_uniforms_only_where_the_outcome_is_uncertain():
    vocab = 4
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = p.log()[None].expand(3, vocab)
    params = SamplingParams(temperature=1.0)
    # q == the target's own distribution: both tokens accepted without a draw, then one draw
    # for the bonus token
    q = NodeDistributions(logits, params, [0], 1, Draft.empty()).probs(0).double()
    gen = torch.Generator().manual_seed(0)
    result = verify(Draft.chain([0, 1], torch.stack([q, q])), logits, params, [0], 1, gen)
    assert result.accepted == (0, 1) and torch.equal(gen.get_state(), advanced(0, 1))
    # q one-hot on a token the target never produces: rejected without a draw, and the
    # residual is p itself: the same single draw, the same token as plain sampling
    onehot = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        draft = Draft.chain([3, 3], torch.stack([onehot, onehot]))
        result = verify(draft, logits, params, [0], 1, gen)
        plain = verify(Draft.empty(), logits[:1], params, [0], 1,
                       torch.Generator().manual_seed(seed))
        assert result.accepted == () and result.tokens == plain.tokens
        assert torch.equal(gen.get_state(), advanced(seed, 1))


def test_one_generator_per_request(tiny_model):
    """Two seeded requests stepped alternately give what each gives alone."""
    prompts = repetitive_prompts()[:2]
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [Decoder(tiny_model, None, "ar", eos_token_ids=[]).start(p, 12, **vars(params)).run()
             for p in prompts]
    runners = [HFRunner(tiny_model) for _ in prompts]
    gens = [Generation(r, Autoregressive(ArConfig(), r), p, 12, params)
            for r, p in zip(runners, prompts)]
    iters = [iter(g) for g in gens]
    for _ in range(13):
        for it in iters:
            next(it, None)
    assert [g.tokens for g in gens] == alone


# ---- every registered proposer against ar -----------------------------------------------------

@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def draft_folder(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("draft")
    noisy_copy(target).save_pretrained(path)
    return str(path)


def overrides(method: str, draft_folder: str, target) -> dict:
    """tests/test_exactness.py's tiny-model config, plus a tiny draft model for methods that
    take one (a ``draft`` config field)."""
    config = dict(tiny_overrides(method, target))
    fields = {f.name for f in dataclasses.fields(registry.get(method).config)}
    if "draft" in fields:
        config.setdefault("draft", draft_folder)
    return config


class Recorder:
    """Wraps a proposer's ``propose`` to see whether its drafts carry probabilities."""

    def __init__(self, proposer):
        self.with_probs = self.drafted = 0
        self.propose = proposer.propose
        proposer.propose = self

    def __call__(self, context, budget):
        draft = self.propose(context, budget)
        if len(draft):
            self.drafted += 1
            self.with_probs += draft.probs is not None
        return draft


#: (options, prompt) pairs of the registry-wide test (the last greedy: every proposer's tokens
#: are ar's, whatever its drafts carry)
REGISTRY_CASES = [(dict(temperature=1.0), repetitive_prompts()[0]),
                  (ALL_OPTIONS, repetitive_prompts()[1]),
                  (LLAMA_OPTIONS, repetitive_prompts()[2]),
                  (dict(logit_bias=BIAS), repetitive_prompts()[1])]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def ar_outputs(target):
    """ar's tokens at seed 11 for each case of the registry-wide test."""
    return [Decoder(target, None, "ar", eos_token_ids=[]).start(prompt, NEW_TOKENS, seed=11,
                                                                 **options).run()
            for options, prompt in REGISTRY_CASES]


@pytest.mark.parametrize("method", [m for m in registry.names(lossy=False) if m != "ar"])
def test_seeded_sampling_matches_ar_for_every_proposer(target, draft_folder, ar_outputs, method):
    config = overrides(method, draft_folder, target)
    for (options, prompt), expected in zip(REGISTRY_CASES, ar_outputs):
        decoder = Decoder(target, None, method, eos_token_ids=[], **config)
        recorder = Recorder(decoder.proposer)
        tokens = decoder.start(prompt, NEW_TOKENS, seed=11, **options).run()
        # one that says it sends none is sized with the load in a server (sizing.py): drafts
        # with probabilities there would make a seeded answer change with the load
        assert decoder.proposer.samples_drafts or recorder.with_probs == 0, method
        # and one whose sampled drafts carry none says so: it is sized as if alone otherwise,
        # without its drafting's measured seconds (early_exit's half-model passes priced free)
        if recorder.drafted and "temperature" in options:
            assert decoder.proposer.samples_drafts == (recorder.with_probs > 0), method
        if recorder.with_probs == 0 or "temperature" not in options:
            assert tokens == expected, (method, options)
        else:
            # drafts with probabilities draw acceptance uniforms: the same distribution as ar
            # (tests/test_sampling_stats.py), not the same tokens; the seed must repeat
            again = Decoder(target, None, method, eos_token_ids=[], **config)
            assert again.start(prompt, NEW_TOKENS, seed=11, **options).run() == tokens, method


class Oracle(Proposer):
    """Knows ar's output; drafts it ("agree"), or tokens differing from it ("never"), or a tree
    hiding it behind wrong branches ("tree")."""

    def __init__(self, runner, prompt_len, truth, mode, vocab=96):
        super().__init__(None, runner)
        self.prompt_len, self.truth, self.mode, self.vocab = prompt_len, truth, mode, vocab

    def propose(self, context, budget):
        done = len(context) - self.prompt_len
        right = list(self.truth[done:done + 4]) or [0]
        wrong = [(t + 1) % self.vocab for t in right]
        if self.mode == "agree":
            return Draft.chain(right)
        if self.mode == "never":
            return Draft.chain(wrong)
        return Draft.from_paths([wrong, right[:1] + wrong[1:], right])


class NeverProduced(Proposer):
    """Drafts, with probabilities, a chain of tokens the target gives probability 0 at the
    first node (outside top-k), with q one-hot: always rejected, and drawing no uniform."""

    def __init__(self, runner, model, sampling):
        super().__init__(None, runner)
        self.model, self.params = model, sampling

    def propose(self, context, budget):
        with torch.no_grad():
            logits = self.model(torch.tensor([list(context)])).logits[0, -1:]
        p = NodeDistributions(logits, self.params, context, self.prompt_len, Draft.empty()).probs(0)
        token = int(torch.nonzero(p == 0)[0])
        q = torch.zeros(len(p), dtype=torch.float64)
        q[token] = 1
        return Draft.chain([token, token], torch.stack([q, q]))

    def start(self, prompt):
        self.prompt_len = len(prompt)


@pytest.mark.parametrize("mode", ["agree", "never", "tree", "never produced, with probs"])
def test_drafts_change_nothing_at_a_seed_with_every_option(target, mode):
    runner = HFRunner(target)
    params = SamplingParams(seed=5, **ALL_OPTIONS)
    for prompt in repetitive_prompts()[:2]:
        reference = Autoregressive(ArConfig(), runner)
        ar = Generation(runner, reference, prompt, NEW_TOKENS, params).run()
        if mode.startswith("never produced"):
            proposer = NeverProduced(runner, target, params)
        else:
            proposer = Oracle(runner, len(prompt), ar, mode)
        gen = Generation(runner, proposer, prompt, NEW_TOKENS, params)
        assert gen.run() == ar, (mode, prompt)
        if mode in ("agree", "tree"):
            assert gen.stats.mean_accepted > 3
        else:
            assert gen.stats.mean_accepted == 1.0


# ---- bad input ---------------------------------------------------------------------------------

BAD = [
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_p=-0.1), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(min_p=-0.1), "min_p must be in [0, 1]"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(seed="7"), "seed must be an integer"),
    (dict(seed=True), "seed must be an integer"),
    (dict(seed=2 ** 64), "seed must be an integer in [-2**63, 2**64)"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2]"),
    (dict(logit_bias={"the": 1.0}), "logit_bias keys must be token ids (integers >= 0)"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids (integers >= 0)"),
    (dict(logit_bias={True: 1.0}), "logit_bias keys must be token ids (integers >= 0)"),
    (dict(logit_bias={"5": 101}), "logit_bias values must be numbers in [-100, 100]"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values must be numbers in [-100, 100]"),
    (dict(logit_bias={5: "high"}), "logit_bias values must be numbers in [-100, 100]"),
    (dict(logit_bias="7=1"), "logit_bias must map token ids to numbers"),
    (dict(logit_bias=[(5, 1.0, 2.0)]), "logit_bias must map token ids to numbers"),
]


@pytest.mark.parametrize("options,message", BAD)
def test_bad_options_raise_clear_errors(options, message):
    with pytest.raises(SpecDecodeError) as info:
        SamplingParams(**options)
    assert message in str(info.value)


@pytest.mark.parametrize("options,message", BAD)
def test_bad_options_through_the_api(target, options, message):
    with pytest.raises(SpecDecodeError) as info:
        specdecode.generate(target, None, [1, 2, 3], method="ngram", max_new_tokens=4,
                            **{"temperature": 1.0, **options})
    assert message in str(info.value)


def test_numpy_integers_are_accepted():
    params = SamplingParams(temperature=1.0, top_k=np.int64(5), seed=np.int32(3))
    assert params.top_k == 5 and type(params.top_k) is int and type(params.seed) is int


@pytest.mark.parametrize("argv,message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.01"], "top_p must be in (0, 1]"),
    (["--top-k", "-3"], "top_k must be an integer >= 0"),
    (["--min-p", "2"], "min_p must be in [0, 1]"),
    (["--seed", "-99999999999999999999999"], "seed must be an integer in"),
    (["--logit-bias", "7"], "--logit-bias expects ID=BIAS"),
    (["--logit-bias", "7=strong"], "--logit-bias expects ID=BIAS"),
    (["--logit-bias", "x=1"], "logit_bias keys must be token ids"),
    (["--logit-bias", "7=200"], "logit_bias values must be numbers in [-100, 100]"),
])
def test_cli_bad_options_one_line_exit_2(capsys, argv, message):
    assert main(["generate", "hi", "--method", "ngram"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--seed", "1.5"], ["--top-k", "2.5"], ["--seed", "abc"]])
def test_cli_non_integer_options_exit_2(capsys, argv):
    """argparse rejects these before specdecode sees them: exit 2, its own error line naming
    the option (after its usage line)."""
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--method", "ngram"] + argv)
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {argv[0]}: invalid int value" in last


def test_first_argmax_is_torchs_argmax_with_ties_nans_and_infinities():
    """The greedy step's argmax (numpy's, for speed) picks what torch.argmax picks: the first
    of tied maxima, a NaN over any number, the first of an all -inf row; other dtypes go to
    torch."""
    from specdecode.sampling import first_argmax

    inf, nan = float("inf"), float("nan")
    rows = [[1.0, 3.0, 3.0, 2.0], [-inf, -inf, -inf], [0.5, nan, 9.0, nan], [inf, 1.0, inf],
            torch.randn(49152).tolist()]
    for row in rows:
        x = torch.tensor(row)
        assert first_argmax(x) == int(x.argmax()), row[:4]
        assert first_argmax(x.to(torch.float64)) == int(x.argmax())
    strided = torch.randn(4, 100)[:, 7]
    assert first_argmax(strided) == int(strided.argmax())


def test_a_penalty_window_counts_the_last_tokens_of_prompt_and_path():
    """llama.cpp's repeat_last_n: the three penalties count the last n tokens of the context
    and of a node's path, prompt and output alike."""
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    context, prompt_len, draft = [1, 2, 3, 4, 4], 3, Draft.chain([5, 4])
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5,
                            frequency_penalty=0.25, penalty_last_n=3)
    nodes = NodeDistributions(logits, params, context, prompt_len, draft)
    for row, window in [(0, [3, 4, 4]), (1, [4, 4, 5]), (2, [4, 5, 4])]:
        want = logits[row].clone()
        for token in set(window):
            value = want[token] / 1.5 if want[token] > 0 else want[token] * 1.5
            want[token] = value - 0.25 * window.count(token) - 0.5
        assert torch.allclose(nodes.penalised(row), want), row
    none = dataclasses.replace(params, penalty_last_n=0)
    assert torch.equal(NodeDistributions(logits, none, context, prompt_len, draft).penalised(2),
                       logits[2])
    with pytest.raises(SpecDecodeError, match="penalty_last_n"):
        SamplingParams(penalty_last_n=-1)
