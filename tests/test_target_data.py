"""``specdecode train data`` (training/target_data.py): conversations written many per forward
on the native runner, into a shard that a later run resumes. On a tiny int4 runner with a
character tokenizer of its vocabulary: a conversation is the same whatever batch wrote it, an
interrupted shard is completed with exactly what was missing, and the sampler keeps top-p."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.llama import LlamaRunner
from specdecode.training.self_data import OPENERS
from specdecode.training.target_data import (TOP_P, Settings, Writer, draw_token, opener,
                                             read_shard, write_shard)
from tiny_models import tiny_llama

VOCAB = 96
EOS = 3


class CharTokenizer:
    """Characters as token ids modulo the tiny vocabulary, with a chat template."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [4 + ord(c) % (VOCAB - 4) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 90) for i in ids if i != EOS)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self(text)["input_ids"] if tokenize else text


@pytest.fixture(scope="module")
def runner():
    model = tiny_llama(vocab_size=VOCAB, hidden_size=64, layers=2, heads=4, kv_heads=2, seed=3,
                       max_positions=512)
    return LlamaRunner.from_transformers(model, "int4", max_context=256)


def writer(runner, batch: int) -> Writer:
    return Writer(runner, CharTokenizer(), {EOS}, Settings(runner.fingerprint(), 12, 20, 5), batch)


def lines(path: Path) -> dict[int, str]:
    return {json.loads(line)["index"]: line for line in path.read_text().splitlines()}


def test_shard_resumes_with_what_was_missing_whatever_the_batch(runner, tmp_path):
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    assert write_shard(writer(runner, 4), whole, 7, 600, show=lambda _: None) == 7
    expected = lines(whole)
    assert sorted(expected) == list(range(7))
    for line in expected.values():
        record = json.loads(line)
        assert 0 < record["prompt_len"] < len(record["ids"])  # a prompt, then an answer
    # an interrupted run: three conversations and half of a fourth line
    kept = list(expected.values())[:3]
    resumed.write_text("".join(line + "\n" for line in kept) + kept[-1][:20])
    assert write_shard(writer(runner, 3), resumed, 7, 600, show=lambda _: None) == 4
    assert lines(resumed) == expected  # batch 3 wrote what batch 4 wrote, nothing twice
    assert len(read_shard(resumed)) == 7


def test_shard_of_other_settings_is_refused(runner, tmp_path):
    path = tmp_path / "shard.jsonl"
    write_shard(writer(runner, 2), path, 2, 600, show=lambda _: None)
    other = Settings(runner.fingerprint(), 12, 20, seed=6)
    with pytest.raises(SpecDecodeError, match="other settings"):
        read_shard(path, other)


def test_openers_vary_beyond_the_fixed_ones():
    rng = random.Random(0)
    drawn = [opener(rng) for _ in range(2000)]
    assert len(set(drawn)) > 500
    assert set(OPENERS) & set(drawn)  # the old openers stay among them
    assert any(o.startswith("Translate") for o in drawn)


def reference_top_p(logits: torch.Tensor, temperature: float, generator) -> int:
    probs = (logits / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    sorted_probs[sorted_probs.cumsum(-1) - sorted_probs > TOP_P] = 0.0
    return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])


@pytest.mark.parametrize("spread", [0.5, 8.0])  # flat: the full sort; peaked: the shortcut
def test_draw_token_is_top_p_sampling(spread):
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * spread
    for seed in range(50):
        ours = draw_token(logits, 0.7, torch.Generator().manual_seed(seed))
        assert ours == reference_top_p(logits, 0.7, torch.Generator().manual_seed(seed))
    assert draw_token(logits, 0.0, torch.Generator()) == int(logits.argmax())
