"""Tool calls in the server: the parser of both call formats (Hermes' ``<tool_call>`` blocks,
Llama 3's bare JSON) on hand-written texts (whole and split at every place), the format read
off a template, the request checks (400s naming the field), and requests end to end through
the real ``openai`` client: the tiny model under a tool-capable template of each format (a
named function or ``required`` is a grammar, so even random weights give a call that parses),
and the real Qwen2.5-Coder-0.5B, whose own template handles tools (greedy answers identical
between methods, streamed as returned whole)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import httpx
import jsonschema
import pytest

from specdecode.server.tool_parser import (Arguments, CallStart, StreamDeltas, ToolCall,
                                           ToolCallParser, collect, parse_tool_calls)
from specdecode.server.tools import (GRANITE_ARRAY, HARMONY, HERMES, LLAMA_JSON, MISTRAL_ARGS,
                                     MISTRAL_ARRAY, QWEN_XML, ToolError, ToolRequest,
                                     check_template, xml_value)

from tiny_models import tiny_llama
from tiny_server import (CONTEXT, MODEL, build_tokenizer, make_server, openai_client,
                         tiny_served_model)

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


# ---- the parser ------------------------------------------------------------------------------

def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict | str]]:
    """Each call's name and arguments: the object they spell, or their text if they spell none
    (a call cut by max_tokens)."""
    def value(arguments: str) -> dict | str:
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return [(c.name, value(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    (CALL, None, [("get_weather", {"city": "Paris", "days": 3})]),
    (CALL + "\n" + SECOND, None, [("get_weather", {"city": "Paris", "days": 3}),
                                   ("get_time", {})]),
    # text before a call is the content; the whitespace between them goes
    ("Let me look that up.\n\n" + CALL, "Let me look that up.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    # text after a call stays, with its own leading whitespace
    (CALL + "\nDone.", "\nDone.", [("get_weather", {"city": "Paris", "days": 3})]),
    # arguments written as JSON text are read as the object they spell
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", {"a": 1})]),
    # no call: the text exactly, whitespace and all
    ("  Just text.\n", "  Just text.\n", []),
    ("", "", []),
    # malformed blocks stay content, markup and all, and the whitespace before them too
    ("Try:\n<tool_call>\n{name: get_weather}\n</tool_call>",
     "Try:\n<tool_call>\n{name: get_weather}\n</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    # a block cut before its call's header is complete (max_tokens) is text as written
    ("x " + CALL[:40], "x " + CALL[:40], []),
    # cut after it, a call with the arguments written so far, as OpenAI's are
    ("x " + CALL[:60], "x", [("get_weather", '{"city": "P')]),
    # the arguments end where their object closes: braces and the closing tag inside their
    # strings are theirs; what follows them in the block is not
    ('<tool_call>{"name":"w","arguments":{"t": "} </tool_call> {\\"", "n": [{}]}, "x": 1}'
     '</tool_call>ok', "ok", [("w", {"t": '} </tool_call> {"', "n": [{}]})]),
    # a closing tag before the arguments close ends the call with what was written
    ('<tool_call>{"name": "w", "arguments": {"a": 1\n</tool_call>', None, [("w", '{"a": 1\n')]),
    # a header with other whitespace, or another order of the fields, is a call too
    ('<tool_call> {\n "name" :"w",\n "arguments":{}}</tool_call>', None, [("w", {})]),
    ('<tool_call>{"arguments": {"a": 1}, "name": "w"}</tool_call>', None, [("w", {"a": 1})]),
    # what only looks like a tag's start is not lost
    ("a < b and <tool", "a < b and <tool", []),
    ("<tool_calls> are fun", "<tool_calls> are fun", []),
    ("</tool_call> alone", "</tool_call> alone", []),
])
def test_parse_whole_texts(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)


BARE = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'


@pytest.mark.parametrize("text, content, calls", [
    (BARE, None, [("get_weather", {"city": "Paris", "days": 3})]),
    # whitespace before the call goes; text after it stays, with its own leading whitespace
    ("\n " + BARE + "\nDone.", "\nDone.", [("get_weather", {"city": "Paris", "days": 3})]),
    # what follows the arguments in the call's object is dropped, strings and nesting followed
    ('{"name": "w", "parameters": {"t": "}\\""}, "x": {"y": "}"}} ok', " ok",
     [("w", {"t": '}"'})]),
    # only the answer's first text can be a call: one after other text is content
    ("Sure: " + BARE, "Sure: " + BARE, []),
    # other JSON, or a call's fields in another order, is content as written
    ('  {"answer": 42}', '  {"answer": 42}', []),
    ('{"parameters": {}, "name": "w"}', '{"parameters": {}, "name": "w"}', []),
    ("", "", []),
    # cut before the header is complete: content as written; after it, the arguments so far
    (BARE[:20], BARE[:20], []),
    (BARE[:49], None, [("get_weather", '{"city": "P')]),
])
def test_parse_whole_bare_json_texts(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, LLAMA_JSON)
    assert got_content == content
    assert calls_of(got_calls) == calls
    # the same text in the Hermes format is all content
    assert parse_tool_calls(text, HERMES) == (text, [])


def xml_call(name: str, **arguments: str) -> str:
    """A call in Qwen3-Coder's XML, each argument's text as given."""
    return (f"<tool_call>\n<function={name}>\n"
            + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
            + "</function>\n</tool_call>")


XML_CALL = xml_call("get_weather", city="Paris", days="3")
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("text, content, calls", [
    (XML_CALL, None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("Checking.\n" + XML_CALL + "\n" + xml_call("get_time"), "Checking.",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    # a string's value is its text as written, "<" and newlines included; a value that does not
    # read as its type stays a string; a parameter the schema does not declare is a string
    (xml_call("get_weather", city="a < b\n</x>", days="three", extra="[1]"), None,
     [("get_weather", {"city": "a < b\n</x>", "days": "three", "extra": "[1]"})]),
    # a JSON body inside the block is read as Hermes' is, streamed as written
    (CALL, None, [("get_weather", {"city": "Paris", "days": 3})]),
    (CALL[:60], None, [("get_weather", '{"city": "P')]),
    # a function tag that is not a name: the block as written
    ("<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
     "<tool_call>\n<function=get weather>\n</function>\n</tool_call>", []),
    # cut by max_tokens: before the function's tag is whole, the text as written; after it,
    # the call with the parameters read so far
    (XML_CALL[:30], XML_CALL[:30], []),
    (XML_CALL[:40], None, [("get_weather", "")]),
    (XML_CALL[:75], None, [("get_weather", '{"city": "Paris"')]),
    # a stray tag ends the arguments; the block's end closes the call
    ("<tool_call><function=get_time>\n<oops/>\n</tool_call>ok", "ok", [("get_time", {})]),
])
def test_parse_whole_xml_texts(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, QWEN_XML, SCHEMAS)
    assert got_content == content
    assert calls_of(got_calls) == calls


MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
NAMED_CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("text, content, calls", [
    (MISTRAL, None, [("get_weather", {"city": "Paris", "days": 3})]),
    # several in one array, an id the model wrote dropped, spaces where a decode puts them
    ('Checking. [TOOL_CALLS] [{"name": "get_time", "arguments": {}, "id": "a1b2c3d4e"}, '
     '{"name": "w", "arguments": {"t": "]}"}}]', "Checking.", [("get_time", {}), ("w", {"t": "]}"})]),
    # an element that opens otherwise is read once the array closes: calls if all are
    ('[TOOL_CALLS][{"arguments": {"a": 1}, "name": "w"}, {"name": "v", "arguments": "{}"}]', None,
     [("w", {"a": 1}), ("v", {})]),
    ('[TOOL_CALLS][{"oops": 1}]', '[TOOL_CALLS][{"oops": 1}]', []),
    # the tag without an array after it, or an array cut before a call's header, is content
    ("[TOOL_CALLS] none", "[TOOL_CALLS] none", []),
    (MISTRAL[:20], MISTRAL[:20], []),
    # cut after the header: the call with the arguments written so far
    (MISTRAL[:61], None, [("get_weather", '{"city": "P')]),
])
def test_parse_whole_mistral_array_texts(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, MISTRAL_ARRAY)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)  # as its templates demand
    assert parse_tool_calls(text, HERMES) == (text, [])


@pytest.mark.parametrize("text, content, calls", [
    (NAMED_CALL, None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("Sure.\n" + NAMED_CALL + '[TOOL_CALLS] get_time [CALL_ID]a1b2c3d4e[ARGS] {}', "Sure.",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    # text after the arguments' object stays
    ('[TOOL_CALLS]w[ARGS]{"t": "}"} done', " done", [("w", {"t": "}"})]),
    # no name, a name that is not one, or no object after [ARGS]: content as written
    ("[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS][ARGS]{}", []),
    ("[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get weather[ARGS]{}", []),
    ("[TOOL_CALLS]w[ARGS]none", "[TOOL_CALLS]w[ARGS]none", []),
    (NAMED_CALL[:20], NAMED_CALL[:20], []),
    (NAMED_CALL[:35], None, [("get_weather", '{"city')]),
])
def test_parse_whole_mistral_args_texts(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, MISTRAL_ARGS)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)


@pytest.mark.parametrize("text, schema, value", [
    ("3", {"type": "integer"}, 3), ("3.5", {"type": "integer"}, "3.5"),
    ("2.5", {"type": "number"}, 2.5), ("True", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}), ("[1, 2]", {"type": "array"}, [1, 2]),
    ("[1, 2]", {"type": "string"}, "[1, 2]"), ("7", {"type": ["null", "integer"]}, 7),
    ("true", {"type": "integer"}, "true"), ("42", None, "42"),
])
def test_an_xml_value_is_read_by_its_schema_type(text, schema, value):
    assert xml_value(text, schema) == value


def parse_in_pieces(pieces: list[str], fmt=HERMES) -> tuple[str, list[tuple[str, dict | str]]]:
    parser = ToolCallParser(fmt, SCHEMAS)
    content, calls = collect([e for p in pieces for e in parser.feed(p)] + parser.finish())
    return content or "", calls_of(calls)


@pytest.mark.parametrize("text", [
    "Sure.\n" + CALL + "\n" + SECOND + "\n",
    "a <tool_call>{oops}</tool_call> <tool b",
    "One " + CALL + " two " + CALL[:50],
    '<tool_call>{"name": "w", "arguments": {"t": "}</tool_call>\\"", "u": [1, {"v": 2}]}} x'
    '</tool_call> <tool_call>{"name": "w", "arguments": {"a": 1\n</tool_call>end',
])
def test_any_split_gives_what_the_whole_text_gives(text):
    check_any_split(text, HERMES)


@pytest.mark.parametrize("text", [
    "\n" + BARE + " and then",
    '{"name": "w", "parameters": {"t": "}\\"", "u": [1, {"v": 2}]}, "x": [{}]} end',
    '{"name": "w", "param',
    ' {"nam: 1}',
])
def test_any_split_of_a_bare_call_gives_what_the_whole_text_gives(text):
    check_any_split(text, LLAMA_JSON)


@pytest.mark.parametrize("text", [
    "So:\n" + XML_CALL + " " + xml_call("get_time") + " <tool",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nx</parameter>\n<par",
    "<tool_call>\n<funct " + CALL,
])
def test_any_split_of_an_xml_call_gives_what_the_whole_text_gives(text):
    check_any_split(text, QWEN_XML)


@pytest.mark.parametrize("text, fmt", [
    ("So " + MISTRAL + " ", "MISTRAL_ARRAY"),
    ('[TOOL_CALLS] [{"arguments": {}, "name": "w"}, {"name": "v", "arguments": {"a": [1]}}] ok',
     "MISTRAL_ARRAY"),
    ("[TOOL_CALLS] [x] [TOOL_CALLS][{\"name", "MISTRAL_ARRAY"),
    (NAMED_CALL + "[TOOL_CALLS]v[CALL_ID]abc[ARGS]{\"a\": \"}\"} [TOOL_CALLS]x[AR", "MISTRAL_ARGS"),
    ("[TOOL_CALLS]w[CALL_", "MISTRAL_ARGS"),
])
def test_any_split_of_a_mistral_call_gives_what_the_whole_text_gives(text, fmt):
    check_any_split(text, {"MISTRAL_ARRAY": MISTRAL_ARRAY, "MISTRAL_ARGS": MISTRAL_ARGS}[fmt])


def check_any_split(text: str, fmt) -> None:
    content, calls = parse_tool_calls(text, fmt, SCHEMAS)
    expected = (content or "", calls_of(calls))
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):  # two cuts: every first cut, a spread of second
            assert parse_in_pieces([text[:i], text[i:j], text[j:]], fmt) == expected, (i, j)
    assert parse_in_pieces(list(text), fmt) == expected  # one character at a time


def test_markup_never_streams_as_content_and_partial_tags_wait():
    parser = ToolCallParser()
    assert parser.feed("Checking <tool") == ["Checking"]  # the space may precede a call
    assert parser.feed("_call>\n{\"name\": ") == []
    events = parser.feed('"get_time", "arguments": {}}\n</tool_call>')
    assert [type(e) for e in events] == [CallStart, Arguments] and parser.calls == 1
    assert parser.feed("\n") == [] and parser.finish() == []  # trailing space after a call


def test_a_call_streams_its_name_at_once_and_its_arguments_as_written():
    parser = ToolCallParser()
    assert parser.feed('<tool_call>\n{"name": "get_weather", "arguments": ') == []
    start, first = parser.feed('{"ci')
    assert isinstance(start, CallStart) and (start.index, start.name) == (0, "get_weather")
    assert first == Arguments(0, '{"ci')
    assert parser.feed('ty": "Paris"') == [Arguments(0, 'ty": "Paris"')]
    assert parser.feed(', "days": 3}<') == [Arguments(0, ', "days": 3}')]  # the object closed
    assert parser.feed("/tool_call") == [] and parser.feed(">\n") == []
    # inside the arguments a "<" that may begin the closing tag waits for the next piece
    parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1')
    assert parser.feed("</tool_") == []
    assert parser.feed("x") == [Arguments(1, "</tool_x")]


def test_a_bare_call_streams_its_name_once_its_header_is_read():
    parser = ToolCallParser(LLAMA_JSON)
    assert parser.feed("\n") == [] and parser.feed('{"name": "get_weather", "param') == []
    start, first = parser.feed('eters": {"ci')
    assert isinstance(start, CallStart) and start.name == "get_weather"
    assert first == Arguments(0, '{"ci')
    assert parser.feed('ty": "Oslo"}') == [Arguments(0, 'ty": "Oslo"}')]
    assert parser.feed("}") == [] and parser.finish() == []
    # an answer that is not a call streams as it comes
    text = ToolCallParser(LLAMA_JSON)
    assert text.feed("  The") == ["  The"] and text.feed(' {"name": 1}') == [' {"name": 1}']


def test_stream_deltas_are_openai_shaped():
    deltas = StreamDeltas(1, HERMES)
    out = []
    for piece in ("Hi.", "\n<tool_", "call>\n" + CALL[12:], "\n" + SECOND):
        out += deltas.text(0, piece)
    last, finish = deltas.finish(0, "stop")
    out += last
    assert finish == "tool_calls"
    assert out[0] == {"content": "Hi."}
    head, args = out[1]["tool_calls"][0], out[2]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert args == {"index": 0, "function": {"arguments": '{"city": "Paris", "days": 3}'}}
    assert out[3]["tool_calls"][0]["index"] == 1 and len(out) == 5
    plain = StreamDeltas(1, None)
    assert plain.text(0, CALL) == [{"content": CALL}] and plain.finish(0, "stop") == ([], "stop")


# ---- the request -----------------------------------------------------------------------------

def test_a_named_or_required_choice_is_a_grammar_over_the_offered_functions():
    named = ToolRequest.of(TOOLS, NAMED)
    assert named.choice == "function" and named.offered == TOOLS
    assert "get_weather" in named.grammar() and "get_time" not in named.grammar()
    assert "(" not in named.grammar().splitlines()[0]  # exactly one call
    required = ToolRequest.of(TOOLS, "required")
    assert "get_time" in required.grammar() and '("\\n" call)*' in required.grammar()
    assert "*" not in ToolRequest.of(TOOLS, "required", False).grammar().splitlines()[0]
    assert ToolRequest.of(TOOLS).grammar() is None  # auto: the model is free
    none = ToolRequest.of(TOOLS, "none")
    assert none.offered is None and not none.parses


def test_a_bare_json_format_calls_once_in_its_own_fields():
    named = ToolRequest.of(TOOLS, NAMED, None)
    llama = dataclasses.replace(named, format=LLAMA_JSON)
    assert grammar_takes(llama.grammar(), BARE, ending=True)
    assert not grammar_takes(llama.grammar(), "Sure: ")  # a named call: nothing else
    assert not grammar_takes(llama.grammar(), CALL)  # not the Hermes block
    assert grammar_takes(named.grammar(), CALL, ending=True)
    # "required": one call, whatever parallel_tool_calls says (the format holds one)
    required = dataclasses.replace(ToolRequest.of(TOOLS, "required"), format=LLAMA_JSON)
    assert not grammar_takes(required.grammar(), BARE + "\n{")
    assert grammar_takes(required.grammar(), '{"name": "get_time", "parameters": {}}',
                         ending=True)
    # a strict function under auto: an answer whose first text is "{" is a call, else free
    strict = dataclasses.replace(ToolRequest.of(STRICT, "auto"), format=LLAMA_JSON)
    for free in ("It is sunny {or not}.", " \n", ""):
        assert grammar_takes(strict.grammar(), free, ending=True)
    assert grammar_takes(strict.grammar(), "\n" + BARE, ending=True)
    assert not grammar_takes(strict.grammar(), BARE.replace("Paris", "Lima"))  # not in its enum
    assert not grammar_takes(strict.grammar(), ' {"answer": ')


def test_an_xml_format_holds_each_parameter_to_its_schema():
    named = dataclasses.replace(ToolRequest.of(TOOLS, NAMED), format=QWEN_XML)
    assert grammar_takes(named.grammar(), XML_CALL, ending=True)
    assert not grammar_takes(named.grammar(), xml_call("get_weather", city="Lima"))  # enum
    assert not grammar_takes(named.grammar(), xml_call("get_weather", city="Oslo", days="9"))
    assert not grammar_takes(named.grammar(),  # "days" is required
                             xml_call("get_weather", city="Oslo"), ending=True)
    flag = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}}
    flagged = dataclasses.replace(ToolRequest.of([flag], "required"), format=QWEN_XML).grammar()
    assert grammar_takes(flagged, xml_call("f", on="True"), ending=True)  # as templates write
    assert not grammar_takes(flagged, xml_call("f", on="yes"))
    # a key or an enum member with quotes and backslashes is spelt as it is
    key = 'a "b\\ c'
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {key: {"enum": ['x"y', "z"]}}, "required": [key]}}}
    odd = dataclasses.replace(ToolRequest.of([odd], "required"), format=QWEN_XML).grammar()
    assert grammar_takes(odd, xml_call("f", **{key: 'x"y'}), ending=True)
    assert not grammar_takes(odd, xml_call("f", **{key: "xy"}))
    required = dataclasses.replace(ToolRequest.of(TOOLS, "required"), format=QWEN_XML)
    assert grammar_takes(required.grammar(), XML_CALL + "\n" + xml_call("get_time"), ending=True)
    # a strict function under auto: free text; a call once its tag is written, a string
    # parameter's value any text up to its closing tag
    note = {"type": "function", "function": {"name": "note", "strict": True, "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    strict = dataclasses.replace(ToolRequest.of([note, *TOOLS[1:]], "auto"), format=QWEN_XML)
    assert grammar_takes(strict.grammar(), "Fine < ok.", ending=True)
    assert grammar_takes(strict.grammar(), "A note: " + xml_call("note", text="if a < b:\n  x")
                         + " and " + xml_call("get_time", tz="UTC"), ending=True)
    assert not grammar_takes(strict.grammar(), xml_call("note", body="x"))  # not its parameter


@pytest.mark.parametrize("name", ["Mistral array", "Mistral [ARGS]"])
def test_a_mistral_format_writes_its_tags_as_their_special_tokens(name):
    """Mistral's grammars spell [TOOL_CALLS] (and [ARGS]) as the special tokens the model was
    trained to write, not as their text in ordinary pieces."""
    tokenizer = tool_tokenizer(TEMPLATES[name])
    fmt = check_template(tokenizer)
    call = MISTRAL if fmt.array else NAMED_CALL
    request = dataclasses.replace(ToolRequest.of(TOOLS, NAMED), format=fmt)
    assert grammar_takes(request.grammar(), call, ending=True, tokenizer=tokenizer)
    spelt = tool_vocabulary(tokenizer).ll.tokenize_str(call)  # the tags in ordinary pieces
    assert not set(spelt) & set(fmt.kept_tokens)
    assert not grammar_takes(request.grammar(), spelt, tokenizer=tokenizer)
    assert not grammar_takes(request.grammar(), call.replace("Paris", "Lima"),
                             tokenizer=tokenizer)  # not in the schema's enum
    two = (MISTRAL[:-1] + ', {"name": "get_time", "arguments": {}}]' if fmt.array
           else NAMED_CALL + "[TOOL_CALLS]get_time[ARGS]{}")
    required = dataclasses.replace(ToolRequest.of(TOOLS, "required"), format=fmt)
    assert grammar_takes(required.grammar(), two, ending=True, tokenizer=tokenizer)
    assert not grammar_takes(request.grammar(), two, ending=True, tokenizer=tokenizer)
    # a strict function under auto: free text, then calls held to their schemas
    strict = dataclasses.replace(ToolRequest.of(STRICT, "auto"), format=fmt)
    assert grammar_takes(strict.grammar(), "Sure [x]. " + call, ending=True, tokenizer=tokenizer)
    assert grammar_takes(strict.grammar(), "Just text.", ending=True, tokenizer=tokenizer)
    assert not grammar_takes(strict.grammar(), "So " + call.replace("Paris", "Lima"),
                             tokenizer=tokenizer)


HARMONY_CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris", "days": 3}')


def test_a_harmony_call_is_a_message_its_tags_special_tokens():
    """gpt-oss's grammars: a named or required call is the answer's one message, to
    functions.NAME, its tags the special tokens; strict functions under auto: notes, then a
    final answer or a call held to its schema."""
    tokenizer = tool_tokenizer(HARMONY_TEMPLATE)
    fmt = check_template(tokenizer)
    request = dataclasses.replace(ToolRequest.of(TOOLS, NAMED), format=fmt)
    assert grammar_takes(request.grammar(), HARMONY_CALL, ending=True, tokenizer=tokenizer)
    spelt = tool_vocabulary(tokenizer).ll.tokenize_str(HARMONY_CALL)  # tags in ordinary pieces
    assert not set(spelt) & set(fmt.kept_tokens)
    assert not grammar_takes(request.grammar(), spelt, tokenizer=tokenizer)
    assert not grammar_takes(request.grammar(), HARMONY_CALL.replace("Paris", "Lima"),
                             tokenizer=tokenizer)  # not in the schema's enum
    time_call = HARMONY_CALL.replace("get_weather", "get_time").split("<|message|>")[0]
    required = dataclasses.replace(ToolRequest.of(TOOLS, "required"), format=fmt)
    assert grammar_takes(required.grammar(), time_call + "<|message|>{}", ending=True,
                         tokenizer=tokenizer)
    assert not grammar_takes(request.grammar(), time_call, tokenizer=tokenizer)
    note = "<|channel|>analysis<|message|>Paris, 3 days.<|end|><|start|>assistant"
    assert not grammar_takes(request.grammar(), note, tokenizer=tokenizer)  # the call first
    strict = dataclasses.replace(ToolRequest.of(STRICT, "auto"), format=fmt)
    for answer in (note + HARMONY_CALL, note + "<|channel|>final<|message|>Sunny [x].",
                   note.replace("analysis", "commentary") + time_call + "<|message|>{\"a\": 1}"):
        assert grammar_takes(strict.grammar(), answer, ending=True, tokenizer=tokenizer)
    assert not grammar_takes(strict.grammar(), note + HARMONY_CALL.replace("Paris", "Lima"),
                             tokenizer=tokenizer)


STRICT = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                            "strict": True}},
          {"type": "function", "function": {"name": "get_time"}}]


@functools.cache
def tool_vocabulary(tokenizer=None):
    from specdecode.constraints import Vocabulary

    tokenizer = tokenizer or tool_tokenizer()
    return Vocabulary(tokenizer, len(tokenizer), [2])


def grammar_takes(grammar: str, text: str | list[int], ending: bool = False,
                  tokenizer=None) -> bool:
    """Does the grammar allow ``text`` as (the start of, or with ``ending`` all of) an
    output? Tokens spelt by longest match over the tiny tokenizer's pieces (``tokenizer``: one
    with special tokens, whose tags in the text are those tokens); or the token ids given."""
    import llguidance

    vocabulary = tool_vocabulary(tokenizer)
    matcher = llguidance.LLMatcher(vocabulary.ll, grammar, log_level=0)
    if isinstance(text, list):
        ids = text
    else:
        tags = MISTRAL_SPECIAL + HARMONY_SPECIAL + ("<|tool_call|>",)
        special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()
                   if t.content in tags} if tokenizer is not None else {}
        parts = re.split("(" + "|".join(map(re.escape, special)) + ")", text) if special else [text]
        ids = [i for part in parts for i in ([special[part]] if part in special
                                             else vocabulary.ll.tokenize_str(part))]
    if matcher.try_consume_tokens(ids) != len(ids):
        return False
    return matcher.is_accepting() if ending else True


def test_a_strict_function_under_auto_holds_the_calls_and_leaves_the_text_free():
    grammar = ToolRequest.of(STRICT, "auto").grammar()
    head = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert grammar_takes(grammar, "Any text < at all {\n", ending=True)  # text, then the end
    assert grammar_takes(grammar, "Sure. " + head + '{"city": "Oslo", "days": 2}}\n</tool_call>'
                         " Done.", ending=True)
    assert not grammar_takes(grammar, head + '{"city": "Lima"')  # not in the schema's enum
    assert not grammar_takes(grammar, head + '{"city": "Oslo"}}')  # "days" is required
    assert not grammar_takes(grammar, '<tool_call>\n{"name": "get_forecast"')  # not offered
    # a function that is not strict: its arguments any object
    assert grammar_takes(grammar, '<tool_call>\n{"name": "get_time", "arguments": {"tz": 1}}'
                         '\n</tool_call>', ending=True)
    assert not grammar_takes(grammar, head + '{"city": "Oslo", "days": 2}}', ending=True)  # open
    # without a strict function, or with the tools hidden, auto is free
    assert ToolRequest.of(TOOLS, "auto").grammar() is None
    assert ToolRequest.of(STRICT, "none").grammar() is None
    # parallel_tool_calls false: a call ends the answer
    call = head + '{"city": "Oslo", "days": 2}}\n</tool_call>'
    assert grammar_takes(grammar, call + " And " + call, ending=True)
    single = ToolRequest.of(STRICT, "auto", parallel_tool_calls=False).grammar()
    assert grammar_takes(single, "Sure. " + call, ending=True)
    assert grammar_takes(single, "Just text.", ending=True)
    assert not grammar_takes(single, call + " And " + call)


@pytest.mark.parametrize("tools, choice, param, words", [
    ([{"type": "code_interpreter"}], None, "tools", "not a function definition"),
    (["get_weather"], None, "tools", "not a function definition"),
    ([], None, "tools", "empty"),
    ([{"type": "function", "function": {"name": "get weather!"}}], None, "tools", "letters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "none"}}], None, "tools",
     "JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools", "describe an object"),
    ([{"type": "function", "function": {"name": "f", "params": {}}}], None, "tools",
     "unknown field 'params'"),
    (TOOLS + TOOLS[:1], None, "tools", "more than once"),
    (None, "auto", "tool_choice", "needs 'tools'"),
    (TOOLS, "always", "tool_choice", "not one of"),
    (TOOLS, {"type": "function", "function": {"name": "get_news"}}, "tool_choice",
     "does not define"),
    (TOOLS, {"type": "function", "name": "get_weather"}, "tool_choice", "must be"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, param, words):
    with pytest.raises(ToolError, match=words) as caught:
        ToolRequest.of(tools, choice)
    assert caught.value.param == param


def test_a_template_without_tools_is_refused_by_name():
    with pytest.raises(ToolError, match="does not support tools"):
        check_template(build_tokenizer())


def test_the_call_format_is_read_off_the_template():
    assert check_template(tool_tokenizer()) == HERMES
    assert check_template(tool_tokenizer(LLAMA_TEMPLATE)) == LLAMA_JSON
    # calls written as bare JSON under "arguments": that field
    arguments = check_template(tool_tokenizer(LLAMA_TEMPLATE.replace("parameters", "arguments")))
    assert arguments == dataclasses.replace(LLAMA_JSON, arguments="arguments")
    assert check_template(tool_tokenizer(XML_TEMPLATE)) == QWEN_XML
    # Mistral's: its tags special tokens where the tokenizer has them, else text
    for template, fmt in ((MISTRAL_TEMPLATE, MISTRAL_ARRAY), (ARGS_TEMPLATE, MISTRAL_ARGS)):
        tokenizer = tool_tokenizer(template)
        found = check_template(tokenizer)
        assert dataclasses.replace(found, special=()) == fmt
        tags = dict(found.special)
        assert set(tags) == ({"[TOOL_CALLS]"} if fmt.array else {"[TOOL_CALLS]", "[ARGS]",
                                                                   "[CALL_ID]"})
        assert all(tokenizer.convert_ids_to_tokens(i) == tag for tag, i in tags.items())
        assert check_template(build_tokenizer(template)) == fmt
    # its templates refuse call ids that are not nine letters and digits (the server's are)
    bad = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]}]
    with pytest.raises(Exception, match="length 9"):
        tool_tokenizer(MISTRAL_TEMPLATE).apply_chat_template(bad, tokenize=False)
    # gpt-oss's harmony messages, their tags special tokens
    harmony = check_template(tool_tokenizer(HARMONY_TEMPLATE))
    assert dataclasses.replace(harmony, special=()) == HARMONY
    assert [tag for tag, _ in harmony.special] == list(HARMONY_SPECIAL[:5])
    # Granite's: the tag its system prompt names, a special token where the tokenizer has it
    granite = check_template(tool_tokenizer(GRANITE_TEMPLATE))
    assert dataclasses.replace(granite, special=()) == GRANITE_ARRAY
    assert [tag for tag, _ in granite.special] == ["<|tool_call|>"]
    assert check_template(build_tokenizer(GRANITE_TEMPLATE)) == GRANITE_ARRAY
    # GLM's <arg_key> calls: refused by name
    with pytest.raises(ToolError, match="format this server does not parse"):
        check_template(tool_tokenizer(GLM_TEMPLATE))


# ---- the served tiny model -------------------------------------------------------------------

#: a Hermes-style template for the tiny tokenizer: the tools' names in a system turn, calls and
#: results as Qwen2.5's template writes them
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}\nCall: <tool_call>\n{}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


#: a Llama 3-style template: the functions shown in the last user turn, a call written as the
#: answer's bare JSON with its arguments under "parameters", results in an "ipython" turn
LLAMA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ 'ipython' if m.role == 'tool' else m.role }}\n"
    "{% if tools and loop.last and m.role == 'user' %}Call"
    "{% for t in tools %} {{ t.function.name }}{% endfor %} as JSON.\n{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: a Qwen3-Coder-style template: calls as XML, a tag per parameter, a string's value as it is
XML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}\nCall in XML.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>"
    "{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>\n"
    "<function={{ c.function.name }}>\n{% for k, v in c.function.arguments.items() %}"
    "<parameter={{ k }}>\n{{ v | tojson if v is mapping or (v is sequence and v is not string) "
    "else v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: Mistral's ids check, as its templates make it of every call and result
MISTRAL_IDS = ("{% if (c or m).id is defined and (c or m).id | length != 9 or m.tool_call_id "
               "is defined and m.tool_call_id | length != 9 %}{{ raise_exception('Tool call "
               "IDs should be alphanumeric strings with length 9!') }}{% endif %}")
#: a Mistral 7B v0.3-style template: the tools before the last user message, calls as a JSON
#: array after [TOOL_CALLS] (each with its id), results in [TOOL_RESULTS]
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% set c = none %}" + MISTRAL_IDS + "<|im_start|>{{ m.role }}\n"
    "{% if tools and loop.last and m.role == 'user' %}[AVAILABLE_TOOLS]{% for t in tools %}"
    "{{ t.function.name }} {% endfor %}[/AVAILABLE_TOOLS]{% endif %}{% if m.tool_calls %}"
    "[TOOL_CALLS][{% for c in m.tool_calls %}" + MISTRAL_IDS + "{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, \"id\": \""
    "{{ c.id }}\"}{{ ', ' if not loop.last }}{% endfor %}]{% elif m.role == 'tool' %}"
    "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: a Mistral Small 3.2-style template: each call [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}
ARGS_TEMPLATE = MISTRAL_TEMPLATE.replace(
    "[TOOL_CALLS][{% for c in m.tool_calls %}" + MISTRAL_IDS + "{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, \"id\": \""
    "{{ c.id }}\"}{{ ', ' if not loop.last }}{% endfor %}]",
    "{% for c in m.tool_calls %}" + MISTRAL_IDS + "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]"
    "{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}")
#: GLM's: a tag pair per argument's key and value (not parsed)
GLM_TEMPLATE = TOOL_TEMPLATE.replace(
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>",
    "<tool_call>{{ c.function.name }}{% for k, v in c.function.arguments.items() %}\n"
    "<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>{% endfor %}\n</tool_call>")
#: a gpt-oss-style template: harmony's messages, the tools in a developer message, a call as
#: a message to functions.NAME ended by <|call|>, its result a message from it
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n"
    "Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|>Tools:{% for t in tools %} "
    "{{ t.function.name }}{% endfor %}<|end|>{% endif %}{% for m in messages %}"
    "{% if m.tool_calls %}{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.thinking }}<|end|>{% endif %}{% for c in m.tool_calls %}<|start|>assistant "
    "to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{% endfor %}{% elif m.role == 'tool' %}"
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>{% elif m.role == 'assistant' %}<|start|>assistant"
    "<|channel|>final<|message|>{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}"
    "<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
#: a Granite 3.x-style template: the system prompt names the tag a call's JSON list follows;
#: earlier calls are not written back, only their results
GRANITE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nWhen a tool is required, respond only with <|tool_call|> "
    "followed by a JSON list of tools used.<|im_end|>\n<|im_start|>available_tools\n"
    "{% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'tool_response' if m.role == 'tool' else m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: the format of each template (the tiny tokenizer's served variants)
TEMPLATES = {"Hermes": TOOL_TEMPLATE, "bare JSON": LLAMA_TEMPLATE, "XML": XML_TEMPLATE,
             "Mistral array": MISTRAL_TEMPLATE, "Mistral [ARGS]": ARGS_TEMPLATE,
             "harmony": HARMONY_TEMPLATE, "Granite": GRANITE_TEMPLATE}
#: Mistral's tags, special tokens of its tokenizer
MISTRAL_SPECIAL = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
#: harmony's tags and ends of a turn, special tokens of gpt-oss's tokenizer
HARMONY_SPECIAL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>",
                   "<|return|>", "<|call|>")


def tool_tokenizer(template: str = TOOL_TEMPLATE):
    special = (MISTRAL_SPECIAL if "[TOOL_CALLS]" in template
               else HARMONY_SPECIAL if "<|channel|>" in template
               else ("<|tool_call|>",) if "<|tool_call|>" in template else ())
    return build_tokenizer(template, special)


@pytest.fixture(scope="module", params=list(TEMPLATES))
def tokenizer(request):
    """The tiny tokenizer under a template of each call format: every request test runs in
    each."""
    return tool_tokenizer(TEMPLATES[request.param])


def id_fits(call_id: str, tokenizer) -> bool:
    """A call id as the served format makes them: nine letters and digits for Mistral's,
    OpenAI's ``call_...`` for the others."""
    if check_template(tokenizer).short_ids:
        return len(call_id) == 9 and call_id.isalnum()
    return call_id.startswith("call_")


