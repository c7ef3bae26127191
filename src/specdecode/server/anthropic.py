"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), as
coding agents written for Claude send it (Claude Code with ``ANTHROPIC_BASE_URL`` pointing
here): each request is read into the chat endpoint's (``Endpoint.respond``), so the model's
chat template, its tool-call format, its reasoning, the prompt cache and every method serve it
as they serve OpenAI's clients, and the answer is written back in Anthropic's form, whole or as
its stream of events.

Read: ``system`` (text or text blocks), ``messages`` whose content is text or blocks (``text``;
an assistant's ``tool_use`` and ``thinking``; a user's ``tool_result``, each an OpenAI ``tool``
message), ``tools`` (``name``, ``description``, ``input_schema``: client tools; Anthropic's own
server tools are a 400), ``tool_choice`` (``auto``, ``any``: a call is required, ``tool``: the
named one, ``none``; ``disable_parallel_tool_use``), ``max_tokens``, ``stop_sequences``,
``temperature`` (Anthropic's default 1.0), ``top_p``, ``top_k`` (older clients send them),
``stream``, ``thinking`` (``enabled``, ``adaptive``, ``between_tools`` or ``disabled``: the
template's ``enable_thinking``, which Qwen3's reads; a budget is not enforced),
``output_config`` (``effort``: the template's ``reasoning_effort``; ``format``: a JSON schema
the answer follows), ``system`` messages among the messages, and the ``specdecode`` extension.
``max_tokens`` is a cap, as Anthropic reads it: an answer may fill the context the prompt
leaves. ``metadata``, ``service_tier``, ``cache_control`` (here and on blocks: the prompt cache
needs no marks), ``context_management`` (not applied: the whole conversation is read),
``container``, ``diagnostics``, ``inference_geo``, ``speed``, ``user_profile_id`` and
``workspace_id`` change nothing. Written: ``content`` blocks
(``thinking``, ``text``, ``tool_use`` with the parsed ``input``), ``stop_reason`` (``end_turn``,
``max_tokens``, ``stop_sequence`` with the ``stop_sequence`` that ended it, ``tool_use``) and
``usage`` (``input_tokens``, ``output_tokens``, ``cache_read_input_tokens``). Errors are
Anthropic's error object.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from specdecode.server.endpoints import Endpoint, chat_prompt, read_json, sse_objects
from specdecode.server.protocol import (ApiError, ChatRequest, SpecDecodeOptions, Strict, new_id,
                                        parse)

#: OpenAI's finish reasons as Anthropic's stop reasons
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
#: ``thinking`` types: whether the template's ``enable_thinking`` is on
THINKING = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}
#: ``output_config.effort`` as OpenAI's reasoning effort
EFFORTS = {"low": "low", "medium": "medium", "high": "high"}
#: an error's status as Anthropic names it
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


