"""The Python API: any transformers causal LM, text in, text + ids + stats out; errors are
ValueErrors with the CLI's messages."""

from __future__ import annotations

import pytest

import specdecode
from specdecode.api import Decoder
from specdecode.errors import SpecDecodeError

from conftest import repetitive_prompts


def test_generate_returns_tokens_and_stats(tiny_model):
    prompt = repetitive_prompts()[0]
    result = specdecode.generate(tiny_model, None, prompt, method="ngram", max_new_tokens=20)
    assert len(result.token_ids) == 20 and result.method == "ngram"
    assert result.stats.new_tokens == 20 and result.finish_reason == "length"
    assert result.token_ids == specdecode.generate(tiny_model, None, prompt, method="ar",
                                                   max_new_tokens=20).token_ids
    stats = result.stats
    # the prefill makes the first token, each verify step the rest; on this repetitive prompt
    # ngram's drafts are accepted, so it needs fewer forwards than ar's 20
    assert stats.target_forwards == 1 + len(stats.accepted_lengths)
    assert sum(stats.accepted_lengths) == 19
    assert stats.accepted_tokens == 19 - len(stats.accepted_lengths) > 0
    assert stats.target_forwards < 20
    assert stats.draft_tokens >= stats.accepted_tokens
    data = stats.as_dict()
    steps = len(stats.accepted_lengths)
    assert data["new_tokens"] == 20 and data["target_forwards"] == 1 + steps
    assert data["mean_accepted"] == round(19 / steps, 4)
    assert data["accepted_tokens"] == stats.accepted_tokens
    assert data["draft_tokens"] == stats.draft_tokens
    histogram = {int(k): v for k, v in data["accepted_histogram"].items()}
    assert sum(histogram.values()) == steps and sum(k * v for k, v in histogram.items()) == 19
    assert data["accepted_per_depth"] == [sum(1 for n in stats.accepted_lengths if n > d)
                                          for d in range(1, max(histogram))]
    assert data["tokens_per_s"] == round(20 / stats.total_s, 3)
    assert stats.total_s >= stats.prefill_s + stats.propose_s + stats.verify_s  # parts of a whole


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt="   "), "prompt is empty"),
    (dict(prompt=[1, 2], method="nope"), "unknown method 'nope'; known methods: ar"),
    (dict(prompt=[1, 2], max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(prompt=[1, 2], max_new_tokens=-3), "max_new_tokens must be a positive integer"),
    (dict(prompt=list(range(5)) * 60), "shorten the prompt"),
    (dict(prompt=[1, 2], max_new_tokens=300), "lower max_new_tokens to at most 254"),
    (dict(prompt=[1, 2], method="ngram", bogus=1), "has no config field 'bogus'"),
    (dict(prompt=[1, 2], method="ngram", num_speculative_tokens=0), "num_speculative_tokens must be >= 1"),
    (dict(prompt=[1, 500]), "outside the vocabulary"),
    (dict(prompt=[1, 2], temperature=-1.0), "temperature must be >= 0"),
])
def test_bad_input_raises_value_error(tiny_model, kwargs, message):
    with pytest.raises(ValueError) as info:
        specdecode.generate(tiny_model, None, **kwargs)
    assert isinstance(info.value, SpecDecodeError)
    assert message in str(info.value)


def test_decoder_keeps_proposer_across_requests(tiny_model):
    decoder = Decoder(tiny_model, None, "ngram")
    first = decoder.start(repetitive_prompts()[0], 8).run()
    again = decoder.start(repetitive_prompts()[0], 8).run()
    assert first == again


def test_a_gguf_files_ends_are_llama_cpps():
    """A GGUF file names one end of sequence: the vocabulary's other ends join it as llama.cpp
    reads them (Phi-3's <|end|> beside <|endoftext|>, Qwen2.5's <|fim_pad|>), harmony's
    <|end|> aside (it ends a message, not the answer); a checkpoint's config is taken as is."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from specdecode.api import eos_ids

    from tiny_server import build_tokenizer

    def ids(tokenizer, *texts):
        return tokenizer.convert_tokens_to_ids(list(texts))

    tokenizer = build_tokenizer(special=("<|endoftext|>", "<|end|>", "<|fim_pad|>"))
    config = GenerationConfig(eos_token_id=ids(tokenizer, "<|endoftext|>")[0])
    gguf = SimpleNamespace(generation_config=config, gguf_path="model.gguf")
    assert eos_ids(gguf, tokenizer) == ids(tokenizer, "<|endoftext|>", "<|im_end|>", "<|end|>",
                                           "<|fim_pad|>")
    checkpoint = SimpleNamespace(generation_config=config)
    assert eos_ids(checkpoint, tokenizer) == ids(tokenizer, "<|endoftext|>")
    harmony = build_tokenizer(special=("<|return|>", "<|end|>", "<|call|>"))
    config = GenerationConfig(eos_token_id=ids(harmony, "<|return|>")[0])
    gguf = SimpleNamespace(generation_config=config, gguf_path="model.gguf")
    assert eos_ids(gguf, harmony) == ids(harmony, "<|return|>", "<|im_end|>", "<|call|>")


def test_ignore_eos_and_stop_token_ids(tiny_model):
    """vLLM's ``ignore_eos`` runs past the model's ends to the token limit; ``stop_token_ids``
    end the answer at other tokens (a bias makes the tiny model write each at once)."""
    decoder = Decoder(tiny_model, None, "ngram", eos_token_ids=[5])
    ended = decoder.start([1, 2, 3], 8, logit_bias={5: 100})
    assert ended.run() == [5] and ended.finish_reason == "stop"
    past = decoder.start([1, 2, 3], 8, logit_bias={5: 100}, ignore_eos=True)
    assert past.run() == [5] * 8 and past.finish_reason == "length"
    stopped = decoder.start([1, 2, 3], 8, logit_bias={7: 100}, stop_token_ids=[7])
    assert stopped.run() == [7] and stopped.finish_reason == "stop"
    with pytest.raises(SpecDecodeError, match=r"stop_token_ids \[96\] are outside"):
        decoder.start([1, 2, 3], 8, stop_token_ids=[96])
