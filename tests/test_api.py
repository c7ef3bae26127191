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
    assert result.stats.target_forwards <= 20
    data = result.stats.as_dict()
    assert set(data) >= {"new_tokens", "target_forwards", "mean_accepted", "tokens_per_s",
                         "accepted_histogram", "accepted_per_depth", "propose_s", "verify_s"}


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