@pytest.fixture(scope="module")
def model(tokenizer):
    """The tiny served model with room for a conversation that holds a call (an XML call is
    over a hundred of the tiny tokenizer's pieces)."""
    return tiny_llama(vocab_size=len(tokenizer), hidden_size=32, max_positions=2 * CONTEXT,
                      seed=1)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    with make_server(model, tokenizer) as background:
        yield background


def test_the_constraints_vocabulary_is_built_before_the_first_request(model, tokenizer):
    # built on the first constrained request instead, it delays that request's first token
    # (1.4 s for Qwen2.5's tokenizer)
    with make_server(model, tokenizer) as background:
        assert background.server.config.app.state.server._vocabulary is not None


#: room for a whole call of get_weather in the tiny tokenizer's short pieces (XML's is longest)
CALL_TOKENS = 128


def ask(client, method="ngram", max_tokens=CALL_TOKENS, **kwargs):
    kwargs.setdefault("tools", TOOLS)
    return client.chat.completions.create(
        model=MODEL, messages=kwargs.pop("messages", QUESTION), max_tokens=max_tokens,
        extra_body={"specdecode": {"method": method, "return_token_ids": True}}, **kwargs)


def streamed(client, max_tokens=CALL_TOKENS, **kwargs) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish reason) put together from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=max_tokens, stream=True, tools=TOOLS,
            **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            if call.id is not None:
                assert call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                calls[call.index][1] += call.function.arguments
        finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("method", ["ar", "ngram", "suffix"])
