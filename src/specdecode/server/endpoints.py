"""OpenAI's chat and completion endpoints over a front end (:mod:`.frontend`): a request is
parsed and checked, its sequences queued as one job, and the job's events leave as one JSON
body or as server-sent events (``data: {...}`` ... ``data: [DONE]``), with usage, log
probabilities and tool calls in OpenAI's shapes. A waiting client that disconnects cancels its
job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from specdecode.api import GenerationResult
from specdecode.server.echo import Echo, vllm_form
from specdecode.server.frontend import Frontend
from specdecode.server.protocol import (ApiError, ChatRequest, CompletionRequest, decode_json,
                                        new_id, now, parse)
from specdecode.server.harmony import Harmony, HarmonySplitter, split_harmony
from specdecode.server.reasoning import ReasoningSplitter, Thinking, split_reasoning
from specdecode.server.scheduler import Job
from specdecode.server.tool_parser import StreamDeltas, collect, parse_tool_calls
from specdecode.server.tools import ToolRequest

#: seconds between checks that a waiting (non-streaming) client is still connected
DISCONNECT_POLL_S = 0.25
#: OpenAI's log-probability for a token that cannot occur (JSON has no -inf)
OPENAI_UNLIKELY = -9999.0


async def chat_prompt(server: Frontend, req: ChatRequest) -> list[int]:
    """A chat request's prompt ids: its messages through the model's template, with its
    tools (their call format read off the template first: a 400 where it has none)."""
    if not req.messages:
        raise ApiError(400, "'messages' must hold at least one message", param="messages")
    messages = [m.as_template_input() for m in req.messages]
    tools = req.tool_request.offered if req.tool_request is not None else None
    if tools:  # the model's call format, read off its template (or a 400)
        req.use_tool_format(await run_in_threadpool(server.tool_format))
    return await run_in_threadpool(server.encode, messages, True, tools, req.template_kwargs())


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


def message_parts(choice: dict, result: GenerationResult, tools: ToolRequest | None,
                  thinking: Thinking | Harmony | None) -> None:
    """A chat choice's message as its reasoning (``thinking``: the model's answers hold a
    reasoning block, or harmony's channels), content and the tool calls parsed from the content
    (``tools``: written in the model's call format, ``tools.format``; harmony's are messages of
    their own)."""
    text, calls = result.text, []
    if isinstance(thinking, Harmony):
        reasoning, rest = split_harmony(text, tools is not None)
        content, calls = collect(rest)
    elif thinking is not None:
        reasoning, content = split_reasoning(text, thinking)
    else:
        reasoning, content = None, text
    if reasoning is not None:
        choice["message"]["reasoning_content"] = reasoning
    if tools is not None and not isinstance(thinking, Harmony):
        content, calls = parse_tool_calls(content, tools.format, tools.schemas)
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


async def sse_objects(events: AsyncIterator[str | bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a stream of server-sent events (a streamed response's body, read
    by the endpoints that answer in another API's form)."""
    async for raw in events:
        text = raw.decode() if isinstance(raw, bytes) else raw
        for line in text.splitlines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


