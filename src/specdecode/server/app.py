"""The FastAPI application: OpenAI's chat and completion endpoints over a backend.

A request is checked completely before it takes a place in the queue (Host header, content
type, body size, JSON, schema, method and config against the server's limits, prompt length
against the context: first from its size, then from its tokens), so bad input costs no model
time and gets OpenAI's error object with a 4xx; docs/server.md lists what a hostile client
meets. Generation runs on the backend: the local
scheduler thread (:class:`Server`), or Ray Serve engine replicas (:mod:`.ray_serve`, the same
routes in front of them); its events come back through an ``asyncio.Queue`` and leave as one
JSON body or as server-sent events (``data: {...}`` ... ``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import queue
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode import registry
from specdecode.api import GenerationResult, encode_prompt
from specdecode.constraints import Vocabulary, make_constraint
from specdecode.engine import check_request
from specdecode.errors import SpecDecodeError
from specdecode.models.base import Runner
from specdecode.sampling import SamplingParams
from specdecode.server.goodput import Batching
from specdecode.server.metrics import CONTENT_TYPE, Metrics
from specdecode.server import limits
from specdecode.server.artifacts import ARTIFACT_FIELDS, Catalogue
from specdecode.server.diffusion import (Dllm, is_diffusion, make_factory, served_method,
                                         served_policies)
from specdecode.server.diffusion import check_request as check_diffusion
from specdecode.server.protocol import (ApiError, ChatRequest, CompletionRequest, SamplingFields,
                                        decode_json, error_body, new_id, now, parse)
from specdecode.server.memory import SharedMemory
from specdecode.server.prompt_cache import PromptCache
from specdecode.server.scheduler import Job, Scheduler, SequenceSpec
from specdecode.server.tools import StreamDeltas, ToolError, check_template, parse_tool_calls

log = logging.getLogger("specdecode.server")

#: seconds between checks that a waiting (non-streaming) client is still connected
DISCONNECT_POLL_S = 0.25
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
#: Host header names a server bound to loopback answers by default (DNS rebinding: a web page's
#: own name that resolves to 127.0.0.1 must not reach it)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: tokenizer copies, so one long prompt being encoded holds no other request up
TOKENIZER_COPIES = 4
#: largest seed + 1 (SamplingParams); choice i of a seeded request uses seed + i, wrapped
SEED_END = 2**64
#: OpenAI's log-probability for a token that cannot occur (JSON has no -inf)
OPENAI_UNLIKELY = -9999.0


@dataclass
class Settings:
    #: the name clients put in ``model`` (``default`` is always accepted too)
    model_id: str = "smollm2"
    #: the method used when a request names none
    method: str = registry.DEFAULT_METHOD
    #: config overrides of the default method (strings are coerced, as from the CLI)
    config: dict[str, Any] = field(default_factory=dict)
    #: sequences that may wait for a slot before requests get 429
    max_queue: int = 32
    #: largest accepted request body (bytes); larger ones get 413
    max_body_bytes: int = 2 * 1024 * 1024
    #: most choices per request
    max_n: int = 8
    #: max_tokens when the request gives none (capped by the context left)
    default_max_tokens: int = 256
    #: Host header names answered (others get 421); None = any (a server on a public address
    #: behind its own names)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS
    #: origins whose web pages may call the API (CORS); empty = none, no CORS headers at all
    cors_origins: tuple[str, ...] = ()
    #: proposer memory each slot may keep (its cache of per-config proposers); a request whose
    #: config alone needs more gets a 400
    proposer_memory_bytes: int = 128 * 2**20
    #: artifacts offered to requests by name (``--artifact NAME=PATH``), besides those found
    #: for the model in the package and the user cache
    artifacts: dict[str, str] = field(default_factory=dict)
    #: how sequences share forwards: draft budgets, draft rows and prompt rows a step
    batching: Batching = field(default_factory=Batching)
    #: memory for earlier prompts' rows that the slots wrote over (:mod:`.prompt_cache`);
    #: 0 = no prompt cache at all
    prompt_cache_bytes: int = 1024 * 2**20


@dataclass(frozen=True)
class ModelInfo:
    """What the routes need to know of the model without running it: the limits every request
    is checked against before it queues (``check_request`` reads these two fields of a runner)
    and the fingerprint clients see."""

    max_context: int
    vocab_size: int
    fingerprint: str
    #: prompt rows the runner prefills per part between other sequences' steps (0: in one call)
    prefill_granule: int = 0

    @classmethod
    def of(cls, runner: Runner) -> ModelInfo:
        return cls(runner.max_context, runner.vocab_size, runner.fingerprint(),
                   runner.prefill_granule)


class Frontend:
    """The state behind the routes, whatever generates the tokens: settings, the tokenizer
    (encoding only), metrics, and a backend that takes jobs (:class:`Job`).

    The backend is the local :class:`Scheduler` (:class:`Server`) or a pool of Ray Serve engine
    replicas (:mod:`.ray_serve`); both offer ``start()``, ``submit(job)`` (raising a 429/503
    :class:`ApiError` when it cannot take the job), ``stop()``, ``alive``, ``parallel`` (sequences
    generated at once) and ``load()``, and post the same events to the job. ``memory`` is the
    cross-request memory, saved on shutdown (``save()``; ``path`` is where).
    """

    def __init__(self, backend, model: ModelInfo, tokenizer, settings: Settings,
                 metrics: Metrics, memory, catalogue: Catalogue | None = None,
                 dllm: Dllm | None = None):
        self.settings = settings
        #: the dLLM ``diffusion:POLICY`` requests decode (:mod:`.diffusion`); None: refused
        self.dllm = dllm
        method = registry.get(settings.method)
        method.make_config(settings.config)  # reject a bad default before serving
        self.backend = backend
        self.memory = memory
        self.metrics = metrics
        self.runner_info = model
        self.max_context = model.max_context
        self.catalogue = catalogue or Catalogue.for_target(model.fingerprint, settings.artifacts)
        # requests are encoded on the event loop's worker threads and (locally) decoded on the
        # scheduler thread; a fast tokenizer used from two threads at once can fail ("Already
        # borrowed"), so each encoding thread borrows a copy of its own from this pool
        self._tokenizers: queue.Queue = queue.Queue()
        for _ in range(TOKENIZER_COPIES):
            self._tokenizers.put(copy.deepcopy(tokenizer))
        #: the most characters one token stands for: a text of n characters has at least
        #: n / this many tokens, so an over-long prompt is refused before it is tokenized
        self.chars_per_token = max(1, max((len(t) for t in tokenizer.get_vocab()), default=1)
                                   if tokenizer is not None else 1)
        self.started = now()
        self.fingerprint = model.fingerprint
        self.tokenizer = tokenizer
        #: the ids ending a generation (a finished grammar allows them); the tokenizer's by default
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids: list[int] = [] if eos is None else [eos]
        self._vocabulary: Vocabulary | None = None

    @property
    def vocabulary(self) -> Vocabulary:
        """The tokens as constraints see them, built on the first request that needs them."""
        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.tokenizer, self.runner_info.vocab_size,
                                          self.eos_token_ids)
        return self._vocabulary

    # ---- request -> sequence specs ---------------------------------------------------------

    def resolve_method(self, req: SamplingFields) -> tuple[registry.Method, Any, int]:
        """(method, its config, its proposer's estimated bytes) for a request; a request's
        config fields are checked against their limits (:mod:`.limits`) and its artifact
        names looked up in the catalogue (:mod:`.artifacts`) before the config is built."""
        base, plus, alias = req.model.partition("+")
        if base not in (self.settings.model_id, "default"):
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves "
                                f"'{self.settings.model_id}' (or '{self.settings.model_id}+METHOD', "
                                "see GET /v1/models)", param="model", code="model_not_found")
        if plus and not alias:
            raise ApiError(400, f"model '{req.model}' names no method after '+'", param="model")
        chosen = req.specdecode.method if req.specdecode else None
        if chosen and alias and chosen != alias:
            raise ApiError(400, f"the model alias names method '{alias}' but specdecode.method "
                                f"is '{chosen}'; give one of them", param="specdecode.method")
        name = chosen or alias or self.settings.method
        try:
            method = served_method(name)
        except SpecDecodeError as exc:
            raise ApiError(400, str(exc), param="specdecode.method" if chosen else "model",
                           code="unknown_method") from None
        overrides = dict(self.settings.config) if name == self.settings.method else {}
        asked = dict(req.specdecode.config) if req.specdecode else {}
        limits.check_overrides(method, asked)
        for field in ARTIFACT_FIELDS:
            if field in asked:
                asked[field] = self.catalogue.resolve(method, field, asked[field])
        overrides.update(asked)
        try:
            config = method.make_config(overrides)
        except (SpecDecodeError, TypeError) as exc:
            raise ApiError(400, str(exc), param="specdecode.config") from None
        limits.check_ranges(method, config, asked)
        artifact_bytes = sum(self.catalogue.loaded_bytes(method, f, getattr(config, f))
                             for f in ARTIFACT_FIELDS if hasattr(config, f))
        needed = limits.proposer_bytes(config, self.runner_info.vocab_size, artifact_bytes)
        budget = self.settings.proposer_memory_bytes
        if needed > budget:
            raise ApiError(400, f"this config of method '{name}' needs about {needed / 2**20:.0f} "
                                f"MiB of proposer memory; this server allows {budget / 2**20:.0f} "
                                "MiB per slot (--proposer-memory-mb): ask for a smaller one",
                           param="specdecode.config")
        return method, config, needed

    def sampling(self, req: SamplingFields) -> dict[str, Any]:
        options = req.sampling()
        try:
            SamplingParams(**options)
        except SpecDecodeError as exc:
            param = next((k for k in options if str(exc).startswith(k)), None)
            raise ApiError(400, str(exc), param=param) from None
        top = req.top_logprobs_count()
        if top is not None:
            options["logprobs"] = top
        asked = req.constraint()
        if asked:
            if self.tokenizer is None:
                raise ApiError(400, "this server has no tokenizer, so it cannot constrain the "
                                    "output", param="response_format")
            try:
                options["constraint"] = make_constraint(self.vocabulary, **asked)
            except SpecDecodeError as exc:  # the grammar engine's own message
                param = ("specdecode.ban" if set(asked) == {"banned"} else
                         "response_format" if req.response_format is not None else
                         "tools" if getattr(req, "tool_request", None) is not None
                         and req.tool_request.constrains else
                         f"specdecode.{next(iter(asked))}")
                raise ApiError(400, str(exc), param=param) from None
        return options

    def max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        context = self.max_context
        if prompt_len >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens, but "
                                f"the prompt has {prompt_len} tokens; shorten the prompt",
                           param=param, code="context_length_exceeded")
        left = context - prompt_len
        if requested is None:
            return min(self.settings.default_max_tokens, left)
        if requested < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {requested}",
                           param="max_tokens")
        if requested > left:
            raise ApiError(400, f"max_tokens ({requested}) plus the prompt ({prompt_len} tokens) "
                                f"exceeds the model's context of {context} tokens; lower "
                                f"max_tokens to at most {left}", param="max_tokens",
                           code="context_length_exceeded")
        return requested

    def specs(self, req: SamplingFields, prompts: list[list[int]], requested: int | None,
              param: str) -> list[SequenceSpec]:
        if not 1 <= req.n <= self.settings.max_n:
            raise ApiError(400, f"n must be between 1 and {self.settings.max_n}, got {req.n}",
                           param="n")
        method, config, proposer_bytes = self.resolve_method(req)
        sampling = self.sampling(req)
        if is_diffusion(method.name):
            check_diffusion(method.name, self.dllm, sampling)
        stop = tuple(req.stop_list())
        specs = []
        for ids in prompts:
            limit = self.max_tokens(len(ids), requested, param)
            try:
                check_request(self.runner_info, ids, limit)
            except SpecDecodeError as exc:
                raise ApiError(400, str(exc), param=param) from None
            for i in range(req.n):
                options = dict(sampling)
                if options.get("seed") is not None:
                    # n seeded choices: distinct, each repeatable, each a valid seed
                    seed = options["seed"] + i
                    options["seed"] = seed - SEED_END if seed >= SEED_END else seed
                specs.append(SequenceSpec(ids, limit, stop, options, method, config,
                                          proposer_bytes))
        return specs

    def check_size(self, prompt, chat: bool) -> None:
        """Refuse a text prompt whose length in characters already proves it longer than the
        context, before any tokenizing: a 2 MB prompt costs nothing."""
        if isinstance(prompt, str):
            texts = [prompt]
        else:  # chat messages, or token ids (counted exactly later, without tokenizing)
            texts = [m.get("content") or "" for m in prompt if isinstance(m, dict)]
        chars = sum(len(t) for t in texts)
        at_least = -(-chars // self.chars_per_token)
        if at_least >= self.max_context:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} "
                                f"tokens, but the prompt has at least {at_least} ({chars} "
                                f"characters, at most {self.chars_per_token} per token); shorten "
                                "the prompt", param="messages" if chat else "prompt",
                           code="context_length_exceeded")

    def encode(self, prompt, chat: bool, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt (on a worker thread, with a tokenizer copy of its own);
        ``tools``: the function definitions the chat template shows the model. Every failure
        is a 400."""
        self.check_size(prompt, chat)
        tokenizer = self._tokenizers.get()
        try:
            if tools:
                check_template(tokenizer)
            return encode_prompt(tokenizer, prompt, chat, tools)
        except ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except SpecDecodeError as exc:
            raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None
        except Exception as exc:  # the tokenizer's own errors: what it could not encode
            raise ApiError(400, f"cannot tokenize the {'messages' if chat else 'prompt'}: "
                                f"{type(exc).__name__}: {exc}"[:300],
                           param="messages" if chat else "prompt") from None
        finally:
            self._tokenizers.put(tokenizer)


class Server(Frontend):
    """The single-process server: ``len(runners)`` slots over the same weights, stepped
    together (one packed forward a step) by one :class:`Scheduler` thread, all sharing one
    suffix global tree."""

    def __init__(self, runners: list[Runner], tokenizer, eos_token_ids: list[int],
                 settings: Settings, memory: SharedMemory | None = None,
                 catalogue: Catalogue | None = None, dllm: Dllm | None = None):
        memory = memory or SharedMemory()
        metrics = Metrics()
        prompt_cache = (PromptCache(settings.prompt_cache_bytes, metrics)
                        if settings.prompt_cache_bytes else None)
        scheduler = Scheduler(runners, tokenizer, eos_token_ids,
                              make_factory(memory.make_proposer, dllm), settings.max_queue,
                              metrics, settings.proposer_memory_bytes, settings.batching,
                              prompt_cache)
        super().__init__(scheduler, ModelInfo.of(runners[0]), tokenizer, settings, metrics,
                         memory, catalogue, dllm)
        self.eos_token_ids = list(eos_token_ids)


# ---- responses ------------------------------------------------------------------------------

def usage(prompt_tokens: int, results: list[GenerationResult]) -> dict[str, Any]:
    """OpenAI's token counts plus this request's own speculation statistics."""
    completion = sum(len(r.token_ids) for r in results)
    steps = sum(len(r.stats.accepted_lengths) for r in results)
    committed = sum(sum(r.stats.accepted_lengths) for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        # OpenAI's field: prompt tokens whose rows were cached (not prefilled again), for
        # every choice
        "prompt_tokens_details": {"cached_tokens": min((r.stats.cached_tokens for r in results),
                                                       default=0)},
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "method": results[0].method if results else None,
        "draft_tokens": sum(r.stats.draft_tokens for r in results),
        "accepted_tokens": sum(r.stats.accepted_tokens for r in results),
        "target_forwards": sum(r.stats.target_forwards for r in results),
        "forced_tokens": sum(r.stats.forced_tokens for r in results),
        "pruned_nodes": sum(r.stats.pruned_nodes for r in results),
        "verify_steps": steps,
        "mean_accepted_length": round(committed / steps, 4) if steps else 0.0,
        # seconds from a choice's start to its first token (its prompt's prefill), the longest
        "prompt_s": round(max((r.stats.prefill_s for r in results), default=0.0), 4),
    }


def with_tool_calls(choice: dict, result: GenerationResult) -> None:
    """A chat choice's message as content and the tool calls parsed from its text."""
    content, calls = parse_tool_calls(result.text)
    choice["message"]["content"] = content
    if calls:
        choice["message"]["tool_calls"] = [call.as_dict() for call in calls]
        if result.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"


class ClientWatch:
    """Notices a client that hung up while its (non-streaming) response is being generated;
    streaming responses are cancelled by Starlette itself when the client goes."""

    def __init__(self, request: Request):
        self.request = request
        self.checked = time.monotonic()

    async def next_event(self, job: Job) -> tuple[str, int, Any]:
        """The job's next event; cancels the job if the client is gone meanwhile."""
        while True:
            if time.monotonic() - self.checked >= DISCONNECT_POLL_S:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    job.cancel()
                    raise ApiError(499, "client closed the request")
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class StreamedLogprobs:
    """Per choice of a stream, the log-probabilities sent so far: a text piece carries those of
    its tokens (:class:`~specdecode.api.Piece`), the last chunk whatever is left."""

    def __init__(self, choices: int):
        self.sent = [0] * choices

    def of(self, index: int, piece: str) -> list | None:
        logprobs = getattr(piece, "logprobs", None)
        if logprobs is not None:
            self.sent[index] += len(logprobs)
        return logprobs

    def rest(self, index: int, result: GenerationResult) -> list | None:
        return None if result.logprobs is None else result.logprobs[self.sent[index]:]


class Endpoint:
    """One completion-style endpoint: how its chunks and final body look."""

    def __init__(self, server: Frontend, chat: bool):
        self.server = server
        self.chat = chat
        self.path = "/v1/chat/completions" if chat else "/v1/completions"
        self.object = "chat.completion" if chat else "text_completion"

    def choice(self, index: int, text: str, finish: str | None, delta: bool,
               logprobs: list | None = None) -> dict:
        """One choice; ``logprobs``: the :class:`~specdecode.engine.TokenLogprob` of its tokens
        (None = not asked for)."""
        lp = None if logprobs is None else self.logprobs(logprobs)
        if not self.chat:
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        key = "delta" if delta else "message"
        body = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": index, key: body, "logprobs": lp, "finish_reason": finish}

    def logprobs(self, entries: list) -> dict:
        """OpenAI's logprobs object: chat's ``content`` list, or completions' parallel lists."""
        vocab = self.server.vocabulary
        def text(token: int) -> str:
            return vocab.token_bytes[token].decode("utf-8", "replace")

        def value(logprob: float) -> float:
            return max(logprob, OPENAI_UNLIKELY)  # -inf (a masked token) is not JSON

        if self.chat:
            return {"content": [
                {"token": text(e.token), "logprob": value(e.logprob),
                 "bytes": list(vocab.token_bytes[e.token]),
                 "top_logprobs": [{"token": text(t), "logprob": value(v),
                                   "bytes": list(vocab.token_bytes[t])} for t, v in e.top]}
                for e in entries], "refusal": None}
        return {"tokens": [text(e.token) for e in entries],
                "token_logprobs": [value(e.logprob) for e in entries],
                "top_logprobs": [{text(t): value(v) for t, v in e.top} for e in entries],
                "text_offset": None}

    def parses_tools(self, req) -> bool:
        """The response's text is parsed for tool calls (server/tools.py)."""
        tools = getattr(req, "tool_request", None) if self.chat else None
        return tools is not None and tools.parses

    def envelope(self, rid: str, model: str, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": rid, "object": kind, "created": now(), "model": model,
                "system_fingerprint": self.server.fingerprint}

    async def handle(self, request: Request) -> Response:
        server = self.server
        payload = await read_json(request, server.settings.max_body_bytes)
        if self.chat:
            req = parse(ChatRequest, payload)
            req.unsupported()
            if not req.messages:
                raise ApiError(400, "'messages' must hold at least one message", param="messages")
            messages = [m.as_template_input() for m in req.messages]
            tools = req.tool_request.offered if req.tool_request is not None else None
            prompts = [await run_in_threadpool(server.encode, messages, True, tools)]
            requested = (req.max_completion_tokens if req.max_completion_tokens is not None
                         else req.max_tokens)
            param = "messages"
        else:
            req = parse(CompletionRequest, payload)
            req.unsupported()
            if not req.prompts():
                raise ApiError(400, "'prompt' must not be empty", param="prompt")
            prompts = [await run_in_threadpool(server.encode, p, False) for p in req.prompts()]
            requested, param = req.max_tokens, "prompt"
        specs = server.specs(req, prompts, requested, param)
        capacity = server.backend.parallel + server.settings.max_queue
        if len(specs) > capacity:  # could never be admitted: retrying would not help
            raise ApiError(400, f"this request asks for {len(specs)} sequences (prompts x n); "
                                f"this server takes at most {capacity} at once", param="n")
        job = Job(specs, asyncio.get_running_loop())
        server.backend.submit(job)
        prompt_tokens = sum(len(ids) for ids in prompts)
        server.metrics.prompt_tokens.inc(prompt_tokens)
        if req.stream:
            return await self.stream(request, job, req, prompt_tokens)
        try:
            return await self.collect(request, job, req, prompt_tokens)
        finally:
            job.cancel()  # a no-op when every sequence is done; stops the rest otherwise
            server.metrics.latency.labels(self.path).observe(time.perf_counter() - job.arrived)

    async def collect(self, request: Request, job: Job, req, prompt_tokens: int) -> Response:
        results: list[GenerationResult | None] = [None] * len(job.specs)
        first_text = True
        watch = ClientWatch(request)
        while any(r is None for r in results):
            kind, index, payload = await watch.next_event(job)
            if kind == "error":
                raise payload
            if kind == "text" and first_text:
                first_text = False
                self.server.metrics.first_token.observe(time.perf_counter() - job.arrived)
            if kind == "done":
                results[index] = payload
        rid = new_id("chatcmpl" if self.chat else "cmpl")
        body = self.envelope(rid, req.model, chunk=False)
        body["choices"] = [self.choice(i, r.text, r.finish_reason, delta=False,
                                       logprobs=r.logprobs)
                           for i, r in enumerate(results)]
        if self.parses_tools(req):
            for choice, result in zip(body["choices"], results):
                with_tool_calls(choice, result)
        if req.specdecode and req.specdecode.return_token_ids:
            for choice, result in zip(body["choices"], results):
                choice["token_ids"] = result.token_ids
        body["usage"] = usage(prompt_tokens, results)
        return JSONResponse(body)

    async def stream(self, request: Request, job: Job, req, prompt_tokens: int) -> Response:
        # wait for the start (or the first error) while we can still answer with a status code
        try:
            first = await ClientWatch(request).next_event(job)
        except BaseException:
            job.cancel()
            raise
        if first[0] == "error":
            job.cancel()
            raise first[2]
        rid = new_id("chatcmpl" if self.chat else "cmpl")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        metrics = self.server.metrics
        chunks = Chunks(self, rid, req.model, len(job.specs), self.parses_tools(req))

        async def events() -> AsyncIterator[str]:
            results: list[GenerationResult | None] = [None] * len(job.specs)
            first_text = True
            event = first
            try:
                if self.chat:
                    for i in range(len(job.specs)):
                        yield chunks.chunk(i, {"role": "assistant", "content": ""})
                while True:
                    kind, index, payload = event
                    if kind == "error":
                        yield sse(payload.body())
                        break
                    if kind == "text":
                        if first_text:
                            first_text = False
                            metrics.first_token.observe(time.perf_counter() - job.arrived)
                        for text in chunks.text(index, payload):
                            yield text
                    elif kind == "done":
                        results[index] = payload
                        for text in chunks.end(index, payload):
                            yield text
                        if all(r is not None for r in results):
                            if include_usage:
                                body = self.envelope(rid, req.model, chunk=True)
                                body["choices"] = []
                                body["usage"] = usage(prompt_tokens, results)
                                yield sse(body)
                            break
                    event = await job.events.get()
                yield "data: [DONE]\n\n"
            finally:
                job.cancel()  # the client left, or we are done: free the slots either way
                metrics.latency.labels(self.path).observe(time.perf_counter() - job.arrived)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class Chunks:
    """The server-sent events of one streamed response: each choice's text pieces, as they
    come or as content and tool calls (:class:`~.tools.StreamDeltas`), with their
    log-probabilities (a piece's ride with its first chunk), and each choice's end."""

    def __init__(self, endpoint: Endpoint, rid: str, model: str, choices: int, tools: bool):
        self.endpoint, self.rid, self.model = endpoint, rid, model
        self.sent = StreamedLogprobs(choices)
        self.deltas = StreamDeltas(choices, tools)

    def chunk(self, index: int, delta: dict, finish: str | None = None, logprobs=None) -> str:
        body = self.endpoint.envelope(self.rid, self.model, chunk=True)
        choice = self.endpoint.choice(index, delta.get("content", ""), finish, delta=True,
                                      logprobs=logprobs)
        if self.endpoint.chat:
            choice["delta"] = delta
        body["choices"] = [choice]
        return sse(body)

    def text(self, index: int, piece: str) -> list[str]:
        parts, logprobs = self.deltas.text(index, piece), self.sent.of(index, piece)
        if logprobs and not parts:  # text held back: its tokens' log-probabilities go now
            parts = [{"content": ""}]
        return [self.chunk(index, d, logprobs=logprobs if i == 0 else None)
                for i, d in enumerate(parts)]

    def end(self, index: int, result: GenerationResult) -> list[str]:
        parts, finish = self.deltas.finish(index, result.finish_reason)
        return [self.chunk(index, d) for d in parts] + [
            self.chunk(index, {"content": ""}, finish, logprobs=self.sent.rest(index, result))]


async def read_json(request: Request, limit: int) -> Any:
    """The body's JSON value: ``Content-Type: application/json`` only (415 otherwise: a web
    page can send text/plain across origins without asking, never JSON), at most ``limit``
    bytes (413), valid, shallow and encodable (400, :func:`~.protocol.decode_json`)."""
    kind = request.headers.get("content-type", "")
    if kind.partition(";")[0].strip().lower() != "application/json":
        raise ApiError(415, f"send the body as JSON with 'Content-Type: application/json' (got "
                            f"{ascii(kind[:60]) if kind else 'none'})",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes; this server accepts at most "
                            f"{limit} (--max-body-bytes)", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)",
                           code="request_too_large")
    if not body:
        raise ApiError(400, "the request body is empty; send a JSON object")
    return decode_json(bytes(body))


