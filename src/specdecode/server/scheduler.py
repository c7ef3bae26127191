"""The server's decode scheduler: one thread, a few runner slots, a bounded queue.

A runner holds one KV cache, so two generations must never share one at the same time. The
scheduler owns ``parallel`` slots, each a runner over the *same* model weights with its own
cache and its own proposers (one per method and config, reused across requests so per-slot
learning such as token recycling carries over; at most ``DECODERS_PER_SLOT`` of them and the
server's proposer memory per slot, least recently used dropped first). One thread admits waiting
sequences into free slots and advances every active generation by one verify step in turn
(round robin), so a short request is not stuck behind a long one and a slow client never blocks
the model. A long prompt takes turns too: where the runner can (``prefill_granule``), it is
prefilled one part per turn, so a short request admitted meanwhile waits for one part, not for
the whole prompt; the parts give bitwise the logits of one prefill.

Speculation stays exact: each generation sees only its own runner, proposer and random
generator; interleaving changes the order of work, never its result.

A disconnected client's sequences are cancelled between steps: closing the text stream runs the
engine's ``finally`` (``proposer.finish``) and frees the slot.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdecode import registry
from specdecode.api import GenerationResult, TextStream
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.base import NOTHING, Needs, Runner
from specdecode.sampling import SamplingParams
from specdecode.server.metrics import Metrics
from specdecode.server.protocol import ApiError

log = logging.getLogger("specdecode.server")

#: (method name, config, runner) -> proposer; lets the server hand shared state (the suffix
#: proposer's global tree) to every slot's proposer
ProposerFactory = Callable[[str, Any, Runner], Any]

#: proposers kept per slot; older (method, config) pairs are dropped first
DECODERS_PER_SLOT = 8
#: prompt rows prefilled per turn (rounded down to a multiple of the runner's granule): a
#: short request beside a long prompt waits for one such part per step of its own
PREFILL_PART_ROWS = 128


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
    #: upper estimate of the proposer's memory (:func:`.limits.proposer_bytes`)
    proposer_bytes: int = 0


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
    decoder: _Decoder | None = None
    #: prompt rows in the slot's cache while the prompt is prefilled in parts
    prefilled: int = 0
    stream: Any = None
    #: one verify step per ``next``; None while the prompt is still being prefilled in parts
    iterator: Any = None


@dataclass
class _Decoder:
    """A slot's proposer for one (method, config), with what a :class:`TextStream` reads of
    its decoder."""

    method: registry.Method
    proposer: Any
    tokenizer: Any
    #: the estimate it counts against the slot's proposer memory
    bytes: int


@dataclass
class _Slot:
    runner: Runner
    #: (method, config) -> _Decoder, least recently used first
    decoders: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    def make_room(self, needed: int, budget: int) -> None:
        """Drop the least recently used proposers until one more of ``needed`` bytes fits
        both bounds (before it is built, so old and new never coexist over the budget)."""
        while self.decoders and (len(self.decoders) >= DECODERS_PER_SLOT or
                                 sum(d.bytes for d in self.decoders.values()) + needed > budget):
            self.decoders.popitem(last=False)


class _PrefilledRunner:
    """The slot's runner as the engine sees it once the scheduler has prefilled the first
    ``done`` prompt rows in parts: its ``prefill`` runs the last part (so the proposer's
    ``start`` still comes before the prefill ends, as in the engine's loop); everything else
    is the runner's own."""

    def __init__(self, runner: Runner, done: int):
        self._runner = runner
        self._done = done

    def prefill(self, ids, needs: Needs = NOTHING):
        return self._runner.prefill_part(ids, self._done, len(ids), needs)

    def __getattr__(self, name):
        return getattr(self._runner, name)


class Scheduler:
    def __init__(self, runners: list[Runner], tokenizer, eos_token_ids: list[int],
                 make_proposer: ProposerFactory, max_queue: int, metrics: Metrics,
                 proposer_budget: int = 128 * 2**20):
        if not runners:
            raise SpecDecodeError("the scheduler needs at least one runner")
        if max_queue < 0:
            raise SpecDecodeError(f"max_queue must be >= 0, got {max_queue}")
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.make_proposer = make_proposer
        self.max_queue = max_queue
        self.metrics = metrics
        #: proposer memory each slot may keep (bytes, by the specs' estimates)
        self.proposer_budget = proposer_budget
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

    def _decoder(self, slot: _Slot, spec: SequenceSpec) -> _Decoder:
        key = (spec.method, repr(spec.config))
        decoder = slot.decoders.pop(key, None)
        if decoder is None:
            slot.make_room(spec.proposer_bytes, self.proposer_budget)
            proposer = self.make_proposer(spec.method, spec.config, slot.runner)
            decoder = _Decoder(registry.get(spec.method), proposer, self.tokenizer,
                               spec.proposer_bytes)
        slot.decoders[key] = decoder  # the most recently used, last
        return decoder

    def _part_rows(self, runner: Runner) -> int:
        granule = runner.prefill_granule
        return max(granule, PREFILL_PART_ROWS // granule * granule) if granule else 0

    def _begin(self, seq: _Sequence) -> None:
        spec = seq.job.specs[seq.index]
        self.metrics.queue_wait.observe(time.perf_counter() - seq.job.arrived)
        if not self._guard(seq, "could not start a sequence",
                           lambda: setattr(seq, "decoder", self._decoder(seq.slot, spec))):
            return
        part = self._part_rows(seq.slot.runner)
        if not part or len(spec.prompt_ids) <= part:
            if not self._guard(seq, "could not start a sequence", lambda: self._start(seq)):
                return
        self._active.append(seq)  # a long prompt: one part per turn (_step) before it starts

    def _start(self, seq: _Sequence) -> None:
        """Begin generating: the engine prefills the prompt (or its last part)."""
        spec = seq.job.specs[seq.index]
        runner = seq.slot.runner
        if seq.prefilled:
            runner = _PrefilledRunner(runner, seq.prefilled)
        generation = Generation(runner, seq.decoder.proposer, spec.prompt_ids, spec.max_tokens,
                                SamplingParams(**spec.sampling), self.eos_token_ids)
        seq.stream = TextStream(seq.decoder, generation, spec.stop)
        seq.iterator = seq.stream.steps()  # one verify step per call, so stepping is fair
        seq.job.post("start", seq.index)

    def _prefill_part(self, seq: _Sequence) -> None:
        """One part of a long prompt; the stream starts once what is left fits one part."""
        ids = seq.job.specs[seq.index].prompt_ids
        stop = seq.prefilled + self._part_rows(seq.slot.runner)
        seq.slot.runner.prefill_part(ids, seq.prefilled, stop, seq.decoder.proposer.needs)
        seq.prefilled = stop
        if len(ids) - stop <= self._part_rows(seq.slot.runner):
            self._start(seq)

    def _guard(self, seq: _Sequence, what: str, action) -> bool:
        """Run ``action``; on failure end the sequence with an error for its request only
        (the config's problem, a 400, or ours, a 500) and keep serving."""
        try:
            action()
            return True
        except SpecDecodeError as exc:
            error = ApiError(400, str(exc), param="specdecode.config")
        except Exception as exc:
            log.exception(what)
            error = ApiError(500, f"internal error: {exc}", kind="server_error")
        if seq in self._active:
            self._active.remove(seq)
        self._release(seq, "error", None)
        seq.job.post("error", seq.index, error)
        return False

    def _step(self, seq: _Sequence) -> None:
        if seq.job.cancelled.is_set():
            self._close(seq)
            self._release(seq, "cancelled", seq.stream.generation.stats if seq.stream else None)
            return
        if seq.iterator is None:
            self._guard(seq, "prefill failed", lambda: self._prefill_part(seq))
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

    @staticmethod
    def _close(seq: _Sequence) -> None:
        if seq.iterator is not None:
            seq.iterator.close()  # runs the engine's finally: proposer.finish

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
            self._close(seq)
            self._release(seq, "cancelled", seq.stream.generation.stats if seq.stream else None)
            seq.job.post("error", seq.index, error)
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
        for seq in pending:
            seq.job.post("error", seq.index, error)
