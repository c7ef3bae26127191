"""Ollama's API, as the many clients written for a local Ollama speak it (its Python and
JavaScript libraries, Open WebUI, Continue's and Zed's Ollama providers, editor plugins that
complete code through ``/api/generate`` with a ``suffix``): ``POST /api/chat`` and
``POST /api/generate``, whole or streamed as Ollama streams (one JSON object a line), and the
routes they read first: ``GET /`` ("Ollama is running"), ``/api/version``, ``/api/tags``,
``/api/show`` and ``/api/ps``. Start the server with ``--port 11434`` to stand where they look.

Each request is read into the chat or completion endpoint's (``Endpoint.respond``), so the
model's chat template, its tool-call format, its reasoning, the prompt cache and every method
serve it as they serve OpenAI's clients; the answer is written back in Ollama's form.

Sampling is Ollama's: its defaults (temperature 0.8, top_k 40, top_p 0.9, min_p 0,
repeat_penalty 1.1 over the last ``repeat_last_n`` 64 tokens) and its order (the penalties, then
top_k, temperature, top_p and min_p), the penalties counting the last ``repeat_last_n`` tokens
of prompt and answer as llama.cpp counts them (server/llama_sampling.py reads the chain);
temperature 0 takes the argmax of the penalised logits, as Ollama does. ``num_predict`` is a
cap: -1 (the default) and -2 write until the context is full. ``typical_p`` below 1 and
``mirostat`` are 400s; ``tfs_z`` and ``penalize_newline`` (which Ollama no longer applies),
``num_ctx`` (the server's ``--max-context`` holds: nothing is cut from a prompt), the load-time
options and ``keep_alive`` change nothing; a field or option Ollama does not know is ignored,
and null is the default, as Ollama reads a request. ``format`` is ``"json"`` or a JSON schema
the answer follows; ``think`` (true, false, or an effort) is the template's ``enable_thinking`` (and
``reasoning_effort``), the reasoning sent as ``thinking``; ``logprobs`` and ``top_logprobs``
give the model's own log-probabilities. Tool calls come back with their arguments as objects,
each whole in one streamed object; a ``tool`` message answers the call of its ``tool_call_id``,
else the earliest unanswered one of its ``tool_name`` (or any). ``/api/generate`` writes the
prompt into the chat template (after ``system``), continues ``context`` (the token ids a previous
answer returned) and returns the new ``context``; ``raw`` sends the prompt as it is, ``suffix``
asks for the middle between them (the model's fill-in-the-middle tokens). Images,
``template`` (a Go template), embeddings and model management are refused, naming why.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from specdecode import registry
from specdecode.errors import SpecDecodeError
from specdecode.fim import fim_tokens
from specdecode.server.endpoints import Endpoint, chat_prompt, read_json, sse_objects
from specdecode.server.frontend import Frontend
from specdecode.server.llama_sampling import LlamaSampling
from specdecode.server.protocol import ApiError, ChatRequest, SpecDecodeOptions, parse

#: the Ollama release whose API these routes follow (clients read it before using newer fields)
OLLAMA_VERSION = "0.12.6"
#: Ollama's order of samplers, in llama-server's names (server/llama_sampling.py)
OLLAMA_CHAIN = ["penalties", "top_k", "temperature", "top_p", "min_p"]
#: a model name's tag that names this server's model (clients add it: ``NAME:latest``)
TAG = ":latest"
#: OpenAI's finish reasons as Ollama's done reasons
DONE_REASONS = {"stop": "stop", "tool_calls": "stop", "length": "length"}
#: the routes of Ollama's that manage models, which this server does not
MANAGEMENT = ("pull", "push", "create", "copy", "delete")


class Lenient(BaseModel):
    """A request read as Ollama reads it (Go's JSON decoding): a field it does not know is
    ignored, and null is the default."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def nulls_are_defaults(cls, data: Any) -> Any:
        return ({k: v for k, v in data.items() if v is not None} if isinstance(data, dict)
                else data)


class OllamaOptions(Lenient):
    """Ollama's ``options``, with its defaults."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_last_n: int = 64
    repeat_penalty: float = 1.1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    num_predict: int = -1
    stop: list[str] | None = None
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    #: accepted, changing nothing here (samplers Ollama dropped, the context and load-time
    #: settings: this server's model is loaded once, with its own context)
    tfs_z: float | None = None
    penalize_newline: bool | None = None
    num_keep: int | None = None
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None

    def sampling(self) -> LlamaSampling:
        """These options as llama-server's sampling fields in Ollama's order (a 400 for a
        sampler this server does not apply)."""
        if self.typical_p < 1.0:
            raise ApiError(400, "typical_p below 1 is not served; send 1.0",
                           param="options.typical_p")
        if self.num_predict == 0 or self.num_predict < -2:
            raise ApiError(400, "num_predict is -1 (until the context is full), -2 or a number "
                                f"of tokens from 1, got {self.num_predict}",
                           param="options.num_predict")
        return LlamaSampling(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            repeat_last_n=self.repeat_last_n, repeat_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, mirostat=self.mirostat, samplers=OLLAMA_CHAIN)


class OllamaMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class OllamaRequest(Lenient):
    """The fields ``/api/chat`` and ``/api/generate`` share (``stream`` is on unless false)."""

    model: str
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    #: accepted, changing nothing here (the model stays loaded)
    keep_alive: str | float | None = None
    specdecode: SpecDecodeOptions | None = None


class OllamaChatRequest(OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(OllamaRequest):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None


def add_ollama_routes(app: FastAPI, chat: Endpoint, completion: Endpoint) -> None:
    server = chat.server

    @app.get("/")
    async def running():
        return PlainTextResponse("Ollama is running")

    @app.head("/")
    async def running_head():
        return PlainTextResponse("")

    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION}

    @app.get("/api/tags")
    async def tags():
        return {"models": [model_entry(server, name) for name in served_names(server)]}

    @app.get("/api/ps")
    async def running_models():
        entry = model_entry(server, served_names(server)[0])
        return {"models": [{**entry, "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                            "context_length": server.max_context}]}

    @app.post("/api/show")
    async def show(request: Request):
        return await ollama_errors(show_model(server, request))

    @app.post("/api/chat")
    async def chat_route(request: Request):
        return await ollama_errors(ollama_chat(chat, request))

    @app.post("/api/generate")
    async def generate_route(request: Request):
        return await ollama_errors(ollama_generate(chat, completion, request))

    for name in ("embed", "embeddings"):
        app.post(f"/api/{name}")(refusal("this server generates text with one model and "
                                         "computes no embeddings"))
    for name in MANAGEMENT:
        app.add_api_route(f"/api/{name}", refusal(
            f"this server serves the model it was started with and does not {name} models "
            "(install one with `specdecode models install NAME`, serve it with "
            "`specdecode serve --model NAME`)"), methods=["POST", "DELETE"])


def refusal(message: str):
    async def route():
        return JSONResponse({"error": message}, status_code=501)
    return route


async def ollama_errors(answer) -> Any:
    """The route's answer, or its error in Ollama's shape (``{"error": message}``)."""
    try:
        return await answer
    except ApiError as exc:
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)


def served_names(server: Frontend) -> list[str]:
    """The model's name and one per exact method (``MODEL+METHOD``), each with Ollama's tag
    (a lossy method needs ``specdecode.allow_lossy``, which a model picker cannot send)."""
    model = server.settings.model_id
    return [model + TAG] + [f"{model}+{name}{TAG}" for name in registry.names()
                            if not registry.get(name).lossy]


def model_name(name: str) -> str:
    """A request's model name as the OpenAI endpoints read it (its ``:latest`` tag dropped)."""
    return name.removesuffix(TAG)


def model_entry(server: Frontend, name: str) -> dict[str, Any]:
    digest = hashlib.sha256(f"{name} {server.fingerprint}".encode()).hexdigest()
    return {"name": name, "model": name, "modified_at": timestamp(server.started),
            "size": 0, "digest": digest, "details": details(server)}


def details(server: Frontend) -> dict[str, Any]:
    family = architecture(server)
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family],
            "parameter_size": "", "quantization_level": ""}


