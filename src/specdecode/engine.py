"""The decode loop: draft, one target forward, verify, commit, emit.

    out = runner.prefill(prompt, proposer.needs)         # the first token comes from here
    proposer.observe(...)                                # the prefill is fed back too
    while not done:
        budget = controller.budget()                     # capped by the tokens left
        draft  = proposer.propose(context, budget)       # a Draft tree (a chain is a tree)
        out    = runner.forward(root, draft, needs)      # ONE target pass over every node
        result = verify(draft, out.logits, sampling, ...)  # accepted path + bonus/recovered
        runner.commit(result.accepted)                   # keep the accepted KV rows only
        proposer.observe(...); controller.observe(...)   # logits and declared features
        emit(result.tokens)                              # cut at end-of-sequence / the limit

A :class:`Generation` is an iterator over the committed token chunks; its ``tokens`` and
``stats`` fill as it runs, so streaming and one-shot generation share the same loop.

Under a constraint (``sampling.constraint``: a grammar, banned outputs) the loop changes in three
places, none of which changes what is committed: the draft loses the nodes the constraint
rejects before the target sees it; the verifier masks each node with its own path's allowed
tokens; and after each commit, while the constraint allows exactly one token, that token is
committed at once without a target forward (jump-forward). Those forced tokens enter the cache
with the next forward, as a chain before the root of a step that drafts nothing else.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from specdecode.constraints import Constraint
from specdecode.control import Controller
from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.models.base import Call, ForwardOutput, PrefillCall, Runner, VerifyCall
from specdecode.models.kv_cache import common_prefix, held_ids
from specdecode.prompt_logprobs import PromptScoring, TokenLogprob
from specdecode.proposer import Feedback, Proposer
from specdecode.sampling import GREEDY, SamplingParams
from specdecode.sizing import SequenceSizer
from specdecode.verify import VerifyResult, verify

#: most forced tokens committed in a row before the next target forward (they ride in its
#: draft as a chain, so this bounds that pass's rows)
MAX_FORCED_RUN = 32


@dataclass
class GenerationStats:
    """Speculation statistics of one request, as data."""

    new_tokens: int = 0
    #: target forward passes, the prefill included
    target_forwards: int = 0
    #: tokens committed by each verify step (accepted + 1); the prefill's token is not counted
    accepted_lengths: list[int] = field(default_factory=list)
    #: draft nodes sent to the target, all steps together
    draft_tokens: int = 0
    #: tokens a constraint forced, committed without a target forward (jump-forward); the
    #: step that puts them in the cache counts them as its accepted draft
    forced_tokens: int = 0
    #: draft nodes a constraint rejected before the target saw them
    pruned_nodes: int = 0
    #: prompt tokens whose rows were held from earlier requests (a server's prompt cache, a
    #: Decoder's conversation): not prefilled again
    cached_tokens: int = 0
    prefill_s: float = 0.0
    propose_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted length tau: tokens committed per verify step (1.0 for ``ar``)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted, all steps together (bonus/recovered tokens excluded)."""
        return sum(self.accepted_lengths) - len(self.accepted_lengths)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        """accepted length -> number of verify steps."""
        return dict(sorted(Counter(self.accepted_lengths).items()))

    @property
    def accepted_per_depth(self) -> list[int]:
        """[d-1] = verify steps that accepted a draft token at depth d."""
        deepest = max(self.accepted_lengths, default=1) - 1
        return [sum(1 for n in self.accepted_lengths if n - 1 >= d) for d in range(1, deepest + 1)]

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted": round(self.mean_accepted, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "forced_tokens": self.forced_tokens,
            "pruned_nodes": self.pruned_nodes,
            "accepted_histogram": {str(k): v for k, v in self.histogram.items()},
            "accepted_per_depth": self.accepted_per_depth,
            "cached_tokens": self.cached_tokens,
            "prefill_s": round(self.prefill_s, 4),
            "propose_s": round(self.propose_s, 4),
            "verify_s": round(self.verify_s, 4),
            "total_s": round(self.total_s, 4),
        }


