"""Reasoning apart from the answer: what a thinking model writes between ``<think>`` and
``</think>`` (Qwen3, Qwen3.5, DeepSeek-R1's distills, Nemotron 3) goes out as the message's
``reasoning_content``, as llama-server and vLLM send it, and only the text after it is the
``content`` (and is read for tool calls: a call the model thinks about is not made).

Whether a model thinks is read off its chat template once (:func:`thinking_of`): one that
writes ``<think>`` at all, and whether its generation prompt already opens the block (Qwen3.5
and Nemotron 3 end the prompt with ``<think>\\n``, so the answer begins inside it; Qwen3 lets
the model write the tag).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.server.tool_parser import partial_tag

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Thinking:
    """How a model's answers hold their reasoning."""

    #: the generation prompt ends inside a ``<think>`` block: the answer begins with reasoning
    opened: bool


def thinking_of(tokenizer) -> Thinking | None:
    """The template's thinking (None: its answers hold no reasoning block)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or ""
    if not template or CLOSE not in template:
        return None
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}],
                                               tokenize=False, add_generation_prompt=True)
    except Exception:  # the template's own errors: the requests will name them
        return Thinking(opened=False)
    return Thinking(opened=left_open(prompt))


def left_open(prompt: str) -> bool:
    """Does the prompt's text end inside a ``<think>`` block (its answer begins with
    reasoning)?"""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ReasoningSplitter:
    """Reasoning and content from an answer's text fed in pieces split anywhere: :meth:`feed`
    and :meth:`finish` return ``("reasoning", text)`` and ``("content", text)`` events, the
    same joined whatever the split. The reasoning is the text of the answer's ``<think>``
    block (from the start where the prompt opened it; else only a block the answer begins
    with), without the whitespace at its ends; the content is what follows the block,
    without the whitespace at its start. An answer cut inside the block is all reasoning."""

    def __init__(self, thinking: Thinking):
        self._text = ""  # unread text
        #: "start" (no text but whitespace yet, a block not opened), "reasoning", "after"
        #: (the block closed, no content yet), "content"
        self._state = "reasoning" if thinking.opened else "start"
        #: the answer holds a reasoning block (the prompt opened it, or its first text did)
        self.reasoned = thinking.opened
        self._begun = False  # the reasoning's first text is out (whitespace before it goes)
        self._space = ""  # whitespace at the reasoning's end so far: dropped at the tag

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._text += text
        events: list[tuple[str, str]] = []
        while self._step(events):
            pass
        return events

    def _step(self, events: list) -> bool:
        """Read what the unread text settles; False when it needs more text."""
        if self._state == "start":
            body = self._text.lstrip()
            if OPEN.startswith(body):  # nothing yet, or what may become the tag
                return False
            if body.startswith(OPEN):
                self._text, self._state, self.reasoned = body[len(OPEN):], "reasoning", True
            else:
                self._state = "content"
            return True
        if self._state == "after":  # whitespace after the block goes
            self._text = self._text.lstrip()
            if not self._text:
                return False
            self._state = "content"
        if self._state == "content":
            events.append(("content", self._text))
            self._text = ""
            return False
        end = self._text.find(CLOSE)
        if end >= 0:
            self._reasoning(self._text[:end], events)
            self._text, self._space = self._text[end + len(CLOSE):], ""
            self._state = "after"
            return True
        keep = partial_tag(self._text, CLOSE)
        self._reasoning(self._text[:len(self._text) - keep], events)
        self._text = self._text[len(self._text) - keep:]
        return False

    def _reasoning(self, text: str, events: list) -> None:
        if not self._begun:
            text = text.lstrip()
            self._begun = bool(text)
        body = text.rstrip()
        if body:
            events.append(("reasoning", self._space + body))
            self._space = ""
        self._space += text[len(body):]

    def finish(self) -> list[tuple[str, str]]:
        """The answer's end: a block never opened and whitespace only: that content; a block
        never closed: the rest of its reasoning."""
        events: list[tuple[str, str]] = []
        if self._state == "start" and self._text:
            events.append(("content", self._text))
        elif self._state == "reasoning":
            self._reasoning(self._text, events)
        self._text = ""
        return events


def split_reasoning(text: str, thinking: Thinking) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; None where it holds no reasoning block."""
    splitter = ReasoningSplitter(thinking)
    events = splitter.feed(text) + splitter.finish()
    reasoning = "".join(t for kind, t in events if kind == "reasoning")
    return ((reasoning if splitter.reasoned else None),
            "".join(t for kind, t in events if kind == "content"))