def architecture(server: Frontend) -> str:
    """The model's architecture as its fingerprint names it (``hf:qwen2:...``)."""
    parts = server.fingerprint.split(":")
    return parts[1] if parts[0] == "hf" and len(parts) > 1 else parts[0]


def timestamp(seconds: float | None = None) -> str:
    at = datetime.now(timezone.utc) if seconds is None else datetime.fromtimestamp(
        seconds, timezone.utc)
    return at.isoformat().replace("+00:00", "Z")


async def show_model(server: Frontend, request: Request) -> dict[str, Any]:
    """``/api/show``: the template, the context and what the model can do (``completion``;
    ``tools`` where its template writes calls; ``insert`` where it has fill-in-the-middle
    tokens; ``thinking`` where its answers hold reasoning)."""
    payload = await read_json(request, server.settings.max_body_bytes)
    name = payload.get("model") or payload.get("name") if isinstance(payload, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, "give the model to show as {\"model\": NAME}", param="model")
    if model_name(name).partition("+")[0] not in (server.settings.model_id, "default"):
        raise ApiError(404, f"model {name!r} not found; this server serves "
                            f"{server.settings.model_id!r}", param="model")
    capabilities = ["completion"]
    try:
        await run_in_threadpool(server.tool_format)
        capabilities.append("tools")
    except ApiError:
        pass
    try:
        if server.tokenizer is not None:
            fim_tokens(server.tokenizer)
            capabilities.append("insert")
    except SpecDecodeError:  # none of the known tags
        pass
    if server.thinking is not None:
        capabilities.append("thinking")
    family = architecture(server)
    return {"modelfile": "", "parameters": "", "license": "",
            "template": getattr(server.tokenizer, "chat_template", None) or "",
            "details": details(server), "capabilities": capabilities,
            "model_info": {"general.architecture": family,
                           f"{family}.context_length": server.max_context},
            "modified_at": timestamp(server.started)}


