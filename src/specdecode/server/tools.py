"""Tool calls: OpenAI's ``tools`` and ``tool_choice`` in, the model's own tool-call text out.

The functions reach the model through its own chat template (``apply_chat_template(messages,
tools=...)``), as it was trained to see them; what it writes back is parsed here. Qwen2.5 and
Hermes-style templates ask for one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallParser` turns generated text, fed in pieces split anywhere, into content and
calls, as a stream sends them: a block that opens with ``{"name": "...", "arguments": {`` is a
call from there on, its name sent at once and its arguments as they are written (an agent's
client sees the call start a few tokens in, not when a long ``write_file`` ends); any other
block becomes a call only once it is closed and its JSON holds a string ``name`` and object
``arguments``; anything else (malformed JSON, text that only looks like the start of a tag)
stays in the content, character for character, so nothing the model wrote is lost. Whitespace
between content and a call is dropped, so ``"Let me check.\\n<tool_call>..."`` gives the
content ``"Let me check."``.

``tool_choice: "required"`` or a named function constrains the output with a grammar
(:meth:`ToolRequest.grammar`): one or more such blocks (exactly one for a named function),
each block's arguments matching its function's parameter schema. Under ``auto``, a function
marked ``"strict": true`` (OpenAI's strict function calling) makes the grammar hold only the
calls: free text, in which a block, once its ``<tool_call>`` is written, is a call of an
offered function, a strict one's arguments matching its schema. The grammar is a per-node
token mask like any other constraint (specdecode/constraints.py), so every method's greedy
output stays token for token what plain decoding under the same grammar gives.

Errors are :class:`ToolError` (a ``ValueError`` carrying the request field it is about); the
server's request parser turns them into 400s.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

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

    @property
    def offered(self) -> list[dict] | None:
        """The tools handed to the chat template (None for ``tool_choice: "none"``: the model
        is not told of them)."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": f.definition} for f in self.functions]

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
        demands: one or more calls (``required``, a named function), or with :attr:`guards`
        free text in which a block, once its ``<tool_call>`` is written, is a call of an
        offered function, a strict one's arguments matching its schema (a lazy lexeme: the
        text ends at the tag); None when the model is free."""
        if self.constrains:
            chosen = [f for f in self.functions if self.choice == "required" or f.name == self.name]
            repeat = ' ("\\n" call)*' if self.choice == "required" and self.parallel else ""
            return "\n".join([f"start: call{repeat}", f'call: "{OPEN}" body']
                             + _bodies(chosen, True))
        if not self.guards:
            return None
        return "\n".join(["%llguidance {}", "start: called* TEXT", "called: opened body",
                          f'opened[lazy]: TEXT "{OPEN}"', "TEXT: /(.|\\n)*/"]
                         + _bodies(self.functions, False))

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


def _bodies(functions, every_schema: bool) -> list[str]:
    """Lark rules ``body``: what follows ``<tool_call>`` in a call of one of ``functions``,
    written as the template shows JSON, the arguments matching the function's ``parameters``
    (``every_schema``; else a strict function's only, any object another's)."""
    rules = []
    for i, f in enumerate(functions):
        held = every_schema or f.strict
        schema = {"type": "object", **(f.parameters if held else {})}
        rules.append(f'body_{i}: "\\n{{\\"name\\": \\"{f.name}\\", \\"arguments\\": " '
                     f'args_{i} "}}\\n{CLOSE}"')
        rules.append(f"args_{i}: %json {json.dumps({**schema, 'x-guidance': ARGUMENT_STYLE})}")
    return [f"body: {' | '.join(f'body_{i}' for i in range(len(functions)))}"] + rules


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
#: chat template text -> None (tools supported) or the reason they are not
_TEMPLATES: dict[str, str | None] = {}


def check_template(tokenizer) -> None:
    """Raise :class:`ToolError` unless the model's chat template shows tools to the model
    and asks for calls in the ``<tool_call>`` format this module parses."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ToolError("this model has no chat template, so it cannot be offered tools; send "
                        "the request without 'tools'")
    if isinstance(template, dict):  # several named templates: the one for tools, or default
        template = template.get("tool_use") or template.get("default") or ""
    if template not in _TEMPLATES:
        _TEMPLATES[template] = _template_problem(tokenizer)
    problem = _TEMPLATES[template]
    if problem is not None:
        raise ToolError(problem)


