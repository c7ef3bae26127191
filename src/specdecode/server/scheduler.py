"""The server's decode scheduler: one thread, runner slots, a bounded queue, one forward a step.

A runner holds one KV cache, so two generations must never share one. The scheduler owns
``parallel`` slots, each a runner over the *same* model weights with its own cache and its own
proposers (one per method and config, reused across requests so per-slot learning such as
token recycling carries over; at most ``DECODERS_PER_SLOT`` of them and the server's proposer
memory per slot, least recently used dropped first).

Each step gathers every active sequence's next target call (its root and draft tree, or a part
of its prompt) and runs them as ONE :meth:`Runner.run_packed`: where the runner packs calls
(the native runner: row-invariant kernels, a cache per sequence) that is one forward whose
every row is bitwise what the sequence's solo forward computes, so batching changes the speed,
never a token; other runners (``hf``) run the calls one after another, round robin. New
prompts are prefilled in parts beside the decode rows (at most ``prefill_rows`` prompt rows a
step: the oldest prompt's part, then the shortest remaining prompts first), so a long prompt
neither stalls the decoding sequences nor holds a short prompt behind it. Before each sequence
drafts, the scheduler caps its draft by goodput (:mod:`.goodput`): expected committed tokens
per second of the whole forward, from the runner's measured row-cost curve and the sequence's
recent acceptance; drafts shrink as the batch grows, down to none. A seeded sampled sequence
whose tokens follow its draft sizes (a draft model's sampled drafts, verified by the rejection
rule) is sized as if alone instead, by its own :class:`~specdecode.sizing.SequenceSizer`, so
that it repeats at any load.

A new request goes to the free slot whose cache shares the longest prefix with its prompt,
and prefills only the rest (:mod:`.prompt_cache`: the slots' own rows, and a bounded store of
rows saved before a slot wrote over them); while it prefills, it copies the rows of its prompt
that running sequences have computed, so that requests arriving together with a common start
compute it once (:meth:`Scheduler._share_prompts`).

Speculation stays exact: each generation sees only its own runner, proposer and random
generator; packing and interleaving change the order of work, never its result, and a reused
prefix holds bitwise the rows its prefill would write.

A disconnected client's sequences are cancelled between steps: closing the generation runs
``proposer.finish`` and frees the slot.
"""

from __future__ import annotations

import asyncio
import collections
import functools
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
from specdecode.models.base import Call, PrefillCall, Runner, VerifyCall
from specdecode.models.kv_cache import common_prefix, held_ids
from specdecode.sampling import SamplingParams
from specdecode.estimates import Acceptance, AnswerLengths, RowCosts, StepOverhead
from specdecode.server.goodput import Batching
from specdecode.sizing import (EXPLORE_LEVELS, Candidate, DraftSizing, DraftTime,
                               SequenceSizer, allocate, catch_up_share, deepened, learning_cap)
from specdecode.server.metrics import Metrics
from specdecode.server.prompt_cache import PromptCache
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
#: prompt rows another sequence's part must compute for a prefilling sequence that shares them
#: before the sequence waits a step to copy them instead of computing them itself
SHARED_ROWS_WORTH_A_STEP = 32