def test_a_named_function_gives_one_call_matching_its_schema(client, tokenizer, method):
    out = ask(client, method, tool_choice=NAMED)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and id_fits(call.id, tokenizer)
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    fmt = check_template(tokenizer)
    tag = dict(fmt.special).get(fmt.open)
    assert tag is None or choice.model_extra["token_ids"][0] == tag  # the tag's special token
    # every method exact: the same tokens as plain decoding under the same grammar
    reference = ask(client, "ar", tool_choice=NAMED).choices[0].model_extra["token_ids"]
    assert choice.model_extra["token_ids"] == reference


def test_a_stream_carries_the_calls_of_the_whole_response(client):
    whole = ask(client, tool_choice=NAMED).choices[0]
    content, calls, finish = streamed(client, tool_choice=NAMED)
    assert finish == whole.finish_reason == "tool_calls"
    assert content == whole.message.content
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_streamed_call_sends_its_name_first_and_its_arguments_as_they_are_written(
        client, tokenizer):
    pieces = []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=CALL_TOKENS, stream=True, tools=TOOLS,
            tool_choice=NAMED, extra_body={"specdecode": {"method": "ar"}}):
        for call in chunk.choices[0].delta.tool_calls or ():
            pieces.append((call.id, call.function.name, call.function.arguments))
    (head_id, name, first), *rest = pieces
    assert id_fits(head_id, tokenizer) and name == "get_weather" and first == ""
    # (the grammar forces stretches of a call, such as `{"city": "`, in one step)
    assert len(rest) > 1 and all(i is None and n is None and a for i, n, a in rest)
    jsonschema.validate(json.loads("".join(a for _, _, a in rest)), WEATHER)


