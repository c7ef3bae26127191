"""Tool calls out: content and calls from the text a model writes, in its template's call
format (:class:`~specdecode.server.tools.ToolFormat`), whole or as a stream sends them
(OpenAI's deltas). :mod:`specdecode.server.tools` has the request side and the formats.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from specdecode.server.tools import (HERMES, MISTRAL_CALL_ID, NAME, NAME_CHAR, NAME_MAX,
                                     ToolFormat, xml_value)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    #: JSON text, as OpenAI sends it
    arguments: str

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(short: bool = False) -> str:
    """OpenAI's kind of call id, or nine letters and digits (``short``: Mistral's templates
    refuse any other id in the conversation a client sends back)."""
    return uuid.uuid4().hex[:9] if short else f"call_{uuid.uuid4().hex[:24]}"


def read_call(block: str) -> ToolCall | None:
    """The call a closed Hermes block's text holds, or None when it holds none (not JSON, no
    string ``name``, ``arguments`` neither an object nor JSON text of one)."""
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


def _header(text: str, arguments: str) -> tuple[bool | None, int, str]:
    """Whether a call's text opens with its header, ``{"name": "NAME", "ARGUMENTS": {`` (any
    whitespace between; ``arguments`` the format's field): (True, where its arguments' ``{``
    is, the name); (None, 0, "") while the text may still become one; (False, 0, "") when it
    cannot."""
    # cut into what is matched in turn: a whitespace run (" "), a literal, or NAME_FIELD (the
    # function's name as a JSON string); the arguments object's "{" ends it
    header = (" ", "{", " ", '"name"', " ", ":", " ", "NAME_FIELD", " ", ",", " ", f'"{arguments}"',
              " ", ":", " ", "{")
    at, name = 0, ""
    for part in header:
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
    too), in the model's call format (``fmt``). :meth:`feed` and :meth:`finish` return events:
    ``str`` (content), :class:`CallStart` and :class:`Arguments`; whatever the split, the
    events' content joined and their calls put together are the same.

    A call that opens with ``{"name": "NAME", "arguments": {`` (the format's field; any
    whitespace between) is a call from there on: its name goes out at once and its arguments
    as they are written, up to the ``}`` that closes their object (strings and nesting
    followed, so a brace or ``</tool_call>`` inside a string is part of them); what follows
    them in the call (the outer ``}``, and in a Hermes block anything up to its closing tag)
    is dropped. Cut by ``max_tokens``, such a call keeps the arguments written so far, as
    OpenAI's do. Any other Hermes block waits for its ``</tool_call>``: a call if its JSON
    holds a string ``name`` and object ``arguments`` (or JSON text of one), else content as
    written. In the bare-JSON format only the answer's first text can be a call, and one
    whose first text is not a call's header is content. In the XML format a block that opens
    with ``<function=NAME>`` is a call from there on, each ``<parameter=KEY>`` going out as a
    piece of the arguments' JSON once its ``</parameter>`` is read (its value read by the
    parameter's schema, :func:`~specdecode.server.tools.xml_value`), the object closed at
    ``</function>`` or at anything else; another block is read as a Hermes one. In Mistral's
    formats ``[TOOL_CALLS]`` opens the calls: a JSON array whose elements are read as bare
    calls are (what follows a call's arguments in its object dropped; an element that opens
    otherwise waits for the array's ``]``, then the rest is calls if each element holds one,
    else content as written), or ``NAME[ARGS]`` and the arguments' object, the call ending
    with it.

    Held back until it is known what it is: text that may be the start of ``<tool_call>``,
    whitespace that may precede a call (dropped if one follows), a call's opening until it
    is known to be a call's header or not, a ``<`` outside the arguments' strings that may
    begin ``</tool_call>``."""

    def __init__(self, fmt: ToolFormat = HERMES, schemas: dict[str, dict] | None = None):
        self.format = fmt
        #: function name -> its parameters' schema (what XML values are read by)
        self.schemas = schemas or {}
        self.calls = 0
        self._text = ""  # unread text
        self._space = ""  # whitespace after the content, kept until we see what follows it
        #: where the text is: "content", "call" (a call's opening, _text its text so far),
        #: "arguments" (a streamed call's), "xml" (an XML call's parameters), "after" (a
        #: streamed call's text after its arguments)
        self._state = "content"
        self._properties: dict = {}  # the XML call's function's parameters, by name
        self._params = 0  # the XML call's parameters read
        #: bare JSON: no text but whitespace read yet (the only place a call can begin)
        self._first = True
        #: what opened the call not yet begun (its tag; a "[" or "," of Mistral's array): the
        #: content it is, where the output ends before the call begins
        self._opened = ""
        self._held = ""  # a Mistral array's rest after an element that is no call's header
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
        fmt = self.format
        if self._state == "content":
            return self._bare_content(events) if not fmt.open else self._tagged_content(events)
        if self._state in ("array", "next", "rest"):
            return self._array_part(events)
        if self._state == "call" and fmt.args:
            return self._named_call(events)
        if self._state == "call" and fmt.xml:
            opens, at, name = _xml_header(self._text)
            if opens:
                self._start(name, events)
                self._text, self._state, self._params = self._text[at:], "xml", 0
                self._properties = self.schemas.get(name, {}).get("properties") or {}
                return True
            if opens is None:
                return False
        if self._state == "xml":
            return self._xml_parameter(events)
        if self._state == "call":
            return self._json_call(events)
        if self._state == "arguments":
            read = self._scan()
            if read:
                events.append(Arguments(self.calls - 1, self._text[:read]))
                self._text = self._text[read:]
            if self._state == "arguments":
                return False
            if fmt.args:  # the arguments' object is the whole call
                self._state = "content"
                return True
            if not fmt.close:  # the rest of the call's object, up to its "}"
                self._depth, self._string, self._escape = 1, False, False
        if not fmt.close:
            read = self._scan()
            self._text = self._text[read:]
            if self._state == "after":
                return False
            self._state = "next" if fmt.array else "content"
            return True
        end = self._text.find(fmt.close)
        if end < 0:
            self._text = self._text[len(self._text) - partial_tag(self._text, fmt.close):]
            return False
        self._text, self._state = self._text[end + len(fmt.close):], "content"
        return True

    def _json_call(self, events: list) -> bool:
        """A JSON call's opening: its header (the call begins, its arguments streamed), or
        what else it is in the format (bare JSON: content; Mistral's array: its rest read
        whole; a tagged block: read once closed)."""
        fmt = self.format
        opens, at, name = _header(self._text, fmt.arguments)
        if opens:
            self._start(name, events)
            self._text, self._state = self._text[at:], "arguments"
            return True
        if not fmt.open or fmt.array:
            if opens is None:
                return False
            if fmt.array:  # an element that opens with no call's header
                self._state, self._depth, self._string, self._escape = "rest", 1, False, False
            else:  # bare JSON: the answer's content
                self._state = "content"
            return True
        return self._closed_block(events)

    def _closed_block(self, events: list) -> bool:
        """A tagged block that opens with no call's header, once its closing tag is read: a
        call if its JSON holds one (:func:`read_call`), else content as written."""
        fmt = self.format
        end = self._text.find(fmt.close)
        if end < 0:
            return False
        block, self._text = self._text[:end], self._text[end + len(fmt.close):]
        self._state = "content"
        call = read_call(block)
        if call is None:  # not a call: the text as the model wrote it, markup included
            self._content(fmt.open + block + fmt.close, events)
        else:
            self._start(call.name, events, call.id)
            events.append(Arguments(self.calls - 1, call.arguments))
        return True

    def _tagged_content(self, events: list) -> bool:
        start = self._text.find(self.format.open)
        if start < 0:
            keep = partial_tag(self._text, self.format.open)
            self._content(self._text[:len(self._text) - keep], events)
            self._text = self._text[len(self._text) - keep:]
            return False
        self._content(self._text[:start], events)
        self._text = self._text[start + len(self.format.open):]
        self._state = "array" if self.format.array else "call"
        self._opened = self.format.open
        return True

    def _array_part(self, events: list) -> bool:
        """Mistral's array of calls: its ``[`` after the tag ("array"; anything else makes the
        tag content), a ``,`` or its ``]`` after a call ("next"), or its rest after an element
        that opens with no call's header ("rest": once the array's ``]`` is read, calls if its
        elements all hold one, :func:`read_call`, else content as written)."""
        if self._state == "rest":
            return self._array_rest(events)
        body = self._text.lstrip()
        if not body:
            return False
        expected = "[" if self._state == "array" else ",]"
        if body[0] not in expected:  # not Mistral's array: content as written
            self._content(self._opened if self._state == "array" else "", events)
            self._state = "content"
            return True
        self._opened += body[0]
        self._text, self._state = body[1:], "content" if body[0] == "]" else "call"
        return True

    def _array_rest(self, events: list) -> bool:
        """The array's rest, held until its ``]`` is read: calls if each element holds one,
        else content as written."""
        read = self._scan()
        self._held, self._text = self._held + self._text[:read], self._text[read:]
        if self._state == "rest":
            return False
        rest, self._held = self._held, ""
        try:
            elements = json.loads("[" + rest)
        except ValueError:
            elements = None
        calls = ([read_call(json.dumps(e)) for e in elements]
                 if isinstance(elements, list) else [None])
        if None in calls:
            self._content(self._opened + rest, events)
            return True
        for call in calls:
            self._start(call.name, events)
            events.append(Arguments(self.calls - 1, call.arguments))
        return True

    def _named_call(self, events: list) -> bool:
        """Mistral's later form after ``[TOOL_CALLS]``: ``NAME[ARGS]`` (a ``[CALL_ID]ID``
        between is dropped) opens a call whose arguments' object follows; other text makes
        the tag content."""
        opens, at, name = _named_header(self._text, self.format.args)
        if opens is None:
            return False
        if opens:
            self._start(name, events)
            self._text, self._state = self._text[at:], "arguments"
        else:
            self._content(self._opened, events)
            self._state = "content"
        return True

    def _bare_content(self, events: list) -> bool:
        if self._first:
            body = self._text.lstrip()
            self._space += self._text[:len(self._text) - len(body)]
            self._text = body
            if not body:
                return False
            self._first = False
            if body.startswith("{"):
                self._state = "call"
                return True
        self._content(self._text, events)
        self._text = ""
        return False

    def _xml_parameter(self, events: list) -> bool:
        """The XML call's next parameter (its JSON field once its closing tag is read) or its
        end (the arguments' ``}``, then on to the block's end, as after a malformed tag)."""
        body = self._text.lstrip()
        if body.startswith(XML_PARAMETER):
            named, ends = body.find(">"), body.find(XML_PARAMETER_END)
            if named < 0 or ends < 0:
                return False
            key, raw = body[len(XML_PARAMETER):named], body[named + 1:ends]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            schema = self._properties.get(key)
            events.append(Arguments(self.calls - 1, ("{" if not self._params else ", ")
                                    + json.dumps(key, ensure_ascii=False) + ": "
                                    + json.dumps(xml_value(raw, schema), ensure_ascii=False)))
            self._params += 1
            self._text = body[ends + len(XML_PARAMETER_END):]
            return True
        if any(tag.startswith(body) for tag in (XML_PARAMETER, XML_FUNCTION_END)):
            return False
        events.append(Arguments(self.calls - 1, "}" if self._params else "{}"))
        self._text = body[len(XML_FUNCTION_END):] if body.startswith(XML_FUNCTION_END) else body
        self._state = "after"
        return True

    def _scan(self) -> int:
        """Characters of the unread text inside the open object (the arguments', or after
        them a bare call's): the state moves to "after" where the object closes (past its
        ``}``), or where the format's closing tag ends the call first."""
        close = self.format.close
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
                    self._state = "after" if self._state == "arguments" else "content"
                    return i + 1
            elif close and char == "<" and close.startswith(self._text[i:i + len(close)]):
                if len(self._text) - i < len(close):
                    return i  # may be the block's end: wait
                self._state = "after"
                return i
        return len(self._text)

    def _start(self, name: str, events: list, call_id: str | None = None) -> None:
        self._space, self._opened = "", ""  # whitespace before a call is dropped
        events.append(CallStart(self.calls, call_id or new_call_id(self.format.short_ids), name))
        self.calls += 1
        self._depth, self._string, self._escape = 0, False, False

    def finish(self) -> list[str | CallStart | Arguments]:
        """The end of the output: held text becomes content (an unclosed block or call
        opening that is not a streamed call, as written) or the rest of the call's arguments;
        whitespace after the last call is dropped."""
        events: list[str | CallStart | Arguments] = []
        if self._state == "arguments" and self._text:
            events.append(Arguments(self.calls - 1, self._text))
        elif self._state in ("content", "call", "array", "rest"):
            opened = self._opened if self._state != "content" else ""
            self._content(opened + self._held + self._text, events)
        self._text, self._held, self._state = "", "", "content"
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


