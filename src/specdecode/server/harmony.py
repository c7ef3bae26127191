"""gpt-oss's answers, in OpenAI's harmony format: reasoning, answer and tool calls as channels.

gpt-oss writes an answer as messages, each a header, ``<|message|>`` and a body; the prompt ends
with ``<|start|>assistant``, and ``<|end|><|start|>assistant`` opens each later message::

    <|channel|>analysis<|message|>The user wants a forecast.<|end|><|start|>assistant
    <|channel|>final<|message|>Sunny all week.

    <|channel|>analysis<|message|>Need the forecast.<|end|><|start|>assistant
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

(a recipient may also stand before the channel, ``to=functions.get_weather<|channel|>commentary
json<|message|>``, as the template writes earlier calls). ``<|return|>`` ends an answer and
``<|call|>`` a call: both stop the generation (:func:`specdecode.api.turn_ends`). The other tags
are special tokens, which a decode drops: the text the server reads keeps them
(:attr:`Harmony.kept_tokens`), for every chat request.

A message to ``functions.NAME`` is a tool call where the request's tools are parsed; else the
analysis channel is the message's ``reasoning_content``, and the final channel and commentary
(without a recipient: a preamble the model means the user to see) its ``content``. A call's id,
name and arguments stream as the other formats' do (:mod:`~specdecode.server.tool_parser`'s
events).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specdecode.constraints import JSON_OPTIONS
from specdecode.server.tool_parser import Arguments, CallStart, new_call_id, partial_tag
from specdecode.server.tools import HARMONY, HARMONY_TAGS, with_special_tags

START, CHANNEL, MESSAGE, END, _ = HARMONY_TAGS
#: a call's recipient: ``functions.`` and the function's name
FUNCTIONS = "functions."
#: the most characters a header holds before its ``<|message|>``; a longer run is not harmony
HEADER_MAX = 256
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
#: what an answer's first header may begin with: its channel, or its recipient
_OPENINGS = (CHANNEL, " to=", "to=")


@dataclass(frozen=True)
class Harmony:
    """A model that answers in harmony's channels: its tags' token ids."""

    tags: tuple[tuple[str, int], ...]

    @property
    def kept_tokens(self) -> tuple[int, ...]:
        """The tags whose text the parsed answer keeps."""
        return tuple(token for _, token in self.tags)


def harmony_of(tokenizer) -> Harmony | None:
    """The model's harmony tags, where its chat template writes harmony's messages and every
    tag is a special token of its tokenizer (None otherwise)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or ""
    if not template or CHANNEL not in template or MESSAGE not in template:
        return None
    found = with_special_tags(HARMONY, tokenizer).special
    return Harmony(found) if len(found) == len(HARMONY_TAGS) else None


