"""gpt-oss's answers in harmony's channels (server/harmony.py): the splitter on hand-written
texts (whole and split at every place), which templates answer in harmony, the turn ends that
stop a generation, and requests end to end through the real ``openai`` client on the tiny
model under a gpt-oss-style template (a grammar makes its random weights write harmony's
messages, their tags as the special tokens): ``reasoning_content`` and ``content`` whole and
streamed, the tags never in either. Its tool calls run in every test of
tests/test_server_tools.py (the "harmony" template)."""

from __future__ import annotations

import json

import httpx
import pytest

from specdecode.api import eos_ids, turn_ends
from specdecode.server.harmony import HarmonySplitter, harmony_of, split_harmony
from specdecode.server.protocol import Message
from specdecode.server.tool_parser import Arguments, CallStart, collect

from test_server_tools import HARMONY_SPECIAL, HARMONY_TEMPLATE, TOOL_TEMPLATE, tool_tokenizer
from tiny_server import EOS, MODEL, build_tokenizer, make_server, tiny_served_model

NOTE = "<|channel|>analysis<|message|>The user wants Paris.<|end|><|start|>assistant"
CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}')
ARGS = '{"city": "Paris"}'


def split(text: str, calls: bool = True) -> tuple:
    """(reasoning, content, [(name, arguments)]) of a whole answer."""
    reasoning, rest = split_harmony(text, calls)
    content, made = collect(rest)
    return reasoning, content, [(c.name, c.arguments) for c in made]


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (NOTE + "<|channel|>final<|message|>Sunny.", "The user wants Paris.", "Sunny.", []),
    (NOTE + CALL, "The user wants Paris.", None, [("get_weather", ARGS)]),
    # the recipient before the channel, as the template writes earlier calls
    (' to=functions.get_weather<|channel|>commentary json<|message|>' + ARGS, None, None,
     [("get_weather", ARGS)]),
    # a preamble (commentary without a recipient) is content; two notes are joined
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + CALL, None,
     "Checking.", [("get_weather", ARGS)]),
    (NOTE + NOTE + "<|channel|>final<|message|>Hi", "The user wants Paris.\nThe user wants "
     "Paris.", "Hi", []),
    # cut short: a body's text is kept, a header's dropped
    (NOTE + "<|channel|>fin", "The user wants Paris.", "", []),
    ("<|channel|>analysis<|message|>Let me", "Let me", "", []),
    # text that does not open as harmony: content as written
    ("Hello <|end|> there", None, "Hello <|end|> there", []),
    (NOTE.split("<|start|>")[0] + " <|st", "The user wants Paris.", "<|st", []),
    ("", None, "", []),
])
def test_split_whole_answers(text, reasoning, content, calls):
    assert split(text) == (reasoning, content, calls)


def test_a_call_is_content_where_the_tools_are_not_parsed():
    assert split(NOTE + CALL, calls=False) == ("The user wants Paris.", ARGS, [])


@pytest.mark.parametrize("text", [
    NOTE + "<|channel|>commentary<|message|>On it.<|end|><|start|>assistant" + CALL,
    NOTE + "<|channel|>final<|message|>It is <b>sunny</b>.",
    "Hi <|start|> there",
])
def test_any_split_gives_what_the_whole_answer_gives(text):
    expected = split(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            splitter = HarmonySplitter(calls=True)
            events = [e for part in (text[:i], text[i:j], text[j:]) for e in splitter.feed(part)]
            events += splitter.finish()
            reasoning = "".join(e[1] for e in events if isinstance(e, tuple)
                                and e[0] == "reasoning")
            content, made = collect([e if not isinstance(e, tuple) else e[1] for e in events
                                     if not (isinstance(e, tuple) and e[0] == "reasoning")])
            got = (reasoning if splitter.reasoned else None, content,
                   [(c.name, c.arguments) for c in made])
            assert got == expected, (i, j)


def test_a_call_streams_its_name_once_its_header_is_read():
    splitter = HarmonySplitter(calls=True)
    note, start, first = splitter.feed(NOTE + CALL[:-8])
    assert note == ("reasoning", "The user wants Paris.")
    assert isinstance(start, CallStart) and (start.index, start.name) == (0, "get_weather")
    assert start.id.startswith("call_") and first == Arguments(0, ARGS[:-8])
    assert splitter.feed(CALL[-8:]) == [Arguments(0, ARGS[-8:])]
    assert splitter.finish() == [] and splitter.made == 1


def test_a_harmony_template_with_its_tags_special_is_read_as_harmony():
    tokenizer = tool_tokenizer(HARMONY_TEMPLATE)
    harmony = harmony_of(tokenizer)
    assert [tag for tag, _ in harmony.tags] == list(HARMONY_SPECIAL[:5])
    assert all(tokenizer.convert_ids_to_tokens(i) == tag for tag, i in harmony.tags)
    # its tags as text, or another template: not harmony
    assert harmony_of(build_tokenizer(HARMONY_TEMPLATE)) is None
    assert harmony_of(tool_tokenizer(TOOL_TEMPLATE)) is None


def test_harmony_turn_ends_stop_a_generation():
    tokenizer = tool_tokenizer(HARMONY_TEMPLATE)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    assert turn_ends(tokenizer) == ends
    assert eos_ids(None, tokenizer) == [EOS] + ends
    # a tokenizer without them (whose unknown token is special) adds none
    assert turn_ends(build_tokenizer()) == [] and eos_ids(None, build_tokenizer()) == [EOS]


def test_an_assistant_message_sends_its_reasoning_to_the_template():
    message = Message(role="assistant", content=None, reasoning_content="Need the forecast.")
    shown = message.as_template_input()
    assert shown["thinking"] == shown["reasoning_content"] == "Need the forecast."
    assert "thinking" not in Message(role="assistant", content="Hi").as_template_input()


# ---- the served tiny model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return tool_tokenizer(HARMONY_TEMPLATE)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_served_model(tokenizer)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    with make_server(model, tokenizer) as background:
        yield background


def answer_grammar(tokenizer) -> str:
    """Lark: a note, then a final answer, each a few letters, the tags as their tokens."""
    ids = {tag: tokenizer.convert_tokens_to_ids(tag) for tag in HARMONY_SPECIAL}
    return (f'start: <[{ids["<|channel|>"]}]> "analysis" <[{ids["<|message|>"]}]> WORD '
            f'<[{ids["<|end|>"]}]> <[{ids["<|start|>"]}]> "assistant" <[{ids["<|channel|>"]}]> '
            f'"final" <[{ids["<|message|>"]}]> WORD\nWORD: /[a-z]{{2,6}}/')


def ask(client, tokenizer, stream: bool):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=48,
        stream=stream, extra_body={"specdecode": {"grammar": answer_grammar(tokenizer)}})