def loaded(req: OllamaRequest, chat: bool) -> JSONResponse:
    """The answer to an empty request: Ollama's way of loading (or, with ``keep_alive`` 0,
    unloading) a model; here the model is always loaded and stays so."""
    reason = "unload" if req.keep_alive in (0, "0") else "load"
    body: dict[str, Any] = {"model": req.model, "created_at": timestamp(), "done": True,
                            "done_reason": reason}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return JSONResponse(body)


def openai_fields(req: OllamaRequest, server: Frontend) -> tuple[dict[str, Any], dict]:
    """(the OpenAI fields of the request's sampling and format, the SamplingParams fields of
    Ollama's chain beside them)."""
    llama = req.options.sampling()
    encode = lambda text: server.encode(text, False)  # noqa: E731 - logit_bias by text
    body = {k: v for k, v in llama.openai_fields(encode).items() if v is not None}
    body["model"] = model_name(req.model)
    body["stop"] = req.options.stop or None
    fmt = req.format
    if fmt == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt}}
    elif fmt not in (None, ""):
        raise ApiError(400, f"format is \"json\" or a JSON schema, got {fmt!r}", param="format")
    if req.specdecode is not None:
        body["specdecode"] = req.specdecode.model_dump()
    return {k: v for k, v in body.items() if v is not None}, llama.chain_sampling(server, ())


def thinking_fields(req: OllamaRequest) -> dict[str, Any]:
    if req.think is None:
        return {}
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": req.think is not False}}
    if isinstance(req.think, str):
        out["reasoning_effort"] = req.think
    return out


def openai_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: calls given ids where they have none, each tool result
    answering a call by id (its own, else the earliest unanswered of its tool's name)."""
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of calls not yet answered
    for i, message in enumerate(messages):
        if message.images:
            raise ApiError(400, f"messages[{i}] holds images; this server's model reads text "
                                "only", param="messages")
        if message.role == "tool":
            out.append({"role": "tool", "content": message.content,
                        "tool_call_id": answered_call(message, open_calls, i)})
            continue
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.role == "assistant":
            calls = [openai_call(call, f"call_{i}_{j}", i)
                     for j, call in enumerate(message.tool_calls or [])]
            open_calls = [(c["id"], c["function"]["name"]) for c in calls]
            if calls:
                entry["tool_calls"] = calls
            if message.thinking:
                entry["reasoning_content"] = message.thinking
        elif message.tool_calls:
            raise ApiError(400, f"messages[{i}] has tool_calls but role {message.role!r}; only "
                                "assistant messages carry them", param="messages")
        out.append(entry)
    return out


def openai_call(call: dict[str, Any], default_id: str, index: int) -> dict[str, Any]:
    function = call.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", {}) if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        raise ApiError(400, f"messages[{index}] has a tool call without a function name and "
                            "arguments ({\"function\": {\"name\": ..., \"arguments\": {...}}})",
                       param="messages")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call.get("id") or default_id, "type": "function",
            "function": {"name": name, "arguments": text}}


def answered_call(message: OllamaMessage, open_calls: list[tuple[str, str]], index: int) -> str:
    """The id of the call a tool message answers, taken off ``open_calls``."""
    for at, (call_id, name) in enumerate(open_calls):
        if (call_id == message.tool_call_id if message.tool_call_id else
                message.tool_name in (None, name)):
            del open_calls[at]
            return call_id
    if message.tool_call_id:
        return message.tool_call_id  # the chat endpoint names the call that was never made
    raise ApiError(400, f"messages[{index}] is a tool result, but no call of "
                        f"{message.tool_name or 'any tool'!r} before it is left unanswered",
                   param="messages")