def test_logprobs_stream_whole_beside_the_calls(client):
    whole = ask(client, tool_choice=NAMED, logprobs=True).choices[0]
    assert len(whole.logprobs.content) == len(whole.model_extra["token_ids"])
    pieces = []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=CALL_TOKENS, stream=True, tools=TOOLS,
            tool_choice=NAMED, logprobs=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            pieces += chunk.choices[0].logprobs.content
    assert [(p.token, round(p.logprob, 5)) for p in pieces] == \
        [(p.token, round(p.logprob, 5)) for p in whole.logprobs.content]


def test_required_calls_offered_functions(client):
    out = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    [call] = out.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    else:
        assert json.loads(call.function.arguments) == {}


def test_auto_and_none_return_what_plain_decoding_gives(client):
    """The tiny model's random text holds no call: ``auto`` returns it as content; ``none``
    does not tell the model of the tools, so its prompt (and answer) are the plain ones."""
    auto = ask(client, max_tokens=12)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    none = ask(client, max_tokens=12, tool_choice="none")
    plain = ask(client, max_tokens=12, tools=None)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens


def test_a_strict_function_under_auto_is_exact_for_every_method(served, client):
    outs = [ask(client, method, max_tokens=24, tools=STRICT)
            for method in ("ar", "ngram", "suffix")]
    ids = [out.choices[0].model_extra["token_ids"] for out in outs]
    assert ids[0] and ids[0] == ids[1] == ids[2]
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "tools": STRICT,
            "response_format": {"type": "json_object"}}
    refused = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert "strict" in refused.json()["error"]["message"]