@dataclass(frozen=True)
class SequenceSpec:
    """Everything a slot needs to generate one choice."""

    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    sampling: dict[str, Any]
    method: registry.Method
    #: the method's frozen config dataclass
    config: Any
    #: upper estimate of the proposer's memory (:func:`.limits.proposer_bytes`)
    proposer_bytes: int = 0
    #: special tokens whose text the choice's text keeps (its tool-call format's tags)
    kept_tokens: tuple[int, ...] = ()
    #: text the answer is expected to repeat (a predicted output), as token ids
    reference: tuple[int, ...] = ()
    #: tokens that end the answer beside the model's (a fill-in-the-middle request's, the
    #: request's stop_token_ids)
    ends: tuple[int, ...] = ()
    #: the model's end-of-sequence ids do not end the answer (vLLM's ``ignore_eos``)
    ignore_eos: bool = False
    #: where the text ends beside stop strings (llama.cpp's ``n_indent`` and
    #: ``t_max_predict_ms``): ``limits.start()`` gives a sequence its :class:`TextStream`'s
    #: ``limits`` (server/infill.py); None: none
    limits: Any = None


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
    generation: Generation | None = None
    stream: TextStream | None = None
    #: prompt rows in the slot's cache while the prompt is prefilled in parts (all of them
    #: from the start where the generation reads the prompt itself, scoring it)
    prefilled: int = 0
    #: its recent verify steps, for its draft budget
    acceptance: Acceptance = field(default_factory=Acceptance)
    #: verify steps since it last sent a draft (sizing.explore_cap)
    idle: int = 0
    #: text pieces of a generation with a decode loop of its own (a lossy method), stepped
    #: one piece a step outside the packed forward
    solo: Any = None
    #: its prompt may start with rows computed elsewhere (the prompt cache's, another running
    #: sequence's: :meth:`Scheduler._place`)
    reuses_rows: bool = False

    @property
    def spec(self) -> SequenceSpec:
        return self.job.specs[self.index]

    @functools.cached_property
    def prompt(self) -> Any:
        """The prompt's ids as the rows' keepers compare them (``kv_cache.held_ids``)."""
        return held_ids(self.spec.prompt_ids)

    @property
    def computed_prompt_rows(self) -> int:
        """Rows of its prompt its slot's cache holds, for another sequence to copy: none while
        a generation scores its prompt itself or runs a loop of its own."""
        if self.solo is not None or self.generation is None or self.generation.reading_prompt:
            return 0
        return min(self.prefilled, self.slot.runner.cache_len)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.spec.prompt_ids)


@dataclass
class _Decoder:
    """A slot's proposer for one (method, config), with what a :class:`TextStream` reads of
    its decoder."""

    method: registry.Method
    proposer: Any
    tokenizer: Any
    #: the estimate it counts against the slot's proposer memory
    bytes: int


@dataclass(frozen=True)
class _Sizing:
    """A decoding sequence's part in a step's draft allocation (``Scheduler._caps``)."""

    #: what ``sizing.allocate`` weighs: its draft levels and their seconds
    candidate: Candidate
    #: fallback(row costs, the step's rows): the cap it sends where the allocation sends none
    #: (``sizing.learning_cap``), or None
    fallback: Callable[[RowCosts, int], tuple[int, int] | None]
    #: its deepest draft (its controller's, the server's row cap, the tokens it has left)
    most: int


@dataclass
class _Slot:
    runner: Runner
    #: the tokens whose rows the runner's cache holds, for the next request (the prompt cache)
    held: Any = field(default_factory=lambda: held_ids(()))
    #: (method, config) -> _Decoder, least recently used first
    decoders: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    def make_room(self, needed: int, budget: int) -> None:
        """Drop the least recently used proposers until one more of ``needed`` bytes fits
        both bounds (before it is built, so old and new never coexist over the budget)."""
        while self.decoders and (len(self.decoders) >= DECODERS_PER_SLOT or
                                 sum(d.bytes for d in self.decoders.values()) + needed > budget):
            self.decoders.popitem(last=False)


