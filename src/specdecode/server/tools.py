"""Tool calls: OpenAI's ``tools`` and ``tool_choice`` in, the model's own tool-call text out.

The functions reach the model through its own chat template (``apply_chat_template(messages,
tools=...)``), as it was trained to see them; what it writes back is parsed here, in the format
its template writes calls in (:func:`check_template` reads it off the template: a probe
conversation with one call, rendered). Seven formats (:class:`ToolFormat`):

- **Hermes** (Qwen2.5, Qwen3, Hermes), one block per call, anywhere in the answer::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- **bare JSON** (Llama 3.1, 3.2 and 3.3 with custom functions), the answer itself a call, one
  an answer (their templates refuse an assistant message of several)::

      {"name": "get_weather", "parameters": {"city": "Paris"}}

- **XML** (Qwen3-Coder, Qwen3.5, Nemotron 3), a block per call, a tag per parameter, a
  string's value as it is and another type's as JSON (read back by the parameter's schema)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

- **Mistral**, after the special token ``[TOOL_CALLS]``, either a JSON array of calls (Mistral
  7B v0.3, Nemo, Ministral 8B) or each call's name, the special token ``[ARGS]`` and its
  arguments (Mistral Small 3.2, Devstral, Ministral 3)::

      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
      [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

  Its tags are special tokens, which a decode drops: the text the server parses keeps them
  (:attr:`ToolFormat.kept_tokens`), and a grammar writes them as those tokens. Call ids are
  nine letters and digits, as its templates demand of the ids a client sends back.

- **a tag and a JSON array** (Granite 3.x), Mistral's first form behind the tag its template's
  system prompt names (the template never writes a call back)::

      <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

- **harmony** (gpt-oss), a call a message of its own to ``functions.NAME`` (one an answer,
  ``<|call|>`` ends it), read apart from the reasoning and content by
  :mod:`specdecode.server.harmony`::

      <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

:class:`~specdecode.server.tool_parser.ToolCallParser` turns generated text, fed in pieces
split anywhere, into content and calls, as a stream sends them: a call that opens with
``{"name": "...", "arguments": {`` (the format's field) is a call from there on, its name sent
at once and its arguments as they are written (an agent's client sees the call start a few
tokens in, not when a long ``write_file`` ends); any other Hermes block becomes a call only
once it is closed and its JSON holds a string ``name`` and object ``arguments``; anything else
(malformed JSON, text that only looks like the start of a tag, an answer that opens with other
JSON) stays in the content, character for character, so nothing the model wrote is lost. An
XML call's name is sent once its ``<function=NAME>`` is read, and each parameter once its
closing tag is.
Whitespace between content and a call is dropped, so ``"Let me check.\\n<tool_call>..."`` gives
the content ``"Let me check."``.

``tool_choice: "required"`` or a named function constrains the output with a grammar
(:meth:`ToolRequest.grammar`): one or more calls (exactly one for a named function, or where
the format holds one), each call's arguments matching its function's parameter schema (in
XML, each parameter's value: a string any text up to its closing tag). Under
``auto``, a function marked ``"strict": true`` (OpenAI's strict function calling) makes the
grammar hold only the calls: free text, in which a call, once begun (its ``<tool_call>`` written,
or for bare JSON the answer's first ``{``), is a call of an offered function, a strict one's
arguments matching its schema. The grammar is a per-node token mask like any other constraint
(specdecode/constraints.py), so every method's greedy output stays token for token what plain
decoding under the same grammar gives.

Errors are :class:`ToolError` (a ``ValueError`` carrying the request field it is about); the
server's request parser turns them into 400s. The output's parser is
:mod:`specdecode.server.tool_parser`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from specdecode.detokenize import special_tokens

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
#: OpenAI's rule for function names (also what keeps them safe inside the grammar's literals):
#: 1 to NAME_MAX of these characters
NAME_CHAR = re.compile(r"[A-Za-z0-9_-]")
NAME_MAX = 64
NAME = re.compile(f"{NAME_CHAR.pattern}{{1,{NAME_MAX}}}")
#: the parameters of a function that declares none: no arguments at all
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
#: arguments written as the template shows JSON (Python's ``json.dumps``): ", " and ": ", no
#: other whitespace (flexible whitespace would let a small model pad forever)
ARGUMENT_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolFormat:
    """How a model's chat template writes a call, so how its output is parsed and held."""

    name: str
    #: the tag that opens a call ("": a call is the answer itself, its first non-space text)
    open: str
    #: the tag that closes it ("": the call's JSON object closing ends it)
    close: str
    #: the field of the call's object that holds the arguments
    arguments: str
    #: several calls in one answer
    parallel: bool
    #: the call written as XML inside the tags, a tag per parameter (else as JSON)
    xml: bool = False
    #: the calls written as one JSON array after the opening tag (Mistral's first form)
    array: bool = False
    #: the tag between a call's name and its arguments' JSON object, where the name is not in
    #: the JSON (Mistral's later form: ``[TOOL_CALLS]NAME[ARGS]{...}``); "" where it is
    args: str = ""
    #: call ids of nine letters and digits (Mistral's templates refuse others)
    short_ids: bool = False
    #: a call is a harmony message to ``functions.NAME`` (gpt-oss: server/harmony.py reads it)
    harmony: bool = False
    #: the format's tags that are special tokens of the served tokenizer, as (tag, token id):
    #: the text the output is parsed from keeps them, and a grammar writes them as that token
    #: (a decode drops special tokens, and their text spelt in ordinary tokens is not what the
    #: model was trained to write)
    special: tuple[tuple[str, int], ...] = ()

    @property
    def kept_tokens(self) -> tuple[int, ...]:
        """The special tokens whose text the parsed output keeps."""
        return tuple(token for _, token in self.special)

    def spelt(self, tag: str) -> str:
        """``tag`` in a Lark grammar: its special token (``<[id]>``) or its text."""
        token = dict(self.special).get(tag)
        return json.dumps(tag) if token is None else f"<[{token}]>"