class Block(BaseModel):
    """A content block; the fields beside each type's (``cache_control``, ``citations``)
    change nothing here."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool = False


class AnthropicMessage(Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class MessagesRequest(Strict):
    model: str
    messages: list[AnthropicMessage]
    max_tokens: int | None = None
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    #: ``effort`` (the template's ``reasoning_effort``) and ``format`` (a JSON schema)
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    #: accepted, changing nothing here (routing, accounting and Anthropic's own features)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    #: Anthropic's server-side clearing of old thinking and tool results: not applied (the
    #: whole conversation is read)
    context_management: dict[str, Any] | None = None
    container: Any = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    specdecode: SpecDecodeOptions | None = None


def add_anthropic_routes(app: FastAPI, chat: Endpoint) -> None:
    @app.post("/v1/messages")
    async def messages_route(request: Request):
        try:
            return await messages(chat, request)
        except ApiError as exc:
            return anthropic_error(exc)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route(request: Request):
        try:
            payload = await read_json(request, chat.server.settings.max_body_bytes)
            req = parse(MessagesRequest, {"max_tokens": 1, **payload})
            ids = await chat_prompt(chat.server, parse(ChatRequest, openai_chat(req)))
            return {"input_tokens": len(ids)}
        except ApiError as exc:
            return anthropic_error(exc)


def anthropic_error(exc: ApiError) -> JSONResponse:
    kind = ERROR_TYPES.get(exc.status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": exc.message}},
                        status_code=exc.status, headers=exc.headers)


async def messages(chat: Endpoint, request: Request):
    payload = await read_json(request, chat.server.settings.max_body_bytes)
    req = parse(MessagesRequest, payload)
    if req.max_tokens is None:
        raise ApiError(400, "max_tokens is required", param="max_tokens")
    body = openai_chat(req)
    # max_tokens is a cap in Anthropic's API: an answer may fill what the context leaves
    ids = await chat_prompt(chat.server, parse(ChatRequest, body))
    input_tokens = len(ids)
    room = chat.server.max_context - input_tokens
    if room < 1:
        raise ApiError(400, f"prompt is too long: {input_tokens} tokens > "
                            f"{chat.server.max_context - 1} maximum (this server's context)",
                       param="messages")
    body["max_tokens"] = min(req.max_tokens, room)
    response = await chat.respond(request, body, ids)  # encoded once
    if not req.stream:
        return JSONResponse(anthropic_message(json.loads(response.body), req))
    events = AnthropicEvents(req, input_tokens)
    return StreamingResponse(events.of(response.body_iterator), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def openai_chat(req: MessagesRequest) -> dict[str, Any]:
    """The chat request ``req`` is, in OpenAI's fields."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": text_of(req.system)})
    for message in req.messages:
        messages += openai_messages(message)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "stop": req.stop_sequences, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [openai_tool(tool) for tool in req.tools]
    if req.tool_choice is not None:
        body.update(openai_tool_choice(req.tool_choice))
    if req.thinking is not None and req.thinking.get("type") in THINKING:
        body["chat_template_kwargs"] = {"enable_thinking": THINKING[req.thinking["type"]]}
    config = req.output_config or {}
    if config.get("effort"):
        body["reasoning_effort"] = EFFORTS.get(config["effort"], "high")
    schema_format = config.get("format") or req.output_format
    if schema_format:
        if schema_format.get("type") != "json_schema" or "schema" not in schema_format:
            raise ApiError(400, "output format: this server reads {\"type\": \"json_schema\", "
                                "\"schema\": {...}}", param="output_config")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": schema_format["schema"]}}
    if req.specdecode is not None:
        body["specdecode"] = req.specdecode.model_dump()
    return {k: v for k, v in body.items() if v is not None}


def text_of(content: str | list[Block] | None) -> str:
    """The text of a string or of text blocks (others are a 400)."""
    if content is None or isinstance(content, str):
        return content or ""
    for block in content:
        if block.type != "text":
            raise ApiError(400, f"a {block.type!r} block where text is expected: this server "
                                "reads text here", param="messages")
    return "".join(block.text or "" for block in content)


def openai_messages(message: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: an assistant's text, reasoning and calls in
    one; a user's tool results each a ``tool`` message, before its text."""
    if isinstance(message.content, str) or message.role == "system":
        return [{"role": message.role, "content": text_of(message.content)}]
    kinds = {block.type for block in message.content}
    allowed = ({"text", "tool_use", "thinking", "redacted_thinking"}
               if message.role == "assistant" else {"text", "tool_result"})
    if kinds - allowed:
        raise ApiError(400, f"a {sorted(kinds - allowed)[0]!r} block in a {message.role} "
                            f"message is not served; this server reads "
                            f"{', '.join(sorted(allowed))} there", param="messages")
    for block in message.content:
        missing = [f for f in {"tool_use": ("id", "name"), "tool_result": ("tool_use_id",)}.get(
            block.type, ()) if getattr(block, f) is None]
        if missing:
            raise ApiError(400, f"a {block.type} block needs its {missing[0]}",
                           param="messages")
    text = "".join(b.text or "" for b in message.content if b.type == "text")
    if message.role == "user":
        results = [{"role": "tool", "tool_call_id": b.tool_use_id,
                    "content": ("Error: " if b.is_error else "") + text_of(b.content)}
                   for b in message.content if b.type == "tool_result"]
        return results + ([{"role": "user", "content": text}] if text or not results else [])
    out: dict[str, Any] = {"role": "assistant", "content": text}
    thinking = "".join(b.thinking or "" for b in message.content if b.type == "thinking")
    if thinking:
        out["reasoning_content"] = thinking
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input or {})}}
             for b in message.content if b.type == "tool_use"]
    if calls:
        out["tool_calls"] = calls
    return [out]


