"""OpenAI's Responses API (server/responses.py) through the official ``openai`` client, on the
tiny model under a Hermes-style tool template: a response is the chat endpoint's answer as
output items (text, usage, an incomplete status), a named function gives a ``function_call``
item whose arguments match its schema, a conversation with the call's output reads as the chat
endpoint's, a stream's events add up to the whole response, and 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from test_server_tools import TOOL_TEMPLATE, WEATHER, tool_tokenizer
from tiny_models import tiny_llama
from tiny_server import CONTEXT, MODEL, make_server, openai_client

TOOLS = [{"type": "function", "name": "get_weather", "description": "A forecast",
          "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                 "description": "A forecast",
                                                 "parameters": WEATHER}}]
QUESTION = "What is the weather in Paris for the next 3 days?"
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client():
    tokenizer = tool_tokenizer(TOOL_TEMPLATE)
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, max_positions=2 * CONTEXT,
                       seed=1)
    with make_server(model, tokenizer) as background:
        yield openai_client(background)


def test_a_response_is_the_chat_endpoints_answer(client):
    response = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                       max_output_tokens=24, temperature=0.0)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0.0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": QUESTION}])
    assert response.output_text == chat.choices[0].message.content
    [item] = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                               else "completed")
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("method", ["ar", "suffix"])
def test_a_named_function_gives_a_function_call_item(client, method):
    response = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS,
                                       tool_choice=NAMED, max_output_tokens=128,
                                       extra_body={"specdecode": {"method": method}})
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def chat_after_call(client, call):
    """The chat endpoint's answer after the question, ``call`` and its output "Sunny"."""
    return client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0.0, tools=CHAT_TOOLS, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}])


def test_a_calls_output_goes_back_as_the_chat_endpoints_tool_message(client):
    first = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS,
                                    tool_choice=NAMED, max_output_tokens=128)
    [call] = [item for item in first.output if item.type == "function_call"]
    items = [{"role": "user", "content": QUESTION},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    answer = client.responses.create(model=MODEL, input=items, tools=TOOLS,
                                     max_output_tokens=16, temperature=0.0)
    chat = chat_after_call(client, call)
    assert answer.output_text == (chat.choices[0].message.content or "")
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stream_adds_up_to_the_whole_response(client):
    asked = dict(model=MODEL, input=QUESTION, tools=TOOLS, max_output_tokens=128,
                 tool_choice="required", parallel_tool_calls=False, temperature=0.0)
    whole = client.responses.create(**asked)
    with client.responses.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"

    def items(response):  # each item's and call's id is new
        return [item.model_dump(include={"type", "name", "arguments", "status", "content"})
                for item in response.output]

    assert items(streamed) == items(whole) and streamed.usage == whole.usage


def test_text_in_pieces_streams_as_output_text_deltas(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24,
                                    temperature=0.0)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24,
                                          temperature=0.0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1]  # cut at max_output_tokens: response.incomplete, as OpenAI's
    assert final.type == f"response.{whole.status}" and final.response.status == whole.status
    assert "".join(deltas) == whole.output_text == final.response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_codexs_tools_a_namespace_and_a_hosted_search(client):
    """Codex sends functions, a namespace of them, and a web search its own client cannot
    run: the search is left out, and a namespaced function's call names its namespace."""
    tools = [{"type": "web_search", "external_web_access": False},
             {"type": "namespace", "name": "weather_v1", "description": "Forecasts",
              "tools": TOOLS}]
    response = client.responses.create(
        model=MODEL, input=QUESTION, tools=tools, tool_choice=NAMED, max_output_tokens=128,
        store=False, include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
        prompt_cache_key="thread", extra_body={"client_metadata": {"thread_id": "t"}})
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.namespace == "weather_v1"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    plain = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                    max_output_tokens=128)
    assert response.usage.input_tokens == plain.usage.input_tokens  # the search: not shown


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"input": [{"type": "function_call", "name": "get_weather", "arguments": "{}"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": "get_weather"}]}, "tools"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools"),
    ({"tools": [*TOOLS, {"type": "namespace", "name": "n", "tools": TOOLS}]}, "tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
])
def test_what_is_not_served_is_a_400(client, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**{"model": MODEL, "input": QUESTION, **fields})
    assert error.value.body["param"] == param


def test_a_stored_response_is_continued_retrieved_and_deleted(client):
    first = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                    max_output_tokens=12, temperature=0.0)
    assert first.store
    then = client.responses.create(model=MODEL, input="And tomorrow?", max_output_tokens=12,
                                   previous_response_id=first.id, temperature=0.0)
    # the stored conversation, then the new input; the first request's instructions stay
    # behind, as OpenAI has it
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0.0,
        messages=[{"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "And tomorrow?"}])
    assert then.output_text == chat.choices[0].message.content
    assert then.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unkept = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4,
                                     store=False)
    assert not unkept.store
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=unkept.id)


def test_the_server_keeps_the_last_responses_kept():
    # --responses-kept 1: the second response drops the first, whose continuation is a 404
    # naming the bound
    tokenizer = tool_tokenizer(TOOL_TEMPLATE)
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, max_positions=2 * CONTEXT,
                       seed=1)
    with make_server(model, tokenizer, responses_kept=1) as background:
        client = openai_client(background)
        first, second = (client.responses.create(model=MODEL, input=text, max_output_tokens=4)
                         for text in (QUESTION, "And tomorrow?"))
        assert client.responses.retrieve(second.id).output_text == second.output_text
        with pytest.raises(openai.NotFoundError, match="keeps the last 1 responses"):
            client.responses.create(model=MODEL, input="x", previous_response_id=first.id)


def test_a_streamed_call_is_stored_for_its_output(client):
    with client.responses.stream(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                 max_output_tokens=128) as stream:
        first = stream.get_final_response()
    [call] = [item for item in first.output if item.type == "function_call"]
    then = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=16,
        temperature=0.0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                 "output": "Sunny"}])
    chat = chat_after_call(client, call)
    assert then.output_text == (chat.choices[0].message.content or "")
    assert then.usage.input_tokens == chat.usage.prompt_tokens
