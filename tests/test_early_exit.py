"""Early exit in the runner, and the self-speculative methods early_exit and del, on tiny models."""

from __future__ import annotations

import pytest
import torch

from specdecode.api import Decoder
from specdecode.draft import Draft
from specdecode.drafting.exit_adapters import ExitAdapters
from specdecode.errors import SpecDecodeError
from specdecode.models.base import Needs
from specdecode.models.hf import HFRunner
from specdecode.drafting.exits import tokens_per_layer

from conftest import repetitive_prompts
from tiny_models import tiny_llama

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=4, seed=3)


@pytest.fixture(scope="module")
def adapter_file(model, tmp_path_factory):
    """Adapters for layers 1..3 with random (non-zero) weights: drafts differ from the plain exit."""
    torch.manual_seed(7)
    adapters = ExitAdapters([1, 2, 3], 32, 4, 1e-6, model.model.norm.weight,
                            {"agreement_after": {"1": 0.2, "2": 0.6, "3": 0.7}})
    with torch.no_grad():
        for layer in adapters.layers:
            adapters[layer].up.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("adapters") / "tiny.safetensors"
    return adapters.save(path, HFRunner(model).fingerprint())


def decode(model, method, prompt, max_new=40, **config):
    return Decoder(model, None, method, eos_token_ids=[], **config).start(prompt, max_new).run()


# ---- runner ------------------------------------------------------------------------------

def test_exit_forward_matches_full_forward_and_manual_head(model):
    runner = HFRunner(model)
    runner.prefill(PROMPT)
    with runner.early_exit.chain(2) as chain:
        h1 = chain.extend([12])
        h2 = chain.extend([13, 14])  # a chain of two in one call
    hidden = torch.cat([h1, h2])
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + [12, 13, 14]]), output_hidden_states=True)
        expected = full.hidden_states[2][0, -3:]
        manual = model.lm_head(model.model.norm(expected))
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.early_exit.logits(hidden), manual, rtol=1e-5, atol=1e-5)
    adapters = ExitAdapters([2], 32, 4, 1e-6, model.model.norm.weight)
    with torch.no_grad():
        adapters[2].up.normal_()
        adapters[2].bias.normal_()
        h = expected + adapters[2].bias + expected @ adapters[2].down.T @ adapters[2].up.T
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * adapters[2].norm_weight
        torch.testing.assert_close(runner.early_exit.logits(hidden, adapters[2]), model.lm_head(normed),
                                   rtol=1e-5, atol=1e-5)


def test_draft_rows_are_dropped_before_the_full_verify_pass(model):
    plain, shared = HFRunner(model), HFRunner(model)
    plain.prefill(PROMPT)
    shared.prefill(PROMPT)
    with shared.early_exit.chain(3) as chain:
        for token in (12, 13, 14):
            chain.extend([token])
        assert all(layer.keys.shape[2] == len(PROMPT) + 3 for layer in shared.cache.layers[:3])
    # closing the chain leaves the cache as the prefill left it
    assert all(layer.keys.shape[2] == len(PROMPT) for layer in shared.cache.layers)
    draft = Draft.chain([13, 14, 15])
    expected = plain.forward(12, draft).logits
    out = shared.forward(12, draft, Needs(layers=(1, 3)))
    assert torch.equal(out.logits, expected)  # the same full forward over the same cache, bit for bit
    assert set(out.layers) == {1, 3} and out.layers[1].shape == (4, 32)
    shared.commit([0, 1])
    assert all(layer.keys.shape[2] == len(PROMPT) + 3 for layer in shared.cache.layers)


def test_exit_layer_errors(model):
    runner = HFRunner(model)
    runner.prefill(PROMPT)
    for bad in (0, 4, 9):
        with pytest.raises(SpecDecodeError, match=r"has 4 layers.*1\.\.3"):
            runner.early_exit.chain(bad)
        with pytest.raises(SpecDecodeError, match=r"has 4 layers.*1\.\.3"):
            runner.forward(12, Draft.empty(), Needs(layers=(bad,)))
    runner.forward(12, Draft.chain([13]))
    with pytest.raises(SpecDecodeError, match="opened between forward and commit"):
        runner.early_exit.chain(2)