class CheckHost:
    """ASGI middleware: answer only requests whose Host header names this server (421
    otherwise), so a web page whose own name an attacker points at 127.0.0.1 (DNS rebinding)
    cannot reach a server on loopback."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app = app
        self.allowed = {h.lower() for h in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_name(host) not in self.allowed:
            response = JSONResponse(error_body(
                f"this server does not answer for host {ascii(host[:100])}; it answers "
                f"{', '.join(sorted(self.allowed))} (start it with --allowed-hosts to add names)",
                code="misdirected_request"), status_code=421)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def host_name(host: str) -> str:
    """'name:port' or '[v6]:port' -> the name, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class CountRequests:
    """ASGI middleware: count every HTTP request by endpoint and status code."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()


def create_app(server: Frontend) -> FastAPI:
    """The ASGI app. On shutdown the scheduler stops first (every proposer sees ``finish``),
    then the suffix global tree is saved (with ``--suffix-cache``)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        server.backend.start()
        try:
            yield
        finally:
            await run_in_threadpool(server.backend.stop)
            await run_in_threadpool(server.memory.save)

    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    chat = Endpoint(server, chat=True)
    completion = Endpoint(server, chat=False)

    add_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat.handle(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion.handle(request)

    @app.get("/v1/models")
    async def models():
        served = registry.names() + (served_policies() if server.dllm is not None else [])
        ids = [server.settings.model_id] + [f"{server.settings.model_id}+{name}"
                                            for name in served]
        return {"object": "list", "data": [
            {"id": i, "object": "model", "created": server.started, "owned_by": "specdecode",
             "max_model_len": server.max_context} for i in ids]}

    @app.get("/health")
    async def health():
        alive = server.backend.alive
        body = {"status": "ok" if alive else "error", "model": server.settings.model_id,
                "method": server.settings.method, "max_context": server.max_context,
                **server.backend.load()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    add_middleware(app, server)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error answers in OpenAI's error shape, an unexpected one as a logged 500."""

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)


def add_middleware(app: FastAPI, server: Frontend) -> None:
    settings = server.settings
    if settings.cors_origins:  # off by default: browsers then keep other origins' pages out
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"], max_age=600)
    if settings.allowed_hosts is not None:
        app.add_middleware(CheckHost, allowed=settings.allowed_hosts)
    app.add_middleware(CountRequests, metrics=server.metrics)  # outermost: counts every answer