XML_FUNCTION, XML_FUNCTION_END = "<function=", "</function>"
XML_PARAMETER, XML_PARAMETER_END = "<parameter=", "</parameter>"


def _xml_header(text: str) -> tuple[bool | None, int, str]:
    """Whether an XML block's text opens with ``<function=NAME>`` (any whitespace before):
    (True, where its text goes on, the name); (None, 0, "") while it may still; (False, 0,
    "") when it cannot."""
    body = text.lstrip()
    at = len(text) - len(body)
    if not body.startswith(XML_FUNCTION):
        return (None, 0, "") if XML_FUNCTION.startswith(body) else (False, 0, "")
    end = body.find(">")
    name = body[len(XML_FUNCTION):end if end >= 0 else len(body)]
    if name and not NAME.fullmatch(name) or len(name) > NAME_MAX:
        return False, 0, ""
    if end < 0:
        return None, 0, ""
    return (True, at + end + 1, name) if name else (False, 0, "")


def _named_header(text: str, args: str) -> tuple[bool | None, int, str]:
    """Whether a Mistral call's text after ``[TOOL_CALLS]`` opens with ``NAME``, an optional
    ``[CALL_ID]ID``, the tag ``args`` and the arguments' ``{`` (whitespace allowed around the
    name and before the ``{``): (True, where the ``{`` is, the name); (None, 0, "") while it
    may still; (False, 0, "") when it cannot."""
    at = len(text) - len(text.lstrip())
    stop = at
    while stop < len(text) and NAME_CHAR.match(text[stop]):
        stop += 1
    name = text[at:stop]
    if len(name) > NAME_MAX:
        return False, 0, ""
    at = len(text) - len(text[stop:].lstrip())
    if at == len(text):
        return None, 0, ""
    if not name:
        return False, 0, ""
    if text.startswith(MISTRAL_CALL_ID, at):
        at += len(MISTRAL_CALL_ID)
        while at < len(text) and text[at].isalnum():
            at += 1
    elif MISTRAL_CALL_ID.startswith(text[at:]):  # (it and the tag both begin "[")
        return None, 0, ""
    rest = text[at:at + len(args)]
    if rest != args:
        return (None, 0, "") if len(rest) < len(args) and args.startswith(rest) else (False, 0, "")
    at += len(args)
    at = len(text) - len(text[at:].lstrip())
    if at == len(text):
        return None, 0, ""
    return (True, at, name) if text[at] == "{" else (False, 0, "")