# ---- exactness ---------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [1, 2, 3])
def test_early_exit_greedy_identical(model, adapter_file, layer):
    for adapters in ("none", str(adapter_file)):
        decoder = Decoder(model, None, "early_exit", eos_token_ids=[], exit_layer=layer,
                          num_speculative_tokens=3, adapters=adapters)
        for prompt in repetitive_prompts()[:3]:
            assert decoder.start(prompt, 40).run() == decode(model, "ar", prompt), (layer, adapters)


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.9])
def test_del_greedy_identical(model, adapter_file, threshold):
    for adapters in ("none", str(adapter_file)):
        # the paper's cost model (no head or verify-width terms) speculates on a 4-layer model
        decoder = Decoder(model, None, "del", eos_token_ids=[], adapters=adapters,
                          confidence_threshold=threshold, head_cost=0.0, verify_token_cost=0.0)
        drafted = 0
        for prompt in repetitive_prompts()[:3]:
            generation = decoder.start(prompt, 40)
            assert generation.run() == decode(model, "ar", prompt), adapters
            drafted += generation.stats.draft_tokens
        assert drafted > 0


@pytest.mark.parametrize("method", ["early_exit", "del"])
def test_sampled_tokens_equal_ar_with_the_same_seed(model, method):
    # deterministic drafts are verified by plain ancestral sampling: same seed, same tokens
    def sample(name):
        decoder = Decoder(model, None, name, eos_token_ids=[])
        return decoder.start(PROMPT, 30, temperature=0.8, seed=11).run()

    assert sample(method) == sample("ar")


def test_early_exit_speculates_and_accepts(model):
    # exit at the last layer but one of a model whose last layer changes little: drafts land
    decoder = Decoder(model, None, "early_exit", eos_token_ids=[], exit_layer=3,
                      num_speculative_tokens=4, adapters="none")
    generation = decoder.start(repetitive_prompts()[0], 40)
    generation.run()
    assert generation.stats.draft_tokens > 0
    assert generation.stats.accepted_tokens > 0


# ---- DEL's estimates and choice ----------------------------------------------------------

def test_shadow_tokens_count_teacher_forced_agreement(model):
    decoder = Decoder(model, None, "del", eos_token_ids=[], decay=1.0, adapters="none",
                      idle_shadow_every=1, idle_shadow_max=1)  # shadow tokens every round
    out = decoder.start(PROMPT, 30).run()
    proposer = decoder.proposer
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + out]), output_hidden_states=True)
    # verify rows cover positions len(PROMPT) .. end-1; each predicts the next output token
    rows = slice(len(PROMPT), len(PROMPT) + len(out) - 1)
    for layer in proposer.layers:
        with torch.no_grad():
            exit_tokens = model.lm_head(model.model.norm(full.hidden_states[layer][0, rows])).argmax(-1)
        assert proposer.trials[layer] == len(out) - 1
        assert proposer.hits[layer] == int((exit_tokens == torch.tensor(out[1:])).sum()), layer


@pytest.mark.parametrize("most, checks", [(3, 4), (64, 2)])
def test_idle_rounds_skip_shadow_tokens_and_back_off(model, most, checks):
    decoder = Decoder(model, None, "del", eos_token_ids=[], decay=1.0, adapters="none",
                      idle_shadow_every=3, idle_shadow_max=most, candidate_layers="1",
                      prior_weight=1e9)
    decoder.proposer.prior = {1: 0.0}  # an overwhelming prior of no agreement: never speculate
    assert len(decoder.start(PROMPT, 13).run()) == 13
    assert all(depth == 0 for _, depth in decoder.proposer.choices)
    # 12 verify rounds of one row each: shadow tokens on rounds 3, 6, 9 and 12 at a fixed
    # interval; backing off, on rounds 3 and 3 + 6 = 9 (the next one would be 9 + 12)
    assert decoder.proposer.trials[1] == checks
    assert decoder.proposer.idle_interval == (3 if most == 3 else 12)
    # the next request goes on at that interval: backing off, one check, on its round 12
    assert len(decoder.start(PROMPT, 13).run()) == 13
    assert decoder.proposer.trials[1] == (4 if most == 3 else 1)
    assert decoder.proposer.idle_interval == (3 if most == 3 else 24)