class Scheduler:
    def __init__(self, runners: list[Runner], tokenizer, eos_token_ids: list[int],
                 make_proposer: ProposerFactory, max_queue: int, metrics: Metrics,
                 proposer_budget: int = 128 * 2**20, batching: Batching = Batching(),
                 prompt_cache: PromptCache | None = None):
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
        #: earlier prompts' rows, reused by prompts that start with them (None: no reuse)
        self.prompt_cache = prompt_cache
        self.max_draft_rows = batching.max_draft_rows
        self.prefill_rows = batching.prefill_rows
        #: the runner's forward seconds by rows (None: drafts as the proposers make them)
        self.row_costs = batching.row_costs(runners[0])
        #: (method, config) -> acceptance of all its sequences, each new sequence's prior
        self._acceptance: dict[tuple[str, str], Acceptance] = {}
        #: each method's recent answer lengths (the tokens a request has left to repay a
        #: draft model's catch-up)
        self._lengths: dict[tuple[str, str], AnswerLengths] = {}
        #: (method, config) -> seconds its proposer takes to draft, a fixed part and a part a
        #: level (a draft model drafts a token a forward), as for one request (sizing.py)
        self._draft_time: dict[tuple[str, str], DraftTime] = {}
        #: a step's seconds besides the forward and the drafting, as a fixed part and a part a
        #: draft row (their attention over a long context, which the curve does not see)
        self._overhead = StepOverhead()
        self._runners = list(runners)
        metrics.watch_kv_caches(self._runners)
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

    def load(self) -> dict:
        with self._cond:
            return {"running": self._busy, "waiting": len(self._pending),
                    "parallel": self.parallel, "max_queue": self.max_queue,
                    "kv_cache_bytes": [runner.kv_bytes for runner in self._runners]}

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and wait for the thread (proposers see ``finish`` for each); then
        the prompt cache is written to its file, where it has one."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.prompt_cache is not None and not self._thread.is_alive():
            self.prompt_cache.persist([(slot.held, slot.runner) for slot in self._free])

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
                        self.metrics.sequences.labels(seq.spec.method.name, "cancelled").inc()
                        continue
                    seq.slot = self._take_slot(seq)
                    self._busy += 1
                    admitted.append(seq)
                self.metrics.queued.set(len(self._pending))
                self.metrics.active.set(self._busy)
            for seq in admitted:
                self._begin(seq)
            self._step()
        self._drain()

    def _decoder(self, slot: _Slot, spec: SequenceSpec) -> _Decoder:
        key = _key(spec)
        decoder = slot.decoders.pop(key, None)
        if decoder is None:
            slot.make_room(spec.proposer_bytes, self.proposer_budget)
            proposer = self.make_proposer(spec.method.name, spec.config, slot.runner)
            decoder = _Decoder(spec.method, proposer, self.tokenizer, spec.proposer_bytes)
        slot.decoders[key] = decoder  # the most recently used, last
        return decoder

    def _take_slot(self, seq: _Sequence) -> _Slot:
        """The free slot whose cache shares the longest prefix with the sequence's prompt (the
        emptiest among equals, so that the others keep what they hold)."""
        if self.prompt_cache is None:
            return self._free.pop()
        best = max(range(len(self._free)), key=lambda i: (
            common_prefix(self._free[i].held, seq.prompt), -len(self._free[i].held)))
        return self._free.pop(best)

    def _place(self, seq: _Sequence) -> int:
        """The prompt cache's part of starting a sequence: the longest cached prefix of its
        prompt put in its slot's cache; its length (0: the prompt is prefilled whole)."""
        slot = seq.slot
        held, slot.held = slot.held, held_ids(())  # the rows are this sequence's from now on
        if self.prompt_cache is None or not slot.runner.reuses_prefix:
            return 0
        # a lossy method runs a loop of its own; a proposer reading the prompt rows' features
        # would miss the reused rows'
        lossy = seq.decoder.method.lossy
        needs = None if lossy else seq.decoder.proposer.needs
        reuse = not lossy and not needs.final_hidden and not needs.layers
        # a scored prompt needs every row's logits, which no cached row keeps
        seq.reuses_rows = reuse and seq.spec.sampling.get("prompt_logprobs") is None
        return self.prompt_cache.place(slot.runner, held, seq.prompt, seq.reuses_rows)

    def _sizer_alone(self, seq: _Sequence, sampling: SamplingParams) -> SequenceSizer | None:
        """A sizer of its own for a sequence whose tokens must not follow the load: seeded,
        sampled, of a method whose drafts carry probabilities (the rejection rule's draws follow
        its draft sizes); sized by the curve and its own steps, as the library sizes it. None
        for every other sequence: the step's allocation sizes it (:meth:`_caps`)."""
        proposer = seq.decoder.proposer
        if self.row_costs is None or proposer.prices_own_drafting:
            return None
        sizer = DraftSizing(self.row_costs, proposer.samples_drafts).sequence(sampling)
        return sizer if sizer.repeatable else None

    def _part_rows(self, runner: Runner) -> int:
        granule = runner.prefill_granule
        return max(granule, PREFILL_PART_ROWS // granule * granule) if granule else 0

    def _begin(self, seq: _Sequence) -> None:
        """Build the sequence's generation; its prompt is prefilled by the coming steps."""
        spec = seq.spec
        self.metrics.queue_wait.observe(time.perf_counter() - seq.job.arrived)
        try:
            seq.decoder = self._decoder(seq.slot, spec)
            sampling = SamplingParams(**spec.sampling)
            ends = ([] if spec.ignore_eos else self.eos_token_ids) + list(spec.ends)
            if seq.decoder.method.lossy:  # its own decode loop (specdecode/lossy/)
                seq.generation = seq.decoder.proposer.generation(
                    spec.prompt_ids, spec.max_tokens, sampling, ends)
                seq.prefilled = len(spec.prompt_ids)
            else:
                seq.generation = Generation(seq.slot.runner, seq.decoder.proposer,
                                            spec.prompt_ids, spec.max_tokens, sampling,
                                            ends, sizer=self._sizer_alone(seq, sampling),
                                            reference=spec.reference)
            seq.stream = TextStream(seq.decoder, seq.generation, spec.stop, spec.kept_tokens,
                                    spec.limits.start() if spec.limits is not None else None)
            if seq.decoder.method.lossy:
                seq.solo = seq.stream.steps()
                self._place(seq)  # what the slot held is saved before the loop writes over it
            else:
                seq.generation.begin()  # (its clock starts: the placing counts as the prompt's)
                seq.prefilled = seq.generation.stats.cached_tokens = self._place(seq)
                if seq.generation.reading_prompt:  # its own calls read the prompt
                    seq.prefilled = len(spec.prompt_ids)
        except Exception as exc:
            self._fail(seq, exc, "could not start a sequence")
            return
        self._active.append(seq)
        seq.job.post("start", seq.index)

    def _gather(self) -> list[tuple[_Sequence, Call]]:
        """Every decoding sequence's verify call, and the step's prompt parts."""
        work = [(seq, seq.generation.pending_call) for seq in self._active
                if seq.solo is None and not seq.prefilling]
        return work + [(seq, PrefillCall(tuple(seq.spec.prompt_ids), seq.prefilled, stop,
                                         seq.decoder.proposer.needs))
                       for seq, stop in self._prompt_parts()]

    def _prompt_parts(self) -> list[tuple[_Sequence, int]]:
        """The next step's prompt parts, each (sequence, the prompt row its part stops at): in
        :func:`prefill_order` within the step's prompt rows, one part at least; a sequence
        whose next rows another part computes waits for them."""
        prefilling = [seq for seq in self._active if seq.solo is None and seq.prefilling]
        parts, rows = [], 0
        for i in prefill_order([len(seq.spec.prompt_ids) - seq.prefilled for seq in prefilling]):
            if rows >= self.prefill_rows:
                break
            seq = prefilling[i]
            if any(_computes_for(other, stop, seq) for other, stop in parts):
                continue  # it copies those rows next step (_share_prompts)
            length = len(seq.spec.prompt_ids)
            part = self._part_rows(seq.slot.runner)
            stop = length if not part else min(length, seq.prefilled + part)
            parts.append((seq, stop))
            rows += stop - seq.prefilled
        return parts

    def _share_prompts(self) -> None:
        """Copy into each prefilling sequence that may reuse rows the rows of its prompt that
        another running sequence has computed: the same tokens from the start give bitwise the
        same rows, so requests that arrive together with a common start (a system prompt, tool
        definitions) compute it once."""
        takers = [seq for seq in self._active if seq.reuses_rows and seq.prefilling]
        if not takers:  # (most steps: nothing is being prefilled)
            return
        donors = [(seq, seq.computed_prompt_rows) for seq in self._active]
        for seq in takers:
            limit = len(seq.prompt) - 1  # the last token is prefilled for its logits
            shared, donor = max(((min(common_prefix(other.prompt[:rows], seq.prompt), limit),
                                  other) for other, rows in donors if other is not seq),
                                key=lambda pair: pair[0], default=(0, None))
            if shared <= seq.prefilled:
                continue
            seq.slot.runner.load_rows(donor.slot.runner.saved_rows(shared), shared)
            self.metrics.prompt_cache_hit_tokens.inc(shared - seq.prefilled)
            seq.generation.stats.cached_tokens += shared - seq.prefilled
            seq.prefilled = shared

    def _step(self) -> None:
        """One packed forward of every active sequence, then each one's verify and draft."""
        for seq in list(self._active):
            if seq.job.cancelled.is_set():
                self._end(seq, "cancelled")
        for seq in [seq for seq in self._active if seq.solo is not None]:
            self._step_solo(seq)
        self._share_prompts()
        work = self._gather()
        if not work:
            return
        started = time.perf_counter()
        try:
            outs = work[0][0].slot.runner.run_packed([(seq.slot.runner, call) for seq, call in work])
        except Exception as exc:
            for seq, _ in work:
                self._fail(seq, exc, "the target's forward failed")
            return
        forward_s = time.perf_counter() - started
        rows = sum(_rows(call) for _, call in work)
        if work[0][0].slot.runner.packs_calls:
            self.metrics.observe_forward(len(work), rows)
        else:  # one forward a call
            for _, call in work:
                self.metrics.observe_forward(1, _rows(call))
        for (seq, call), out in zip(work, outs):
            self._after(seq, call, out, forward_s)
        drafting_s = self._draft_all()
        if self.row_costs is not None:
            # what neither the row curve nor the drafting explains: verifying, text, each
            # sequence's share of the packed forward besides its rows, the draft rows' attention
            unexplained = time.perf_counter() - started - self.row_costs(rows) - drafting_s
            draft_rows = sum(len(call.draft) for _, call in work if isinstance(call, VerifyCall))
            self._overhead.observe(draft_rows, unexplained)

    def _step_solo(self, seq: _Sequence) -> None:
        """One piece of a generation that runs its own decode loop."""
        try:
            piece = next(seq.solo)
        except StopIteration:
            self._end(seq, None)
            return
        except Exception as exc:
            self._fail(seq, exc, "generation failed")
            return
        if piece:
            seq.job.post("text", seq.index, piece)

    def _after(self, seq: _Sequence, call: Call, out, forward_s: float) -> None:
        """Take the sequence's share of the forward: a prompt part, or a verify step's
        tokens as text."""
        if isinstance(call, PrefillCall) and seq.prefilling:
            seq.prefilled = call.stop
            if call.stop < len(call.ids):
                return
        generation = seq.generation
        try:
            generation.advance(out)
            piece = seq.stream.feed()
        except Exception as exc:
            self._fail(seq, exc, "generation failed")
            return
        if isinstance(call, VerifyCall):
            generation.stats.verify_s += forward_s
        if isinstance(call, VerifyCall) and not call.forced:  # a forced chain says nothing of drafts
            accepted = generation.stats.accepted_lengths[-1] - 1
            seq.acceptance.observe(call.draft, accepted)
            self._method_acceptance(seq).observe(call.draft, accepted)
            seq.idle = 0 if len(call.draft) else seq.idle + 1
        if piece:
            seq.job.post("text", seq.index, piece)
        if generation.finish_reason is not None or seq.stream.stopped:
            self._end(seq, None)

    def _draft_all(self) -> float:
        """Cap every decoding sequence's next draft by goodput, then let each draft; the
        seconds spent drafting."""
        stepped = [seq for seq in self._active if not seq.prefilling and seq.solo is None]
        for seq in stepped:
            if seq.generation.reading_prompt:
                seq.generation.next_call()  # the prompt's next scored part: nothing drafted
        drafting = [seq for seq in stepped if not seq.generation.reading_prompt]
        # sequences with a sizer of their own size their drafts within the server's row bound
        joint = [seq for seq in drafting if seq.generation.sizer is None]
        # what each draft must first read of the tokens it skipped, and a level's seconds, by
        # the drafter's own row-cost curve, where drafts are priced
        priced = ([seq.generation.draft_seconds() for seq in joint]
                  if self.row_costs is not None else [(0.0, 0.0)] * len(joint))
        allocated = iter(zip(self._caps(joint, priced, len(drafting) - len(joint)), priced))
        alone = ((self.max_draft_rows, self.max_draft_rows), (0.0, 0.0))
        total = 0.0
        for seq in drafting:
            generation = seq.generation
            cap, (catch_up_s, _) = alone if generation.sizer is not None else next(allocated)
            generation.draft_cap = cap
            started = time.perf_counter()
            try:
                generation.next_call()
            except Exception as exc:
                self._fail(seq, exc, "drafting failed")
                continue
            if cap[0] > 0:
                spent = time.perf_counter() - started
                total += spent
                call = generation.pending_call
                # a catch-up, or forced tokens (nothing drafted), is no sample of drafting (a
                # sequence sized alone prices its drafting without timings)
                if (len(call.draft) and not call.forced and not catch_up_s
                        and generation.sizer is None):
                    self._drafting(seq).observe(call.draft.max_depth, spent)
        return total

    def _caps(self, drafting: list[_Sequence], priced: list[tuple[float, float]],
              others: int) -> list[tuple[int, int]]:
        """Each sequence's (max depth, max draft rows) for its next step; ``priced``: each
        one's catch-up seconds (spread by :func:`~specdecode.sizing.catch_up_share`) and a
        level's seconds by its drafter's curve (until its method's drafting is timed);
        ``others``: the decoding sequences sized alone, a row each here."""
        if self.row_costs is None:
            return [(self.max_draft_rows, self.max_draft_rows)] * len(drafting)
        sizings = [self._sizing(seq, *seconds) for seq, seconds in zip(drafting, priced)]
        prompt_rows = sum(stop - seq.prefilled for seq, stop in self._prompt_parts())
        prompt_rows += sum(_rows(seq.generation.pending_call) for seq in self._active
                           if seq.solo is None and not seq.prefilling
                           and seq.generation.reading_prompt)
        caps = allocate([sizing.candidate for sizing in sizings], self.row_costs,
                        len(drafting) + others + prompt_rows, *self._overhead.line)
        step_rows = len(drafting) + others + prompt_rows + sum(rows for _, rows in caps)
        return [deepened((depth, min(rows, self.max_draft_rows)), seq.acceptance, sizing.most,
                         self.max_draft_rows) if depth
                else sizing.fallback(self.row_costs, step_rows) or (0, 0)
                for (depth, rows), sizing, seq in zip(caps, sizings, drafting)]

    def _sizing(self, seq: _Sequence, catch_up_s: float, level_s: float) -> _Sizing:
        """``seq``'s part in its step's allocation (see :meth:`_caps`)."""
        prior = self._method_acceptance(seq)
        generation = seq.generation
        left = generation.max_new_tokens - len(generation.tokens)
        most = min(generation.controller.budget().max_depth, self.max_draft_rows, left - 1)
        if generation.proposer.prices_own_drafting:  # auto sizes each part's drafts itself
            whole = (most, self.max_draft_rows)
            return _Sizing(Candidate(()), lambda *_: whole, most)
        levels = seq.acceptance.levels(max(0, min(most, len(prior.offered) + EXPLORE_LEVELS)),
                                       prior)
        draft_s, level_s = self._drafting(seq).priced(level_s)
        if catch_up_s:  # spread over the tokens the request can be expected to add
            left = self._method_lengths(seq).expected_left(len(generation.tokens), left)
        candidate = Candidate(levels, draft_s + catch_up_share(catch_up_s, left, levels), level_s)
        # where the budget leaves a sequence without a draft, one is sent anyway when its
        # method's estimate must learn: a token for its first drafts while its method's record
        # does not rule one out, a small draft after long without one (an early miss would
        # keep it at nothing)
        return _Sizing(candidate, functools.partial(
            learning_cap, max_depth=most, max_nodes=self.max_draft_rows,
            own_drafts=seq.acceptance.drafts, record=prior, idle=seq.idle, tokens_left=left,
            draft_s=draft_s, level_s=level_s, catch_up_s=catch_up_s,
            row_s=self._overhead.line[1], missed=seq.acceptance.missed), most)

    def _method_acceptance(self, seq: _Sequence) -> Acceptance:
        return self._acceptance.setdefault(_key(seq.spec), Acceptance())

    def _method_lengths(self, seq: _Sequence) -> AnswerLengths:
        return self._lengths.setdefault(_key(seq.spec), AnswerLengths())

    def _drafting(self, seq: _Sequence) -> DraftTime:
        return self._draft_time.setdefault(_key(seq.spec), DraftTime())

    def _fail(self, seq: _Sequence, exc: Exception, what: str) -> None:
        """End the sequence with an error for its request only (the config's problem, a 400,
        or ours, a 500) and keep serving."""
        if isinstance(exc, SpecDecodeError):
            error = ApiError(400, str(exc), param="specdecode.config")
        else:
            log.error(what, exc_info=exc)
            error = ApiError(500, f"internal error: {exc}", kind="server_error")
        self._end(seq, "error")
        seq.job.post("error", seq.index, error)

    def _end(self, seq: _Sequence, outcome: str | None) -> None:
        """Close the generation (the proposer's finish) and free the slot; ``outcome`` None:
        it finished, and its result goes to the request."""
        if seq in self._active:
            self._active.remove(seq)
        stats = None
        if seq.solo is not None:
            seq.solo.close()  # its loop's finally
        if seq.generation is not None:
            seq.generation.close()
            stats = seq.generation.stats
            self._keep_rows(seq, outcome)
        if outcome is None:
            result: GenerationResult = seq.stream.finish()
            outcome = result.finish_reason
            self._method_lengths(seq).observe(len(result.token_ids))
            seq.job.post("done", seq.index, result)
        self.metrics.observe_sequence(seq.spec.method.name, outcome, stats)
        with self._cond:
            self._free.append(seq.slot)
            self._busy -= 1
            self.metrics.active.set(self._busy)
        seq.slot = None

    def _keep_rows(self, seq: _Sequence, outcome: str | None) -> None:
        """Remember which tokens the slot's rows hold after a sequence that left its cache
        whole (finished or cancelled between steps), for the next request's prompt."""
        runner = seq.slot.runner
        if (self.prompt_cache is None or seq.solo is not None or outcome == "error"
                or not runner.reuses_prefix or runner.pending_rows):
            return
        context = seq.spec.prompt_ids + seq.generation.tokens
        seq.slot.held = held_ids(context[:runner.cache_len])

    def _drain(self) -> None:
        """Shutdown: close running generations, fail everything still waiting."""
        error = ApiError(503, "the server is shutting down", kind="server_error",
                         code="shutting_down")
        for seq in list(self._active):
            self._end(seq, "cancelled")
            seq.job.post("error", seq.index, error)
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
        for seq in pending:
            seq.job.post("error", seq.index, error)


def _key(spec: SequenceSpec) -> tuple[str, str]:
    return spec.method.name, repr(spec.config)


def prefill_order(rows_left: list[int]) -> list[int]:
    """The order in which prompt parts are taken, given the prompt rows each prefilling sequence
    has left, oldest first: the oldest first, so that every prompt moves on however many
    shorter ones arrive after it; then the fewest rows left first (shortest remaining first,
    which keeps the mean wait for a first token least), so that a short request is not held
    behind the long prompts that came before it."""
    return [0] + sorted(range(1, len(rows_left)), key=rows_left.__getitem__) if rows_left else []


def _computes_for(other: _Sequence, stop: int, seq: _Sequence) -> bool:
    """Whether ``other``'s prompt part, up to row ``stop``, computes rows of ``seq``'s prompt
    (the same tokens from the start) that ``seq`` would compute next, enough of them that
    ``seq`` waits a step and copies them (:meth:`Scheduler._share_prompts`)."""
    if not seq.reuses_rows or other.prefilled > seq.prefilled:
        return False
    shared = min(common_prefix(other.prompt, seq.prompt), stop, len(seq.prompt) - 1)
    return shared - seq.prefilled >= SHARED_ROWS_WORTH_A_STEP


def _rows(call: Call) -> int:
    return call.rows if isinstance(call, VerifyCall) else call.stop - call.start