def test_a_conversation_with_calls_and_results_is_served(client):
    """The server's call goes back as the client sends it, with its id (Mistral's template
    refuses ids that are not nine letters and digits) and a result."""
    [call] = ask(client, tool_choice=NAMED).choices[0].message.tool_calls
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    out = ask(client, max_tokens=8, messages=messages)
    assert out.choices[0].finish_reason in ("stop", "length")


BAD = [
    ({"tools": [{"type": "retrieval"}]}, "tools", "not a function definition"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "tool_choice", "does not define"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"messages": [{"role": "tool", "content": "24 C"}]}, "messages", "no 'tool_call_id'"),
    ({"messages": [{"role": "tool", "content": "24 C", "tool_call_id": "call_9"}]}, "messages",
     "no earlier assistant message"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages",
     "only assistant messages"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "give one of them"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}],
      "tool_choice": "required"}, "tools", "invalid"),
    # offered tools (auto) leave other constraints' errors to their own field
    ({"tools": TOOLS, "specdecode": {"regex": "("}}, "specdecode.regex", "regex"),
]


@pytest.mark.parametrize("change, param, words", BAD)
def test_bad_tool_requests_get_a_400_naming_the_field(served, client, change, param, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, **change}
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert ask(client, max_tokens=2).choices[0].finish_reason == "length"  # still serving


