"""Ollama's API (server/ollama.py) through the official ``ollama`` client, on the tiny model
under a template with tools and fill-in-the-middle tokens: a chat or a templated generation is
the library's answer under Ollama's sampling (its defaults, its order, the penalty window),
with every method; a stream adds up to the whole answer; ``context`` continues a generation;
``raw`` and ``suffix`` are the completion endpoint's answers; a conversation's tool calls and
results read as OpenAI's, and a streamed call comes back whole with its arguments an object;
the routes clients read first; errors in Ollama's form. Marked slow: the real Qwen2.5-Coder-0.5B
under Ollama's sampling is the library's answer with ``ar`` and ``suffix``, and its middle the
completion endpoint's."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from specdecode.api import Decoder
from specdecode.models.llama import LlamaRunner
from specdecode.server.frontend import Frontend
from specdecode.server.ollama import OllamaAnswer
from test_infill import SPECIAL
from test_server_tools import TOOL_TEMPLATE, WEATHER, qwen  # noqa: F401 - a fixture
from tiny_models import tiny_llama
from tiny_server import EOS, MODEL, build_tokenizer, make_server, openai_client

CONTEXT = 512
#: a prompt that repeats itself: Ollama's default repeat penalty changes its answers
REPEATED = "def add(a, b):\n    return a + b\n" * 3
QUESTION = [{"role": "user", "content": REPEATED}]
#: what the library is asked for to sample as Ollama does by default
OLLAMA_DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.0, repetition_penalty=1.1,
                       penalty_last_n=64)
#: greedy, no penalties: what the OpenAI endpoints give
PLAIN = {"temperature": 0, "repeat_penalty": 1.0}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A forecast",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TOOL_TEMPLATE, SPECIAL)


@pytest.fixture(scope="module")
def runner(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, max_positions=CONTEXT, seed=1)
    return LlamaRunner.from_transformers(model, "int4", max_context=CONTEXT)


@pytest.fixture(scope="module")
def served(tokenizer, runner):
    with make_server(None, tokenizer, runners=[runner.replica(), runner.replica()],
                     method="suffix") as background:
        yield background


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served.url, timeout=60)


@pytest.fixture(scope="module")
def decoder(runner, tokenizer):
    return Decoder(runner.replica(), tokenizer, "ar", [EOS])


@pytest.mark.parametrize("method", ["ar", "suffix", "ngram"])
def test_a_chat_is_the_librarys_answer_under_ollamas_sampling(client, decoder, method):
    for seed in range(3):
        got = client.chat(model=f"{MODEL}+{method}:latest", messages=QUESTION,
                          options={"seed": seed, "num_predict": 16})
        want = decoder.generate(QUESTION, 16, seed=seed, **OLLAMA_DEFAULTS)
        assert got.message.content == want.text
        assert got.eval_count == len(want.token_ids) and got.done
        assert got.done_reason == ("length" if want.finish_reason == "length" else "stop")


def test_greedy_takes_the_penalised_argmax(client, decoder):
    """Temperature 0 with Ollama's default repeat penalty: the argmax of the penalised logits
    (which is not the OpenAI endpoints' greedy answer)."""
    got = client.chat(model=MODEL, messages=QUESTION, options={"temperature": 0,
                                                               "num_predict": 24})
    want = decoder.generate(QUESTION, 24, temperature=0, repetition_penalty=1.1,
                            penalty_last_n=64).text
    assert got.message.content == want
    assert want != decoder.generate(QUESTION, 24, temperature=0).text


def test_a_stream_adds_up_to_the_whole_answer(client):
    options = {"seed": 5, "num_predict": 20}
    whole = client.chat(model=MODEL, messages=QUESTION, options=options)
    parts = list(client.chat(model=MODEL, messages=QUESTION, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    last = parts[-1]
    assert last.eval_count == whole.eval_count and last.done_reason == whole.done_reason
    assert last.total_duration >= last.prompt_eval_duration > 0


def test_generate_continues_its_context(client, served, decoder):
    first = client.generate(model=MODEL, prompt="Hello", system="Be brief.",
                            options={**PLAIN, "num_predict": 8})
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    prompt = decoder.encode(chat)
    answer = decoder.generate(chat, 8, temperature=0)
    assert first.response == answer.text
    assert first.context == prompt + answer.token_ids
    second = client.generate(model=MODEL, prompt="More", context=first.context,
                             options={**PLAIN, "num_predict": 8})
    ids = first.context + decoder.encode([{"role": "user", "content": "More"}])
    want = openai_client(served).completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                                    temperature=0)
    assert second.response == want.choices[0].text
    assert second.context[:len(ids)] == ids
    *_, last = client.generate(model=MODEL, prompt="Hello", system="Be brief.", stream=True,
                               options={**PLAIN, "num_predict": 8})
    assert last.done and last.context == first.context


def test_a_request_without_stream_is_streamed_as_lines(served):
    """Ollama streams unless told not to (its own client always says which)."""
    answer = httpx.post(served.url + "/api/generate", timeout=30,
                        json={"model": MODEL, "prompt": "Hello", "options": {"num_predict": 4}})
    assert answer.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in answer.text.splitlines()]
    assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])


