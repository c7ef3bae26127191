"""llama.cpp's ``POST /infill``: code completion for editor plugins (llama.vim, llama.vscode)
that speak llama-server's own API rather than OpenAI's; and its ``POST /completion`` (also
``/completions``), the same fields and answer around a plain ``prompt`` (text or token ids), as
clients with a llama.cpp backend send it.

A request gives the text before the cursor (``input_prefix``), after it (``input_suffix``),
what was typed on the cursor's line (``prompt``, after the prefix) and chunks of other files
(``input_extra``: ``[{"filename", "text"}]``, a plugin's ring of recently seen code); the prompt
is the model's repository-level fill-in-the-middle layout (``FimTokens.in_repository`` in
specdecode/fim.py, as llama-server lays it out), so the other files come first and stay a cached
prefix between requests. ``n_predict: 0`` reads the prompt and writes nothing (a plugin's
warm-up of its ring: the rows stay in the prompt cache).

llama-server's sampling fields and its chain (``samplers``) are read as
server/llama_sampling.py says. ``n_indent`` ends the completion at a line indented less,
``t_max_predict_ms`` at the first new line after that many milliseconds of generation
(:class:`LineLimits`). ``grammar`` (GBNF) or ``json_schema`` constrains the answer
(specdecode/constraints.py). ``n_probs`` reports each token's log-probability and its most
likely alternatives in ``completion_probabilities``: the model's own, as llama-server reports
them, or with ``post_sampling_probs`` the probabilities of the distribution sampled from.
``response_fields`` keeps only the named fields, nested ones
as ``"timings/prompt_n"`` keys, as llama-server does. ``cache_prompt``, ``id_slot`` and
``t_max_prompt_ms`` are accepted and do nothing (llama-server ignores the last too): the prompt
cache serves every request; so are its fields for context shifting, row reuse by shifting, and
its debug and progress output (:class:`LlamaRequest`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from specdecode.api import GenerationResult
from specdecode.server.endpoints import (OPENAI_UNLIKELY, ClientWatch, StreamedLogprobs,
                                         read_json, sse)
from specdecode.server.frontend import Frontend
from specdecode.server.llama_sampling import DEFAULT_CHAIN, LlamaSampling
from specdecode.server.protocol import ApiError, CompletionRequest, SpecDecodeOptions, parse
from specdecode.server.scheduler import Job

#: llama-server's default batch: the window its /infill prompt's prefix and suffix are cut to
#: (at most half the context here)
LLAMA_BATCH = 2048
#: the files' budget of a prompt is the same for answers up to this long (llama.vim's and
#: llama.vscode's n_predict), so that a warm-up (n_predict 0) caches what the completions read
PLUGIN_ANSWER = 128


class ExtraChunk(BaseModel):
    """One chunk of another file (a plugin's fields besides these, such as ``time``, are
    ignored, as llama-server ignores them)."""

    model_config = ConfigDict(extra="ignore")
    text: str = ""
    filename: str = "tmp"


class LlamaRequest(LlamaSampling):
    """llama-server's generation fields, with its defaults (its sampling's in
    :class:`~specdecode.server.llama_sampling.LlamaSampling`)."""

    n_predict: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] = Field(default_factory=list)
    stream: bool = False
    n_indent: int = 0
    t_max_predict_ms: int = 0
    t_max_prompt_ms: int = 0
    cache_prompt: bool = True
    id_slot: int = -1
    return_tokens: bool = False
    #: a GBNF grammar, or a JSON schema, the answer follows (the grammar where both are given)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    response_fields: list[str] = Field(default_factory=list)
    #: accepted and without effect here: context shifting (a prompt and answer past the
    #: context is a 400), cache reuse by shifting rows, llama-server's debug and progress
    #: output
    n_keep: int = 0
    n_discard: int = 0
    n_cache_reuse: int = 0
    timings_per_token: bool = False
    return_progress: bool = False
    verbose: bool = False
    backend_sampling: bool = False
    sse_ping_interval: int | None = None
    stream_options: dict[str, Any] | None = None
    n_cmpl: int = 1
    model: str | None = None
    specdecode: SpecDecodeOptions | None = None

    def completion(self, ids: list[int], encode: Callable[[str], list[int]]) -> CompletionRequest:
        """The OpenAI completion this request asks for (its sampling in OpenAI's fields;
        ``encode``: a text's token ids, for ``logit_bias`` by text)."""
        if self.n_cmpl != 1:
            raise ApiError(400, "one completion a request here; send n_cmpl 1",
                           param="n_cmpl")
        predict = self.predicted
        body = {"model": "default", "prompt": ids, "stop": self.stop,
                "max_tokens": None if predict is None else max(predict, 1),
                **self.openai_fields(encode)}
        extension = self.specdecode.model_dump() if self.specdecode is not None else {}
        if self.grammar:
            extension["grammar"] = self.grammar
        elif self.json_schema is not None:  # an empty schema: any object, as llama-server has it
            schema = self.json_schema or {"type": "object"}
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "json_schema", "schema": schema}}
        if extension:
            body["specdecode"] = extension
        return parse(CompletionRequest, body)

    @property
    def predicted(self) -> int | None:
        """Tokens to write (``n_predict``, else ``max_tokens``); None: the server's default."""
        predict = next((n for n in (self.n_predict, self.max_tokens, self.max_completion_tokens)
                        if n is not None), None)
        return None if predict is None or predict < 0 else predict

    @property
    def writes_nothing(self) -> bool:
        """``n_predict`` 0: the prompt is read (and cached) and no text returned."""
        return self.predicted == 0


