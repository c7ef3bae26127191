"""`specdecode serve`: the real server on loopback, spoken to with the official ``openai``
client (chat, completion, streaming, stop sequences, seeds, methods) and with raw HTTP for the
error cases, plus queueing, disconnects, a small load test and the suffix tree's persistence.

Most tests serve a tiny random Llama with a small BPE tokenizer built here (no download, no real
model); greedy responses are compared with the Decoder API over the same weights. The last test
(slow) does the same on the real default model.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from specdecode import registry
from specdecode.api import Decoder
from specdecode.models.base import NOTHING
from specdecode.models.hf import HFRunner
from specdecode.server import BackgroundServer
from specdecode.server.app import Server, Settings, create_app
from specdecode.server.loadtest import run_load
from specdecode.server.memory import SharedMemory

from tiny_server import BODY_LIMIT, CONTEXT, EOS, MODEL, make_server


@pytest.fixture(scope="module")
def served(model, tokenizer):
    with make_server(model, tokenizer) as background:
        yield background


def reference(model, tokenizer, prompt, max_tokens, method="ar", chat=True, stop=()):
    """The Decoder API's greedy output: what `specdecode generate` prints."""
    return Decoder(HFRunner(model), tokenizer, method, [EOS]).generate(
        prompt, max_tokens, chat, stop)


def chat(client, content, **kwargs):
    kwargs.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=kwargs.pop("model", MODEL),
                                          messages=[{"role": "user", "content": content}],
                                          **kwargs)


def still_serving(served):
    assert httpx.get(served.url + "/health").json()["status"] == "ok"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ---- chat and completion equal the Decoder API ---------------------------------------------

#: the model-free methods: they need no trained artifact or draft model
MODEL_FREE = [m for m in ("ar", "ngram", "recycling", "suffix") if m in registry.names()]


@pytest.mark.parametrize("method", MODEL_FREE)
def test_greedy_chat_equals_decoder_for_model_free_methods(client, model, tokenizer, method):
    prompt = "The quick brown fox"
    ref = reference(model, tokenizer, prompt, 24)
    response = chat(client, prompt, temperature=0,
                    extra_body={"specdecode": {"method": method, "return_token_ids": True}})
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.message.content == ref.text
    assert choice.message.role == "assistant" and choice.finish_reason == ref.finish_reason
    usage = response.usage
    assert usage.completion_tokens == len(ref.token_ids)
    assert usage.prompt_tokens == len(Decoder(HFRunner(model), tokenizer).encode(prompt))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = usage.model_extra
    assert extra["method"] == method
    assert extra["target_forwards"] == extra["verify_steps"] + 1  # + the prefill
    assert extra["accepted_tokens"] <= extra["draft_tokens"]
    # tokens = the prefill's one + (accepted + 1) per verify step, cut at the limit
    assert extra["mean_accepted_length"] >= 1.0
    assert extra["verify_steps"] + extra["accepted_tokens"] >= usage.completion_tokens - 1


def test_model_alias_picks_the_method(client, model, tokenizer):
    ref = reference(model, tokenizer, "Hello world", 16)
    response = chat(client, "Hello world", max_tokens=16, model=f"{MODEL}+ar")
    assert response.choices[0].message.content == ref.text
    assert response.usage.model_extra["method"] == "ar"
    assert response.model == f"{MODEL}+ar"
    default = chat(client, "Hello world", max_tokens=16, model="default")
    assert default.usage.model_extra["method"] == "ngram"  # the server's --method


def test_completion_text_token_ids_and_batch(client, model, tokenizer):
    ref = reference(model, tokenizer, "def add(a, b):", 20, chat=False)
    out = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=20)
    assert out.choices[0].text == ref.text and out.object == "text_completion"
    ids = tokenizer("The lazy dog")["input_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=20)
    assert by_ids.choices[0].text == reference(model, tokenizer, ids, 20, chat=False).text
    batch = client.completions.create(model=MODEL, prompt=["def add(a, b):", "The lazy dog"],
                                      max_tokens=20)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == ref.text and batch.choices[1].text == by_ids.choices[0].text
    assert batch.usage.prompt_tokens == out.usage.prompt_tokens + by_ids.usage.prompt_tokens


def test_streaming_equals_the_whole_response(client):
    whole = chat(client, "How are you today?", max_tokens=30)
    stream = chat(client, "How are you today?", max_tokens=30, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.model_extra["draft_tokens"] == whole.usage.model_extra["draft_tokens"]

    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20)
    pieces = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=20,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == completion.choices[0].text
    assert pieces[-1].choices[0].finish_reason == completion.choices[0].finish_reason


def test_stream_ends_with_done(served):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "stream": True}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    json.loads(lines[-2][6:])