class StreamedLogprobs:
    """Per choice of a stream, the log-probabilities sent so far: a text piece carries those of
    its tokens (:class:`~specdecode.api.Piece`), the last chunk whatever is left; and the
    characters of the tokens sent, where the next chunk's ``text_offset`` starts."""

    def __init__(self, choices: int):
        self.sent = [0] * choices
        self.chars = [0] * choices

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
               logprobs: list | None = None, prompt: tuple | None = None,
               offset: int = 0) -> dict:
        """One choice; ``logprobs``: the :class:`~specdecode.engine.TokenLogprob` of its tokens
        (None = not asked for); ``prompt``: (ids, prompt log-probabilities) echoed before them;
        ``offset``: the characters of the choice's text before them (a stream's)."""
        lp = (None if logprobs is None and prompt is None
              else self.logprobs(logprobs or [], prompt, offset))
        if not self.chat:
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        key = "delta" if delta else "message"
        body = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": index, key: body, "logprobs": lp, "finish_reason": finish}

    def logprobs(self, entries: list, prompt: tuple | None = None, offset: int = 0) -> dict:
        """OpenAI's logprobs object: chat's ``content`` list, or completions' parallel lists
        (``prompt``: (ids, their entries) in front, the first token's null: server/echo.py),
        ``text_offset`` each token's first character in the choice's text, from ``offset``
        (counted in the tokens' texts, as vLLM counts them)."""
        vocab = self.server.vocabulary
        text = self.token_text

        def value(logprob: float) -> float:
            return max(logprob, OPENAI_UNLIKELY)  # -inf (a masked token) is not JSON

        if self.chat:
            return {"content": [
                {"token": text(e.token), "logprob": value(e.logprob),
                 "bytes": list(vocab.token_bytes[e.token]),
                 "top_logprobs": [{"token": text(t), "logprob": value(v),
                                   "bytes": list(vocab.token_bytes[t])} for t, v in e.top]}
                for e in entries], "refusal": None}
        head: list = [[], [], []]
        if prompt is not None:
            ids, scored = prompt
            head = [[text(ids[0])], [None], [None]]
            entries = list(scored[1:]) + list(entries)
        tokens = head[0] + [text(e.token) for e in entries]
        return {"tokens": tokens,
                "token_logprobs": head[1] + [value(e.logprob) for e in entries],
                "top_logprobs": head[2] + [{text(t): value(v) for t, v in e.top} for e in entries],
                "text_offset": list(itertools.accumulate(map(len, tokens[:-1]), initial=offset))
                if tokens else []}

    def token_text(self, token: int) -> str:
        return self.server.vocabulary.token_bytes[token].decode("utf-8", "replace")

    def parses_tools(self, req) -> ToolRequest | None:
        """The tools whose calls the response's text is parsed for (server/tool_parser.py);
        None: not parsed."""
        tools = getattr(req, "tool_request", None) if self.chat else None
        return tools if tools is not None and tools.parses else None

    def envelope(self, rid: str, model: str, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": rid, "object": kind, "created": now(), "model": model,
                "system_fingerprint": self.server.fingerprint}

    async def handle(self, request: Request) -> Response:
        return await self.respond(request, await read_json(request,
                                                           self.server.settings.max_body_bytes))

    async def respond(self, request: Request, payload: Any, prompt: list[int] | None = None,
                      sampling: dict[str, Any] | None = None, ends: tuple[int, ...] = ()
                      ) -> Response:
        """The response to a request's JSON ``payload`` (``request``: its connection, watched
        for a client that leaves; ``prompt``: the prompt's ids, where the caller has encoded
        them already, with ``ends``: the tokens beside the model's that end the answer, a
        middle's; ``sampling``: SamplingParams fields beside OpenAI's, which another API's
        sampler chain sets)."""
        server = self.server
        echo = None
        if self.chat:
            req = parse(ChatRequest, payload)
            prompts = [prompt if prompt is not None else await chat_prompt(server, req)]
            answers = await run_in_threadpool(server.answers, prompts[0])
            reference = await run_in_threadpool(server.reference, req.prediction_text())
            requested = (req.max_completion_tokens if req.max_completion_tokens is not None
                         else req.max_tokens)
            param = "messages"
        else:
            req = parse(CompletionRequest, payload)
            req.unsupported()
            if not req.prompts():
                raise ApiError(400, "'prompt' must not be empty", param="prompt")
            if prompt is not None:
                prompts = [prompt]
            elif req.suffix:  # fill in the middle: each prompt the text before it
                filled = [await run_in_threadpool(server.fill_in, p, req.suffix)
                          for p in req.prompts()]
                prompts, ends = [ids for ids, _ in filled], filled[0][1]
            else:
                prompts = [await run_in_threadpool(server.encode, p, False)
                           for p in req.prompts()]
            echo = await run_in_threadpool(Echo.of, req, prompts, server.decode)
            requested = echo.max_tokens(req.max_tokens) if echo else req.max_tokens
            param, answers, reference = "prompt", None, ()
        specs = server.specs(req, prompts, requested, param, reference, ends)
        if sampling:
            specs = [dataclasses.replace(spec, sampling={**spec.sampling, **sampling})
                     for spec in specs]
        capacity = server.backend.parallel + server.settings.max_queue
        if len(specs) > capacity:  # could never be admitted: retrying would not help
            raise ApiError(400, f"this request asks for {len(specs)} sequences (prompts x n); "
                                f"this server takes at most {capacity} at once", param="n")
        job = Job(specs, asyncio.get_running_loop())
        server.backend.submit(job)
        prompt_tokens = sum(len(ids) for ids in prompts)
        server.metrics.prompt_tokens.inc(prompt_tokens)
        if req.stream:
            return await self.stream(request, job, req, prompt_tokens, answers, echo)
        try:
            return await self.collect(request, job, req, prompt_tokens, answers, echo)
        finally:
            job.cancel()  # a no-op when every sequence is done; stops the rest otherwise
            server.metrics.latency.labels(self.path).observe(time.perf_counter() - job.arrived)

    async def collect(self, request: Request, job: Job, req, prompt_tokens: int,
                      answers: Thinking | Harmony | None, echo: Echo | None = None) -> Response:
        """The whole response; ``answers``: how a chat answer holds its reasoning; ``echo``:
        the prompts in front of the choices."""
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
                results[index] = echo.result(index, payload) if echo else payload
        rid = new_id("chatcmpl" if self.chat else "cmpl")
        body = self.envelope(rid, req.model, chunk=False)
        body["choices"] = [self.choice(i, r.text, r.finish_reason, delta=False,
                                       logprobs=r.logprobs, prompt=echoed(echo, i, r))
                           for i, r in enumerate(results)]
        for choice, result in zip(body["choices"], results):
            choice["stop_reason"] = result.stop_string  # vLLM's: the stop string that ended it
        if self.chat:
            tools = self.parses_tools(req)
            for choice, result in zip(body["choices"], results):
                message_parts(choice, result, tools, answers)
        if req.specdecode and req.specdecode.return_token_ids:
            for choice, result in zip(body["choices"], results):
                choice["token_ids"] = result.token_ids
        if req.prompt_logprobs is not None:  # vLLM's: a chat's prompt, or each choice's
            forms = [vllm_form(r.prompt_logprobs, req.prompt_logprobs, self.token_text)
                     for r in results]
            if self.chat:
                body["prompt_logprobs"] = forms[0]
            else:
                for choice, form in zip(body["choices"], forms):
                    choice["prompt_logprobs"] = form
        body["usage"] = usage(prompt_tokens, results)
        return JSONResponse(body)

    async def stream(self, request: Request, job: Job, req, prompt_tokens: int,
                     answers: Thinking | Harmony | None, echo: Echo | None = None) -> Response:
        """The response as server-sent events; ``answers`` and ``echo`` as :meth:`collect`'s."""
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
        chunks = Chunks(self, rid, req.model, len(job.specs), self.parses_tools(req), answers,
                        echo, bool(req.specdecode and req.specdecode.return_token_ids))

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
                        results[index] = echo.result(index, payload) if echo else payload
                        for text in chunks.end(index, results[index]):
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
    come or as reasoning (:class:`~.reasoning.ReasoningSplitter`), content and tool calls
    (:class:`~.tool_parser.StreamDeltas`), with their log-probabilities (a piece's ride with
    its first chunk), and each choice's end."""

    def __init__(self, endpoint: Endpoint, rid: str, model: str, choices: int,
                 tools: ToolRequest | None, thinking: Thinking | Harmony | None = None,
                 echo: Echo | None = None, token_ids: bool = False):
        self.endpoint, self.rid, self.model = endpoint, rid, model
        #: whether a choice's last chunk carries its answer's token ids
        self.token_ids = token_ids
        #: the prompts sent in front of the choices, each once, before its first text
        self.echo, self.echoed = echo, [False] * choices
        self.sent = StreamedLogprobs(choices)
        harmony = isinstance(thinking, Harmony)  # its calls are messages, not in the content
        self.deltas = (StreamDeltas(choices, tools.format, tools.schemas)
                       if tools is not None and not harmony else StreamDeltas(choices, None))
        self.reasoning: list | None = None
        if harmony:
            self.reasoning = [HarmonySplitter(tools is not None) for _ in range(choices)]
        elif thinking is not None:
            self.reasoning = [ReasoningSplitter(thinking) for _ in range(choices)]

    def _deltas(self, index: int, events: list) -> list[dict]:
        """The deltas of a choice's reasoning and content pieces (the content read for calls)
        and of the calls harmony's messages hold."""
        out: list[dict] = []
        for event in events:
            if not isinstance(event, tuple):
                out.append(self.deltas.call(index, event))
            elif event[0] == "reasoning":
                out.append({"reasoning_content": event[1]})
            else:
                out += self.deltas.text(index, event[1])
        return out

    def chunk(self, index: int, delta: dict, finish: str | None = None, logprobs=None,
              prompt: tuple | None = None, stop: str | None = None,
              token_ids: list[int] | None = None) -> str:
        body = self.endpoint.envelope(self.rid, self.model, chunk=True)
        choice = self.endpoint.choice(index, delta.get("content", ""), finish, delta=True,
                                      logprobs=logprobs, prompt=prompt,
                                      offset=self.sent.chars[index])
        if finish is not None:
            choice["stop_reason"] = stop
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if self.endpoint.chat:
            choice["delta"] = delta
        elif choice["logprobs"] is not None:
            self.sent.chars[index] += sum(map(len, choice["logprobs"]["tokens"]))
        body["choices"] = [choice]
        return sse(body)

    def _echo(self, index: int, prompt_logprobs: list | None) -> list[str]:
        """The choice's prompt, before its first text (once)."""
        if self.echo is None or self.echoed[index]:
            return []
        self.echoed[index] = True
        prompt = self.echo.scored(index, prompt_logprobs)
        return [self.chunk(index, {"content": self.echo.texts[index]}, prompt=prompt)]

    def text(self, index: int, piece: str) -> list[str]:
        echoed = self._echo(index, getattr(piece, "prompt_logprobs", None))
        if self.echo is not None and self.echo.only:  # the decoded token is dropped
            return echoed
        return echoed + self._text(index, piece)

    def _text(self, index: int, piece: str) -> list[str]:
        events = (self.reasoning[index].feed(piece) if self.reasoning is not None
                  else [("content", piece)])
        parts, logprobs = self._deltas(index, events), self.sent.of(index, piece)
        if logprobs and not parts:  # text held back: its tokens' log-probabilities go now
            parts = [{"content": ""}]
        return [self.chunk(index, d, logprobs=logprobs if i == 0 else None)
                for i, d in enumerate(parts)]

    def end(self, index: int, result: GenerationResult) -> list[str]:
        """The choice's last chunks (``result`` as echoed, where the prompts are)."""
        echoed = self._echo(index, result.prompt_logprobs)
        if self.echo is not None and self.echo.only:
            return echoed + [self.chunk(index, {"content": ""}, result.finish_reason)]
        return echoed + self._end(index, result)

    def _end(self, index: int, result: GenerationResult) -> list[str]:
        held = self._deltas(index, self.reasoning[index].finish() if self.reasoning is not None
                            else [])
        parts, finish = self.deltas.finish(index, result.finish_reason)
        parts = held + parts
        return [self.chunk(index, d) for d in parts] + [
            self.chunk(index, {"content": ""}, finish, logprobs=self.sent.rest(index, result),
                       stop=result.stop_string,
                       token_ids=result.token_ids if self.token_ids else None)]


def echoed(echo: Echo | None, index: int, result: GenerationResult) -> tuple | None:
    """The prompt's (ids, log-probabilities) in front of choice ``index``'s, where it is
    echoed with them."""
    return None if echo is None else echo.scored(index, result.prompt_logprobs)


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