def test_a_model_whose_template_has_no_tools_gets_a_400():
    plain = build_tokenizer()
    with make_server(tiny_served_model(plain), plain, parallel=1) as background:
        body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "tools": TOOLS}
        response = httpx.post(background.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400
        assert "does not support tools" in response.json()["error"]["message"]
        body["tool_choice"] = "none"  # not offered: the template never sees them
        assert httpx.post(background.url + "/v1/chat/completions", json=body,
                          timeout=30).status_code == 200


# ---- the real Qwen2.5-Coder-0.5B, whose own template handles tools ----------------------------

@pytest.fixture(scope="module")
def qwen():
    """Qwen2.5-Coder-0.5B (scripts/setup.sh installs it), skipped where it is not installed."""
    from specdecode.models.loading import load_model
    from specdecode.models.parted import PARTED_MODELS, is_assembled

    model = PARTED_MODELS["qwen2.5-coder-0.5b"]
    if not is_assembled(model):
        pytest.skip(f"qwen2.5-coder-0.5b is not installed: `{model.install_command}`")
    return load_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def qwen_client(qwen):
    from specdecode.api import eos_ids
    from specdecode.models.loading import make_runner
    from specdecode.server import BackgroundServer
    from specdecode.server.app import Server, Settings, create_app

    server = Server([make_runner(qwen)], qwen.tokenizer, eos_ids(qwen, qwen.tokenizer),
                    Settings(model_id=MODEL, method="suffix"))
    with BackgroundServer(create_app(server)) as background:
        yield openai_client(background)


@pytest.mark.slow
def test_qwen_calls_parse_alike_for_every_method_streamed_or_not(qwen_client):
    answers = {method: ask(qwen_client, method, 48, tool_choice=NAMED).choices[0]
               for method in ("ar", "suffix")}
    assert answers["ar"].model_extra["token_ids"] == answers["suffix"].model_extra["token_ids"]
    choice = answers["suffix"]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert arguments["city"] == "Paris"
    content, calls, finish = streamed(qwen_client, tool_choice=NAMED, max_tokens=48)
    assert (content, calls, finish) == (None, [("get_weather", call.function.arguments)],
                                        "tool_calls")


@pytest.mark.slow
def test_qwen_under_auto_answers_alike_for_every_method_streamed_or_not(qwen_client):
    """Unconstrained, the 0.5B may call or write the call as a JSON block in text (it does the
    latter with its own tokenizer's <tool_call> token): whichever, every method writes the same
    tokens, and the stream puts together the same content, calls and finish reason."""
    answers = {method: ask(qwen_client, method, 48, tool_choice="auto").choices[0]
               for method in ("ar", "suffix")}
    assert answers["ar"].model_extra["token_ids"] == answers["suffix"].model_extra["token_ids"]
    choice = answers["suffix"]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    assert choice.message.content or calls
    assert streamed(qwen_client, tool_choice="auto", max_tokens=48) == (
        choice.message.content, calls, choice.finish_reason)


@pytest.mark.slow
def test_qwen_answers_from_a_tool_result(qwen, qwen_client):
    """The call and its result go back through Qwen's template (the arguments as the object
    they spell, the result in its <tool_response>), and the model answers (the 0.5B calls
    the function again rather than answering in text: what it writes, not what we parse)."""
    from specdecode.server.protocol import ChatRequest, parse

    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C all three days"}]
    request = parse(ChatRequest, {"model": MODEL, "messages": messages, "tools": TOOLS})
    prompt = qwen.tokenizer.apply_chat_template(
        [m.as_template_input() for m in request.messages], tools=TOOLS, tokenize=False,
        add_generation_prompt=True)
    assert '"arguments": {"city": "Paris", "days": 3}}' in prompt
    assert "<tool_response>\nSunny, 24 C all three days\n</tool_response>" in prompt
    out = ask(qwen_client, "suffix", 48, messages=messages).choices[0]
    assert out.message.content or out.message.tool_calls
    assert out.finish_reason in ("stop", "tool_calls")