class HarmonySplitter:
    """Reasoning, content and tool calls from a harmony answer's text fed in pieces split
    anywhere: :meth:`feed` and :meth:`finish` return ``("reasoning", text)``, ``("content",
    text)``, :class:`~.tool_parser.CallStart` and :class:`~.tool_parser.Arguments` events, the
    same joined whatever the split. ``calls``: messages to ``functions.NAME`` are calls (the
    request's tools are parsed). A second message of the same kind is joined to the first by a
    newline. Text that does not open as harmony is all content, as written."""

    def __init__(self, calls: bool):
        self.calls = calls
        self._text = ""  # unread text
        #: "header" (up to <|message|>), "body", "next" (after <|end|>: <|start|> awaited),
        #: "plain" (not harmony: content as written)
        self._state = "header"
        self._first = True  # the answer's first header
        self._kind = ""  # the body's: "reasoning", "content" or "arguments"
        self._written: set[str] = set()  # the kinds whose text is out
        self._opened = False  # the body's first text is not out yet
        #: the answer holds reasoning (an analysis message)
        self.reasoned = False
        #: the calls read so far
        self.made = 0

    def feed(self, text: str) -> list:
        self._text += text
        events: list = []
        while self._step(events):
            pass
        return events

    def _step(self, events: list) -> bool:
        """Read what the unread text settles; False when it needs more text."""
        if self._state == "plain":
            if self._text:
                events.append(("content", self._text))
                self._text = ""
            return False
        if self._state == "next":
            rest = self._text.lstrip()
            if START.startswith(rest):  # nothing yet, or what may become the tag
                return False
            self._state = "header" if rest.startswith(START) else "plain"
            self._text = rest[len(START):] if self._state == "header" else rest
            return True
        if self._state == "header":
            return self._header(events)
        at = min((i for i in (self._text.find(END), self._text.find(START)) if i >= 0),
                 default=-1)
        if at >= 0:  # the message ends (a <|start|> without <|end|> ends it too)
            self._body(self._text[:at], events)
            self._text = self._text[at + (len(END) if self._text.startswith(END, at) else 0):]
            self._state = "next"
            return True
        keep = max(partial_tag(self._text, END), partial_tag(self._text, START))
        self._body(self._text[:len(self._text) - keep], events)
        self._text = self._text[len(self._text) - keep:]
        return False

    def _header(self, events: list) -> bool:
        at = self._text.find(MESSAGE)
        if at < 0:
            opening = not self._first or any(o.startswith(self._text) or self._text.startswith(o)
                                             for o in _OPENINGS)
            if not opening or len(self._text) > HEADER_MAX:
                self._state = "plain"
                return True
            return False
        header, self._text = self._text[:at], self._text[at + len(MESSAGE):]
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        if recipient and recipient.group(1).startswith(FUNCTIONS) and self.calls:
            events.append(CallStart(self.made, new_call_id(),
                                    recipient.group(1)[len(FUNCTIONS):]))
            self.made += 1
            self._kind = "arguments"
        elif channel and channel.group(1) == "analysis":
            self._kind, self.reasoned = "reasoning", True
        else:
            self._kind = "content"
        self._state, self._first, self._opened = "body", False, True
        return True

    def _body(self, text: str, events: list) -> None:
        if not text:
            return
        if self._kind == "arguments":
            events.append(Arguments(self.made - 1, text))
            return
        if self._opened and self._kind in self._written:
            text = "\n" + text
        self._opened = False
        self._written.add(self._kind)
        events.append((self._kind, text))

    def finish(self) -> list:
        """The answer's end: the rest of a body cut short, or of text held as a tag's start
        after a message (a header cut short is dropped)."""
        events: list = []
        if self._state == "body":
            self._body(self._text, events)
        elif self._state == "next" and self._text.strip():
            events.append(("content", self._text.lstrip()))
        self._text = ""
        return events


def in_final_message(asked: dict, harmony: Harmony) -> dict:
    """``make_constraint``'s arguments with a JSON ``response_format`` (``json_object`` or
    ``json_schema``) held as the final channel's message, ``<|channel|>final<|message|>`` then
    the JSON: gpt-oss writes its answer there, and JSON from the answer's first token would
    make it write outside its own format (and the JSON alone is the message's content)."""
    schema = {"type": "object"} if asked.get("json_object") else asked.get("json_schema")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return asked  # make_constraint names the problem
    if not isinstance(schema, dict):
        return asked
    tags = dict(harmony.tags)
    out = {k: v for k, v in asked.items() if k not in ("json_object", "json_schema")}
    out["grammar"] = (f'start: <[{tags[CHANNEL]}]> "final" <[{tags[MESSAGE]}]> answer\n'
                      f"answer: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
    return out


def split_harmony(text: str, calls: bool) -> tuple[str | None, list]:
    """(reasoning, the content and call events) of a whole answer; no reasoning is None."""
    splitter = HarmonySplitter(calls)
    events = splitter.feed(text) + splitter.finish()
    reasoning = "".join(e[1] for e in events if isinstance(e, tuple) and e[0] == "reasoning")
    rest = [e[1] if isinstance(e, tuple) else e for e in events
            if not (isinstance(e, tuple) and e[0] == "reasoning")]
    return (reasoning if splitter.reasoned else None), rest