def test_stop_sequences_cut_the_text_also_across_stream_pieces(client):
    content = "The quick brown fox"
    whole = chat(client, content, max_tokens=40).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in chat(client, content, max_tokens=40,
                                                                 stream=True) if c.choices]
    pieces = [p for p in pieces if p]
    # a stop string that straddles two streamed pieces: its first half must not be streamed
    assert "".join(pieces) == whole
    j = next(j for j in range(1, len(pieces)) if whole.find(pieces[j - 1][-1] + pieces[j][0])
             == len("".join(pieces[:j])) - 1)
    stop = pieces[j - 1][-1] + pieces[j][0]
    expected = whole[:whole.find(stop)]
    # more than OpenAI's 4: lm-evaluation-harness sends HumanEval's five and the end of sequence
    response = chat(client, content, max_tokens=40,
                    stop=[stop, "never appears", "\nclass", "\ndef", "\n#", "\nif", "\nprint"])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = [c for c in chat(client, content, max_tokens=40, stop=stop, stream=True)
                if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_n_choices(client, model, tokenizer):
    options = dict(temperature=1.5, top_p=0.95, max_tokens=24, extra_body={"top_k": 50})
    first = chat(client, "Tell me a story", seed=11, n=3, **options)
    alone = Decoder(HFRunner(model), tokenizer, "ngram", [EOS]).generate(
        "Tell me a story", 24, temperature=1.5, top_p=0.95, top_k=50, seed=11)
    assert first.choices[0].message.content == alone.text  # interleaving changes nothing
    again = chat(client, "Tell me a story", seed=11, n=3, **options)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # choice i is seeded with seed + i
    other = [chat(client, "Tell me a story", seed=s, **options).choices[0].message.content
             for s in (12, 13)]
    assert texts[1:] == other  # so choice 1 of seed 11 is choice 0 of seed 12
    extras = {"top_k": 50, "min_p": 0.05, "repetition_penalty": 1.3}  # vLLM's extra fields
    penalised = [chat(client, "Tell me a story", seed=11, presence_penalty=1.0,
                      frequency_penalty=0.5, temperature=1.5, max_tokens=24, extra_body=extras)
                 for _ in range(2)]
    assert penalised[0].choices[0].message.content == penalised[1].choices[0].message.content
    assert first.usage.completion_tokens == sum(
        chat(client, "Tell me a story", seed=s, **options).usage.completion_tokens
        for s in (11, 12, 13))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_logit_bias_is_the_decoder_apis(client, model, tokenizer, method):
    """OpenAI's logit_bias: the served answer is the Decoder API's with the same bias, and
    the tokens of the unbiased answer, all but banned, do not appear."""
    decoder = Decoder(HFRunner(model), tokenizer, method, [EOS])
    plain = decoder.generate("Tell me a story", 24)
    bias = {str(t): -100 for t in set(plain.token_ids)}
    alone = decoder.generate("Tell me a story", 24, logit_bias=bias)
    response = chat(client, "Tell me a story", logit_bias=bias,
                    extra_body={"specdecode": {"method": method}})
    assert response.choices[0].message.content == alone.text != plain.text
    assert not set(alone.token_ids) & set(plain.token_ids)


def test_ignore_eos_and_stop_token_ids(served, client):
    """vLLM's extras: ``ignore_eos`` runs to max_tokens past the model's end (which a bias
    makes the tiny model write at once); ``stop_token_ids`` end the answer, out of its text."""
    forced = {"logit_bias": {str(EOS): 100}, "max_tokens": 5}
    ended = client.completions.create(model=MODEL, prompt="Hello", **forced)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    past = client.completions.create(model=MODEL, prompt="Hello", **forced,
                                     extra_body={"ignore_eos": True})
    assert past.choices[0].finish_reason == "length" and past.usage.completion_tokens == 5
    stopped = chat(client, "Hello", logit_bias={"40": 100},
                   extra_body={"stop_token_ids": [40]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].message.content == ""
    r = httpx.post(served.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "stop_token_ids": [10 ** 6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


def test_continue_final_message_goes_on_from_the_assistants_text(client, model, tokenizer):
    """vLLM's continue_final_message: the prompt is the conversation with the assistant's
    last message left open (transformers' continue_final_message), and the answer is what
    follows it, as plain decoding of those ids gives it."""
    messages = [{"role": "user", "content": "Tell me a story"},
                {"role": "assistant", "content": "Once upon a time"}]
    ids = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    assert ids != tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
    alone = Decoder(HFRunner(model), tokenizer, "ngram", [EOS]).generate(ids, 16)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                         extra_body={"continue_final_message": True})
    assert got.choices[0].message.content == alone.text
    assert got.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="must then be the assistant's"):
        chat(client, "Tell me a story", extra_body={"continue_final_message": True})


def test_tokenize_gives_the_ids_requests_prompt_with(served, client, model, tokenizer):
    """vLLM's /tokenize: a completion's prompt and a chat's messages become the ids the
    requests themselves count as their prompt; /detokenize gives their text back."""
    def post(path, body, status=200):
        r = httpx.post(served.url + path, json=body, timeout=30)
        assert r.status_code == status, r.text
        return r.json()

    decoder = Decoder(HFRunner(model), tokenizer, "ar", [EOS])
    raw = post("/tokenize", {"model": MODEL, "prompt": "Hello there", "return_token_strs": True})
    assert raw["tokens"] == decoder.encode("Hello there", chat=False)
    assert raw["count"] == len(raw["tokens"]) and raw["max_model_len"] == CONTEXT
    assert raw["token_strs"] == [tokenizer.decode([t]) for t in raw["tokens"]]
    completion = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2)
    assert completion.usage.prompt_tokens == raw["count"]
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat_ids = post("/tokenize", {"messages": messages})
    assert chat_ids["tokens"] == decoder.encode("Tell me a story") != raw["tokens"]
    assert chat_ids["token_strs"] is None
    assert chat(client, "Tell me a story", max_tokens=2).usage.prompt_tokens == chat_ids["count"]
    assert post("/detokenize", {"tokens": chat_ids["tokens"]})["prompt"] == tokenizer.decode(
        chat_ids["tokens"])
    for body, param, needle in [
            ({"prompt": "x", "messages": messages}, "prompt", "one of them"),
            ({}, "prompt", "one of them"),
            ({"prompt": "x", "tools": []}, "tools", "goes with 'messages'"),
            ({"prompt": "x", "add_bos": True}, "add_bos", "Unrecognized request argument")]:
        error = post("/tokenize", body, 400)["error"]
        assert error["param"] == param and needle in error["message"]
    error = post("/detokenize", {"tokens": [1, 10 ** 6]}, 400)["error"]
    assert error["param"] == "tokens" and "outside the vocabulary" in error["message"]


def test_llama_servers_tokenize_and_detokenize(served, tokenizer):
    """llama-server's forms: ``content`` (text, or text and ids mixed), its pieces; the text
    of ids under ``content``."""
    def post(path, body, status=200):
        r = httpx.post(served.url + path, json=body, timeout=30)
        assert r.status_code == status, r.text
        return r.json()

    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    assert post("/tokenize", {"content": "Hello there"}) == {"tokens": ids}
    mixed = post("/tokenize", {"content": ["Hello there", 7, "Hello there"]})["tokens"]
    assert mixed == ids + [7] + ids
    pieces = post("/tokenize", {"content": "Hello there", "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert "".join(p["piece"] for p in pieces).strip() == "Hello there"
    assert post("/detokenize", {"tokens": ids})["content"] == tokenizer.decode(ids)
    assert post("/tokenize", {"content": "x", "parse_special": False}, 400)["error"][
        "param"] == "parse_special"
    assert post("/tokenize", {"content": [10 ** 6]}, 400)["error"]["param"] == "content"


def test_models_health_and_metrics(served, client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == MODEL and f"{MODEL}+suffix" in ids and f"{MODEL}+ar" in ids
    health = httpx.get(served.url + "/health").json()
    assert health["status"] == "ok" and health["parallel"] == 2 and health["max_context"] == CONTEXT
    before = metric_values(httpx.get(served.url + "/metrics").text)
    # a repetitive prompt, so ngram drafts and the draft counters move
    response = chat(client, "thank you thank you thank you", max_tokens=12,
                    extra_body={"specdecode": {"method": "ngram"}})
    after = metric_values(httpx.get(served.url + "/metrics").text)
    usage = response.usage.model_extra

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # every counter moved by exactly this request's own figures, reported in its usage
    assert grew("specdecode_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert grew("specdecode_sequences_total", method="ngram",
                outcome=response.choices[0].finish_reason) == 1
    assert grew("specdecode_completion_tokens_total", method="ngram") \
        == response.usage.completion_tokens
    assert grew("specdecode_prompt_tokens_total") == response.usage.prompt_tokens
    assert grew("specdecode_target_forwards_total", method="ngram") == usage["target_forwards"]
    assert grew("specdecode_draft_tokens_total", method="ngram") == usage["draft_tokens"]
    assert grew("specdecode_accepted_tokens_total", method="ngram") == usage["accepted_tokens"] > 0
    steps = usage["verify_steps"]
    assert grew("specdecode_accepted_length_count", method="ngram") == steps
    assert grew("specdecode_accepted_length_sum", method="ngram") \
        == pytest.approx(usage["mean_accepted_length"] * steps, abs=1e-3)
    assert grew("specdecode_accepted_length_bucket", method="ngram", le="+Inf") == steps
    assert grew("specdecode_request_latency_seconds_count",
                endpoint="/v1/chat/completions") == 1
    assert grew("specdecode_time_to_first_token_seconds_count") == 1
    assert grew("specdecode_queue_wait_seconds_count") == 1
    assert after[("specdecode_active_sequences", ())] == 0
    assert after[("specdecode_queued_sequences", ())] == 0


def metric_values(text: str) -> dict:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


# ---- bad input: OpenAI's error object, a 4xx, and the server keeps serving ---------------------

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def with_(**changes):
    body = dict(GOOD)
    for key, value in changes.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return json.dumps(body).encode()


@pytest.mark.parametrize("path,body,status,param,needle", [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None, "not valid JSON"),
    ("/v1/chat/completions", b"", 400, None, "body is empty"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("/v1/chat/completions", b"\xff\xfe", 400, None, "not valid JSON"),
    ("/v1/chat/completions", with_(messages=None), 400, "messages", "'messages' is a required"),
    ("/v1/chat/completions", with_(messages="hi"), 400, "messages", "valid list"),
    ("/v1/chat/completions", with_(messages=[]), 400, "messages", "at least one message"),
    ("/v1/chat/completions", with_(messages=[{"role": "robot", "content": "x"}]), 400,
     "messages", "messages.0.role"),
    ("/v1/chat/completions", with_(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages",
     "type 'image_url' are not supported"),
    ("/v1/chat/completions", with_(model=None), 400, "model", "'model' is a required"),
    ("/v1/chat/completions", with_(max_tokens="ten"), 400, "max_tokens", "valid integer"),
    ("/v1/chat/completions", with_(max_tokens=0), 400, "max_tokens", "at least 1"),
    ("/v1/chat/completions", with_(stream="yes"), 400, "stream", "valid boolean"),
    ("/v1/chat/completions", with_(temperature=-1), 400, "temperature", "temperature must be >= 0"),
    ("/v1/chat/completions", with_(top_p=0), 400, "top_p", "top_p must be in (0, 1]"),
    ("/v1/chat/completions", with_(seed=1.5), 400, "seed", "valid integer"),
    ("/v1/chat/completions", with_(n=99), 400, "n", "n must be between 1 and 8"),
    ("/v1/chat/completions", with_(stop=[chr(97 + i) for i in range(17)]), 400, "stop",
     "at most 16"),
    ("/v1/chat/completions", with_(max_token=5), 400, "max_token", "Unrecognized request argument"),
    ("/v1/chat/completions", with_(top_logprobs=3), 400, "top_logprobs", "needs 'logprobs'"),
    ("/v1/chat/completions", with_(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "top_logprobs must be in [0, 20]"),
    ("/v1/chat/completions", with_(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}), 400,
     "response_format", "invalid json schema"),
    ("/v1/chat/completions", with_(response_format={"type": "json_schema"}), 400,
     "response_format", "needs 'json_schema'"),
    ("/v1/chat/completions", with_(response_format={"type": "xml"}), 400, "response_format",
     "response_format.type"),
    ("/v1/chat/completions", with_(specdecode={"grammar": "start: foo("}), 400,
     "specdecode.grammar", "invalid grammar"),
    ("/v1/chat/completions", with_(specdecode={"regex": "[a-"}), 400, "specdecode.regex",
     "invalid regex"),
    ("/v1/chat/completions", with_(specdecode={"ban": [""]}), 400, "specdecode.ban",
     "must not be empty"),
    ("/v1/chat/completions", with_(max_tokens=10_000), 400, "max_tokens", "lower max_tokens to at most"),
    ("/v1/chat/completions", with_(messages=[{"role": "user", "content": "fox " * 300}]), 400,
     "messages", "maximum context length is 256 tokens"),
    ("/v1/chat/completions", with_(model="gpt-4"), 404, "model", "does not exist"),
    ("/v1/chat/completions", with_(model="tiny+bogus"), 400, "model",
     "unknown method 'bogus'; known methods: ar"),
    ("/v1/chat/completions", with_(specdecode={"method": "bogus"}), 400, "specdecode.method",
     "known methods: ar"),
    ("/v1/chat/completions", with_(model="tiny+ar", specdecode={"method": "ngram"}), 400,
     "specdecode.method", "give one of them"),
    ("/v1/chat/completions", with_(specdecode={"method": "ngram", "config": {"bogus": 1}}), 400,
     "specdecode.config", "has no config field 'bogus'"),
    ("/v1/chat/completions", with_(specdecode={"method": "ngram", "config": {
        "num_speculative_tokens": 0}}), 400, "specdecode.config", "must be >= 1"),
    ("/v1/chat/completions", with_(specdecode={"method": "suffix", "config": {
        "max_tree_depth": 8}}), 400, "specdecode.config.max_tree_depth",
     "is set when the server starts"),
    ("/v1/chat/completions", b'{"pad": "' + b"x" * (BODY_LIMIT + 10) + b'"}', 413, None,
     "at most 65536"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "prompt",
     "prompt is empty"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 5000]}).encode(), 400,
     "prompt", "outside the vocabulary"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "suffix": "y",
                                    "echo": True}).encode(), 400, "echo", "cannot be combined"),
    ("/v1/chat/completions", with_(logit_bias={"5": 150}), 400, "logit_bias",
     "logit_bias values must be numbers in [-100, 100]"),
    ("/v1/chat/completions", with_(logit_bias={"hello": 1}), 400, "logit_bias",
     "logit_bias keys must be token ids"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x",
                                    "logit_bias": {"5000": -100}}).encode(), 400, "logit_bias",
     "outside this model's vocabulary"),
    ("/v1/nothing", json.dumps(GOOD).encode(), 404, None, "Not Found"),
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(served, path, body, status,
                                                                     param, needle):
    r = httpx.post(served.url + path, content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"
    still_serving(served)


def test_wrong_http_method_and_chunked_oversized_body(served):
    r = httpx.get(served.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()

    def chunks():  # no content-length: the limit is enforced while reading
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b" " * 1024

    r = httpx.post(served.url + "/v1/chat/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    still_serving(served)


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "Hi", max_tokens=100_000)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        chat(client, "Hi", model="gpt-4")


# ---- concurrency ----------------------------------------------------------------------------

class GatedRunner(HFRunner):
    """Prefill waits for ``gate``; ``entered`` tells the test it got there."""

    def __init__(self, model):
        super().__init__(model)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def prefill(self, ids, needs=NOTHING):
        self.entered.set()
        assert self.gate.wait(30)
        return super().prefill(ids, needs)


class SlowRunner(HFRunner):
    def forward(self, root, draft, needs=NOTHING):
        time.sleep(0.02)
        return super().forward(root, draft, needs)


def test_full_queue_answers_429_then_everything_completes(model, tokenizer):
    runner = GatedRunner(model)
    with make_server(model, tokenizer, runners=[runner], max_queue=1) as served:
        results = {}

        def post(name):
            r = httpx.post(served.url + "/v1/chat/completions", json=GOOD, timeout=60)
            results[name] = r

        running = threading.Thread(target=post, args=("running",))
        running.start()
        assert runner.entered.wait(30)
        waiting = threading.Thread(target=post, args=("waiting",))
        waiting.start()
        deadline = time.monotonic() + 30
        while httpx.get(served.url + "/health").json()["waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        full = httpx.post(served.url + "/v1/chat/completions", json=GOOD)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        two = httpx.post(served.url + "/v1/chat/completions", json=dict(GOOD, n=2))
        assert two.status_code == 429  # fits an idle server (one slot + one place), not now
        never = httpx.post(served.url + "/v1/chat/completions", json=dict(GOOD, n=3))
        assert never.status_code == 400 and "at most 2 at once" in never.json()["error"]["message"]
        runner.gate.set()
        running.join(60)
        waiting.join(60)
        assert results["running"].status_code == results["waiting"].status_code == 200
        assert results["running"].json()["choices"] == results["waiting"].json()["choices"]
        still_serving(served)


class FinishSpy(SharedMemory):
    """Records the output each proposer's ``finish`` receives."""

    def __init__(self):
        super().__init__()
        self.finished: list[list[int]] = []

    def make_proposer(self, method, config, runner):
        proposer = super().make_proposer(method, config, runner)
        finish = proposer.finish

        def spy(output):
            self.finished.append(list(output))
            finish(output)

        proposer.finish = spy
        return proposer


def wait_idle(served, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(served.url + "/health").json()
        if load["running"] == 0 and load["waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"slot not freed: {load}"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(model, tokenizer, stream):
    spy = FinishSpy()
    with make_server(model, tokenizer, runners=[SlowRunner(model)], memory=spy,
                     method="ar") as served:  # ar: one slow forward per token
        body = dict(GOOD, max_tokens=200, stream=stream)
        if stream:
            with httpx.stream("POST", served.url + "/v1/chat/completions", json=body) as r:
                lines = (json.loads(line[6:]) for line in r.iter_lines() if line)
                # leave once text arrives: generation is under way
                next(c for c in lines if c["choices"][0]["delta"].get("content"))
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(served.url + "/v1/chat/completions", json=body, timeout=0.5)
        wait_idle(served)
        # cancelled, not finished: fewer tokens than the limit
        assert len(spy.finished) == 1 and 0 < len(spy.finished[0]) < 200
        metrics = httpx.get(served.url + "/metrics").text
        assert 'specdecode_sequences_total{method="ar",outcome="cancelled"} 1.0' in metrics
        still_serving(served)


def test_concurrent_requests_are_never_mixed_up(model, tokenizer):
    """The load test, small: every response complete and equal to its single-request output."""
    with make_server(model, tokenizer, parallel=3, max_queue=64) as served:
        prompts = ["The quick brown fox", "Hello world!", "def add(a, b):", "How are you?",
                   "Speculative decoding", "thank you"]
        report = run_load(served.url, MODEL, prompts, requests=24, concurrency=6, max_tokens=16,
                          time_limit=120)
        data = report.as_dict()
        assert report.ok, data["problems"]
        assert data["completed"] == data["correct"] == 24
        # the figures are those of the 24 outcomes
        latencies = sorted(o.latency_s for o in report.outcomes)
        assert data["p50_latency_s"] == round(latencies[11], 3)  # the 12th of 24
        assert data["p95_latency_s"] == round(latencies[22], 3)  # the 23rd of 24
        assert data["requests_per_s"] == round(24 / report.wall_s, 3)
        tokens = [o.completion_tokens for o in report.outcomes]
        assert all(1 <= n <= 16 for n in tokens) and data["completion_tokens"] == sum(tokens)


def test_load_report_percentiles_count_only_completed_requests():
    from specdecode.server.loadtest import LoadReport, Outcome

    outcomes = [Outcome(i, 0, False, latency_s=float(20 - i), completion_tokens=2)
                for i in range(20)]
    outcomes.append(Outcome(20, 0, False, latency_s=99.0, error="timeout"))
    data = LoadReport(21, 4, wall_s=10.0, outcomes=outcomes).as_dict()
    # latencies 1..20 s: the 10th and the 19th; the failed request's 99 s is not a latency
    assert (data["p50_latency_s"], data["p95_latency_s"]) == (10.0, 19.0)
    assert data["completed"] == 20 and data["requests_per_s"] == 2.1
    assert data["completion_tokens"] == 40 and data["tokens_per_s"] == 4.0


# ---- cross-request memory -------------------------------------------------------------------

def test_suffix_global_tree_is_shared_saved_and_loaded(model, tokenizer, tmp_path):
    path = tmp_path / "suffix.json"
    memory = SharedMemory(path)
    prompt = "The quick brown fox"
    with make_server(model, tokenizer, memory=memory, method="suffix") as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
        first = chat(client, prompt, max_tokens=40)
        # a second slot's proposer answers the same prompt from the first answer in the tree
        second = chat(client, prompt, max_tokens=40)
        assert second.choices[0].message.content == first.choices[0].message.content
        assert (second.usage.model_extra["mean_accepted_length"]
                > first.usage.model_extra["mean_accepted_length"])
        cached = memory.global_cache.cached_requests
        assert len(cached) == 2
    assert path.exists()  # saved on shutdown

    restarted = SharedMemory(path)
    assert len(restarted.global_cache.cached_requests) == 2
    with make_server(model, tokenizer, memory=restarted, method="suffix") as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
        warm = chat(client, prompt, max_tokens=40)
    assert warm.choices[0].message.content == first.choices[0].message.content
    assert (warm.usage.model_extra["mean_accepted_length"]
            > first.usage.model_extra["mean_accepted_length"])


def test_a_suffix_cache_of_another_depth_is_refused(tmp_path):
    from specdecode.errors import SpecDecodeError
    from specdecode.suffix_cache import SuffixCache

    path = tmp_path / "deep.json"
    SuffixCache(max_tree_depth=32).save(path)
    with pytest.raises(SpecDecodeError, match="max_tree_depth 32"):
        SharedMemory(path)


@pytest.mark.parametrize("args,message", [
    (["--method", "bogus"], "unknown method 'bogus'; known methods: ar"),
    (["--method", "ngram", "-c", "bogus=1"], "has no config field 'bogus'"),
    (["--parallel", "0"], "--parallel must be >= 1"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--responses-kept", "-1"], "--responses-kept must be >= 0"),
    (["--suffix-cache", "{tmp}/broken.json"], "is not valid JSON"),
])
def test_serve_rejects_bad_flags_before_loading_the_model(args, message, tmp_path, capsys):
    from specdecode.cli import main

    (tmp_path / "broken.json").write_text("{")
    assert main(["serve", *[a.format(tmp=tmp_path) for a in args]]) == 2
    assert message in capsys.readouterr().err


# ---- the real model -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.ci
def test_real_model_greedy_responses_equal_specdecode_generate(real_model):
    from specdecode.api import eos_ids

    eos = eos_ids(real_model.model, real_model.tokenizer)
    runners = [HFRunner(real_model.model) for _ in range(2)]
    server = Server(runners, real_model.tokenizer, eos,
                    Settings(model_id="smollm2", method=registry.DEFAULT_METHOD))
    prompt = "Write a Python function that returns the squares of a list of numbers."
    with BackgroundServer(create_app(server)) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                               timeout=300)
        # `specdecode generate --method ar`; every method is lossless, so one reference serves
        ref = Decoder(HFRunner(real_model.model), real_model.tokenizer, "ar", eos).generate(
            prompt, 40)
        for method in (registry.DEFAULT_METHOD, "suffix"):
            response = chat(client, prompt, max_tokens=40, model=f"smollm2+{method}",
                            extra_body={"specdecode": {"return_token_ids": True}})
            assert response.choices[0].model_extra["token_ids"] == ref.token_ids, method
            assert response.choices[0].message.content == ref.text, method
