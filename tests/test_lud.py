"""LUD (specdecode/lossy/lud.py, docs/lossy.md): the decode step's slots against the trainer's
one-forward layout, units and their threshold, the slots' LoRA kept off ordinary rows, the
trainer, and a quality floor on the default model."""

from __future__ import annotations

import argparse
import random
import time

import pytest
import torch

from specdecode.api import Decoder
from specdecode.artifacts import save_artifact
from specdecode.engine import GenerationStats
from specdecode.errors import SpecDecodeError
from specdecode.lossy.lud import (ADAPTERS_KIND, Lud, LudConfig, UnitAdapters, lexical_unit,
                                  load_adapters)
from specdecode.models.hf import HFRunner
from specdecode.models.llama import LlamaRunner
from specdecode.sampling import GREEDY
from specdecode.training import lud as trainer
from specdecode.training.runs import Checkpoint
from tiny_models import tiny_llama

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def tiny_hf():
    return HFRunner(tiny_llama(vocab_size=96, hidden_size=32, layers=2, seed=3))


def random_adapters(model, slots: int = 3, seed: int = 0) -> UnitAdapters:
    torch.manual_seed(seed)
    adapters = UnitAdapters.fresh(model, slots, rank=4)
    with torch.no_grad():
        for up in adapters.up.values():
            up.normal_(0, 0.5)
        adapters.slot_embeddings.normal_(0, 1)
    return adapters.eval().requires_grad_(False)


def decode(method, prompt, tokens) -> tuple[list[list[int]], GenerationStats]:
    stats = GenerationStats()
    return list(method.decode(prompt, tokens, GREEDY, frozenset(), stats)), stats


def test_a_unit_stops_at_the_first_unconfident_prediction():
    probs = torch.tensor([[0.95, 0.05, 0.0], [0.0, 0.92, 0.08], [0.5, 0.0, 0.5], [0, 0, 1.0]])
    assert lexical_unit(probs, 0.9) == [0, 1]
    assert lexical_unit(probs, 0.4) == [0, 1, 0, 2]
    # an unconfident next token is emitted alone, however confident the slots
    assert lexical_unit(probs[[2, 3]], 0.9) == [0]