def cap(num_predict: int, room: int, param: str) -> int:
    """Tokens an answer may take: ``num_predict`` (-1, -2: all) within the context's ``room``
    (none left: a 400 naming ``param``, the prompt's field)."""
    if room < 1:
        raise ApiError(400, "the prompt fills this server's context; shorten it or start "
                            "the server with a larger --max-context", param=param)
    return room if num_predict < 0 else min(num_predict, room)


async def ollama_chat(endpoint: Endpoint, request: Request):
    server = endpoint.server
    started = time.perf_counter()
    req = parse(OllamaChatRequest, await read_json(request, server.settings.max_body_bytes))
    if not req.messages:
        return loaded(req, chat=True)
    fields, sampling = openai_fields(req, server)
    body = {**fields, **thinking_fields(req), "messages": openai_messages(req.messages),
            "tools": req.tools or None, "stream": req.stream,
            **log_fields(req, chat=True)}
    body = {k: v for k, v in body.items() if v is not None}
    ids = await chat_prompt(server, parse(ChatRequest, body))
    body["max_tokens"] = cap(req.options.num_predict, server.max_context - len(ids), "messages")
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    response = await endpoint.respond(request, body, ids, sampling)
    return OllamaAnswer(req.model, started, chat=True).of(response, req.stream)


async def ollama_generate(chat: Endpoint, completion: Endpoint, request: Request):
    server = chat.server
    started = time.perf_counter()
    req = parse(OllamaGenerateRequest, await read_json(request, server.settings.max_body_bytes))
    if req.images:
        raise ApiError(400, "this server's model reads text only; leave out images",
                       param="images")
    if req.template:
        raise ApiError(400, "template (a Go template) is not served: the prompt goes through "
                            "the model's own chat template, or as it is with raw: true",
                       param="template")
    if not req.prompt and req.suffix is None:
        return loaded(req, chat=False)
    fields, sampling = openai_fields(req, server)
    templated = not req.raw and req.suffix is None
    body = {**fields, "stream": req.stream, **log_fields(req, chat=templated)}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if templated:
        response, ids = await templated_answer(chat, request, req, body, sampling)
    else:
        response, ids = await plain_answer(completion, request, req, body, sampling)
    return OllamaAnswer(req.model, started, chat=False, context=ids).of(response, req.stream)


async def templated_answer(chat: Endpoint, request: Request, req: OllamaGenerateRequest,
                           body: dict[str, Any], sampling: dict):
    """(the chat endpoint's response to the prompt in the chat template after ``context``, the
    prompt's ids: the ``context`` the answer continues)."""
    server = chat.server
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}]
    body.update(messages=messages, **thinking_fields(req))
    body["specdecode"] = {**body.get("specdecode", {}), "return_token_ids": True}
    ids = list(req.context or []) + await chat_prompt(server, parse(ChatRequest, body))
    body["max_tokens"] = cap(req.options.num_predict, server.max_context - len(ids), "prompt")
    return await chat.respond(request, body, ids, sampling), ids


async def plain_answer(completion: Endpoint, request: Request, req: OllamaGenerateRequest,
                       body: dict[str, Any], sampling: dict):
    """(the completion endpoint's response to the raw prompt after ``context``, or to the
    middle between ``prompt`` and ``suffix``; None: no ``context`` is returned)."""
    server = completion.server
    ends: tuple[int, ...] = ()
    if req.suffix is not None:
        ids, ends = await run_in_threadpool(server.fill_in, req.prompt, req.suffix)
    else:
        ids = list(req.context or []) + await run_in_threadpool(server.encode, req.prompt,
                                                                 False)
    body["prompt"] = ids  # (the completion request's field, which must not be empty)
    body["max_tokens"] = cap(req.options.num_predict, server.max_context - len(ids), "prompt")
    return await completion.respond(request, body, ids, sampling, ends), None


def log_fields(req: OllamaRequest, chat: bool) -> dict[str, Any]:
    """``logprobs``/``top_logprobs`` as the chat (or the completion) endpoint takes them."""
    if not req.logprobs:
        return {}
    if chat:
        return {"logprobs": True, "top_logprobs": req.top_logprobs}
    return {"logprobs": req.top_logprobs}