HERMES = ToolFormat("Hermes", OPEN, CLOSE, "arguments", True)
#: Llama 3.x's custom-function calls: the answer is ``{"name": ..., "parameters": {...}}``
LLAMA_JSON = ToolFormat("bare JSON", "", "", "parameters", False)
#: Qwen3-Coder's (and Nemotron 3's): ``<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE
#: \n</parameter>\n</function>\n</tool_call>``, a string's value as it is, others' as JSON (a
#: block of JSON instead is read as Hermes' is, its arguments under "arguments")
QWEN_XML = ToolFormat("XML", OPEN, CLOSE, "arguments", True, xml=True)
MISTRAL_TAG = "[TOOL_CALLS]"
#: Mistral 7B v0.3's, Nemo's and Ministral 8B's: ``[TOOL_CALLS][{"name": ..., "arguments":
#: {...}}, ...]``, the tag a special token
MISTRAL_ARRAY = ToolFormat("Mistral JSON array", MISTRAL_TAG, "", "arguments", True, array=True,
                           short_ids=True)
#: Mistral Small 3.2's, Devstral's and Ministral 3's: ``[TOOL_CALLS]NAME[ARGS]{...}`` a call
#: (a ``[CALL_ID]ID`` before ``[ARGS]`` is read and dropped)
MISTRAL_ARGS = ToolFormat("Mistral [ARGS]", MISTRAL_TAG, "", "arguments", True, args="[ARGS]",
                          short_ids=True)
MISTRAL_CALL_ID = "[CALL_ID]"
#: Granite 3.x's: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``, Mistral's array
#: behind another tag; its template never writes a call back, so the tag is read off the
#: instruction its system prompt gives (:data:`_TOLD_TAG`)
GRANITE_ARRAY = ToolFormat("tag and JSON array", "<|tool_call|>", "", "arguments", True,
                           array=True)
#: gpt-oss's: a harmony message ``<|channel|>commentary to=functions.NAME <|constrain|>json
#: <|message|>{...}``, one an answer (``<|call|>`` ends it)
HARMONY = ToolFormat("harmony", "<|channel|>", "", "arguments", False, harmony=True)
#: harmony's tags, special tokens of gpt-oss's tokenizer (server/harmony.py's)
HARMONY_TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")