def test_the_decode_step_computes_the_trainers_forward(tiny_hf):
    """A step's slots after cached tokens give the probabilities the trainer's one-forward
    layout gives for the same anchor, and they leave the cache."""
    from transformers import DynamicCache

    adapters = random_adapters(tiny_hf.model)
    method = Lud(LudConfig(), tiny_hf, adapters=adapters)
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    cache = DynamicCache()
    with torch.no_grad():
        method.step(ids[:4], 0, 3, cache)
        stepped = method.step(ids[4:7], 4, 3, cache)
        own, slots = trainer.slot_logits(tiny_hf.model, adapters, ids, torch.tensor([3, 6]), 3)
    assert cache.get_seq_length() == 7
    torch.testing.assert_close(stepped[0], torch.softmax(own[1], -1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stepped[1:], torch.softmax(slots[1], -1), atol=1e-5, rtol=1e-4)


def test_each_units_first_token_is_plain_decodings(tiny_hf):
    """With threshold 0 every unit is 1 + slots tokens, and its first token is the plain
    model's greedy token after everything emitted before: the slots' LoRA and KV rows never
    reach an ordinary row."""
    method = Lud(LudConfig(threshold=0.0), tiny_hf, adapters=random_adapters(tiny_hf.model))
    units, stats = decode(method, PROMPT, 13)
    assert [len(u) for u in units] == [4, 4, 4, 1] and stats.target_forwards == 4
    context = list(PROMPT)
    with torch.no_grad():
        for unit in units:
            plain = tiny_hf.model(input_ids=torch.tensor([context])).logits[0, -1]
            assert unit[0] == int(plain.argmax())
            context += unit


def test_the_native_runner_computes_the_hf_runners_steps(tiny_hf):
    """A prompt and then units with their slots: the native runner's probabilities (fp32, the
    fused q/k/v LoRA with the folded attention scale) are the hf runner's; its cache keeps
    the fed rows only."""
    from transformers import DynamicCache

    adapters = random_adapters(tiny_hf.model)
    hf = Lud(LudConfig(), tiny_hf, adapters=adapters)
    runner = LlamaRunner.from_transformers(tiny_hf.model)
    native = Lud(LudConfig(), runner, adapters=adapters)
    cache = DynamicCache()
    with torch.no_grad():
        for fed, start in (([5, 6, 7, 8], 0), ([9, 10, 11], 4), ([12], 7)):
            torch.testing.assert_close(native.step(fed, start, 3, runner.cache),
                                       hf.step(fed, start, 3, cache), atol=1e-5, rtol=1e-4)
            assert runner.cache.length == start + len(fed)


def test_no_slots_is_ar_on_the_native_int4_runner(tiny_hf):
    runner = LlamaRunner.from_transformers(tiny_hf.model, weights="int4")
    ar = Decoder(runner, None, "ar", eos_token_ids=[]).generate(PROMPT, 16).token_ids
    adapters = random_adapters(tiny_hf.model)
    for config in (LudConfig(placeholders=0), LudConfig(threshold=1.0)):
        units, _ = decode(Lud(config, runner, adapters=adapters), PROMPT, 16)
        assert [t for u in units for t in u] == ar


def test_no_slots_or_an_unreachable_threshold_is_ar(tiny_hf):
    ar = Decoder(tiny_hf, None, "ar", eos_token_ids=[]).generate(PROMPT, 16).token_ids
    adapters = random_adapters(tiny_hf.model)
    for config in (LudConfig(placeholders=0), LudConfig(threshold=1.0)):
        units, _ = decode(Lud(config, tiny_hf, adapters=adapters), PROMPT, 16)
        assert [t for u in units for t in u] == ar and all(len(u) == 1 for u in units)


def test_lud_refuses_what_it_cannot_load(tiny_hf, tmp_path):
    adapters = random_adapters(tiny_hf.model, slots=2)
    with pytest.raises(SpecDecodeError, match="trained for 2 slots"):
        Lud(LudConfig(placeholders=3), tiny_hf, adapters=adapters)
    with pytest.raises(SpecDecodeError, match="train lud"):
        Lud(LudConfig(adapters=str(tmp_path / "absent.safetensors")), tiny_hf)
    path = save_artifact(tmp_path / "a.safetensors", adapters.tensors(), ADAPTERS_KIND,
                         adapters.settings(), tiny_hf.fingerprint())
    loaded = load_adapters(str(path), tiny_hf)
    torch.testing.assert_close(loaded.slot_embeddings, adapters.slot_embeddings,
                               atol=2e-3, rtol=2e-3)  # float16 storage


def test_training_lowers_the_slot_loss_and_checkpoints(tiny_hf, tmp_path):
    model = tiny_hf.model.requires_grad_(False)
    tokens = Decoder(tiny_hf, None, "ar", eos_token_ids=[]).generate(PROMPT, 24).token_ids
    conversation = (PROMPT + tokens, len(PROMPT))
    adapters = UnitAdapters.fresh(model, 3, rank=4)
    anchors = trainer.pick_anchors(conversation, 8, random.Random(0))
    targets = trainer.slot_targets(conversation[0], anchors, 3)

    def loss() -> float:
        with torch.no_grad():
            _, logits = trainer.slot_logits(model, adapters, conversation[0], anchors, 3)
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                       ignore_index=-100))

    before = loss()
    parser = argparse.ArgumentParser()
    trainer.add_arguments(parser)
    args = parser.parse_args(["--anchors", "8", "--lr", "1e-2"])
    optim = torch.optim.AdamW(adapters.parameters(), lr=1e-2)
    state = {"step": 0, "log": []}
    trainer._train(model, adapters, optim, [conversation], state,
                   Checkpoint(tmp_path / "checkpoint.pt", resume=False), args,
                   time.monotonic() + 600, lambda text: None,
                   max_steps=4)
    assert state["step"] == 4 and loss() < before
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == state["step"]
    measured = trainer.evaluate(model, adapters, [conversation], 3, 0.9)
    assert len(measured["slot_top1"]) == 3 and measured["mean_unit_tokens"] >= 1


#: floor for the short-input dev-half prompts (mt_bench, qa, math_reasoning: test_lossy's
#: short_dev_prompts), 32 new tokens, the hf runner, the packaged adapters at threshold 0.5 (at
#: the default 0.9 units longer than one token are too rare on this model to test for):
#: measured 0.854 with 4 multi-token units (0.562, 1.000, 1.000; over the first prompt of all
#: six tasks 0.552 with 13 units, docs/lossy.md). Each unit's first token is ar's, so agreement
#: falls only where an accepted slot token was wrong
LUD_TOKEN_FLOOR = 0.55


@pytest.mark.slow
def test_lud_stays_near_ar_on_the_default_model(real_model):
    from specdecode.api import eos_ids
    from specdecode.bench.quality import token_agreement
    from specdecode.artifacts import find_artifacts

    from test_lossy import short_dev_prompts

    runner = HFRunner(real_model.model)
    if not find_artifacts(ADAPTERS_KIND, runner.fingerprint()):
        pytest.skip("no LUD adapters for the default model: `specdecode train lud`")
    eos = eos_ids(real_model.model, real_model.tokenizer)
    ar = Decoder(runner, real_model.tokenizer, "ar", eos)
    lud = Decoder(runner, real_model.tokenizer, "lud", eos, threshold=0.5)
    agreements, multi = [], 0
    for prompt in short_dev_prompts():
        reference = ar.generate(prompt, 32).token_ids
        result = lud.generate(prompt, 32)
        agreements.append(token_agreement(result.token_ids, reference))
        multi += sum(n > 1 for n in result.stats.accepted_lengths)
    assert sum(agreements) / len(agreements) >= LUD_TOKEN_FLOOR, agreements
    assert multi > 0, "no multi-token unit: it is ar"
