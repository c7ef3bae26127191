"""The server's decode scheduler: one thread, a few runner slots, a bounded queue.

A runner holds one KV cache, so two generations must never share one at the same time. The
scheduler owns ``parallel`` slots, each a runner over the *same* model weights with its own
cache and its own proposers (one per method and config, reused across requests so per-slot
learning such as token recycling carries over). One thread admits waiting sequences into free
slots and advances every active generation by one verify step in turn (round robin), so a short
request is not stuck behind a long one and a slow client never blocks the model.

Speculation stays exact: each generation sees only its own runner, proposer and random
generator; interleaving changes the order of work, never its result.

A disconnected client's sequences are cancelled between steps: closing the text stream runs the
engine's ``finally`` (``proposer.finish``) and frees the slot.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdecode.api import Decoder, GenerationResult
from specdecode.errors import SpecDecodeError
from specdecode.models.base import Runner
from specdecode.server.metrics import Metrics
from specdecode.server.protocol import ApiError

log = logging.getLogger("specdecode.server")

#: (method name, config, runner) -> proposer; lets the server hand shared state (the suffix
#: proposer's global tree) to every slot's proposer
ProposerFactory = Callable[[str, Any, Runner], Any]

#: proposers kept per slot; older (method, config) pairs are dropped first
DECODERS_PER_SLOT = 8


@dataclass(frozen=True)
class SequenceSpec:
    """Everything a slot needs to generate one choice."""

    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    sampling: dict[str, Any]
    method: str
    #: the method's frozen config dataclass
    config: Any


class Job:
    """One HTTP request: ``n`` sequences whose events go back to the request's event loop.

    Events are tuples ``(kind, index, payload)``: ``("start", i, None)``, ``("text", i, piece)``,
    ``("done", i, GenerationResult)``, ``("error", i, ApiError)``.
    """

    def __init__(self, specs: list[SequenceSpec], loop: asyncio.AbstractEventLoop):
        self.specs = specs
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.arrived = time.perf_counter()

    def post(self, kind: str, index: int, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, index, payload))
        except RuntimeError:  # the request's event loop is gone: nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class _Sequence:
    job: Job
    index: int
    slot: _Slot | None = None
    stream: Any = None
    iterator: Any = None


@dataclass
class _Slot:
    runner: Runner
    decoders: collections.OrderedDict = field(default_factory=collections.OrderedDict)


class Scheduler:
    def __init__(self, runners: list[Runner], tokenizer, eos_token_ids: list[int],
                 make_proposer: ProposerFactory, max_queue: int, metrics: Metrics):
        if not runners:
            raise SpecDecodeError("the scheduler needs at least one runner")
        if max_queue < 0:
            raise SpecDecodeError(f"max_queue must be >= 0, got {max_queue}")
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.make_proposer = make_proposer
        self.max_queue = max_queue
        self.metrics = metrics
        self._free = [_Slot(runner) for runner in runners]
        self.parallel = len(self._free)
        self._pending: collections.deque[_Sequence] = collections.deque()
        self._active: list[_Sequence] = []
        self._busy = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdecode-scheduler", daemon=True)

    # ---- called from the event loop ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue the job's sequences, or raise a 429 when the queue cannot take them all."""
        with self._cond:
            if self._stopping:
                raise ApiError(503, "the server is shutting down", kind="server_error",
                               code="shutting_down")
            if not self.alive:
                raise ApiError(503, "the decode scheduler has stopped; see the server log",
                               kind="server_error", code="scheduler_stopped")
            waiting = max(0, self._busy + len(self._pending) + len(job.specs) - self.parallel)
            if waiting > self.max_queue:
                raise ApiError(
                    429, f"the server is busy: {self._busy} sequences running and "
                         f"{len(self._pending)} waiting (queue limit {self.max_queue}); retry later",
                    kind="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            self._pending.extend(_Sequence(job, i) for i in range(len(job.specs)))
            self.metrics.queued.set(len(self._pending))
            self._cond.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def load(self) -> dict[str, int]:
        with self._cond:
            return {"running": self._busy, "waiting": len(self._pending),
                    "parallel": self.parallel, "max_queue": self.max_queue}

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and wait for the thread (proposers see ``finish`` for each)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the scheduler thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._active:
                    self._cond.wait()
                if self._stopping:
                    break
                admitted = []
                while self._pending and self._free:
                    seq = self._pending.popleft()
                    if seq.job.cancelled.is_set():
                        self.metrics.sequences.labels(seq.job.specs[seq.index].method,
                                                      "cancelled").inc()
                        continue
                    seq.slot = self._free.pop()
                    self._busy += 1
                    admitted.append(seq)
                self.metrics.queued.set(len(self._pending))
                self.metrics.active.set(self._busy)
            for seq in admitted:
                self._begin(seq)
            for seq in list(self._active):
                self._step(seq)
        self._drain()

    def _decoder(self, slot: _Slot, spec: SequenceSpec) -> Decoder:
        key = (spec.method, repr(spec.config))
        decoder = slot.decoders.get(key)
        if decoder is None:
            decoder = Decoder(slot.runner, self.tokenizer, spec.method, self.eos_token_ids,
                              make_proposer=self.make_proposer, **dataclasses.asdict(spec.config))
            slot.decoders[key] = decoder
            if len(slot.decoders) > DECODERS_PER_SLOT:
                slot.decoders.popitem(last=False)
        slot.decoders.move_to_end(key)
        return decoder

    def _begin(self, seq: _Sequence) -> None:
        spec = seq.job.specs[seq.index]
        self.metrics.queue_wait.observe(time.perf_counter() - seq.job.arrived)
        try:
            decoder = self._decoder(seq.slot, spec)
            seq.stream = decoder.stream(spec.prompt_ids, spec.max_tokens, False, spec.stop,
                                        **spec.sampling)
        except SpecDecodeError as exc:
            self._release(seq, "error", None)
            seq.job.post("error", seq.index, ApiError(400, str(exc)))
            return
        except Exception as exc:  # keep serving: report it to this request only
            log.exception("could not start a sequence")
            self._release(seq, "error", None)
            seq.job.post("error", seq.index, ApiError(500, f"internal error: {exc}",
                                                      kind="server_error"))
            return
        seq.iterator = seq.stream.steps()  # one verify step per call, so stepping is fair
        self._active.append(seq)
        seq.job.post("start", seq.index)

    def _step(self, seq: _Sequence) -> None:
        if seq.job.cancelled.is_set():
            seq.iterator.close()  # runs the engine's finally: proposer.finish
            self._release(seq, "cancelled", seq.stream.generation.stats)
            return
        try:
            piece = next(seq.iterator)
        except StopIteration:
            result: GenerationResult = seq.stream.result
            self._release(seq, result.finish_reason, result.stats)
            seq.job.post("done", seq.index, result)
            return
        except Exception as exc:
            log.exception("generation failed")
            self._release(seq, "error", seq.stream.generation.stats)
            seq.job.post("error", seq.index, ApiError(500, f"internal error: {exc}",
                                                      kind="server_error"))
            return
        if piece:
            seq.job.post("text", seq.index, piece)

    def _release(self, seq: _Sequence, outcome: str, stats) -> None:
        if seq in self._active:
            self._active.remove(seq)
        self.metrics.observe_sequence(seq.job.specs[seq.index].method, outcome, stats)
        with self._cond:
            self._free.append(seq.slot)
            self._busy -= 1
            self.metrics.active.set(self._busy)
        seq.slot = None

    def _drain(self) -> None:
        """Shutdown: close running generations, fail everything still waiting."""
        error = ApiError(503, "the server is shutting down", kind="server_error",
                         code="shutting_down")
        for seq in list(self._active):
            seq.iterator.close()
            self._release(seq, "cancelled", seq.stream.generation.stats)
            seq.job.post("error", seq.index, error)
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
        for seq in pending:
            seq.job.post("error", seq.index, error)