class ToolError(ValueError):
    """A request whose tools, tool choice or tool messages cannot be served; ``param`` is the
    request field to fix."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


# ---- the request -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]
    #: the definition as the client sent it, handed to the chat template unchanged
    definition: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    #: OpenAI's ``strict``: the call's arguments always match ``parameters``
    strict: bool = False


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""

    functions: tuple[Function, ...]
    #: "none", "auto", "required" or "function" (one named function: ``name``)
    choice: str = "auto"
    name: str | None = None
    #: more than one call per answer (``required`` only; a named function gets exactly one)
    parallel: bool = True
    #: the served model's call format (:func:`check_template`), set once the template is read
    format: ToolFormat = HERMES

    @property
    def offered(self) -> list[dict] | None:
        """The tools handed to the chat template (None for ``tool_choice: "none"``: the model
        is not told of them)."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": f.definition} for f in self.functions]

    @property
    def schemas(self) -> dict[str, dict]:
        """Each function's parameters' schema, by name (what an XML call's values are read
        by)."""
        return {f.name: f.parameters for f in self.functions}

    @property
    def constrains(self) -> bool:
        """The output is held to tool calls by a grammar (``required``, a named function)."""
        return self.choice in ("required", "function")

    @property
    def guards(self) -> bool:
        """The output is free but its calls are held by a grammar: ``auto`` with a function
        marked ``strict``."""
        return self.choice == "auto" and any(f.strict for f in self.functions)

    @property
    def parses(self) -> bool:
        """The output is parsed for calls (not with ``tool_choice: "none"``)."""
        return self.choice != "none"

    def grammar(self) -> str | None:
        """A Lark grammar (llguidance's, with ``%json`` schemas) for what ``tool_choice``
        demands: one or more calls (``required`` where the format holds several, a named
        function), or with :attr:`guards` free text in which a call, once begun, is a call of
        an offered function, a strict one's arguments matching its schema (Hermes: a lazy
        lexeme, the text ends at the tag; bare JSON: an answer whose first text is ``{`` is
        the call); None when the model is free."""
        fmt = self.format
        if fmt.harmony:
            return self._harmony_grammar()
        if self.constrains:
            chosen = [f for f in self.functions if self.choice == "required" or f.name == self.name]
            several = self.choice == "required" and self.parallel and fmt.parallel
            header = ["%llguidance {}"] if fmt.xml else []  # (its lazy lexemes)
            if fmt.array:
                calls = [f"start: {fmt.spelt(fmt.open)} {_array(several)}"]
            else:
                repeat = (" call*" if fmt.args else ' ("\\n" call)*') if several else ""
                calls = [f"start: call{repeat}",
                         f"call: {fmt.spelt(fmt.open)} body" if fmt.open else "call: body"]
            return "\n".join(header + calls + _bodies(chosen, True, fmt))
        if not self.guards:
            return None
        if not fmt.open:  # whitespace, then a call or text that does not open with "{"
            return "\n".join(["start: WS? (body | TEXT)?", "WS: /[ \\t\\n]+/",
                              "TEXT: /[^{ \\t\\n](.|\\n)*/"] + _bodies(self.functions, False, fmt))
        # the text up to an opening tag: a special token ends it by itself, a tag spelt in
        # text ends a lazy lexeme; parallel_tool_calls false: a call ends the answer
        lazy = "" if dict(fmt.special).get(fmt.open) is not None else "[lazy]"
        start = "start: called* TEXT" if self.parallel else "start: called | TEXT"
        return "\n".join(["%llguidance {}", start,
                          f"called: opened {_array(self.parallel) if fmt.array else 'body'}",
                          f"opened{lazy}: TEXT {fmt.spelt(fmt.open)}"]
                         + ([] if fmt.xml else ["TEXT: /(.|\\n)*/"])
                         + _bodies(self.functions, False, fmt))

    def _harmony_grammar(self) -> str | None:
        """:meth:`grammar` in harmony's messages: a call is the message ``<|channel|>commentary
        to=functions.NAME <|constrain|>json<|message|>ARGS`` (``<|call|>``, an end of the
        answer, follows it); ``required`` or a named function: the answer is one call (no
        reasoning before it: a note of unbounded length could take the whole answer); strict
        functions under ``auto``: notes of reasoning or commentary, then a call or the final
        answer."""
        fmt = self.format
        tag = _harmony_spelt(fmt)
        start, channel, message, end = tag["start"], tag["channel"], tag["message"], tag["end"]
        if self.constrains:
            functions = [f for f in self.functions
                         if self.choice == "required" or f.name == self.name]
            rules = ["start: call"]
        elif self.guards:
            functions = list(self.functions)
            # a note's text ends at the special token that closes it
            rules = ["start: note* (final | call)",
                     f'note: {channel} ("analysis" | "commentary") {message} TEXT {end} {start} '
                     '"assistant"',
                     f'final: {channel} "final" {message} TEXT', "TEXT: /(.|\\n)*/"]
        else:
            return None
        rules.append(f'call: {channel} "commentary to=functions." body')
        return "\n".join(rules + _bodies(functions, self.constrains, fmt))

    @classmethod
    def of(cls, tools: list | None, tool_choice: Any = None,
           parallel_tool_calls: bool | None = None) -> ToolRequest | None:
        """The checked request (None without tools); raises :class:`ToolError`."""
        if tools is None:
            if tool_choice is not None:
                raise ToolError("'tool_choice' needs 'tools': give the function definitions the "
                                "model may call, or drop 'tool_choice'", "tool_choice")
            if parallel_tool_calls is not None:
                raise ToolError("'parallel_tool_calls' needs 'tools'", "parallel_tool_calls")
            return None
        if not tools:
            raise ToolError("'tools' is empty; give at least one function definition, or drop "
                            "'tools'")
        functions = tuple(_function(i, t) for i, t in enumerate(tools))
        names = [f.name for f in functions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ToolError(f"'tools' defines function {twice[0]!r} more than once; give each "
                            "function one definition")
        choice, name = _choice(tool_choice, names)
        return cls(functions, choice, name, parallel_tool_calls is not False)


def _bodies(functions, every_schema: bool, fmt: ToolFormat) -> list[str]:
    """Lark rules ``body``: a call of one of ``functions`` after the format's opening tag,
    written as the template shows JSON (or its XML), the arguments matching the function's
    ``parameters`` (``every_schema``; else a strict function's only, any object another's)."""
    if fmt.xml:
        return _xml_bodies(functions, every_schema)
    rules = []
    lead, tail = ("\\n", f"\\n{fmt.close}") if fmt.close else ("", "")
    for i, f in enumerate(functions):
        held = every_schema or f.strict
        schema = {"type": "object", **(f.parameters if held else {})}
        if fmt.harmony:
            tag = _harmony_spelt(fmt)
            rules.append(f'body_{i}: "{f.name} " {tag["constrain"]} "json" {tag["message"]} '
                         f'args_{i}')
        elif fmt.args:
            rules.append(f'body_{i}: "{f.name}" {fmt.spelt(fmt.args)} args_{i}')
        else:
            rules.append(f'body_{i}: "{lead}{{\\"name\\": \\"{f.name}\\", '
                         f'\\"{fmt.arguments}\\": " args_{i} "}}{tail}"')
        rules.append(_json_rule(f"args_{i}", schema))
    return [f"body: {' | '.join(f'body_{i}' for i in range(len(functions)))}"] + rules


def _harmony_spelt(fmt: ToolFormat) -> dict[str, str]:
    """Harmony's tags in a Lark grammar (:meth:`ToolFormat.spelt`), by their names."""
    return {tag.strip("<|>"): fmt.spelt(tag) for tag in HARMONY_TAGS}


def _array(several: bool) -> str:
    """Lark: calls in a JSON array (one, or ``several``), as Mistral's templates write them."""
    return '"[" body' + (' (", " body)*' if several else "") + ' "]"'


def _json_rule(name: str, schema: dict) -> str:
    """Lark rule ``name``: JSON matching ``schema``, written as the template shows JSON."""
    return f"{name}: %json {json.dumps({**schema, 'x-guidance': ARGUMENT_STYLE})}"


def _xml_bodies(functions, every_schema: bool) -> list[str]:
    """``_bodies`` in the XML format: ``<function=NAME>``, then a tag per parameter in the
    schema's order (the required ones always), each value a string's text as it is (a lazy
    lexeme: it ends at ``</parameter>``), an enum's member, or another type's JSON; a function
    whose arguments are not held takes any parameters, each a text."""
    rules = ["TEXT: /(.|\\n)*/", 'KEY: /[A-Za-z0-9_.-]+/',
             'any_param: "<parameter=" KEY ">\\n" text_value "\\n"',
             'text_value[lazy]: TEXT "\\n</parameter>"']
    for i, f in enumerate(functions):
        properties = f.parameters.get("properties") or {}
        required = set(f.parameters.get("required") or ())
        held = (every_schema or f.strict) and isinstance(properties, dict)
        parts = []
        for j, (key, schema) in enumerate(properties.items() if held else ()):
            tag = json.dumps(f"<parameter={key}>\n", ensure_ascii=False)  # (a key's quotes)
            rules.append(f"p_{i}_{j}: {tag} " + _xml_value_rule(i, j, schema, rules))
            parts.append(f"p_{i}_{j}" + ("" if key in required else "?"))
        tag, end = f'"\\n<function={f.name}>\\n"', f'"</function>\\n{CLOSE}"'
        rules.append(f"body_{i}: " + " ".join([tag, *(parts if held else ["any_param*"]), end]))
    return [f"body: {' | '.join(f'body_{i}' for i in range(len(functions)))}"] + rules


def _xml_value_rule(i: int, j: int, schema: Any, rules: list[str]) -> str:
    """What follows parameter j's tag in function i's XML call (rules it needs go to
    ``rules``): a string's text, an enum's member as it is, another type's JSON, then the
    closing tag."""
    schema = schema if isinstance(schema, dict) else {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return ("(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in enum)
                + ') "\\n</parameter>\\n"')
    kind = _xml_type(schema)
    if kind in ("string", None):
        return 'text_value "\\n"'
    if kind == "boolean":  # JSON's, or Python's as the templates write earlier calls' values
        return '("true" | "false" | "True" | "False") "\\n</parameter>\\n"'
    rules.append(_json_rule(f"v_{i}_{j}", schema))
    return f'v_{i}_{j} "\\n</parameter>\\n"'


def _xml_type(schema: dict) -> str | None:
    """A parameter schema's type: its ``type``, the first that is not null of a list of
    them; None where it names none."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def xml_value(text: str, schema: Any) -> Any:
    """A parameter's value from its XML text, read by its schema's type: a string as it is,
    a number, a boolean (``true`` or Python's ``True``), an object or array as JSON; text
    that does not read as its type, or a parameter the schema does not declare, is a
    string."""
    kind = _xml_type(schema) if isinstance(schema, dict) else None
    if kind in ("integer", "number", "object", "array", "null"):
        try:
            value = json.loads(text)
        except ValueError:
            return text
        fits = {"integer": int, "number": (int, float), "object": dict, "array": list,
                "null": type(None)}[kind]
        return value if isinstance(value, fits) and not isinstance(value, bool) else text
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    return text


def _function(i: int, tool: Any) -> Function:
    where = f"tools[{i}]"
    shape = ('{"type": "function", "function": {"name": ..., "description": ..., '
             '"parameters": {JSON schema}}}')
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ToolError(f"{where} is not a function definition (type {kind!r}); this server "
                        f"calls functions only: send {shape}")
    unknown = sorted(set(tool) - {"type", "function"})
    definition = tool.get("function")
    if unknown or not isinstance(definition, dict):
        raise ToolError(f"{where} must be {shape}" +
                        (f"; it also has {', '.join(map(repr, unknown))}" if unknown else ""))
    extra = sorted(set(definition) - {"name", "description", "parameters", "strict"})
    if extra:
        raise ToolError(f"{where}.function has unknown field {extra[0]!r}; a function has "
                        "'name', 'description', 'parameters' and 'strict'")
    name = definition.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name must be 1 to {NAME_MAX} letters, digits, '_' "
                        f"or '-', got {name!r}")
    if not isinstance(definition.get("description", ""), str):
        raise ToolError(f"{where}.function.description must be a string")
    if not isinstance(definition.get("strict", False), bool):
        raise ToolError(f"{where}.function.strict must be true or false")
    parameters = definition.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object (such as "
                        '{"type": "object", "properties": {...}}), got '
                        f"{type(parameters).__name__}")
    if parameters.get("type", "object") != "object":
        raise ToolError(f"{where}.function.parameters must describe an object (the arguments "
                        f"are a JSON object), got type {parameters.get('type')!r}")
    return Function(name, parameters, definition, definition.get("strict", False))


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    named = '{"type": "function", "function": {"name": ...}}'
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(f"tool_choice {tool_choice!r} is not one of 'none', 'auto', "
                            f"'required' or {named}", "tool_choice")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(function, dict) or tool_choice.get("type") != "function"
            or set(tool_choice) != {"type", "function"} or set(function) != {"name"}):
        raise ToolError(f"tool_choice must be 'none', 'auto', 'required' or {named}, got "
                        f"{json.dumps(tool_choice)[:120]}", "tool_choice")
    name = function["name"]
    if name not in names:
        raise ToolError(f"tool_choice names function {name!r}, which 'tools' does not define "
                        f"(it defines {', '.join(map(repr, names))})", "tool_choice")
    return "function", name


def check_conversation(messages: list) -> None:
    """Tool fields of the messages (objects with ``role``, ``tool_calls``, ``tool_call_id``):
    calls only on assistant messages, and every ``tool`` message answering an earlier call by
    its id. Raises :class:`ToolError`."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.tool_calls is not None and message.role != "assistant":
            raise ToolError(f"{where} has 'tool_calls' but role {message.role!r}; only "
                            "assistant messages carry tool calls", "messages")
        if message.role != "tool" and message.tool_call_id is not None:
            raise ToolError(f"{where} has 'tool_call_id' but role {message.role!r}; only tool "
                            "messages answer a call", "messages")
        for call in message.tool_calls or ():
            called.add(call.id)
        if message.role == "tool":
            if message.tool_call_id is None:
                raise ToolError(f"{where} has role 'tool' but no 'tool_call_id'; give the id "
                                "of the assistant's tool call it answers", "messages")
            if message.tool_call_id not in called:
                raise ToolError(f"{where} answers tool call {message.tool_call_id!r}, which no "
                                "earlier assistant message made (its 'tool_calls' ids)",
                                "messages")


def template_arguments(arguments: str) -> Any:
    """A call's ``arguments`` (JSON text) as chat templates expect them: the decoded object
    (templates write it with ``tojson``; the text itself would be quoted twice); text that
    is not a JSON object is passed on as it is."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


# ---- the model's template --------------------------------------------------------------------

_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
#: the probe answered by a call, to see how the template writes one (an id of nine letters and
#: digits: Mistral's templates refuse others), and by text, to see the turn's header
_PROBE_CALL = _PROBE_MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
    {"id": "call12345", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
_PROBE_ANSWER = "It is sunny."
_PROBE_TEXT = _PROBE_MESSAGES + [{"role": "assistant", "content": _PROBE_ANSWER}]
#: a template's instruction naming the tag a call's JSON list follows (Granite 3.x: "respond
#: only with <|tool_call|> followed by a JSON list of tools used")
_TOLD_TAG = re.compile(r"(<\|\w+\|>) followed by a JSON list")
#: the probe's call as JSON, its arguments under either field
_JSON_CALL = r'\{\s*"name"\s*:\s*"get_weather"\s*,\s*"(parameters|arguments)"\s*:\s*\{\s*"city"'
#: chat template text -> its call format, or the reason tools cannot be served with it
_TEMPLATES: dict[str, ToolFormat | str] = {}


def check_template(tokenizer) -> ToolFormat:
    """The format the model's chat template writes calls in; raises :class:`ToolError` unless
    the template shows tools to the model and writes calls in a format this module parses."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ToolError("this model has no chat template, so it cannot be offered tools; send "
                        "the request without 'tools'")
    if isinstance(template, dict):  # several named templates: the one for tools, or default
        template = template.get("tool_use") or template.get("default") or ""
    if template not in _TEMPLATES:
        _TEMPLATES[template] = _template_format(tokenizer)
    found = _TEMPLATES[template]
    if isinstance(found, str):
        raise ToolError(found)
    return with_special_tags(found, tokenizer)


def with_special_tags(fmt: ToolFormat, tokenizer) -> ToolFormat:
    """``fmt`` with those of its tags that are special tokens of ``tokenizer`` (Mistral's
    ``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` are, where Qwen's ``<tool_call>`` is an
    ordinary added token)."""
    # the detokenizer's own reckoning of what is special: what it drops unless told to keep it
    special = special_tokens(tokenizer)
    tags = (HARMONY_TAGS if fmt.harmony
            else (fmt.open, fmt.args, MISTRAL_CALL_ID if fmt.args else ""))
    found = tuple((tag, special[tag]) for tag in tags if tag in special)
    return replace(fmt, special=found) if found else fmt


def _template_format(tokenizer) -> ToolFormat | str:
    """The template's call format, read off the probe rendered with and without tools, and
    answered by a call and by text (what each adds to the conversation: the assistant's
    turn); or why it has none this module parses. Hermes: the turn holds ``<tool_call>`` then
    the call's JSON; bare JSON: the turn is its text answer's header, then the call's JSON."""
    def render(messages, tools, prompt=False):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=prompt)

    def turn(asked, messages):
        answered = render(messages, _PROBE_TOOLS)
        return answered[len(os.path.commonprefix([asked, answered])):]

    try:
        with_tools = render(_PROBE_MESSAGES, _PROBE_TOOLS, prompt=True)
        without = render(_PROBE_MESSAGES, None, prompt=True)
        asked = render(_PROBE_MESSAGES, _PROBE_TOOLS)
        called, texted = turn(asked, _PROBE_CALL), turn(asked, _PROBE_TEXT)
    except Exception as exc:  # the template's own errors
        return f"this model's chat template fails when given tools or calls ({exc}); send the " \
               "request without 'tools'"
    if with_tools == without:
        return ("this model's chat template does not support tools (it renders the same prompt "
                "with and without them), so the model would never see them; send the request "
                "without 'tools', or serve a model whose template handles tools (such as "
                "qwen2.5-coder-0.5b)")
    if re.search(r"to=functions\.get_weather\b", called) and HARMONY.open in called:
        return HARMONY
    hermes = re.search(re.escape(OPEN) + r"\s*" + _JSON_CALL, called)
    if hermes and hermes.group(1) == HERMES.arguments:
        return HERMES
    array = re.search(re.escape(MISTRAL_TAG) + r"\s*\[\s*" + _JSON_CALL, called)
    if array and array.group(1) == MISTRAL_ARRAY.arguments:
        return MISTRAL_ARRAY
    if re.search(re.escape(MISTRAL_TAG) + "get_weather" + f"({re.escape(MISTRAL_CALL_ID)}\\w+)?"
                 + re.escape(MISTRAL_ARGS.args) + r'\s*\{\s*"city"', called):
        return MISTRAL_ARGS
    if re.search(re.escape(OPEN) + r"\s*<function=get_weather>\s*<parameter=city>\s*Paris\s*"
                 r"</parameter>", called):
        return QWEN_XML
    header = texted[:texted.find(_PROBE_ANSWER)]
    bare = re.match(r"\s*" + _JSON_CALL, called[len(header):])
    if _PROBE_ANSWER in texted and called.startswith(header) and bare:
        return replace(LLAMA_JSON, arguments=bare.group(1))
    told = _TOLD_TAG.search(with_tools)
    if told and "get_weather" not in called:  # a template that never writes a call back
        return replace(GRANITE_ARRAY, open=told.group(1))
    return ("this model's chat template writes tool calls in a format this server does not "
            f"parse (it parses {OPEN} blocks of JSON, the Qwen2.5 and Hermes format, or of "
            "<function=...> XML, Qwen3-Coder's, an answer that is a call's JSON, Llama 3's, "
            f"Mistral's {MISTRAL_TAG} followed by a JSON array of calls or by "
            f"NAME{MISTRAL_ARGS.args}{{...}}, and gpt-oss's harmony messages to functions.NAME); "
            "send the request without 'tools'")
