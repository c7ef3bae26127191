"""Tool calls: OpenAI's ``tools`` and ``tool_choice`` in, the model's own tool-call text out.

The functions reach the model through its own chat template (``apply_chat_template(messages,
tools=...)``), as it was trained to see them; what it writes back is parsed here. Qwen2.5 and
Hermes-style templates ask for one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallParser` turns generated text, fed in pieces split anywhere, into content and
calls. A block becomes a call only once it is closed and its JSON holds a string ``name`` and
object ``arguments``; anything else (malformed JSON, a block cut by ``max_tokens``, text that
only looks like the start of a tag) stays in the content, character for character, so nothing
the model wrote is lost. Whitespace between content and a call is dropped, so
``"Let me check.\\n<tool_call>..."`` gives the content ``"Let me check."``.

``tool_choice: "required"`` or a named function constrains the output with a grammar
(:meth:`ToolRequest.grammar`): one or more such blocks (exactly one for a named function),
each block's arguments matching its function's parameter schema. The grammar is a per-node
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
#: OpenAI's rule for function names (also what keeps them safe inside the grammar's literals)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
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
    def parses(self) -> bool:
        """The output is parsed for calls (not with ``tool_choice: "none"``)."""
        return self.choice != "none"

    def grammar(self) -> str | None:
        """A Lark grammar (llguidance's, with ``%json`` schemas) for the output ``tool_choice``
        demands, or None when the model is free (``auto``, ``none``)."""
        if not self.constrains:
            return None
        chosen = [f for f in self.functions if self.choice == "required" or f.name == self.name]
        rules = []
        for i, f in enumerate(chosen):
            schema = {"type": "object", **f.parameters, "x-guidance": ARGUMENT_STYLE}
            rules.append(f'call_{i}: "{OPEN}\\n{{\\"name\\": \\"{f.name}\\", \\"arguments\\": " '
                         f'args_{i} "}}\\n{CLOSE}"')
            rules.append(f"args_{i}: %json {json.dumps(schema)}")
        calls = " | ".join(f"call_{i}" for i in range(len(chosen)))
        repeat = ' ("\\n" call)*' if self.choice == "required" and self.parallel else ""
        return "\n".join([f"start: call{repeat}", f"call: {calls}"] + rules)

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
        raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', "
                        f"got {name!r}")
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
    return Function(name, parameters, definition)


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


class ToolCallParser:
    """Content and calls from generated text fed in pieces (split anywhere, inside a tag
    too). :meth:`feed` and :meth:`finish` return events: ``str`` (content) or :class:`ToolCall`;
    whatever the split, the events' content joined and their calls are the same.

    Held back until it is known what it is: text that may be the start of ``<tool_call>``,
    whitespace that may precede a call (dropped if one follows), and an open block until its
    ``</tool_call>`` (a call if it parses, else content as written)."""

    def __init__(self):
        self.calls = 0
        self._text = ""  # unread text
        self._space = ""  # whitespace after the content, kept until we see what follows it
        self._open = False  # inside a block: _text is its text so far

    def feed(self, text: str) -> list[str | ToolCall]:
        self._text += text
        events: list[str | ToolCall] = []
        while True:
            if not self._open:
                start = self._text.find(OPEN)
                if start < 0:
                    keep = _partial_tag(self._text)
                    self._content(self._text[:len(self._text) - keep], events)
                    self._text = self._text[len(self._text) - keep:]
                    return events
                self._content(self._text[:start], events)
                self._text, self._open = self._text[start + len(OPEN):], True
            end = self._text.find(CLOSE)
            if end < 0:
                return events
            block, self._text = self._text[:end], self._text[end + len(CLOSE):]
            self._open = False
            call = read_call(block)
            if call is None:  # not a call: the text as the model wrote it, markup included
                self._content(OPEN + block + CLOSE, events)
            else:
                self._space = ""  # whitespace before a call is dropped
                self.calls += 1
                events.append(call)

    def finish(self) -> list[str | ToolCall]:
        """The end of the output: held text becomes content (an unclosed block as written);
        whitespace after the last call is dropped."""
        events: list[str | ToolCall] = []
        rest = OPEN + self._text if self._open else self._text
        self._text, self._open = "", False
        self._content(rest, events)
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


def _partial_tag(text: str) -> int:
    """Characters at the end of ``text`` that begin ``<tool_call>`` (0 if none)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; with calls, no content is None (as OpenAI sends
    it)."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return (content or None) if calls else content, calls


class StreamDeltas:
    """The chat deltas a stream sends for each choice: every text piece as content, or, when
    the request's tools are parsed (``parse``), content and calls as OpenAI streams them: a
    call's first delta has its ``index`` (its place among the choice's calls), ``id``, ``type``
    and ``function.name``, the next its ``function.arguments``."""

    def __init__(self, choices: int, parse: bool):
        self.parsers = [ToolCallParser() for _ in range(choices)] if parse else None

    def text(self, index: int, piece: str) -> list[dict]:
        if self.parsers is None:
            return [{"content": piece}] if piece else []
        return self._deltas(index, self.parsers[index].feed(piece))

    def finish(self, index: int, reason: str) -> tuple[list[dict], str]:
        """(the last deltas, the finish reason) when choice ``index`` ended for ``reason``."""
        if self.parsers is None:
            return [], reason
        parser = self.parsers[index]
        return self._deltas(index, parser.finish()), finish_reason(reason, parser.calls)

    def _deltas(self, index: int, events: list[str | ToolCall]) -> list[dict]:
        out, calls = [], self.parsers[index].calls - sum(isinstance(e, ToolCall) for e in events)
        for event in events:
            if isinstance(event, str):
                out.append({"content": event})
                continue
            out.append({"tool_calls": [{"index": calls, "id": event.id, "type": "function",
                                        "function": {"name": event.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": calls,
                                        "function": {"arguments": event.arguments}}]})
            calls += 1
        return out


def finish_reason(reason: str, calls: int) -> str:
    """OpenAI's ``tool_calls`` when an output that ended by itself made calls."""
    return "tool_calls" if calls and reason == "stop" else reason