def test_raw_and_suffix_are_the_completion_endpoints_answers(client, served):
    completions = openai_client(served).completions
    raw = client.generate(model=MODEL, prompt=REPEATED, raw=True,
                          options={**PLAIN, "num_predict": 12})
    want = completions.create(model=MODEL, prompt=REPEATED, max_tokens=12, temperature=0)
    assert raw.response == want.choices[0].text and raw.context is None
    middle = client.generate(model=MODEL, prompt="def add(a, b):\n", suffix="\n\nprint(add)",
                             options={**PLAIN, "num_predict": 12})
    want = completions.create(model=MODEL, prompt="def add(a, b):\n", suffix="\n\nprint(add)",
                              max_tokens=12, temperature=0)
    assert middle.response == want.choices[0].text


def test_a_middle_is_tokenized_once(client, served, monkeypatch):
    # /api/generate with a suffix builds the middle's prompt once and hands its ids (and the
    # tokens that end a middle) to the completion endpoint, which does not build it again
    built = []
    fill_in = Frontend.fill_in
    monkeypatch.setattr(Frontend, "fill_in",
                        lambda self, *args: built.append(args) or fill_in(self, *args))
    middle = client.generate(model=MODEL, prompt="def add(a, b):\n", suffix="\n\nprint(add)",
                             options={**PLAIN, "num_predict": 6})
    assert middle.done and len(built) == 1


def test_a_conversations_calls_and_results_read_as_openais(client, served):
    ollama_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    openai_messages = [
        ollama_messages[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1_0", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1_0"}]
    got = client.chat(model=MODEL, messages=ollama_messages, tools=TOOLS,
                      options={**PLAIN, "num_predict": 12})
    want = openai_client(served).chat.completions.create(
        model=MODEL, messages=openai_messages, tools=TOOLS, max_tokens=12, temperature=0)
    assert got.message.content == want.choices[0].message.content


def test_a_streamed_call_comes_back_whole_with_an_object():
    answer = OllamaAnswer("m", 0.0, chat=True)
    pieces = [{"index": 0, "id": "call_0", "function": {"name": "get_weather", "arguments": ""}},
              {"index": 0, "function": {"arguments": '{"city": "Pa'}},
              {"index": 0, "function": {"arguments": 'ris"}'}}]
    out = []
    for piece in pieces:
        out += answer.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [piece]}}]})
    out += answer.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    out += answer.chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}})
    calls, last = out
    assert calls["message"]["tool_calls"] == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert last["done"] and last["done_reason"] == "stop" and last["eval_count"] == 7


def test_format_and_logprobs(client):
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}
    answer = client.chat(model=MODEL, messages=QUESTION, format=schema,
                         options={"seed": 1, "num_predict": 48})
    jsonschema.validate(json.loads(answer.message.content), schema)
    scored = client.chat(model=MODEL, messages=QUESTION, logprobs=True, top_logprobs=2,
                         options={"seed": 1, "num_predict": 6})
    assert len(scored.logprobs) == scored.eval_count
    assert all(len(entry.top_logprobs) == 2 for entry in scored.logprobs)


def test_the_routes_clients_read_first(served, client):
    assert httpx.get(served.url + "/", timeout=10).text == "Ollama is running"
    assert httpx.get(served.url + "/api/version", timeout=10).json()["version"]
    names = [m.model for m in client.list().models]
    assert names[0] == f"{MODEL}:latest" and f"{MODEL}+suffix:latest" in names
    assert f"{MODEL}+lud:latest" not in names  # lossy methods need allow_lossy
    shown = client.show(MODEL)
    assert {"completion", "tools", "insert"} <= set(shown.capabilities)
    architecture = shown.modelinfo["general.architecture"]
    assert shown.modelinfo[f"{architecture}.context_length"] == CONTEXT
    [running] = client.ps().models
    assert running.context_length == CONTEXT
    loaded = client.chat(model=MODEL, messages=[])
    assert loaded.done and loaded.done_reason == "load"


