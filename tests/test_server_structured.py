"""The server's structured output, logprobs and bans, through the real ``openai`` client on
loopback (the tiny model and BPE tokenizer of test_server): responses equal the Decoder API under
the same constraint, JSON validates against its schema, logprobs stream as they are returned
whole, and bad grammars are 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from specdecode.api import Decoder
from specdecode.models.hf import HFRunner

from tiny_server import EOS, MODEL, make_server

SCHEMA = {"type": "object",
          "properties": {"word": {"type": "string", "maxLength": 8},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "count"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                 "strict": True}}
PROMPT = "Describe the fox as JSON."


@pytest.fixture(scope="module")
def served(model, tokenizer):
    with make_server(model, tokenizer) as background:
        yield background


def reference(model, tokenizer, method, max_tokens=40, **request):
    return Decoder(HFRunner(model), tokenizer, method, [EOS]).generate(PROMPT, max_tokens,
                                                                        **request)


@pytest.mark.parametrize("method", ["ar", "ngram", "suffix"])
def test_json_schema_response_equals_the_decoder_and_validates(client, model, tokenizer, method):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=40,
        response_format=FORMAT, extra_body={"specdecode": {"method": method}})
    choice = out.choices[0]
    expected = reference(model, tokenizer, method, json_schema=SCHEMA)
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_mode_gives_an_object(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=60,
        response_format={"type": "json_object"})
    content = out.choices[0].message.content
    assert content.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_chat_logprobs_equal_the_decoder_and_stream_the_same(client, model, tokenizer):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
                  logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    expected = reference(model, tokenizer, "ngram", 16, logprobs=3).logprobs
    assert len(whole) == len(expected)
    for got, want in zip(whole, expected):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert len(got.top_logprobs) == 3
        assert got.top_logprobs[0].logprob >= got.top_logprobs[1].logprob
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == \
        [(e.token, round(e.logprob, 5)) for e in whole]


def test_completion_logprobs_in_openai_form(client):
    out = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=6,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_banned_strings_never_appear_and_match_the_decoder(client, model, tokenizer):
    free = reference(model, tokenizer, "ngram", 30).text
    word = next(w for w in free.split() if len(w) >= 2)[:2]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=30,
        extra_body={"specdecode": {"ban": [word]}})
    text = out.choices[0].message.content
    assert word not in text
    assert text == reference(model, tokenizer, "ngram", 30, banned=[word]).text


def test_bad_schema_is_a_400_with_the_engines_message(served):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "required": 5}}}}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"
