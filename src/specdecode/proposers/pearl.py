"""PEARL: the drafter drafts on a thread of its own while the target verifies (Liu et al., 2024,
"PEARL: Parallel Speculative Decoding with Adaptive Draft Length", arXiv 2408.11850; reference
code smart-lty/ParallelSpeculativeDecoding).

The pair is ``quantized``'s: the precise target (``--weights fp32`` or ``bf16``) and its own int4
copy (:func:`specdecode.proposers.quantized.int4_session`, the same loader and draft session).
The engine's loop is unchanged: the target's forward runs between :meth:`propose` and
:meth:`observe`, so the proposer starts the drafter's work in ``propose`` and collects it in
``observe``; the native kernels run without the GIL, so both models compute at once, each on
its own OpenMP team (``drafter_threads``, ``target_threads``).

Each round the drafter drafts ``gamma`` tokens after the draft the target is verifying, as if
it were all accepted (its first token guesses the target's bonus token):

* **post-verify** (a draft is ready): ``propose`` hands over the tokens drafted last round, at
  once, and the drafter drafts the next ``gamma`` after them while the target verifies them.
  If the target accepts every token and its bonus token is the drafter's first, the rest is the
  next round's draft, already made; otherwise it is discarded and the drafter rewinds (its
  cache keeps the committed prefix only, :meth:`NativeDraftLM.catch_up`).
* **pre-verify** (nothing ready: the first round, or after a rejection): the target reads the
  committed context alone (an empty draft: its one row is the paper's check of the first draft
  token) while the drafter drafts ``gamma`` tokens; if the target's token is the drafter's
  first, the others are the next round's draft.

The draft length adapts as the paper's does: a run of accepted rounds keeps drafting without a
pause, and a rejection costs one pre-verify round instead of a full chain drafted in vain.
``gamma`` is the paper's window (its scripts use 5), best near the ratio of a target verify to a
draft forward: an fp32 verify costs several int4 forwards, so the default is 10.

Exact: greedy, the drafter proposes its argmax and the target's argmax decides. Sampled, each
draft token is drawn from the int4 copy's processed distribution q given the tokens before it
(recorded in ``Draft.probs``); a ready draft is used only where the target's own token equals
the drafter's first, so given the committed context it is a draw from q like any other, and the
verifier's rule keeps the target's distribution. ``gamma`` is fixed, not timed, so seeded runs
repeat. Measurements and the memory-bandwidth bound: docs/quantized.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specdecode.control import Controller
from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.models.base import Runner
from specdecode.proposer import Feedback, Proposer
from specdecode.proposers.quantized import int4_session
from specdecode.registry import param, register


@dataclass(frozen=True)
class PearlConfig:
    gamma: int = param(10, "tokens the drafter drafts per round while the target verifies (the "
                           "paper's window, best near the ratio of a verify to a draft forward; "
                           "docs/quantized.md compares 5, 10 and 16)", bounds=(1, 64))
    # startup only: the server's own cores, the operator's to share out
    drafter_threads: int = param(1, "OpenMP threads of the drafter's thread",
                                 bounds=(1, 256), startup_only=True)
    target_threads: int = param(0, "OpenMP threads of the thread running the request (the "
                                   "target's) while it runs; 0: the threads it had less the "
                                   "drafter's, at least 1", bounds=(0, 256), startup_only=True)

    def __post_init__(self):
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")
        require(self.drafter_threads >= 1,
                f"drafter_threads must be >= 1, got {self.drafter_threads}")
        require(self.target_threads >= 0,
                f"target_threads must be >= 0 (0: automatic), got {self.target_threads}")


@dataclass
class PearlStats:
    """What the two threads did, over the proposer's life (read by tests and
    ``scripts/pearl_overlap.py``)."""

    pre_verify_rounds: int = 0
    post_verify_rounds: int = 0
    #: rounds whose draft-ahead was kept as the next draft, and rounds whose was discarded
    ahead_kept: int = 0
    ahead_discarded: int = 0
    #: seconds the target's thread waited in ``observe`` for the drafter to finish its round
    target_wait_s: float = 0.0
    #: seconds the drafter sat finished before ``observe`` came for its round
    drafter_wait_s: float = 0.0
    #: seconds the drafter computed
    drafter_busy_s: float = 0.0


@dataclass
class _Round:
    """The drafter's work in flight: the draft the target verifies and the tokens after it."""

    proposed: list[int]
    job: Future
    #: when the drafter finished (set by the drafter's thread)
    done_at: list[float] = field(default_factory=list)


