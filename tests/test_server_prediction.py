"""OpenAI's Predicted Outputs (``prediction``): text the answer is expected to repeat, which
the suffix and ngram methods draft from. On the tiny model, end to end through the real ``openai``
client: an answer given its own text as the prediction is plain decoding's, token for token,
with most of its tokens accepted from drafts (without the prediction, none); bad predictions
get a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from specdecode.proposers.suffix import SuffixConfig
from specdecode.server.memory import SharedMemory

from tiny_server import CONTEXT, MODEL, build_tokenizer, make_server, tiny_served_model

def question(n: int) -> list[dict]:
    return [{"role": "user", "content": f"Rewrite {n}: def add(a, b): return a + b"}]


@pytest.fixture(scope="module")
def served():
    tokenizer = build_tokenizer()
    # no tree of earlier answers: what suffix drafts comes from the request alone
    memory = SharedMemory(suffix_config=SuffixConfig(max_cached_requests=0))
    with make_server(tiny_served_model(tokenizer), tokenizer, memory=memory,
                     method="suffix") as background:
        yield background


def ask(client, method: str, messages: list[dict], prediction=None, max_tokens: int = 24):
    extra = {"prediction": prediction} if prediction is not None else {}
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, **extra,
        extra_body={"specdecode": {"method": method, "return_token_ids": True}})


@pytest.mark.parametrize("method, parts", [("suffix", False), ("suffix", True),
                                           ("ngram", False)])
def test_a_prediction_is_drafted_from_and_changes_no_token(client, method, parts):
    messages = question(int(parts) + 2 * (method == "ngram"))
    plain = ask(client, "ar", messages).choices[0]
    text = plain.message.content
    content = [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}] \
        if parts else text
    alone = ask(client, method, messages)
    predicted = ask(client, method, messages, {"type": "content", "content": content})
    for out in (alone, predicted):
        assert out.choices[0].model_extra["token_ids"] == plain.model_extra["token_ids"]
    accepted = predicted.usage.model_extra["accepted_tokens"]
    assert accepted >= predicted.usage.completion_tokens / 2
    assert alone.usage.model_extra["accepted_tokens"] < accepted


@pytest.mark.parametrize("prediction, words", [
    ({"type": "text", "content": "x"}, "content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "image_url"),
    ({"type": "content", "content": "add " * (4 * CONTEXT)}, "longer than this model's context"),
])
def test_a_bad_prediction_gets_a_400_naming_it(served, prediction, words):
    body = {"model": MODEL, "messages": question(2), "max_tokens": 4, "prediction": prediction}
    refused = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"].startswith("prediction")
    assert words in refused.json()["error"]["message"]
