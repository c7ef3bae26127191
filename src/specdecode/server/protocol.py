"""The OpenAI wire format: request schemas, error objects and response bodies.

Requests are validated strictly (wrong types are errors, not coerced; unknown fields are
rejected the way OpenAI rejects them) so a typo such as ``"max_token": 5`` fails loudly instead of
being ignored. Every failure becomes OpenAI's error object::

    {"error": {"message": ..., "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Beyond OpenAI's fields the server accepts vLLM's sampling extras (``top_k``, ``min_p``,
``repetition_penalty``) and ``"specdecode": {"method": ..., "config": {...}}`` to choose the
decoding method per request; its ``ban``, ``regex`` and ``grammar`` constrain the output
(docs/structured-output.md), as ``response_format`` does; a lossy method (docs/lossy.md) also
needs ``"allow_lossy": true`` there.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from specdecode.server.tools import (ToolError, ToolFormat, ToolRequest, check_conversation,
                                     template_arguments)

#: most stop sequences a request gives (OpenAI allows 4; lm-evaluation-harness sends a task's
#: every one and the end of sequence: six for HumanEval; vLLM and llama-server set no limit)
MAX_STOP = 16
#: deepest nesting of arrays and objects in a request body (OpenAI's schemas need 5)
MAX_JSON_DEPTH = 32
#: most alternatives per token (OpenAI's top_logprobs limit; its completions allow 5)
MAX_TOP_LOGPROBS = 20
#: methods ``diffusion:POLICY`` decode with the server's dLLM (server/diffusion.py)
DIFFUSION_PREFIX = "diffusion:"


class ApiError(Exception):
    """An error the client caused (4xx) or the server cannot serve now (429/503)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object; text that cannot be encoded (a lone surrogate quoted from a
    request) is escaped, so an error can always be sent."""
    message, param = (None if t is None else t.encode("utf-8", "backslashreplace").decode()
                      for t in (message, param))
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SpecDecodeOptions(Strict):
    """The ``specdecode`` extra field: the method and its config for this request."""

    method: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    #: add each choice's generated token ids (``choices[i].token_ids``; non-streaming only),
    #: for exactness checks that must not compare text
    return_token_ids: bool = False
    #: strings (and token-id lists) the output must never contain
    ban: list[str | list[int]] = Field(default_factory=list)
    #: constrain the output to this regex / this Lark (or GBNF) grammar
    regex: str | None = None
    grammar: str | None = None
    #: commit the tokens a grammar forces without a target forward (off: for measurements)
    jump_forward: bool = True
    #: run a lossy method (docs/lossy.md), whose output differs from plain decoding's on
    #: purpose; without it such a method is refused (:func:`check_lossy`)
    allow_lossy: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` as OpenAI defines it."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    specdecode: SpecDecodeOptions | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | int | None = None
    #: token id (a decimal string, as JSON keys are) -> a number in [-100, 100] added to its
    #: logit at every position (OpenAI's meaning)
    logit_bias: dict[str, float] | None = None
    #: vLLM's: the model's end tokens do not end the answer (fixed-length benchmarks)
    ignore_eos: bool = False
    #: vLLM's: tokens that end the answer beside the model's (not in its text)
    stop_token_ids: list[int] | None = None
    #: vLLM's: each prompt token's log-probability and this many alternatives, in vLLM's form
    #: (a completion's choices' ``prompt_logprobs``, a chat's ``prompt_logprobs``)
    prompt_logprobs: int | None = None

    def kept_tokens(self) -> tuple[int, ...]:
        """Special tokens whose text the choices' text keeps (a chat request's tool-call
        format's tags); none here."""
        return ()

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise ApiError(400, f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}",
                           param="stop")
        return [s for s in stops if s]

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (None = the default)."""
        names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "logit_bias",
                 "prompt_logprobs")
        # an empty logit_bias sets nothing, as OpenAI reads it
        return {k: getattr(self, k) for k in names if getattr(self, k) not in (None, {})}

    @model_validator(mode="after")
    def check_lossy(self):
        """A lossy method, named by ``specdecode.method`` or the model alias
        (``MODEL+METHOD``), only with ``specdecode.allow_lossy`` (a 400 naming the fix)."""
        alias = self.model.partition("+")[2]
        name = (self.specdecode.method if self.specdecode else None) or alias
        if name and not (self.specdecode and self.specdecode.allow_lossy) and _is_lossy(name):
            raise LossyRefused(name)
        return self

    def constraint(self) -> dict[str, Any]:
        """The keyword arguments of ``make_constraint`` this request sets."""
        out: dict[str, Any] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            out["json_object"] = True
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ApiError(400, "response_format of type 'json_schema' needs "
                                    "'json_schema': {'name': ..., 'schema': {...}}",
                               param="response_format")
            out["json_schema"] = fmt.json_schema.schema_
        ext = self.specdecode
        if ext is not None:
            for name in ("regex", "grammar"):
                if getattr(ext, name) is not None:
                    if out:
                        raise ApiError(400, f"specdecode.{name} and response_format both "
                                            "constrain the output; give one",
                                       param=f"specdecode.{name}")
                    out[name] = getattr(ext, name)
            if ext.ban:
                out["banned"] = list(ext.ban)
            if out and not ext.jump_forward:
                out["jump_forward"] = False
        return out

    def top_logprobs_count(self) -> int | None:
        """Alternatives reported per token; None = no log-probabilities."""
        value = self.logprobs
        if value is None or value is False:
            return None
        if value is True or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (the "
                                f"alternatives reported per token), got {value!r}",
                           param="logprobs")
        return value



class LossyRefused(ValueError):
    """A lossy method asked for without opting in (``parse`` turns it into a 400)."""

    def __init__(self, method: str):
        super().__init__(
            f"method '{method}' is lossy: its output differs from plain decoding's on purpose "
            "(docs/lossy.md); to accept that, send \"specdecode\": {\"method\": "
            f"\"{method}\", \"allow_lossy\": true}}")
        self.method = method


def _is_lossy(name: str) -> bool:
    from specdecode import registry
    from specdecode.errors import SpecDecodeError

    if name.startswith(DIFFUSION_PREFIX):  # a dLLM's output, not the AR model's
        return True
    try:
        return registry.get(name).lossy
    except SpecDecodeError:
        return False  # an unknown method is refused by name later, with the known ones


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are supported (checked on use, so the
    error can name the unsupported type)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


def text_of(content: str | list[ContentPart] | None, param: str) -> str | None:
    """A message's (or a prediction's) text: a string, or its text parts joined (a 400 for
    another kind of part)."""
    if not isinstance(content, list):
        return content
    for i, part in enumerate(content):
        if part.type != "text":
            raise ApiError(400, f"content parts of type {part.type!r} are not supported (this is "
                                "a text model); send text parts or a string", param=param)
        if part.text is None:
            raise ApiError(400, f"content part {i} is of type 'text' but has no 'text' field; "
                                "send {\"type\": \"text\", \"text\": \"...\"}", param=param)
    return "".join(part.text for part in content)


class Prediction(Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat."""

    type: Literal["content"]
    content: str | list[ContentPart]


