"""Anthropic's Messages API (server/anthropic.py) through the official ``anthropic`` client, on
the tiny model under a Hermes-style tool template: an answer is the chat endpoint's in
Anthropic's form (text, stop reasons, usage, the stop sequence), a named tool gives a
``tool_use`` block whose input matches its schema, a conversation with a tool's result reads
as OpenAI's, a stream's events add up to the whole message, token counts, and errors in
Anthropic's form."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from test_server_tools import TOOL_TEMPLATE, WEATHER, tool_tokenizer
from tiny_models import tiny_llama
from tiny_server import CONTEXT, MODEL, make_server, openai_client

TOOLS = [{"name": "get_weather", "description": "A forecast", "input_schema": WEATHER}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NAMED = {"type": "tool", "name": "get_weather"}
#: the SDK has no temperature (Anthropic's default is 1.0); older clients send it in the body
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def tokenizer():
    return tool_tokenizer(TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def served(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, max_positions=2 * CONTEXT,
                       seed=1)
    with make_server(model, tokenizer) as background:
        yield background


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0,
                               timeout=60)


def test_a_message_is_the_chat_endpoints_answer(served, claude):
    message = claude.messages.create(model=MODEL, messages=QUESTION, system="Be brief.",
                                     max_tokens=24, extra_body=GREEDY)
    chat = openai_client(served).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *QUESTION],
        max_tokens=24, temperature=0.0)
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.role == "assistant" and message.model == MODEL
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length"
                                   else "end_turn")
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert (message.usage.input_tokens + message.usage.cache_read_input_tokens
            == chat.usage.prompt_tokens)


def test_a_stop_sequence_is_named(served, claude):
    free = claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                  extra_body=GREEDY).content[0].text
    stop = free.strip()[3:5]
    message = claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                     extra_body=GREEDY, stop_sequences=["\x00", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text
    chat = openai_client(served).chat.completions.create(  # vLLM's stop_reason says it too
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0.0, stop=["\x00", stop])
    assert chat.choices[0].model_extra["stop_reason"] == stop


@pytest.mark.parametrize("method", ["ar", "suffix"])
def test_a_named_tool_gives_a_tool_use_block(claude, method):
    message = claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=128,
                                     tools=TOOLS, tool_choice=NAMED,
                                     extra_body={"specdecode": {"method": method}})
    assert message.stop_reason == "tool_use"
    [call] = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)


def test_a_tool_result_goes_back_as_the_chat_endpoints_tool_message(served, claude):
    first = claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=128,
                                   tools=TOOLS, tool_choice=NAMED)
    [call] = [b for b in first.content if b.type == "tool_use"]
    conversation = [*QUESTION, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"},
                        {"type": "text", "text": "Thanks."}]}]
    answer = claude.messages.create(model=MODEL, messages=conversation, max_tokens=16,
                                    tools=TOOLS, extra_body=GREEDY)
    openai_tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "A forecast", "parameters": WEATHER}}]
    chat = openai_client(served).chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0.0, tools=openai_tools, messages=[
            *QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": call.id, "type": "function", "function": {
                    "name": "get_weather",
                    "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
            {"role": "user", "content": "Thanks."}])
    texts = [b.text for b in answer.content if b.type == "text"]
    assert "".join(texts) == (chat.choices[0].message.content or "")
    count = claude.messages.count_tokens(model=MODEL, messages=conversation, tools=TOOLS)
    assert count.input_tokens == chat.usage.prompt_tokens


def test_a_stream_adds_up_to_the_whole_message(claude):
    asked = dict(model=MODEL, messages=QUESTION, max_tokens=128, tools=TOOLS,
                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                 extra_body=GREEDY)
    whole = claude.messages.create(**asked)
    with claude.messages.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    def blocks(message):  # each call's id is new
        return [b.model_dump(exclude={"id"}) for b in message.content]

    assert blocks(streamed) == blocks(whole) and streamed.content[0].id.startswith("call_")
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_claude_codes_fields_are_taken(claude):
    """What Claude Code sends beside the messages: max_tokens far past the context (a cap),
    adaptive thinking, effort, context management, metadata, a system message among them."""
    message = claude.messages.create(
        model=MODEL, max_tokens=32000, thinking={"type": "adaptive"},
        output_config={"effort": "high"}, metadata={"user_id": "someone"},
        messages=[*QUESTION, {"role": "system", "content": "Be brief."}],
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                      "keep": "all"}]}, **GREEDY})
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens + message.usage.output_tokens <= 2 * CONTEXT


def test_errors_are_anthropics(served, claude):
    with pytest.raises(anthropic.BadRequestError) as server_tool:
        claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=8,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "server tool" in server_tool.value.message
    body = httpx.post(served.url + "/v1/messages", timeout=30, json={
        "model": MODEL, "messages": QUESTION}).json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": "AA=="}}
    result = {"type": "tool_result", "content": "Sunny"}  # no tool_use_id
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        claude.messages.create(model=MODEL, max_tokens=8,
                               messages=[{"role": "user", "content": [result]}])
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=MODEL, max_tokens=8,
                               messages=[{"role": "user", "content": [image]}])
