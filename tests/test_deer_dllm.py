"""``deer:drafter=dllm``: the small dLLM (diffusion/dllm.py) drafts deer's block
(drafting/dllm_draft.py). On tiny random models with a random delta (so the dLLM is not the AR
model): greedy gives ``ar``'s tokens, T > 0 keeps the target's distribution, the dLLM's cache
follows the committed context through rejections, and a missing delta is named."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from specdecode.api import Decoder
from specdecode.control import Budget
from specdecode.diffusion.dllm import DiffusionDelta, merged_runner
from specdecode.diffusion.model import DiffusionModel
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.hf import HFRunner
from specdecode.registry import get
from specdecode.sampling import SamplingParams

from conftest import repetitive_prompts
from test_draft_heads import check_sampled_distribution
from tiny_models import scratch_dir, tiny_llama

BLOCK = 8


def random_delta(model, scale: float = 0.01, seed: int = 3) -> DiffusionDelta:
    """A rank-4 delta with random non-zero ``up``: the dLLM differs from the AR model."""
    vocab = model.config.vocab_size
    delta = DiffusionDelta(model, 4, config={"mask_id": vocab - 1, "block_size": BLOCK})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in delta.up.values():
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    return delta


_DELTAS: dict[str, str] = {}


def tiny_dllm(model) -> str:
    """A random delta for ``model`` saved as an artifact (cached per model)."""
    key = HFRunner(model).fingerprint()
    if key not in _DELTAS:
        path = scratch_dir("specdecode-tiny-dllm-") / "dllm.safetensors"
        _DELTAS[key] = str(random_delta(model).save(path, key))
    return _DELTAS[key]


@functools.cache
def tiny_models():
    return [tiny_llama(seed=0), tiny_llama(seed=1, layers=3, tie_embeddings=True)]


@pytest.mark.parametrize("shape,weights", [("chain", "fp32"), ("tree", "fp32"), ("tree", "int8")])
def test_greedy_identical_to_ar_on_tiny_models(shape, weights):
    for model in tiny_models():
        ar = Decoder(model, None, "ar", eos_token_ids=[])
        # one decoder for all prompts: its dLLM cache is reused across requests
        decoder = Decoder(model, None, "deer", eos_token_ids=[], drafter="dllm",
                          dllm=tiny_dllm(model), shape=shape, min_path_prob=0.0,
                          dllm_weights=weights)
        accepted = steps = 0
        for prompt in repetitive_prompts():
            generation = decoder.start(prompt, 32)
            assert generation.run() == ar.start(prompt, 32).run(), (shape, prompt)
            accepted += generation.stats.accepted_tokens
            steps += len(generation.stats.accepted_lengths)
        # drafts land and some are rejected: the dLLM is close to the model, not the model
        assert 0 < accepted < steps * BLOCK, (shape, weights, accepted, steps)


def test_end_of_sequence_and_token_limit():
    model = tiny_models()[0]
    prompt = repetitive_prompts()[0]
    full = Decoder(model, None, "ar", eos_token_ids=[]).start(prompt, 32).run()
    eos = [full[9]]
    config = {"drafter": "dllm", "dllm": tiny_dllm(model), "min_path_prob": 0.0}
    ended = Decoder(model, None, "deer", eos_token_ids=eos, **config)
    assert ended.start(prompt, 32).run() == full[:full.index(eos[0]) + 1]
    decoder = Decoder(model, None, "deer", eos_token_ids=[], **config)
    for limit in (1, 2, 5):
        assert decoder.start(prompt, limit).run() == full[:limit]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampled_drafts_keep_the_target_distribution(shape):
    check_sampled_distribution("deer", {"drafter": "dllm", "shape": shape}, 400,
                               lambda model: {"dllm": tiny_dllm(model)})


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_block_is_the_dllms_after_the_committed_context(temperature):
    """After a request that shares only the prompt's start (the dLLM's cache rewound to it)
    and steps with rejections (only committed tokens read), the drafted block's logits are
    those of a fresh dLLM prefilled with the committed context: its cache holds exactly the
    committed tokens. Greedy, the chain is the block's argmax."""
    model = tiny_models()[0]
    runner = HFRunner(model)
    config = get("deer").make_config({"drafter": "dllm", "dllm": tiny_dllm(model),
                                      "shape": "chain", "min_path_prob": 0.0})
    proposer = get("deer").proposer(config, runner)
    prompt = repetitive_prompts()[1]
    sampling = SamplingParams(temperature=temperature, seed=2)
    Generation(runner, proposer, prompt[:6] + [3, 3], 12, sampling).run()
    generation = Generation(runner, proposer, prompt, 20, sampling)
    output = generation.run()
    lengths = generation.stats.accepted_lengths
    assert sum(lengths) > 0 and min(lengths) < BLOCK  # accepted drafts, and rejected ones
    context = list(prompt) + list(output)
    draft = proposer.propose(context, Budget(64, 64))
    delta = DiffusionDelta.load(tiny_dllm(model), model, runner.fingerprint())
    fresh = DiffusionModel(merged_runner(model, delta), 95)
    fresh.prefill(context)
    torch.testing.assert_close(proposer.lm.block_logits(), fresh.denoise([95] * BLOCK),
                               atol=1e-4, rtol=1e-4)
    if temperature == 0:
        assert list(draft.tokens) == proposer.lm.block_logits().argmax(-1).tolist()
        assert draft.probs is None
    else:
        assert draft.probs is not None and draft.probs.shape == (BLOCK, 96)