def _template_problem(tokenizer) -> str | None:
    def render(tools):
        return tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=tools, tokenize=False,
                                             add_generation_prompt=True)

    try:
        with_tools, without = render(_PROBE_TOOLS), render(None)
    except Exception as exc:  # the template's own errors
        return f"this model's chat template fails when given tools ({exc}); send the request " \
               "without 'tools'"
    if with_tools == without:
        return ("this model's chat template does not support tools (it renders the same prompt "
                "with and without them), so the model would never see them; send the request "
                "without 'tools', or serve a model whose template handles tools (such as "
                "qwen2.5-coder-0.5b)")
    if OPEN not in with_tools:
        return (f"this model's chat template asks for tool calls in a format this server does "
                f"not parse (it parses {OPEN} JSON blocks, the Qwen2.5 and Hermes format); send "
                "the request without 'tools'")
    return None


# ---- the output ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    #: JSON text, as OpenAI sends it
    arguments: str

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_call(block: str) -> ToolCall | None:
    """The call a closed block's text holds, or None when it holds none (not JSON, no string
    ``name``, ``arguments`` neither an object nor JSON text of one)."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True)
class CallStart:
    """A call's first event: its place among the output's calls, ``id`` and ``name``."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    """The next piece of call ``index``'s arguments (JSON text)."""
    index: int
    text: str


#: the header a streamed call opens with, cut into what :func:`_header` matches in turn: a
#: whitespace run (" "), a literal, or NAME_FIELD (the function's name as a JSON string); the
#: arguments object's "{" ends it
_HEADER = (" ", "{", " ", '"name"', " ", ":", " ", "NAME_FIELD", " ", ",", " ", '"arguments"', " ",
           ":", " ", "{")


def _header(text: str) -> tuple[bool | None, int, str]:
    """Whether a block's text opens with a call's header: (True, where its arguments' ``{``
    is, the name); (None, 0, "") while the text may still become one; (False, 0, "") when it
    cannot."""
    at, name = 0, ""
    for part in _HEADER:
        if part == " ":
            while at < len(text) and text[at].isspace():
                at += 1
            continue
        if part == "NAME_FIELD":
            if at == len(text):
                return None, 0, ""
            if text[at] != '"':
                return False, 0, ""
            stop = at + 1
            while stop < len(text) and NAME_CHAR.match(text[stop]):
                stop += 1
            if stop == len(text):
                return (None, 0, "") if stop - at - 1 <= NAME_MAX else (False, 0, "")
            if text[stop] != '"' or not NAME.fullmatch(text[at + 1:stop]):
                return False, 0, ""
            at, name = stop + 1, text[at + 1:stop]
            continue
        piece = text[at:at + len(part)]
        if piece != part[:len(piece)]:
            return False, 0, ""
        if len(piece) < len(part):
            return None, 0, ""
        at += len(part)
    return True, at - 1, name