class InfillRequest(LlamaRequest):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""


class NativeCompletionRequest(LlamaRequest):
    prompt: str | list[int]


@dataclasses.dataclass(frozen=True)
class LineLimits:
    """llama-server's ``n_indent`` (a line after the first indented by fewer whitespace
    characters ends the completion before it) and ``t_max_predict_ms`` (once generation has
    run that long, the next new line ends it, the line kept)."""

    n_indent: int
    max_predict_s: float

    def start(self) -> _LineLimit:
        return _LineLimit(self)


class _LineLimit:
    """One sequence's :class:`LineLimits`, its clock started at its first text."""

    def __init__(self, limits: LineLimits):
        self.limits = limits
        self.started: float | None = None
        self.seen = 0  # characters of text already looked at for new lines

    def cut(self, text: str) -> int | None:
        now = time.perf_counter()
        if self.started is None:
            self.started = now
        if self.limits.n_indent > 0:
            start = text.find("\n")
            while start >= 0:
                line = text[start + 1:]
                body = line.lstrip(" \t")
                if body and len(line) - len(body) < self.limits.n_indent:
                    return start + 1
                start = text.find("\n", start + 1)
        fresh, self.seen = text[self.seen:], len(text)
        if (self.limits.max_predict_s > 0 and "\n" in fresh
                and now - self.started > self.limits.max_predict_s):
            return len(text)
        return None

    def held(self, text: str) -> int:
        """A last line of whitespace only may still turn out indented too little."""
        if self.limits.n_indent <= 0 or "\n" not in text:
            return 0
        last = text[text.rfind("\n") + 1:]
        return len(last) if not last.strip(" \t") else 0


def add_llama_routes(app: FastAPI, server: Frontend) -> None:
    @app.post("/infill")
    async def infill_route(request: Request):
        return await infill(server, request)

    @app.post("/completion")
    @app.post("/completions")
    async def completion_route(request: Request):
        return await native_completion(server, request)

    @app.get("/props")
    async def props_route():
        return props(server)


def props(server: Frontend) -> dict[str, Any]:
    """llama-server's ``GET /props``: the sampling a request starts from and the context
    (``default_generation_settings``), the slots, the chat template and the end tokens, which
    clients with a llama.cpp backend read before their first request."""
    tokenizer = server.tokenizer
    defaults = {**LlamaSampling().model_dump(), "samplers": list(DEFAULT_CHAIN), "n_predict": -1}
    return {"default_generation_settings": {"n_ctx": server.max_context, "params": defaults},
            "total_slots": server.backend.parallel, "model_alias": server.settings.model_id,
            "model_path": server.settings.model_id,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": False, "endpoint_props": False, "endpoint_metrics": True,
            "chat_template": getattr(tokenizer, "chat_template", None) or "",
            "bos_token": getattr(tokenizer, "bos_token", None) or "",
            "eos_token": getattr(tokenizer, "eos_token", None) or "",
            "build_info": "specdecode",
            "is_sleeping": False}