def test_del_choice_follows_acceptance(model):
    decoder = Decoder(model, None, "del", eos_token_ids=[], adapters="none",
                      candidate_layers="1,3", head_cost=0.0, verify_token_cost=0.0)
    p = decoder.proposer
    p.hits, p.trials = {1: 0.0, 3: 0.0}, {1: 100.0, 3: 100.0}
    assert p.choose(8)[1] == 0  # nothing agrees: plain decoding is the best TPL
    p.hits = {1: 100.0, 3: 100.0}
    assert p.choose(8) == (1, 8)  # every layer always agrees: the cheapest drafts the longest
    p.hits = {1: 30.0, 3: 99.0}
    assert p.choose(8)[0] == 3


def test_tokens_per_layer_is_the_papers_formula_without_cpu_terms():
    a, layer, d, n = 0.6, 8, 4, 32
    assert tokens_per_layer(a, layer, d, n) == pytest.approx((1 - a ** (d + 1)) / (1 - a) / (d * layer + n))


# ---- bad input ---------------------------------------------------------------------------

def test_bad_input(model, tmp_path):
    with pytest.raises(SpecDecodeError, match=r"exit_layer 7 is outside the model.*4 layers.*1\.\.3"):
        Decoder(model, None, "early_exit", exit_layer=7)
    with pytest.raises(SpecDecodeError, match="num_speculative_tokens must be >= 1"):
        Decoder(model, None, "early_exit", num_speculative_tokens=0)
    with pytest.raises(SpecDecodeError, match="max_speculative_tokens must be >= 1"):
        Decoder(model, None, "del", max_speculative_tokens=0)
    with pytest.raises(SpecDecodeError, match="idle_shadow_every must be >= 1 and at most "
                                              "idle_shadow_max, got 8 and 4"):
        Decoder(model, None, "del", idle_shadow_every=8, idle_shadow_max=4)
    with pytest.raises(SpecDecodeError, match=r"candidate layer 4 is outside the model.*1\.\.3"):
        Decoder(model, None, "del", candidate_layers="2,4")
    with pytest.raises(SpecDecodeError, match="comma-separated layer numbers"):
        Decoder(model, None, "del", candidate_layers="two")
    with pytest.raises(SpecDecodeError, match="does not exist"):
        Decoder(model, None, "early_exit", adapters=str(tmp_path / "none.safetensors"))


def test_artifact_for_another_model_is_refused(adapter_file):
    other = tiny_llama(layers=4, seed=4)
    for method in ("early_exit", "del"):
        with pytest.raises(SpecDecodeError, match="trained for another target model"):
            Decoder(other, None, method, adapters=str(adapter_file))


def test_adapters_must_cover_the_exit_layer(model, adapter_file, tmp_path):
    adapters = ExitAdapters([2], 32, 4, 1e-6, model.model.norm.weight)
    path = adapters.save(tmp_path / "l2.safetensors", HFRunner(model).fingerprint())
    with pytest.raises(SpecDecodeError, match=r"cover layers \[2\], not exit_layer 3"):
        Decoder(model, None, "early_exit", exit_layer=3, adapters=str(path))


def test_runner_without_early_exit_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2)).eval()
    for method in ("early_exit", "del"):
        with pytest.raises(SpecDecodeError, match=f"method '{method}' drafts with the target's early layers"):
            Decoder(gpt2, None, method)