@register("pearl", PearlConfig,
          paper="PEARL: Parallel Speculative Decoding with Adaptive Draft Length (Liu et al., "
                "2024, arXiv 2408.11850)",
          summary="the int4 copy drafts on its own thread while the fp32/bf16 target verifies "
                  "(pre- and post-verify; --weights fp32); output exactly the precise model's")
class PearlProposer(Proposer):
    def __init__(self, config: PearlConfig, runner: Runner):
        super().__init__(config, runner)
        self.session = int4_session(runner)
        self.stats = PearlStats()
        self._pool: ThreadPoolExecutor | None = None
        self._round: _Round | None = None
        #: a draft made ahead: (the context it follows, its tokens, their q or None)
        self._ready: tuple[list[int], list[int], torch.Tensor | None] | None = None
        self._caller_threads: int | None = None

    def make_controller(self) -> Controller:
        return Controller(self.config.gamma, self.config.gamma)

    def start(self, prompt: Sequence[int]) -> None:
        self._settle()
        self.session.start(prompt, self.sampling)
        self._ready = None
        # the target runs on this thread: its own team, beside the drafter's
        self._caller_threads = torch.get_num_threads()
        c = self.config
        torch.set_num_threads(c.target_threads or max(1, self._caller_threads - c.drafter_threads))
        # the int4 copy reads the prompt while the target prefills it
        self._submit([], list(prompt), 0)

    def propose(self, context, budget):
        self._settle()
        limit = min(budget.max_depth, budget.max_nodes)
        ready, self._ready = self._ready, None
        tokens, probs = [], None
        if ready is not None and ready[0] == list(context) and ready[1] and limit > 0:
            tokens, probs = ready[1][:limit], None if ready[2] is None else ready[2][:limit]
            self.stats.post_verify_rounds += 1
        else:
            self.stats.pre_verify_rounds += 1
        self._submit(tokens, list(context) + tokens, self.config.gamma)
        return Draft.chain(tokens, probs) if tokens else Draft.empty()

    def observe(self, feedback: Feedback) -> None:
        work, self._round = self._round, None
        if work is None:  # a step the engine took without a draft of ours (forced tokens)
            return
        waited_from = time.perf_counter()
        ahead, ahead_probs = work.job.result()
        self.stats.target_wait_s += time.perf_counter() - waited_from
        self.stats.drafter_wait_s += max(0.0, waited_from - work.done_at[0])
        if feedback.prefill:
            return
        # kept only where the target took the whole draft and its own next token is the
        # drafter's first: then the rest follows the committed context exactly
        if ahead and list(feedback.tokens) == work.proposed + ahead[:1]:
            self._ready = (list(feedback.context) + list(feedback.tokens), ahead[1:],
                           None if ahead_probs is None else ahead_probs[1:])
            self.stats.ahead_kept += 1
        else:
            self.stats.ahead_discarded += 1

    def finish(self, output: Sequence[int]) -> None:
        self._settle()
        self._ready = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._caller_threads is not None:
            torch.set_num_threads(self._caller_threads)
            self._caller_threads = None

    def _submit(self, proposed: list[int], path: list[int], length: int) -> None:
        """Start the drafter on ``length`` tokens after ``path`` (0: only read it)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pearl-drafter",
                                            initializer=torch.set_num_threads,
                                            initargs=(self.config.drafter_threads,))
        done_at: list[float] = []
        job = self._pool.submit(self._draft_after, path, length, done_at)
        self._round = _Round(proposed, job, done_at)

    def _settle(self) -> None:
        """Wait for a round nobody observed (a generation closed early); forget it."""
        work, self._round = self._round, None
        if work is not None:
            work.job.result()

    def _draft_after(self, path: list[int], length: int,
                     done_at: list[float]) -> tuple[list[int], torch.Tensor | None]:
        """The drafter's thread: up to ``length`` tokens after ``path``, each drawn from the
        drafter's processed distribution; each but the last enters the drafter's cache as read,
        so the next round continues from there (or rewinds to the committed prefix)."""
        started = time.perf_counter()
        lm, tokens, probs = self.session.lm, [], []
        capacity = lm.runner.cache.capacity
        if capacity is not None:  # the ahead tokens may run past the request's end: not its room
            length = max(0, min(length, capacity - len(path)))
        for _ in range(length):
            logits, _ = lm.catch_up(path)
            token, q, _ = self.session.draw(logits, path)
            tokens.append(token)
            path = path + [token]
            if q is not None:
                probs.append(q)
        if length == 0:
            lm.catch_up(path)
        done_at.append(time.perf_counter())
        self.stats.drafter_busy_s += done_at[0] - started
        return tokens, torch.stack(probs) if probs else None
