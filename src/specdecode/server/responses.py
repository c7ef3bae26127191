"""OpenAI's Responses API (``POST /v1/responses``), as agents written for it send it (Codex CLI,
the OpenAI Agents SDK): each request is read into the chat endpoint's (``Endpoint.respond``),
so the model's chat template, its tool-call format, its reasoning, the prompt cache and every
method serve it, and the answer is written back as a response's output items, whole or as its
stream of events.

Read: ``input`` (text, or items: messages whose content is text or ``input_text``/
``output_text`` parts, the model's earlier ``function_call`` items, ``function_call_output``
items, earlier ``reasoning`` items, whose text goes back with the next assistant message),
``instructions`` (a system message first), ``tools`` (``function`` tools: ``name``,
``description``, ``parameters``, and those of a ``namespace``, whose calls name it; tools the
API's own servers run, such as ``web_search``, are left out: the model is not told of them;
other kinds are a 400), ``tool_choice``,
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``,
``reasoning.effort`` (the template's ``reasoning_effort``), ``text.format`` (``json_schema`` or
``json_object``) and the ``specdecode`` extension. A response is kept (``store``, true unless
false) for ``previous_response_id`` (its conversation goes before the new input; its
instructions do not, as OpenAI has it) and for ``GET``/``DELETE /v1/responses/{id}``: the last
``--responses-kept`` (256) in memory; ``background`` is a 400. ``include``, ``metadata``,
``client_metadata``, ``user``, ``prompt_cache_key``, ``safety_identifier``, ``service_tier``,
``truncation`` and ``text.verbosity`` change nothing.
Written: ``reasoning``, ``message`` (``output_text``) and ``function_call`` items, ``status``
(``incomplete`` with ``max_output_tokens`` where the answer was cut), ``usage`` (cached input
tokens: the rows the prompt cache held); streamed, the Responses events, numbered.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from specdecode.server.endpoints import Endpoint, read_json, sse_objects
from specdecode.server.protocol import ApiError, SpecDecodeOptions, Strict, new_id, parse

#: tools the API's own servers run: left out of the prompt here (a server without them)
HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter",
          "image_generation", "computer_use_preview", "mcp")
#: ``reasoning.effort`` as the chat template's ``reasoning_effort``
EFFORTS = {"minimal": "minimal", "low": "low", "medium": "medium", "high": "high",
           "xhigh": "high"}


class ResponsesRequest(Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    #: ``store`` (true unless false) keeps the response for ``previous_response_id``;
    #: ``background`` is refused
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    #: accepted, changing nothing here
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    stream_options: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    specdecode: SpecDecodeOptions | None = None



class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: each its
    response object and its conversation as chat messages (its answer included, its
    ``instructions`` not, as OpenAI carries them over), in memory, the least recently used
    dropped past ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.kept[response["id"]] = (response, conversation)
        while len(self.kept) > self.limit:
            self.kept.popitem(last=False)

    def get(self, rid: str,
            param: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if rid not in self.kept:
            raise ApiError(404, f"no response {rid!r} is kept here (this server keeps the last "
                                f"{self.limit} responses stored with store true, in memory)",
                           param=param, code="not_found")
        self.kept.move_to_end(rid)
        return self.kept[rid]

    def delete(self, rid: str) -> None:
        self.get(rid)  # a 404 where it is not kept
        del self.kept[rid]


def add_responses_routes(app: FastAPI, chat: Endpoint) -> None:
    store = ResponseStore(chat.server.settings.responses_kept)

    @app.post("/v1/responses")
    async def responses_route(request: Request):
        payload = await read_json(request, chat.server.settings.max_body_bytes)
        req = parse(ResponsesRequest, payload)
        if req.background:
            raise ApiError(400, "background: this server answers while the request waits; "
                                "send background false", param="background")
        history = ([] if req.previous_response_id is None else
                   store.get(req.previous_response_id, "previous_response_id")[1])
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) \
            else req.input
        conversation = history + chat_messages(items)
        builder = ResponseBuilder(req, None if req.store is False else (
            lambda response, answer: store.put(response, conversation + [answer])))
        response = await chat.respond(request, openai_chat(req, conversation))
        if not req.stream:
            return JSONResponse(builder.whole(json.loads(response.body)))
        return StreamingResponse(builder.events(response.body_iterator),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @app.get("/v1/responses/{rid}")
    async def retrieve_route(rid: str):
        return store.get(rid)[0]

    @app.delete("/v1/responses/{rid}")
    async def delete_route(rid: str):
        store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}


def openai_chat(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request ``req`` is, in the chat endpoint's fields (``conversation``: its
    input, after the stored conversation it continues, as chat messages)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += conversation
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    functions = function_tools(req.tools)
    if functions:
        body["tools"] = [chat_tool(function) for function, _ in functions]
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    effort = (req.reasoning or {}).get("effort")
    if effort in EFFORTS:
        body["reasoning_effort"] = EFFORTS[effort]
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema")}}
    elif fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.get("type") != "text":
        raise ApiError(400, f"text.format type {fmt.get('type')!r}: this server reads text, "
                            "json_schema and json_object", param="text")
    if req.specdecode is not None:
        body["specdecode"] = req.specdecode.model_dump()
    return {k: v for k, v in body.items() if v is not None}


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a model's calls join its message (or make one), each
    call's output a ``tool`` message, earlier reasoning the next assistant message's."""
    out: list[dict[str, Any]] = []
    reasoning = ""
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": item.get("role"), "content": parts_text(item.get("content"))}
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "function_call":
            needs(item, ("call_id", "name"), kind)
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            if reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
            out[-1].setdefault("tool_calls", []).append({
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}})
        elif kind == "function_call_output":
            needs(item, ("call_id",), kind)
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else parts_text(output)})
        elif kind == "reasoning":
            reasoning += "".join(part.get("text", "") for part in
                                 (item.get("content") or item.get("summary") or []))
        else:
            raise ApiError(400, f"an input item of type {kind!r}: this server reads messages, "
                                "function_call, function_call_output and reasoning items",
                           param="input")
    return out