@pytest.mark.parametrize("request_fields, says", [
    ({"options": {"typical_p": 0.5}}, "typical_p"),
    ({"options": {"mirostat": 2}}, "mirostat"),
    ({"options": {"num_predict": 0}}, "num_predict"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]}, "images"),
    ({"format": "yaml"}, "format"),
    ({"model": "other"}, "other"),
])
def test_bad_requests_are_errors_in_ollamas_form(served, request_fields, says):
    body = {"model": MODEL, "messages": QUESTION, "stream": False, **request_fields}
    answer = httpx.post(served.url + "/api/chat", json=body, timeout=10)
    assert answer.status_code in (400, 404) and says in answer.json()["error"]


def test_unknown_fields_and_nulls_are_read_as_ollama_reads_them(served, client):
    """Ignored, and the default (Go's JSON decoding): clients send both."""
    want = client.chat(model=MODEL, messages=QUESTION, options={"seed": 2, "num_predict": 8})
    body = {"model": MODEL, "messages": QUESTION, "stream": False, "no_such_field": 1,
            "options": {"seed": 2, "num_predict": 8, "mirostat": None, "top_k": None,
                        "system": "not an option"}}
    got = httpx.post(served.url + "/api/chat", json=body, timeout=30).json()
    assert got["message"]["content"] == want.message.content


def test_the_client_raises_the_servers_error(client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=MODEL, messages=QUESTION, options={"mirostat": 2})
    assert caught.value.status_code == 400 and "mirostat" in caught.value.error


def test_what_is_not_served_names_why(served):
    for path in ("/api/pull", "/api/embed", "/api/create"):
        answer = httpx.post(served.url + path, json={"model": MODEL}, timeout=10)
        assert answer.status_code == 501 and "this server" in answer.json()["error"]
    answer = httpx.post(served.url + "/api/generate", timeout=10,
                        json={"model": MODEL, "prompt": "x", "template": "{{ .Prompt }}"})
    assert answer.status_code == 400 and "template" in answer.json()["error"]
    for body, status in (({}, 400), ({"model": "other"}, 404)):
        answer = httpx.post(served.url + "/api/show", json=body, timeout=10)
        assert answer.status_code == status and "model" in answer.json()["error"]


# ---- the real Qwen2.5-Coder-0.5B -------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_served(qwen):
    """A server of the 0.5B, and a runner beside it for the library's answers."""
    from specdecode.api import eos_ids
    from specdecode.models.loading import make_runner
    from specdecode.server import BackgroundServer
    from specdecode.server.app import Server, Settings, create_app

    runner = make_runner(qwen)
    server = Server([runner.replica()], qwen.tokenizer, eos_ids(qwen, qwen.tokenizer),
                    Settings(model_id=MODEL, method="suffix"))
    with BackgroundServer(create_app(server)) as background:
        yield background, runner


@pytest.mark.slow
def test_the_real_model_under_ollamas_sampling_is_the_librarys(qwen, qwen_served):
    from specdecode.api import eos_ids

    served, runner = qwen_served
    client = ollama.Client(host=served.url, timeout=600)
    decoder = Decoder(runner.replica(), qwen.tokenizer, "ar", eos_ids(qwen, qwen.tokenizer))
    messages = [{"role": "user", "content": "Rename x to total and return the whole function:"
                                            "\n\ndef double(x):\n    return x + x\n"}]
    want = decoder.generate(messages, 48, seed=3, **OLLAMA_DEFAULTS).text
    for method in ("ar", "suffix"):
        got = client.chat(model=f"{MODEL}+{method}", messages=messages,
                          options={"seed": 3, "num_predict": 48})
        assert got.message.content == want, method
    middle = client.generate(model=MODEL, prompt="def double(x):\n", suffix="\n\nprint(double(2))",
                             options={**PLAIN, "num_predict": 24})
    fim = openai_client(served).completions.create(
        model=MODEL, prompt="def double(x):\n", suffix="\n\nprint(double(2))", max_tokens=24,
        temperature=0)
    assert middle.response == fim.choices[0].text and "return" in middle.response