@torch.no_grad()
def test_extend_and_denoise_is_append_then_denoise():
    """The drafter's one forward (new committed rows, then the block) gives what an append and
    a denoise give in two, and commits the same rows."""
    model = tiny_llama(seed=0)
    delta = random_delta(model)
    one = DiffusionModel(merged_runner(model, delta), 95)
    two = DiffusionModel(merged_runner(model, delta), 95)
    prompt, tokens, block = [4, 9, 17, 3, 30], [22, 41, 7], [95] * 5
    for dllm in (one, two):
        dllm.prefill(prompt)
    together = one.extend_and_denoise(tokens, len(block))
    two.append(tokens)
    torch.testing.assert_close(together, two.denoise(block), atol=1e-5, rtol=1e-5)
    assert one.length == two.length == len(prompt) + len(tokens)
    # nothing new: the block after the committed rows, position 0 from the last one's row
    torch.testing.assert_close(one.extend_and_denoise([], 3), two.denoise(block[:3]),
                               atol=1e-5, rtol=1e-5)
    one.rewind(len(prompt))
    with pytest.raises(SpecDecodeError, match="prefill"):
        one.extend_and_denoise([], 3)


def test_clear_errors():
    with pytest.raises(SpecDecodeError, match="specdecode train dllm"):
        Decoder(tiny_llama(seed=9), None, "deer", drafter="dllm")
    with pytest.raises(SpecDecodeError, match="unknown drafter"):
        get("deer").make_config({"drafter": "diffusion"})
    with pytest.raises(SpecDecodeError, match="unknown weight format"):
        get("deer").make_config({"drafter": "dllm", "dllm_weights": "int3"})


@pytest.mark.slow
def test_greedy_identical_on_the_default_runner_with_the_shipped_dllm(real_model):
    """SmolLM2 on the native int4 runner (what the CLI and bench use), drafted by the shipped
    dLLM (fp32)."""
    from specdecode.api import eos_ids
    from specdecode.models.loading import make_runner

    from test_exactness import check_greedy_identical, dev_prompts

    runner = make_runner(real_model)
    check_greedy_identical(runner, runner, real_model.tokenizer, "deer", dev_prompts()[1::2], 64,
                           eos_ids(real_model.model, real_model.tokenizer), {"drafter": "dllm"})