class ToolCallParser:
    """Content and calls from generated text fed in pieces (split anywhere, inside a tag
    too). :meth:`feed` and :meth:`finish` return events: ``str`` (content), :class:`CallStart`
    and :class:`Arguments`; whatever the split, the events' content joined and their calls
    put together are the same.

    A block that opens with ``{"name": "NAME", "arguments": {`` (any whitespace between) is a
    call from there on: its name goes out at once and its arguments as they are written, up to
    the ``}`` that closes their object (strings and nesting followed, so a brace or
    ``</tool_call>`` inside a string is part of them); what follows it in the block (the outer
    ``}``) is dropped. Cut by ``max_tokens``, such a call keeps the arguments written so far,
    as OpenAI's do. Any other block waits for its ``</tool_call>``: a call if its JSON holds a
    string ``name`` and object ``arguments`` (or JSON text of one), else content as written.

    Held back until it is known what it is: text that may be the start of ``<tool_call>``,
    whitespace that may precede a call (dropped if one follows), a block's opening until it
    is known to be a call's header or not, a ``<`` outside the arguments' strings that may
    begin ``</tool_call>``."""

    def __init__(self):
        self.calls = 0
        self._text = ""  # unread text
        self._space = ""  # whitespace after the content, kept until we see what follows it
        #: where the text is: "content", "block" (a block's opening, _text its text so far),
        #: "arguments" (a streamed call's), "after" (a streamed call's block after them)
        self._state = "content"
        self._depth = 0  # open objects and arrays of the arguments
        self._string = False  # inside a string of the arguments
        self._escape = False  # after a backslash in that string

    def feed(self, text: str) -> list[str | CallStart | Arguments]:
        self._text += text
        events: list[str | CallStart | Arguments] = []
        while self._step(events):
            pass
        return events

    def _step(self, events: list) -> bool:
        """Read what the unread text settles; False when it needs more text."""
        if self._state == "content":
            start = self._text.find(OPEN)
            if start < 0:
                keep = _partial_tag(self._text)
                self._content(self._text[:len(self._text) - keep], events)
                self._text = self._text[len(self._text) - keep:]
                return False
            self._content(self._text[:start], events)
            self._text, self._state = self._text[start + len(OPEN):], "block"
            return True
        if self._state == "block":
            opens, at, name = _header(self._text)
            if opens:
                self._start(name, events)
                self._text, self._state = self._text[at:], "arguments"
                return True
            end = self._text.find(CLOSE)
            if end < 0:
                return False
            block, self._text = self._text[:end], self._text[end + len(CLOSE):]
            self._state = "content"
            call = read_call(block)
            if call is None:  # not a call: the text as the model wrote it, markup included
                self._content(OPEN + block + CLOSE, events)
            else:
                self._start(call.name, events, call.id)
                events.append(Arguments(self.calls - 1, call.arguments))
            return True
        if self._state == "arguments":
            read = self._arguments()
            if read:
                events.append(Arguments(self.calls - 1, self._text[:read]))
                self._text = self._text[read:]
            if self._state == "arguments":
                return False
        end = self._text.find(CLOSE)
        if end < 0:
            self._text = self._text[len(self._text) - _partial_tag(self._text, CLOSE):]
            return False
        self._text, self._state = self._text[end + len(CLOSE):], "content"
        return True

    def _arguments(self) -> int:
        """Characters of the unread text that belong to the arguments (the state moves on
        when their object closes, or when ``</tool_call>`` ends the block first)."""
        for i, char in enumerate(self._text):
            if self._escape:
                self._escape = False
            elif self._string:
                self._escape, self._string = char == "\\", char != '"'
            elif char == '"':
                self._string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "after"
                    return i + 1
            elif char == "<" and CLOSE.startswith(self._text[i:i + len(CLOSE)]):
                if len(self._text) - i < len(CLOSE):
                    return i  # may be the block's end: wait
                self._state = "after"
                return i
        return len(self._text)

    def _start(self, name: str, events: list, call_id: str | None = None) -> None:
        self._space = ""  # whitespace before a call is dropped
        events.append(CallStart(self.calls, call_id or new_call_id(), name))
        self.calls += 1
        self._depth, self._string, self._escape = 0, False, False

    def finish(self) -> list[str | CallStart | Arguments]:
        """The end of the output: held text becomes content (an unclosed block that is not a
        streamed call, as written) or the rest of the call's arguments; whitespace after the
        last call is dropped."""
        events: list[str | CallStart | Arguments] = []
        if self._state == "arguments" and self._text:
            events.append(Arguments(self.calls - 1, self._text))
        elif self._state in ("content", "block"):
            self._content(OPEN + self._text if self._state == "block" else self._text, events)
        self._text, self._state = "", "content"
        if self._space and not self.calls:
            events.append(self._space)
        self._space = ""
        return events

    def _content(self, text: str, events: list) -> None:
        if not text:
            return
        body = text.rstrip()
        if not body:  # only whitespace: keep it until we know what follows
            self._space += text
            return
        events.append(self._space + body)
        self._space = text[len(body):]


def _partial_tag(text: str, tag: str = OPEN) -> int:
    """Characters at the end of ``text`` that begin ``tag`` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; with calls, no content is None (as OpenAI sends
    it)."""
    parser = ToolCallParser()
    return collect(parser.feed(text) + parser.finish())


def collect(events: list[str | CallStart | Arguments]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) the parser's events put together; with calls, no content is None."""
    content, calls = [], []
    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif isinstance(event, CallStart):
            calls.append(ToolCall(event.id, event.name, ""))
        else:
            call = calls[event.index]
            calls[event.index] = ToolCall(call.id, call.name, call.arguments + event.text)
    text = "".join(content)
    return (text or None) if calls else text, calls


class StreamDeltas:
    """The chat deltas a stream sends for each choice: every text piece as content, or, when
    the request's tools are parsed (``parse``), content and calls as OpenAI streams them: a
    call's first delta has its ``index`` (its place among the choice's calls), ``id``, ``type``
    and ``function.name``, the next ones pieces of its ``function.arguments``."""

    def __init__(self, choices: int, parse: bool):
        self.parsers = [ToolCallParser() for _ in range(choices)] if parse else None

    def text(self, index: int, piece: str) -> list[dict]:
        if self.parsers is None:
            return [{"content": piece}] if piece else []
        return [_delta(e) for e in self.parsers[index].feed(piece)]

    def finish(self, index: int, reason: str) -> tuple[list[dict], str]:
        """(the last deltas, the finish reason) when choice ``index`` ended for ``reason``."""
        if self.parsers is None:
            return [], reason
        parser = self.parsers[index]
        return [_delta(e) for e in parser.finish()], finish_reason(reason, parser.calls)


def _delta(event: str | CallStart | Arguments) -> dict:
    if isinstance(event, str):
        return {"content": event}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def finish_reason(reason: str, calls: int) -> str:
    """OpenAI's ``tool_calls`` when an output that ended by itself made calls."""
    return "tool_calls" if calls and reason == "stop" else reason