def openai_tool(tool: AnthropicTool) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise ApiError(400, f"tool {tool.name!r} is Anthropic's server tool {tool.type!r}; "
                            "this server calls client tools only (name, description, "
                            "input_schema)", param="tools")
    function = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def openai_tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    chosen = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        chosen = {"type": "function", "function": {"name": choice.get("name")}}
    if chosen is None:
        raise ApiError(400, f"tool_choice type {kind!r}: this server reads auto, any, tool "
                            "and none", param="tool_choice")
    out: dict[str, Any] = {"tool_choice": chosen}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def anthropic_message(body: dict[str, Any], req: MessagesRequest) -> dict[str, Any]:
    """The chat endpoint's whole response as Anthropic's message."""
    choice = body["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    stop, reason = stop_reason(choice)
    return {"id": "msg_" + body["id"].rpartition("-")[2], "type": "message",
            "role": "assistant", "model": req.model, "content": content,
            "stop_reason": reason, "stop_sequence": stop, "usage": usage(body["usage"])}


def stop_reason(choice: dict[str, Any]) -> tuple[str | None, str]:
    """(the stop sequence that ended the answer, Anthropic's stop reason)."""
    stop = choice.get("stop_reason")
    if isinstance(stop, str):
        return stop, "stop_sequence"
    return None, STOP_REASONS.get(choice["finish_reason"], "end_turn")


def usage(openai: dict[str, Any]) -> dict[str, Any]:
    cached = (openai.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": openai["prompt_tokens"] - cached,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": openai["completion_tokens"]}


class AnthropicEvents:
    """The chat endpoint's stream of chunks as Anthropic's events: ``message_start``, a
    ``content_block_start``/``_delta``/``_stop`` run per block (thinking, text, each tool
    call's ``input_json_delta`` pieces), ``message_delta`` with the stop reason and usage,
    ``message_stop``; an error as an ``error`` event."""

    def __init__(self, req: MessagesRequest, input_tokens: int):
        self.req = req
        self.input_tokens = input_tokens
        self.block = -1  # the open block's index
        self.open: str | None = None  # its kind: "thinking", "text" or a call's index
        self.choice: dict[str, Any] = {"finish_reason": "stop"}

    async def of(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        yield event("message_start", {"type": "message_start", "message": {
            "id": new_id("msg").replace("-", "_"), "type": "message", "role": "assistant",
            "model": self.req.model, "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}})
        async for data in sse_objects(chunks):
            if "error" in data:
                yield event("error", {"type": "error", "error": {
                    "type": "api_error", "message": data["error"].get("message", "")}})
                return
            for out in self.chunk(data):
                yield out

    def chunk(self, data: dict[str, Any]) -> list[str]:
        out: list[str] = []
        for choice in data.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self.into("thinking", {"type": "thinking", "thinking": ""})
                out.append(self.delta({"type": "thinking_delta",
                                       "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                out += self.into("text", {"type": "text", "text": ""})
                out.append(self.delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    out += self.into(f"call {call['index']}", {
                        "type": "tool_use", "id": call["id"], "name": function.get("name"),
                        "input": {}})
                if function.get("arguments"):
                    out.append(self.delta({"type": "input_json_delta",
                                           "partial_json": function["arguments"]}))
            if choice.get("finish_reason"):
                self.choice = choice
        if data.get("usage"):
            out += self.close()
            stop, reason = stop_reason(self.choice)
            out.append(event("message_delta", {
                "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                "usage": {**usage(data["usage"]), "output_tokens":
                          data["usage"]["completion_tokens"]}}))
            out.append(event("message_stop", {"type": "message_stop"}))
        return out

    def into(self, kind: str, start: dict[str, Any]) -> list[str]:
        """Open a block of ``kind`` (closing the open one) unless it is open."""
        if self.open == kind:
            return []
        out = self.close()
        self.block += 1
        self.open = kind
        return out + [event("content_block_start", {"type": "content_block_start",
                                                    "index": self.block,
                                                    "content_block": start})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop",
                                             "index": self.block})]

    def delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"type": "content_block_delta",
                                             "index": self.block, "delta": delta})


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