class FunctionCall(Strict):
    name: str
    #: JSON text, as OpenAI sends it
    arguments: str


class MessageToolCall(Strict):
    """A call an assistant message made (sent back with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: an assistant message's calls; a tool message's answer names the call it answers
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    #: an assistant message's reasoning, as the server sent it (templates that show the model
    #: its earlier reasoning read it: Qwen3's as ``reasoning_content``, gpt-oss's as
    #: ``thinking``, before a call)
    reasoning_content: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role,
                               "content": text_of(self.content, "messages") or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": template_arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            out["reasoning_content"] = out["thinking"] = self.reasoning_content
        return out


#: apply_chat_template's own arguments, which chat_template_kwargs may not set
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize",
                                "padding", "truncation", "max_length", "return_tensors",
                                "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatRequest(SamplingFields):
    messages: list[Message]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    #: function definitions (server/tools.py checks them, with ``tool_choice``)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    #: OpenAI's reasoning effort: the chat template's ``reasoning_effort`` (gpt-oss's reads it)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    #: variables for the chat template, as vLLM and llama-server take them (Qwen3's
    #: ``enable_thinking``)
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's: the last message, the assistant's, is continued (the answer goes on from its
    #: text) instead of closed and followed by a new turn
    continue_final_message: bool = False
    #: OpenAI's Predicted Outputs: text the answer is expected to repeat, which lookups draft
    #: from (server/frontend.py)
    prediction: Prediction | None = None
    _tools: ToolRequest | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def check_tools(self):
        """``tools``, ``tool_choice`` and the messages' tool fields (a :class:`ToolError`,
        which ``parse`` turns into a 400 naming the field)."""
        self._tools = ToolRequest.of(self.tools, self.tool_choice, self.parallel_tool_calls)
        check_conversation(self.messages)
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables this request sets (a 400 for one the server sets
        itself)."""
        out = dict(self.chat_template_kwargs or {})
        taken = sorted(set(out) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ApiError(400, f"chat_template_kwargs sets {taken[0]!r}, which the server sets "
                                "from the request itself; drop it", param="chat_template_kwargs")
        if self.reasoning_effort is not None:
            out.setdefault("reasoning_effort", self.reasoning_effort)
        if self.continue_final_message:
            if not self.messages or self.messages[-1].role != "assistant":
                raise ApiError(400, "continue_final_message continues the last message, which "
                                    "must then be the assistant's", param="continue_final_message")
            out.update(continue_final_message=True, add_generation_prompt=False)
        return out

    def prediction_text(self) -> str | None:
        """The predicted output's text (None: none given)."""
        return text_of(self.prediction.content, "prediction") if self.prediction else None

    @property
    def tool_request(self) -> ToolRequest | None:
        """The checked tools (None: the request offers none)."""
        return self._tools

    def kept_tokens(self) -> tuple[int, ...]:
        """The tool-call format's tags that are special tokens, where the output is parsed for
        calls."""
        tools = self._tools
        return tools.format.kept_tokens if tools is not None and tools.parses else ()

    def use_tool_format(self, fmt: ToolFormat) -> None:
        """The served model's call format (:func:`~.tools.check_template`): what the calls'
        grammar spells and the output is parsed in."""
        self._tools = dataclasses.replace(self._tools, format=fmt)

    def constraint(self) -> dict[str, Any]:
        """``tool_choice: "required"``, a named function or a ``strict`` function under
        ``auto`` adds the calls' grammar."""
        out = super().constraint()
        grammar = self._tools.grammar() if self._tools is not None else None
        if grammar is not None:
            taken = [k for k in ("json_object", "json_schema", "regex", "grammar") if k in out]
            if taken:
                held = self._tools.constrains
                why = (f"tool_choice {self.tool_choice!r} constrains the output to tool calls"
                       if held else "a function with 'strict': true constrains the calls in the "
                                    "output")
                raise ApiError(400, f"{why}, and the request also constrains it "
                                    f"({taken[0].replace('_', ' ')}); give one of them",
                               param="tool_choice" if held else "tools")
            out["grammar"] = grammar
        return out

    def top_logprobs_count(self) -> int | None:
        """OpenAI's chat form: ``logprobs`` true, ``top_logprobs`` alternatives (0..20)."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ApiError(400, "chat 'logprobs' is true or false; the alternatives go in "
                                "'top_logprobs'", param="logprobs")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true",
                               param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                                    f"{self.top_logprobs}", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    #: each choice's text starts with its prompt, and its log-probabilities with the prompt's
    #: (server/echo.py)
    echo: bool = False
    #: the text after the insertion point: fill in the middle, ``prompt`` the text before it
    #: (OpenAI's insertion; specdecode/fim.py)
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> None:
        if self.echo and self.suffix:
            raise ApiError(400, "echo and suffix cannot be combined: a filled-in middle has no "
                                "single prompt to echo", param="echo")
        if self.best_of not in (None, 1, self.n):
            raise ApiError(400, "best_of is not supported by this server; use n", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt, text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


def decode_json(body: bytes) -> Any:
    """A request body -> its JSON value, checked by :func:`check_json`; every way it can fail
    (bad syntax or encoding, ``NaN``, nesting too deep for the parser) is a 400."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(400, f"the request body nests arrays and objects too deeply (at most "
                            f"{MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    check_json(value)
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def check_json(value: Any) -> None:
    """Refuse nesting deeper than ``MAX_JSON_DEPTH`` and strings (keys too) holding a lone
    UTF-16 surrogate (``"\\ud800"`` is valid JSON but no character: it cannot be tokenized,
    nor encoded back into an answer). Iterative, so no input can exhaust the stack."""
    stack = [(value, 1, ())]
    while stack:
        item, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests arrays and objects more than "
                                f"{MAX_JSON_DEPTH} levels deep", param=_param(where))
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, where)
                stack.append((child, depth + 1, where + (key,)))
        elif isinstance(item, list):
            stack.extend((child, depth + 1, where + (i,)) for i, child in enumerate(item)
                         if isinstance(child, (str, dict, list)))