def partial_tag(text: str, tag: str) -> int:
    """Characters at the end of ``text`` that begin ``tag`` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def parse_tool_calls(text: str, fmt: ToolFormat = HERMES, schemas: dict[str, dict] | None = None
                     ) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output in format ``fmt`` (``schemas``: the functions'
    parameters, by name); with calls, no content is None (as OpenAI sends it)."""
    parser = ToolCallParser(fmt, schemas)
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
    the request's tools are parsed (``fmt``, the model's call format, ``schemas`` the
    functions' parameters by name; None: not parsed),
    content and calls as OpenAI streams them: a call's first delta has its ``index`` (its
    place among the choice's calls), ``id``, ``type`` and ``function.name``, the next ones
    pieces of its ``function.arguments``."""

    def __init__(self, choices: int, fmt: ToolFormat | None,
                 schemas: dict[str, dict] | None = None):
        self.parsers = [ToolCallParser(fmt, schemas) for _ in range(choices)] if fmt else None
        #: each choice's calls read elsewhere (:meth:`call`: harmony's messages)
        self.made = [0] * choices

    def text(self, index: int, piece: str) -> list[dict]:
        if self.parsers is None:
            return [{"content": piece}] if piece else []
        return [_delta(e) for e in self.parsers[index].feed(piece)]

    def call(self, index: int, event: CallStart | Arguments) -> dict:
        """The delta of an event of a call read elsewhere than in the content."""
        self.made[index] += isinstance(event, CallStart)
        return _delta(event)

    def finish(self, index: int, reason: str) -> tuple[list[dict], str]:
        """(the last deltas, the finish reason) when choice ``index`` ended for ``reason``."""
        if self.parsers is None:
            return [], finish_reason(reason, self.made[index])
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
