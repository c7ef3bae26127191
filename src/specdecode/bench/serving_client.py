"""The clients of ``scripts/serving_bench.py``: the official ``openai`` client (``AsyncOpenAI``),
``concurrency`` requests in flight at once, every other one streamed.

Each request gives one :class:`Outcome`: its text (with each tool call the model makes, as
``<call NAME ARGUMENTS>``), finish reason, response id, completion tokens (from ``usage``;
streams ask for it with ``stream_options.include_usage``), latency (send to last byte) and,
when streamed, time to first token (send to the first chunk with text or a tool call's name).
A batch has a time limit: requests still running at the limit are cancelled and recorded as
errors, never waited for. A request may be told to hang up after a few chunks (``hang_up``): it
closes its stream, as a user closing a browser tab does, and is recorded as ``disconnected``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from specdecode.bench.serving_workloads import Request, Sampling
from specdecode.errors import SpecDecodeError


@dataclass
class Outcome:
    index: int
    stream: bool
    text: str = ""
    finish_reason: str | None = None
    response_id: str = ""
    completion_tokens: int = 0
    latency_s: float = 0.0
    #: send to the first chunk carrying text (streamed requests only)
    ttft_s: float | None = None
    error: str | None = None
    #: the client closed the stream on purpose after a few chunks
    disconnected: bool = False

    @property
    def complete(self) -> bool:
        return self.error is None and not self.disconnected

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Batch:
    outcomes: list[Outcome]
    #: first send to last answer
    wall_s: float


def openai_module():
    try:
        import openai
    except ImportError:
        raise SpecDecodeError("the serving benchmark speaks through the official openai "
                              "client: pip install openai") from None
    return openai


async def send(client, model: str, request: Request, sampling: Sampling, max_tokens: int,
               stream: bool, hang_up: int | None = None) -> Outcome:
    """One chat completion; errors are recorded in the outcome, not raised."""
    out = Outcome(request.index, stream)
    fields = sampling.fields(request.index)
    if request.tools:
        fields["tools"] = list(request.tools)
    start = time.perf_counter()
    try:
        if not stream:
            r = await client.chat.completions.create(
                model=model, messages=request.messages(), max_tokens=max_tokens, **fields)
            text = ToolCallText()  # a whole message reads as one delta
            out.text = text.piece(r.choices[0].message) + text.close()
            out.finish_reason = r.choices[0].finish_reason
            out.response_id = r.id
            out.completion_tokens = r.usage.completion_tokens if r.usage else 0
        else:
            chunks, calls = 0, ToolCallText()
            response = await client.chat.completions.create(
                model=model, messages=request.messages(), max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, **fields)
            try:
                async for chunk in response:
                    out.response_id = chunk.id
                    for choice in chunk.choices:
                        piece = calls.piece(choice.delta)
                        if piece and out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - start
                        out.text += piece
                        out.finish_reason = choice.finish_reason or out.finish_reason
                    if chunk.usage is not None:
                        out.completion_tokens = chunk.usage.completion_tokens
                    chunks += 1
                    if hang_up is not None and chunks >= hang_up:
                        out.disconnected = True
                        break
            finally:
                await response.close()
            out.text += calls.close()
            if not out.disconnected and out.finish_reason is None:
                raise RuntimeError("the stream ended without a finish reason")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # recorded, then counted as an error of the batch
        out.error = f"{type(exc).__name__}: {exc}"[:500]
    out.latency_s = time.perf_counter() - start
    return out


class ToolCallText:
    """An answer's tool calls as :func:`send` records them, streamed or whole alike:
    ``<call NAME ARGUMENTS>`` each, the name from a call's first delta, the arguments in the
    pieces they come in (a whole message is one delta with every call whole)."""

    def __init__(self):
        self.open = False

    def piece(self, delta) -> str:
        """The text of a chunk's delta (or a whole message): its content, then its tool
        calls' parts."""
        text = delta.content or ""
        for call in delta.tool_calls or ():
            function = call.function
            if function is not None and function.name:
                text += (">" if self.open else "") + f"<call {function.name} "
                self.open = True
            text += (function.arguments or "") if function is not None else ""
        return text

    def close(self) -> str:
        """What ends the text: the last call's end, where one is open."""
        return ">" if self.open else ""


async def run_batch_async(base_url: str, model: str, requests: list[Request], sampling: Sampling,
                          max_tokens: int, concurrency: int, time_limit: float,
                          hang_up: dict[int, int] | None = None) -> Batch:
    """Every request once, ``concurrency`` at a time; ``hang_up``: request index -> chunks
    after which that (streamed) request closes its stream."""
    openai = openai_module()
    hang_up = hang_up or {}
    gate = asyncio.Semaphore(concurrency)
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none",
                                max_retries=0, timeout=time_limit)

    async def one(request: Request) -> Outcome:
        async with gate:
            stream = request.streamed or request.index in hang_up
            return await send(client, model, request, sampling, max_tokens, stream,
                              hang_up.get(request.index))

    start = time.perf_counter()
    tasks = [asyncio.ensure_future(one(r)) for r in requests]
    try:
        done, pending = await asyncio.wait(tasks, timeout=time_limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
    finally:
        await client.close()
    outcomes = []
    for request, task in zip(requests, tasks):
        if task in done and task.exception() is None:
            outcomes.append(task.result())
        else:
            reason = "time limit reached first" if task not in done else repr(task.exception())
            outcomes.append(Outcome(request.index, request.streamed, error=reason))
    return Batch(outcomes, wall)


def run_batch(base_url: str, model: str, requests: list[Request], sampling: Sampling,
              max_tokens: int, concurrency: int, time_limit: float,
              hang_up: dict[int, int] | None = None) -> Batch:
    return asyncio.run(run_batch_async(base_url, model, requests, sampling, max_tokens,
                                       concurrency, time_limit, hang_up))