def needs(item: dict[str, Any], fields: tuple[str, ...], kind: str) -> None:
    """A 400 unless each of ``fields`` of ``item`` is a string."""
    for field in fields:
        if not isinstance(item.get(field), str):
            raise ApiError(400, f"a {kind} item needs its {field} (a string)", param="input")


def parts_text(content: Any) -> str:
    """A message's text: a string, or its text parts (others are a 400)."""
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise ApiError(400, "content is text or a list of parts ({\"type\": \"input_text\", "
                            "\"text\": ...})", param="input")
    texts = []
    for part in content:
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise ApiError(400, f"a content part of type {part.get('type')!r}: this server "
                                "reads text", param="input")
        texts.append(part.get("text", ""))
    return "".join(texts)


def function_tools(tools: list[dict[str, Any]] | None) -> list[tuple[dict[str, Any], str | None]]:
    """Each function tool with the namespace it came in (None: none), hosted tools left out;
    a 400 for a name two tools share."""
    out: list[tuple[dict[str, Any], str | None]] = []
    for tool in tools or []:
        kind = tool.get("type")
        if kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list) or not all(isinstance(f, dict) for f in inner):
                raise ApiError(400, "a namespace's tools are a list of function tools",
                               param="tools")
            out += [(function, tool.get("name")) for function in inner]
        elif kind not in HOSTED:
            out.append((tool, None))
    names = [function.get("name") for function, _ in out]
    shared = sorted({name for name in names if names.count(name) > 1})
    if shared:
        raise ApiError(400, f"two tools are named {shared[0]!r}", param="tools")
    return out


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ApiError(400, f"a tool of type {tool.get('type')!r}: this server calls function "
                            "tools (name, description, parameters)", param="tools")
    function = {"name": tool.get("name"), "parameters": tool.get("parameters") or
                {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ApiError(400, f"tool_choice of type {choice.get('type')!r}: this server reads auto, "
                        "none, required and a function", param="tool_choice")


class ResponseBuilder:
    """A response object from the chat endpoint's answer, whole or from its stream of chunks
    (then as the Responses events, each numbered)."""

    def __init__(self, req: ResponsesRequest,
                 keep: Callable[[dict[str, Any], dict[str, Any]], None] | None = None):
        self.req = req
        #: called with the finished response and its answer as a chat message, to store it
        self.keep = keep
        self.namespaces = {f.get("name"): space for f, space in function_tools(req.tools)}
        self.id = item_id("resp")
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self.open: str | None = None  # the open item's kind: reasoning, message or a call's

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": req.model, "output": self.output,
                "error": None, "instructions": req.instructions,
                "incomplete_details": ({"reason": "max_output_tokens"}
                                       if status == "incomplete" else None),
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "temperature": req.temperature, "top_p": req.top_p,
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                "reasoning": req.reasoning, "store": self.keep is not None,
                "truncation": "disabled",
                "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
                "usage": usage and response_usage(usage)}

    def whole(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = body["choices"][0]
        message = choice["message"]
        if message.get("reasoning_content"):
            self.output.append(reasoning_item(item_id("rs"), message["reasoning_content"]))
        if message.get("content"):
            self.output.append(message_item(item_id("msg"), message["content"]))
        for call in message.get("tool_calls") or []:
            self.output.append(self.call(call["id"], call["function"]["name"],
                                         call["function"]["arguments"]))
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.finished(status, body["usage"])

    def finished(self, status: str, usage: dict[str, Any]) -> dict[str, Any]:
        """The finished response, stored where the request asks for it."""
        response = self.response(status, usage)
        if self.keep is not None:
            self.keep(response, assistant_message(self.output))
        return response

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def events(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        finish = "stop"
        async for data in sse_objects(chunks):
            if "error" in data:
                error = data["error"]
                yield self.event("error", code=error.get("code"),
                                 message=error.get("message", ""), param=error.get("param"))
                return
            for choice in data.get("choices", []):
                for out in self.delta(choice.get("delta") or {}):
                    yield out
                finish = choice.get("finish_reason") or finish
            if data.get("usage"):
                for out in self.close():
                    yield out
                status = "incomplete" if finish == "length" else "completed"
                yield self.event(f"response.{status}",
                                 response=self.finished(status, data["usage"]))

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.open != "reasoning":
                out += self.start("reasoning", reasoning_item(item_id("rs"), ""))
            item = self.output[-1]
            item["content"][0]["text"] += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=len(self.output) - 1, content_index=0,
                                  delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.open != "message":
                out += self.start("message", message_item(item_id("msg"), ""))
                out.append(self.event("response.content_part.added", **self.at(),
                                      content_index=0, part=text_part("")))
            item = self.output[-1]
            item["content"][0]["text"] += delta["content"]
            out.append(self.event("response.output_text.delta", **self.at(), content_index=0,
                                  delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                out += self.start(f"call {call['index']}",
                                  self.call(call["id"], function.get("name"), ""))
            if function.get("arguments"):
                self.output[-1]["arguments"] += function["arguments"]
                out.append(self.event("response.function_call_arguments.delta", **self.at(),
                                      delta=function["arguments"]))
        return out

    def call(self, call_id: str, name: str | None, arguments: str) -> dict[str, Any]:
        """A function call item, with the namespace its function came in."""
        item = {"type": "function_call", "id": item_id("fc"), "call_id": call_id,
                "name": name, "arguments": arguments, "status": "completed"}
        if self.namespaces.get(name):
            item["namespace"] = self.namespaces[name]
        return item

    def at(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def start(self, kind: str, item: dict[str, Any]) -> list[str]:
        out = self.close()
        item["status"] = "in_progress"
        self.output.append(item)
        self.open = kind
        return out + [self.event("response.output_item.added", output_index=len(self.output) - 1,
                                 item=item)]

    def close(self) -> list[str]:
        """The open item's closing events."""
        if self.open is None:
            return []
        item, at = self.output[-1], self.at()
        out = []
        if self.open == "reasoning":
            out.append(self.event("response.reasoning_text.done", **at, content_index=0,
                                  text=item["content"][0]["text"]))
        elif self.open == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", **at, content_index=0,
                                  text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", **at, content_index=0,
                                  part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", **at,
                                  name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        self.open = None
        return out + [self.event("response.output_item.done", output_index=at["output_index"],
                                 item=item)]


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the chat message that answered."""
    def texts(kind: str) -> str:
        return "".join(part["text"] for item in output if item["type"] == kind
                       for part in item["content"])

    message: dict[str, Any] = {"role": "assistant", "content": texts("message")}
    if texts("reasoning"):
        message["reasoning_content"] = texts("reasoning")
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    return message


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
            "content": [text_part(text)]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


def item_id(prefix: str) -> str:
    return new_id(prefix).replace("-", "_")