def test_the_channels_go_apart_whole_and_streamed(client, tokenizer):
    choice = ask(client, tokenizer, False).choices[0]
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning.isalpha() and choice.message.content.isalpha()
    assert choice.finish_reason == "stop"
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in ask(client, tokenizer, True):
        delta = chunk.choices[0].delta
        streamed["content"] += delta.content or ""
        streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": reasoning, "content": choice.message.content}


@pytest.mark.parametrize("end", ["<|return|>", "<|call|>"])
def test_a_turn_end_stops_the_answer(served, client, tokenizer, end):
    """The grammar lets the answer go on after the end; the server stops at it (a grammar's
    end, and without one, the scheduler's)."""
    scheduler = served.server.config.app.state.server.backend
    assert tokenizer.convert_tokens_to_ids(end) in scheduler.eos_token_ids
    grammar = (f"start: <[{tokenizer.convert_tokens_to_ids('<|channel|>')}]> \"final\" "
               f"<[{tokenizer.convert_tokens_to_ids('<|message|>')}]> WORD "
               f"<[{tokenizer.convert_tokens_to_ids(end)}]> WORD\nWORD: /[a-z]{{2,6}}/")
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=48,
        extra_body={"specdecode": {"grammar": grammar}}).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content.isalpha()


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "city", "schema": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}},
])
def test_a_json_response_format_is_the_final_message(client, tokenizer, response_format):
    """The JSON comes as the final channel's message (gpt-oss's own format), and it alone is
    the content."""
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=64,
        response_format=response_format,
        extra_body={"specdecode": {"return_token_ids": True}}).choices[0]
    assert choice.model_extra["token_ids"][0] == tokenizer.convert_tokens_to_ids("<|channel|>")
    value = json.loads(choice.message.content)
    assert isinstance(value, dict)
    if response_format["type"] == "json_schema":
        assert value["city"] in ("Paris", "Oslo")


def test_the_reasoning_effort_reaches_the_template(served, client, tokenizer):
    """OpenAI's ``reasoning_effort`` is the template's variable (gpt-oss's system message says
    it); the template's own arguments cannot be set through ``chat_template_kwargs``."""
    frontend = served.server.config.app.state.server
    messages = [{"role": "user", "content": "Hi."}]
    for effort, kwargs in (("medium", {}), ("high", {"reasoning_effort": "high"})):
        prompt = tokenizer.decode(frontend.encode(messages, True, None, kwargs))
        assert f"Reasoning: {effort}\n" in prompt
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    low = httpx.post(served.url + "/v1/chat/completions", json=body | {"reasoning_effort": "low"},
                     timeout=30)
    plain = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=30)
    assert low.status_code == plain.status_code == 200
    assert low.json()["usage"]["prompt_tokens"] != plain.json()["usage"]["prompt_tokens"]
    for bad, param in (({"reasoning_effort": "extreme"}, "reasoning_effort"),
                       ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                       ({"chat_template_kwargs": "x"}, "chat_template_kwargs")):
        refused = httpx.post(served.url + "/v1/chat/completions", json=body | bad, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_a_template_that_reads_a_missing_field_is_refused_naming_it():
    """gpt-oss's template writes each function's description (``"// " + description``), which
    OpenAI's requests may leave out: the error names the field to give."""
    from specdecode.api import encode_prompt
    from specdecode.errors import SpecDecodeError

    template = ("{% for t in tools %}{{ '// ' + t.function.description }}{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    with pytest.raises(SpecDecodeError, match="'description' that the request does not give"):
        encode_prompt(build_tokenizer(template), [{"role": "user", "content": "Hi."}], True, tools)
    tools[0]["function"]["description"] = "The time"
    assert encode_prompt(build_tokenizer(template), [{"role": "user", "content": "Hi."}], True,
                         tools)