class OllamaAnswer:
    """The chat or completion endpoint's answer in Ollama's shape: one object, or a line per
    piece (a chat's tool calls each whole, in one line when the answer ends) and a last line
    with the done reason, the counts and durations (nanoseconds) and, for a templated
    ``/api/generate``, the ``context`` (prompt and answer ids)."""

    def __init__(self, model: str, started: float, chat: bool,
                 context: list[int] | None = None):
        self.model, self.started, self.chat, self.context = model, started, chat, context
        self.calls: dict[int, dict[str, Any]] = {}  # a stream's calls, by index
        self.finish = "stop"
        self.token_ids: list[int] = []

    def piece(self, content: str = "", thinking: str | None = None,
              calls: list | None = None, logprobs: list | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": timestamp()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            body["message"] = message
        else:
            body["response"] = content
            if thinking:
                body["thinking"] = thinking
        if logprobs:
            body["logprobs"] = logprobs
        body["done"] = False
        return body

    def last(self, body: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
        """``body`` (a piece) as the answer's last object: done, with the statistics."""
        total = time.perf_counter() - self.started
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        prompt_s = min(usage.get("prompt_s", 0.0), total)
        body.update(done=True, done_reason=DONE_REASONS.get(self.finish, "stop"),
                    total_duration=int(total * 1e9), load_duration=0,
                    prompt_eval_count=usage["prompt_tokens"] - cached,
                    prompt_eval_duration=int(prompt_s * 1e9),
                    eval_count=usage["completion_tokens"],
                    eval_duration=int((total - prompt_s) * 1e9))
        if self.context is not None:
            body["context"] = self.context + self.token_ids
        return body

    def of(self, response, stream: bool):
        """The endpoint's ``response`` in Ollama's form: one object, or its lines."""
        if not stream:
            return JSONResponse(self.whole(json.loads(response.body)))
        return StreamingResponse(self.stream(response.body_iterator),
                                 media_type="application/x-ndjson",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def whole(self, response: dict[str, Any]) -> dict[str, Any]:
        choice = response["choices"][0]
        self.finish = choice["finish_reason"]
        self.token_ids = choice.get("token_ids") or []
        if "message" in choice:  # the chat endpoint's (a templated /api/generate's too)
            message = choice["message"]
            body = self.piece(message.get("content") or "", message.get("reasoning_content"),
                              [ollama_call(c) for c in message.get("tool_calls") or []],
                              ollama_logprobs(choice.get("logprobs")))
        else:
            body = self.piece(choice.get("text") or "",
                              logprobs=ollama_logprobs(choice.get("logprobs")))
        return self.last(body, response["usage"])

    async def stream(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        async for data in sse_objects(chunks):
            if "error" in data:
                yield line({"error": data["error"].get("message", "")})
                return
            for body in self.chunk(data):
                yield line(body)

    def chunk(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for choice in data.get("choices", []):
            delta = choice.get("delta") or {}
            text = delta.get("content") if "delta" in choice else choice.get("text")
            thinking = delta.get("reasoning_content")
            logprobs = ollama_logprobs(choice.get("logprobs"))
            for call in delta.get("tool_calls") or []:
                self.add_call(call)
            if text or thinking or logprobs:
                out.append(self.piece(text or "", thinking, logprobs=logprobs))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                self.token_ids = choice.get("token_ids") or []
        if data.get("usage"):
            if self.calls:
                out.append(self.piece(calls=[ollama_call(c) for c in self.calls.values()]))
            out.append(self.last(self.piece(), data["usage"]))
        return out

    def add_call(self, delta: dict[str, Any]) -> None:
        """A streamed call's piece: its id and name first, then its arguments' text."""
        call = self.calls.setdefault(delta["index"], {"function": {"name": "",
                                                                    "arguments": ""}})
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


def ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI call as Ollama's: the arguments an object."""
    text = call["function"]["arguments"] or "{}"
    try:
        arguments = json.loads(text)
    except ValueError:
        arguments = text
    return {"function": {"name": call["function"]["name"], "arguments": arguments}}


def ollama_logprobs(logprobs: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """A chat's or a completion's log-probabilities as Ollama's list (token, logprob,
    top_logprobs)."""
    if not logprobs:
        return None
    if "content" in logprobs:
        return [{"token": e["token"], "logprob": e["logprob"], "bytes": e.get("bytes"),
                 "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                                  for t in e.get("top_logprobs") or []]}
                for e in logprobs["content"] or []]
    return [{"token": token, "logprob": logprob,
             "top_logprobs": [{"token": t, "logprob": v} for t, v in (top or {}).items()]}
            for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                           logprobs["top_logprobs"])]


def line(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False) + "\n"