async def infill(server: Frontend, request: Request):
    req = parse(InfillRequest, await read_json(request, server.settings.max_body_bytes))
    files = [(c.filename, c.text) for c in req.input_extra]
    predict = req.predicted if req.predicted is not None else server.settings.default_max_tokens
    ids, cut, ends = await run_in_threadpool(
        server.fill_in_repository, files, req.input_prefix, req.input_suffix, req.prompt,
        *fit(server.max_context, max(predict, PLUGIN_ANSWER)))
    return await answer(server, request, req, Prompt(ids, ends, cut), "input_prefix")


async def native_completion(server: Frontend, request: Request):
    req = parse(NativeCompletionRequest, await read_json(request, server.settings.max_body_bytes))
    ids = await run_in_threadpool(server.encode, req.prompt, False)
    return await answer(server, request, req, Prompt(ids), "prompt")


async def answer(server: Frontend, request: Request, req: LlamaRequest, prompt: Prompt,
                 param: str):
    """Run the request on ``prompt`` (its ``ends`` those beside the model's) and answer as
    llama-server does, whole or streamed."""
    ids = prompt.ids
    completion = req.completion(ids, lambda text: server.encode(text, False))
    try:
        specs = server.specs(completion, [ids], completion.max_tokens, param, (), prompt.ends)
    except ApiError as exc:  # the constraint's fields by llama-server's names
        exc.param = {"response_format": "json_schema", "specdecode.grammar": "grammar"}.get(
            exc.param, exc.param)
        raise
    chain = req.chain_sampling(server, prompt.ends)
    specs = [dataclasses.replace(spec, sampling={**spec.sampling, **chain}) for spec in specs]
    if req.n_indent > 0 or req.t_max_predict_ms > 0:
        limits = LineLimits(req.n_indent, req.t_max_predict_ms / 1000)
        specs = [dataclasses.replace(spec, limits=limits) for spec in specs]
    job = Job(specs, asyncio.get_running_loop())
    server.backend.submit(job)
    server.metrics.prompt_tokens.inc(len(ids))
    if not req.response_fields or "prompt" in req.response_fields:
        prompt = dataclasses.replace(prompt, text=await run_in_threadpool(server.decode, ids))
    if req.stream:
        return await stream(server, request, req, job, prompt)
    try:
        result = await finished(ClientWatch(request), job)
    finally:
        job.cancel()
    return JSONResponse(response(server, req, prompt, result))


