"""Int4 self-drafting (``quantized``) and its hierarchy (``hierspec``): exact against the precise
target's own ``ar`` on a native fp32 target read from a GGUF file (the drafter reads the same
file in int4) and on a ``transformers`` target; clear refusals where no int4 copy exists.

Files are tiny random-weight shapes written by ``specdecode.bench.shapes``; the greedy and
end-of-sequence cases on tiny ``transformers`` models are in test_exactness.py (every
registered method)."""

from __future__ import annotations

import pytest
import torch

from specdecode.api import Decoder
from specdecode.bench.shapes import write_shape
from specdecode.errors import SpecDecodeError
from specdecode.models.llama import LlamaRunner
from tiny_models import tiny_llama
from specdecode.proposers.quantized import int4_copy

PROMPTS = ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [1, 5, 9, 200, 300, 41, 7, 88, 5, 9, 200])
METHODS = ("quantized", "hierspec")


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_shape(tmp_path_factory.mktemp("quant") / "tiny.gguf", "tiny", "Q4_1", vocab=512)


@pytest.fixture(scope="module")
def fp32_target(tiny_file):
    return LlamaRunner.from_gguf(tiny_file, "fp32")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("controller", ["confidence", "heuristic", "fixed"])
def test_greedy_equals_the_fp32_targets_ar(fp32_target, method, controller):
    ar = Decoder(fp32_target, None, "ar", eos_token_ids=[])
    decoder = Decoder(fp32_target, None, method, eos_token_ids=[], controller=controller)
    for prompt in PROMPTS:
        assert decoder.start(prompt, 40).run() == ar.start(prompt, 40).run()


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_repeats_and_drafts_carry_probabilities(fp32_target, method):
    # a fresh decoder each time: hierspec's suffix tree learns across requests, and another
    # draft gives another (equally distributed) sample
    runs = [Decoder(fp32_target, None, method, eos_token_ids=[])
            .start(PROMPTS[1], 30, temperature=0.7, seed=3).run() for _ in range(2)]
    decoder = Decoder(fp32_target, None, method, eos_token_ids=[])
    decoder.start(PROMPTS[1], 1, temperature=0.7, seed=3).run()
    assert runs[0] == runs[1] and len(runs[0]) == 30
    draft = decoder.proposer.propose(list(PROMPTS[1]), decoder.proposer.make_controller().budget())
    assert draft.probs is not None and draft.probs.shape == (len(draft), fp32_target.vocab_size)


def test_the_drafter_reads_the_targets_file_and_holds_no_embedding_table(fp32_target):
    copy = int4_copy(fp32_target)
    assert copy.weights == "int4" and copy.source == fp32_target.source
    assert copy.embed.nbytes == fp32_target.embed.nbytes == 0  # both read rows from the file
    assert copy.cache is not fp32_target.cache


def test_an_int4_target_is_refused_with_the_fix(tiny_file):
    with pytest.raises(SpecDecodeError, match="--weights fp32"):
        Decoder(LlamaRunner.from_gguf(tiny_file, "int4"), None, "quantized")


def test_a_native_target_without_a_file_is_refused(tiny_model):
    runner = LlamaRunner.from_transformers(tiny_model, "fp32")
    with pytest.raises(SpecDecodeError, match="not a GGUF file"):
        Decoder(runner, None, "quantized")


def test_sizes_that_are_not_int4_groups_are_refused():
    model = tiny_llama(hidden_size=48, heads=4, kv_heads=2)
    with pytest.raises(SpecDecodeError, match="int4 groups"):
        Decoder(model, None, "quantized")


def test_a_transformers_target_gets_an_int4_copy_of_its_weights(tiny_model):
    prompt = PROMPTS[0]
    ar = Decoder(tiny_model, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
    decoder = Decoder(tiny_model, None, "quantized", eos_token_ids=[])
    assert decoder.start(prompt, 24).run() == ar
    # the copy is int4 and follows the target closely enough to be accepted sometimes
    gen = decoder.start(prompt, 24)
    gen.run()
    assert gen.stats.accepted_tokens > 0
    assert decoder.proposer.session.lm.runner.runner.weights == "int4"


@pytest.mark.parametrize("verifier", ["specinfer", "spectr"])
def test_k_iid_chains_under_either_verifier(fp32_target, verifier):
    decoder = Decoder(fp32_target, None, "quantized", eos_token_ids=[], drafts=3, verifier=verifier)
    runs = [decoder.start(PROMPTS[1], 30, temperature=0.7, seed=5).run() for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30
    draft = decoder.proposer.propose(list(PROMPTS[1]), decoder.proposer.make_controller().budget())
    rule = {"specinfer": "recursive", "spectr": "spectr"}[verifier]
    assert draft.sibling_rule == rule and len(draft.children(-1)) == 3
    # the three depth-1 siblings were drawn from one q
    assert torch.equal(draft.probs[0], draft.probs[1]) and torch.equal(draft.probs[0], draft.probs[2])
    # greedy drafts one chain whatever k is
    decoder.start(PROMPTS[0], 2).run()
    assert decoder.proposer.propose(list(PROMPTS[0]), decoder.proposer.make_controller().budget()).is_chain


@pytest.fixture(scope="module")
def default_fp32(real_model):
    from specdecode.models.loading import make_runner

    return make_runner(real_model, "native", "fp32")


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_the_default_models_fp32_output_exactly(real_model, default_fp32, method):
    """On SmolLM2's GGUF read as fp32, with the int4 copy read from the same file."""
    from test_exactness import dev_prompts

    ar = Decoder(default_fp32, real_model.tokenizer, "ar")
    decoder = Decoder(default_fp32, real_model.tokenizer, method)
    for prompt in dev_prompts()[:3]:
        assert decoder.generate(prompt, 48).token_ids == ar.generate(prompt, 48).token_ids