def check_request(runner: Runner, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    """Reject bad requests before any model work, with the fix in the message."""
    require(len(prompt_ids) > 0, "the prompt is empty; give at least one token of text")
    require(isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool)
            and max_new_tokens > 0,
            f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    # the native runner holds min(the model's context, 4096) positions unless told more
    larger = ("shorten the prompt, or load the model with more positions (--max-context N, "
              "max_context=N: up to its context length)")
    require(len(prompt_ids) < runner.max_context,
            f"the prompt has {len(prompt_ids)} tokens but the runner holds "
            f"{runner.max_context} positions; {larger}")
    require(len(prompt_ids) + max_new_tokens <= runner.max_context,
            f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new_tokens}) "
            f"exceeds the runner's {runner.max_context} positions; lower max_new_tokens "
            f"to at most {runner.max_context - len(prompt_ids)}, or {larger}")
    check_ids(prompt_ids, runner.vocab_size, "prompt token ids")


def check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """A clear error naming ``what`` and its first ids outside a vocabulary of
    ``vocab_size`` tokens (a prompt's, stop tokens, ids to decode)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    require(not bad, f"{what} {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")


def cut_chunk(tokens: Sequence[int], produced: int, max_new_tokens: int,
              eos_token_ids: frozenset[int], admit=None) -> tuple[list[int], str | None]:
    """The part of ``tokens`` a generation that has ``produced`` tokens commits, and why it then
    ends (``"stop"`` at end-of-sequence or where ``admit(token)`` refuses, ``"length"`` at the
    token limit; None to go on). Every decode loop cuts here, so all stop at the same place."""
    out: list[int] = []
    for token in tokens:
        if admit is not None and not admit(token):
            return out, "stop"
        out.append(token)
        if token in eos_token_ids:
            return out, "stop"
        if produced + len(out) >= max_new_tokens:
            return out, "length"
    return out, None


class Generation:
    """One request. Iterate for token chunks as they are committed.

    The loop is also open in steps, for a server that runs many generations' target passes as
    one (:meth:`Runner.run_packed`): :meth:`begin` gives the prefill call, :meth:`advance` takes
    a pass's output and returns the committed chunk, :meth:`next_call` drafts and gives the
    next verify call, :meth:`close` ends it. Iterating is exactly that loop with the
    generation's own runner running each call.
    """

    def __init__(self, runner: Runner, proposer: Proposer, prompt_ids: Sequence[int],
                 max_new_tokens: int, sampling: SamplingParams = GREEDY,
                 eos_token_ids: Sequence[int] = (), controller: Controller | None = None,
                 sizer: SequenceSizer | None = None, reference: Sequence[int] = (),
                 reuse_prefix: bool = False):
        """``sizer``: caps each draft by expected tokens per second of the runner's row costs
        (specdecode/sizing.py); None: the controller's budget (and :attr:`draft_cap`) alone.
        ``reference``: text the answer is expected to repeat
        (:meth:`~specdecode.proposer.Proposer.use_reference`). ``reuse_prefix``: the prompt's
        start that the runner's cache holds from its last generation (its prompt and answer,
        :meth:`~specdecode.models.base.Runner.held_tokens`) is not prefilled again (the rows are
        bitwise those a prefill writes, where the runner :attr:`reuses_prefix`)."""
        check_request(runner, prompt_ids, max_new_tokens)
        self.runner = runner
        self.proposer = proposer
        self.prompt_ids = list(prompt_ids)
        self.reference = list(reference)
        self.reuse_prefix = reuse_prefix
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.eos_token_ids = frozenset(eos_token_ids)
        self.controller = controller or proposer.make_controller()
        self.constraint: Constraint | None = None
        if sampling.constraint is not None:
            vocab = sampling.constraint.vocabulary.vocab_size
            require(vocab == runner.vocab_size,
                    f"the constraint was built for a vocabulary of {vocab} tokens but the model "
                    f"has {runner.vocab_size}; build it with the model's vocab_size")
            self.constraint = sampling.constraint.start()
        require(sampling.max_biased_id < runner.vocab_size,
                f"logit_bias names token {sampling.max_biased_id}, outside the model's "
                f"vocabulary (ids 0..{runner.vocab_size - 1})")
        #: one entry per committed token when ``sampling.logprobs`` is set, else None
        self.logprobs: list[TokenLogprob] | None = [] if sampling.logprobs is not None else None
        self.tokens: list[int] = []
        self.stats = GenerationStats()
        #: "stop" (end-of-sequence) or "length" (max_new_tokens); None while running
        self.finish_reason: str | None = None
        #: (deepest node, most nodes) the next :meth:`next_call` may draft (a server's goodput
        #: budget); None = the controller's budget alone
        self.draft_cap: tuple[int, int] | None = None
        self.sizer = sizer
        #: when the step being run began, and the seconds its drafting took (for the sizer)
        self._step_started = 0.0
        self._draft_s = 0.0
        self._context = list(self.prompt_ids)
        self._generator = None
        self._call: Call | None = None
        #: forced tokens committed since the last forward (not yet in the cache)
        self._forced: list[int] = []
        #: the prompt read row by row and scored, where ``sampling.prompt_logprobs`` asks
        self._scoring: PromptScoring | None = None
        self._started = 0.0
        self._closed = False

    def __iter__(self) -> Iterator[list[int]]:
        try:
            call = self.begin()
            while True:
                t0 = time.perf_counter()
                scoring = self.reading_prompt
                out = call.run(self.runner)
                if isinstance(call, VerifyCall) and not scoring:  # a prefill's is prefill_s
                    self.stats.verify_s += time.perf_counter() - t0
                yield self.advance(out)
                if self.finish_reason is not None:
                    return
                call = self.next_call()
        finally:
            self.close()

    @property
    def reading_prompt(self) -> bool:
        """The prompt is being read as scored chains (:mod:`specdecode.prompt_logprobs`): the
        calls until the first token are those, and nothing is drafted."""
        return self._scoring is not None and not self._scoring.done

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """Each prompt token's log-probability (the first None) once the prompt is read,
        where ``sampling.prompt_logprobs`` asked for them; else None."""
        if self._scoring is None or not self._scoring.done:
            return None
        return self._scoring.entries

    @property
    def pending_call(self) -> Call | None:
        """The call given by :meth:`begin` or :meth:`next_call` and not yet advanced."""
        return self._call

    def begin(self) -> PrefillCall:
        """Start the proposer; the prompt's prefill is the first call (its first token's, where
        the prompt is scored)."""
        require(self._call is None and not self.tokens, "this generation has already begun")
        self._started = time.perf_counter()
        self._generator = self.sampling.generator()
        self.proposer.set_sampling(self.sampling)
        self.proposer.couple(self._generator)
        self.proposer.start(self.prompt_ids)
        if self.reference:
            self.proposer.use_reference(self.reference)
        ids = tuple(self.prompt_ids)
        if self.sampling.prompt_logprobs is not None:  # every row's logits: nothing reused
            self._scoring = PromptScoring(ids, self.sampling.prompt_logprobs, self.proposer.needs)
            self._call = self._scoring.next_call()
            return self._call
        start = self.stats.cached_tokens = self._held_prefix() if self.reuse_prefix else 0
        self._call = PrefillCall(ids, start, len(ids), self.proposer.needs)
        return self._call

    def _held_prefix(self) -> int:
        """Keep the rows of the prompt's longest start the runner holds (all but its last
        token, whose logits the prefill gives); their length. 0 where the proposer reads the
        prompt rows' features, which a prefill from there would not give."""
        needs = self.proposer.needs
        if needs.final_hidden or needs.layers:
            return 0
        n = common_prefix(self.runner.held_tokens(), held_ids(self.prompt_ids[:-1]))
        if n:
            self.runner.keep_prefix(n)
        return n

    def draft_seconds(self) -> tuple[float, float]:
        """What the proposer's next draft costs by its drafter's own row-cost curve
        (:meth:`~specdecode.proposer.Proposer.draft_seconds`)."""
        return self.proposer.draft_seconds(self._context)

    def next_call(self) -> VerifyCall:
        """Draft within the budget (the controller's, capped by the tokens left and
        :attr:`draft_cap`) and give the verify call."""
        require(self.finish_reason is None and self._call is None,
                "next_call needs a generation whose last call was advanced and that has not finished")
        if self.reading_prompt:
            self._call = self._scoring.next_call()
            return self._call
        t0 = time.perf_counter()
        context = self._context
        if self._forced:  # jump-forward: the forced tokens enter the cache, nothing is drafted
            root = context[-1 - len(self._forced)]
            self._call = VerifyCall(root, Draft.chain(self._forced), self.proposer.needs,
                                    forced=True)
            return self._call
        left = self.max_new_tokens - len(self.tokens)
        budget = replace(self.controller.budget().capped(left - 1), tokens_left=left)
        if self.draft_cap is not None:
            budget = budget.capped(self.draft_cap[0]).capped_nodes(self.draft_cap[1])
        if self.sizer is not None and budget.max_depth > 0:
            depth, nodes = self.sizer.cap(budget.max_depth, budget.max_nodes,
                                          *self.draft_seconds(), tokens_left=left,
                                          generated=len(self.tokens))
            budget = budget.capped(depth).capped_nodes(nodes)
        self._step_started = t0
        if budget.max_depth > 0:
            draft = self.proposer.propose(context, budget).truncated(budget.max_depth,
                                                                     budget.max_nodes)
        else:  # nothing may be drafted (the last token, a loaded server, drafts that do not
            draft = Draft.empty()  # pay): skip the drafting
        self._draft_s = time.perf_counter() - t0
        if self.constraint is not None:
            kept = self.constraint.prune(draft, keep_rejected_leaves=not self.sampling.greedy
                                         and draft.probs is not None)
            self.stats.pruned_nodes += len(draft) - len(kept)
            draft = kept
        self.stats.propose_s += time.perf_counter() - t0
        self._call = VerifyCall(context[-1], draft, self.proposer.needs)
        return self._call

    def advance(self, out: ForwardOutput) -> list[int]:
        """Verify the last call's output, commit, feed back, and return the committed chunk."""
        call, self._call = self._call, None
        require(call is not None, "advance needs a call from begin or next_call")
        context, stats = self._context, self.stats
        prompt_len = len(self.prompt_ids)
        if self.reading_prompt:
            out = self._scoring.take(self.runner, call, out)
            if out is None:  # more of the prompt to read
                stats.target_forwards += 1
                return []
            return self._first_token(out)
        if isinstance(call, PrefillCall):
            return self._first_token(out)
        t0 = time.perf_counter()
        draft, forced = call.draft, self._forced
        if forced:
            # the chain's nodes are committed already: verify only after the last of them
            self._forced = []
            k = len(forced)
            result = verify(Draft.empty(), out.logits[k:k + 1], self.sampling, context,
                            prompt_len, self._generator, self.constraint)
            before = context[:len(context) - k]
            accepted, tokens = tuple(range(k)), tuple(forced) + result.tokens
        else:
            result = verify(draft, out.logits, self.sampling, context, prompt_len,
                            self._generator, self.constraint)
            before, accepted, tokens = context, result.accepted, result.tokens
        self.runner.commit(accepted)
        t1 = time.perf_counter()
        stats.verify_s += t1 - t0
        stats.target_forwards += 1
        stats.draft_tokens += len(draft)
        self.proposer.observe(Feedback(tuple(before), draft, out.logits, accepted, tokens, out))
        if not forced:
            self.controller.observe(len(draft), len(result.accepted))
            if self.sizer is not None:
                self.sizer.observe(draft, len(result.accepted), self._draft_s,
                                   t1 - self._step_started)
        stats.propose_s += time.perf_counter() - t1
        chunk = self._emit_verified(result)
        # count what was committed: tokens accepted past end-of-sequence are dropped; a forced
        # chain counts as this step's accepted draft (what a server's acceptance tracking reads)
        stats.accepted_lengths.append(len(forced) + len(chunk))
        return chunk + self._jump_forward()

    def _first_token(self, out: ForwardOutput) -> list[int]:
        """The prefill's output (or what the prompt's scored parts add up to): the first
        token, and the prompt fed back to the proposer."""
        stats, context = self.stats, self._context
        t0 = time.perf_counter()
        stats.target_forwards += 1
        stats.prefill_s = t0 - self._started
        first = verify(Draft.empty(), out.logits, self.sampling, context, len(self.prompt_ids),
                       self._generator, self.constraint)
        self.proposer.observe(Feedback(tuple(context), Draft.empty(), out.logits, (),
                                       first.tokens, out, prefill=True))
        stats.propose_s += time.perf_counter() - t0
        return self._emit_verified(first) + self._jump_forward()

    def close(self) -> None:
        """End it (finished or not): the proposer's ``finish`` runs once."""
        if self._closed:
            return
        self._closed = True
        if self._generator is not None:  # begun
            self.proposer.finish(self.tokens)
            self.stats.total_s = time.perf_counter() - self._started
        if self.sizer is not None and self.finish_reason is not None:  # ended, not cancelled
            self.sizer.finish(len(self.tokens))
        if self.stats.target_forwards:  # the cache holds this generation's rows
            self.runner.note_held(self._context)

    def _emit_verified(self, result: VerifyResult) -> list[int]:
        """Commit a verify step's tokens, with their log-probabilities when asked for (read
        before the commit moves the constraint past the rows' paths)."""
        entries = []
        if self.logprobs is not None:
            top = self.sampling.logprobs
            raw = self.sampling.raw_logprobs
            for token, row in zip(result.tokens, result.rows):
                logprobs = (result.target.logits[row].float().log_softmax(-1) if raw
                            else result.target.logprobs(row))
                values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0])
                alternatives = tuple((i, v) for i, v in zip(ids.tolist(), values.tolist())
                                     if v > float("-inf"))  # tokens the processors dropped: none
                entries.append(TokenLogprob(token, float(logprobs[token]), alternatives))
        chunk = self._emit(result.tokens, self._context)
        if self.logprobs is not None:
            self.logprobs.extend(entries[:len(chunk)])
        return chunk

    def _jump_forward(self) -> list[int]:
        """After a commit: end a finished grammar; commit the tokens the constraint forces."""
        constraint = self.constraint
        if constraint is None or self.finish_reason is not None:
            return []
        chunk: list[int] = []
        while self.finish_reason is None and len(self._forced) < MAX_FORCED_RUN:
            if constraint.finished:
                self.finish_reason = "stop"
                break
            if not constraint.spec.jump_forward:
                break
            token = constraint.forced()
            if token is None:
                break
            chunk += self._emit([token], self._context)
            self._forced.append(token)
            self.stats.forced_tokens += 1
            if self.logprobs is not None:
                self.logprobs.append(TokenLogprob(token, 0.0, ((token, 0.0),)))
        return chunk

    def _emit(self, tokens: Sequence[int], context: list[int]) -> list[int]:
        """Commit ``tokens``, cut at end-of-sequence or the token limit. Under a constraint
        each token is fed to it; a finished grammar ends the generation before any
        end-of-sequence token (every method stops at the same place: ``ar`` when the grammar
        finishes, a speculative step where a drafted end-of-sequence follows)."""
        admit = None if self.constraint is None else self._admit
        out, reason = cut_chunk(tokens, len(self.tokens), self.max_new_tokens,
                                self.eos_token_ids, admit)
        self.finish_reason = reason or self.finish_reason
        self.tokens.extend(out)
        context.extend(out)
        self.stats.new_tokens = len(self.tokens)
        return out

    def _admit(self, token: int) -> bool:
        """Feed ``token`` to the constraint; False (commit nothing more) once it has finished."""
        if self.constraint.finished:
            return False
        self.constraint.commit([token])
        return True

    def run(self) -> list[int]:
        for _ in self:
            pass
        return self.tokens