def fit(context: int, predict: int) -> tuple[int, int]:
    """(window, files' budget) of an /infill prompt (``FimTokens.in_repository``) in a
    ``context`` of tokens, ``predict`` of them to write: llama-server's rule (its batch, and
    the context less the batch and twice the tokens to write)."""
    window = min(LLAMA_BATCH, context // 2)
    return window, max(0, context - window - 2 * predict)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A request's prompt: its ids, the tokens beside the model's ends that end its answer (a
    middle's), whether it was cut to fit the context, and its text (where the answer shows
    it)."""

    ids: list[int]
    ends: tuple[int, ...] = ()
    truncated: bool = False
    text: str = ""


async def finished(watch: ClientWatch, job: Job) -> GenerationResult:
    while True:
        kind, _, payload = await watch.next_event(job)
        if kind == "error":
            raise payload
        if kind == "done":
            return payload


def response(server: Frontend, req: LlamaRequest, prompt: Prompt,
             result: GenerationResult) -> dict[str, Any]:
    """llama-server's completion object (``response_fields``: only those, flat)."""
    stats = result.stats
    content = "" if req.writes_nothing else result.text
    predicted = 0 if req.writes_nothing else len(result.token_ids)
    evaluated = len(prompt.ids) - stats.cached_tokens
    decode_s = max(stats.total_s - stats.prefill_s, 1e-9)
    ends = {*server.eos_token_ids, *prompt.ends}
    stop_type = ("limit" if req.writes_nothing or result.finish_reason == "length" else
                 "eos" if result.token_ids and result.token_ids[-1] in ends else "word")
    body = {
        "index": 0, "content": content, "tokens": result.token_ids if req.return_tokens else [],
        "id_slot": req.id_slot, "stop": True, "model": server.settings.model_id,
        "tokens_predicted": predicted, "tokens_evaluated": len(prompt.ids),
        "generation_settings": {"n_predict": req.n_predict, "temperature": req.temperature,
                                "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p,
                                "seed": req.seed, "stop": req.stop, "n_indent": req.n_indent,
                                "t_max_predict_ms": req.t_max_predict_ms,
                                "samplers": req.samplers, "method": result.method},
        "prompt": prompt.text, "has_new_line": "\n" in content, "truncated": prompt.truncated,
        "stop_type": stop_type, "stopping_word": "", "tokens_cached": stats.cached_tokens,
        **probabilities(server, req, [] if req.writes_nothing else result.logprobs),
        "timings": {"cache_n": stats.cached_tokens, "prompt_n": evaluated,
                    "prompt_ms": stats.prefill_s * 1000,
                    "prompt_per_token_ms": stats.prefill_s * 1000 / max(evaluated, 1),
                    "prompt_per_second": evaluated / max(stats.prefill_s, 1e-9),
                    "predicted_n": predicted, "predicted_ms": decode_s * 1000,
                    "predicted_per_token_ms": decode_s * 1000 / max(predicted, 1),
                    "predicted_per_second": predicted / decode_s},
    }
    return fields_of(body, req.response_fields) if req.response_fields else body


def probabilities(server: Frontend, req: LlamaRequest, entries: list | None) -> dict[str, Any]:
    """llama-server's ``completion_probabilities`` of these tokens' log-probabilities
    (:class:`~specdecode.engine.TokenLogprob`), where the request asks for them (``n_probs``):
    ``logprob`` and ``top_logprobs``, or with ``post_sampling_probs`` ``prob`` and
    ``top_probs`` (the alternatives the sampled distribution gives a probability)."""
    if not req.n_probs or entries is None:
        return {}
    pieces = server.vocabulary.token_bytes
    post = req.post_sampling_probs
    key = "prob" if post else "logprob"

    def one(token: int, logprob: float) -> dict[str, Any]:
        piece = pieces[token]
        value = math.exp(logprob) if post else max(logprob, OPENAI_UNLIKELY)
        return {"id": token, "token": piece.decode("utf-8", "ignore"), "bytes": list(piece),
                key: value}

    return {"completion_probabilities": [
        {**one(e.token, e.logprob), "top_" + key + "s": [
            one(t, v) for t, v in e.top if not post or v > -math.inf]} for e in entries]}


def fields_of(body: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """The named fields of ``body``, a nested one by its path (``timings/prompt_n``), under
    that path as a key; fields it does not have are left out."""
    out = {}
    for path in fields:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


async def stream(server: Frontend, request: Request, req: LlamaRequest, job: Job,
                 prompt: Prompt) -> StreamingResponse:
    """Server-sent events as llama-server sends them: a ``content`` piece each, then the
    whole object (its ``content`` empty) with ``stop`` true."""
    watch = ClientWatch(request)
    sent = StreamedLogprobs(1)
    first = await watch.next_event(job)
    if first[0] == "error":
        job.cancel()
        raise first[2]

    async def events() -> AsyncIterator[str]:
        event = first
        try:
            while True:
                kind, _, payload = event
                if kind == "error":
                    yield sse(payload.body())
                    return
                if kind == "text" and not req.writes_nothing:
                    yield sse({"index": 0, "content": payload, "stop": False,
                               **probabilities(server, req, sent.of(0, payload))})
                if kind == "done":
                    last = {**response(server, req, prompt, payload), "content": ""}
                    last.pop("completion_probabilities", None)
                    rest = [] if req.writes_nothing else sent.rest(0, payload)
                    yield sse({**last, **probabilities(server, req, rest)})
                    return
                event = await job.events.get()
        finally:
            job.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