def _check_text(text: str, where: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ascii(text[exc.start:exc.end])
        raise ApiError(400, f"the request holds a lone UTF-16 surrogate ({bad}) in "
                            f"'{_path(where) or 'a key'}'; send valid Unicode text",
                       param=_param(where)) from None


def _path(where: tuple) -> str:
    return ".".join(str(p) if isinstance(p, int) else ascii(p)[1:-1] for p in where)


def _param(where: tuple) -> str | None:
    return ascii(where[0])[1:-1] if where else None


def parse(schema: type[Strict], payload: Any) -> Strict:
    """Validate ``payload``; the first problem becomes a 400 naming the field."""
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        refused = first.get("ctx", {}).get("error")
        if isinstance(refused, LossyRefused):
            raise ApiError(400, str(refused), param="specdecode.allow_lossy",
                           code="lossy_method") from None
        if isinstance(refused, ToolError):
            raise ApiError(400, str(refused), param=refused.param) from None
        loc = [str(part) for part in first["loc"]]
        param = loc[0] if loc else None
        if first["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {'.'.join(loc)}"
        elif first["type"] == "missing":
            message = f"'{'.'.join(loc)}' is a required property"
        else:
            # union members appear in the location as type names; keep only field names/indices
            path = ".".join(p for p in loc if not any(c in p for c in "[]()") and p not in
                            ("str", "int", "float", "bool", "list", "dict"))
            message = f"invalid value for '{path}': {first['msg'].lower()} (got {first['input']!r:.80})"
        raise ApiError(400, message, param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
