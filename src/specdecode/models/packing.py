"""Many calls in one forward of the native runner: the scheduling of ``run_packed``.

Row invariance lets one forward serve many sequences (continuous batching, Yu et al. 2022,
"Orca"): each sequence is a ``replica()`` with a cache of its own, the linear layers run over
every sequence's rows at once (their weights read once), and rotary embedding, the cache write
and attention run per sequence on its cache (:func:`packed_plan`), so each sequence's logits
are bitwise what its own forward gives. Each call is a generator of items, one a forward: a
verify step is one, a prompt part of several ``PREFILL_BLOCK`` blocks runs its next block in
each further forward, as ``prefill_part`` runs them one after another. ``forward`` and
``prefill_part`` are the one-call case, so a call's output and its runner's books are the same
packed or alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode import kernels
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import Call, ForwardOutput, PrefillCall, Runner, VerifyCall
from specdecode.models.kv_cache import AttentionPlan, BlockedKVCache

#: prefill runs prompts in blocks of this many rows (bounds the attention score buffer)
PREFILL_BLOCK = 128


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's rows in a forward: its cache, its tokens, where they go and what they see
    (``plan``), the layers whose outputs it reads, and whether they take the prompt layers."""

    cache: BlockedKVCache
    tokens: Sequence[int]
    plan: AttentionPlan
    capture: tuple[int, ...] = ()
    prefill: bool = False


@dataclass(frozen=True)
class Pass:
    """What one call's rows leave for the final norm and the head."""

    #: the last layer's hidden states of the rows the call returns features of [fed, H]
    hidden: torch.Tensor
    #: the rows of ``hidden`` whose logits it returns
    logit_rows: slice
    #: the LM head those logits come from
    head: object
    final_hidden: bool
    layers: dict[int, torch.Tensor]


class PackedForwards:
    """The native runner's ``run_packed``: what it runs are the runner's own ``cache``,
    ``layers``, heads and ``run_items``."""

    #: every format's decode layers are row invariant, so verify rows of many sequences share a
    #: forward; so do prompt blocks where the prompt layers are the decode layers (int4, int8).
    #: fp32 and bf16 prompts go through ATen's GEMMs, which are not: each of their prompt
    #: blocks runs in a forward of its own, beside the packed one.
    packs_calls = True

    @torch.inference_mode()
    def run_packed(self, work: Sequence[tuple[Runner, Call]]) -> list[ForwardOutput | None]:
        """Every call of ``work`` (on this runner and replicas of it) in one forward: the linear
        layers over every call's rows at once, rotary embedding and attention per call on its
        runner's cache. A prompt part of several ``PREFILL_BLOCK`` blocks runs its next block
        in each further forward (with the other parts' next blocks), as ``prefill_part`` runs
        them one after another. :meth:`forward` and :meth:`prefill_part` are the one-call
        case, so a call's output and its runner's books are the same packed or alone."""
        work = list(work)
        self._check_work(work)
        steps = [runner._steps(call) for runner, call in work]
        items = {i: next(step) for i, step in enumerate(steps)}
        passes: list[Pass | None] = [None] * len(work)
        while items:
            following = {}
            for (i, item), out in zip(items.items(), self._run_round(list(items.values()))):
                try:
                    following[i] = steps[i].send(out)
                except StopIteration as done:
                    passes[i] = done.value
            items = following
        return self._outputs(passes)

    def _check_work(self, work: list[tuple[Runner, Call]]) -> None:
        """Refuse, before anything runs, what some call of ``work`` would refuse."""
        seen = set()
        for i, (runner, call) in enumerate(work):
            # (messages formatted only on failure: this runs for every sequence every pass)
            if not (isinstance(runner, PackedForwards) and runner.layers is self.layers):
                raise SpecDecodeError(
                    f"run_packed: runner {i} ({getattr(runner, 'name', type(runner).__name__)}) "
                    "does not share this runner's weights; pack only replicas of one model "
                    "(runner.replica())")
            if id(runner) in seen:
                raise SpecDecodeError(f"run_packed: runner {i} has two calls in one pass; give "
                                      "each runner one call")
            seen.add(id(runner))
            if not isinstance(call, (PrefillCall, VerifyCall)):
                raise SpecDecodeError(f"run_packed: call {i} is a {type(call).__name__}, not a "
                                      "PrefillCall or VerifyCall")
            runner._check_call(call)

    def _check_call(self, call: Call) -> None:
        self._check_needs(call.needs)
        cache = self.cache
        if isinstance(call, VerifyCall):
            require(cache.pending == 0, "runner.forward called twice without commit")
            cache.check_room(call.rows)
            return
        ids, start, stop = call.ids, call.start, call.stop
        require(0 < len(ids) <= self.max_context,
                f"prefill needs 1..{self.max_context} tokens, got {len(ids)}")
        # a part of a prompt whose prefill is row invariant may start after any cached prefix
        require((start % PREFILL_BLOCK == 0 or self.reuses_prefix) and start < stop <= len(ids)
                and (start == 0 or start == cache.length),
                f"prefill part {start}:{stop} of {len(ids)} rows must start at 0 or where the "
                f"last part stopped ({cache.length}), at a multiple of {PREFILL_BLOCK}")
        require(start == 0 or cache.pending == 0, "tokens appended between forward and commit")
        require(cache.capacity >= stop, f"the cache holds {cache.capacity} rows; a prompt of "
                                        f"{stop} rows does not fit")

    def _steps(self, call: Call):
        """A generator of ``call``'s items on this runner, one a forward: it is sent each
        item's (hidden states, captured layers) and returns the call's :class:`Pass` (None for
        a prompt part before the last)."""
        return self._verify_steps(call) if isinstance(call, VerifyCall) else self._prefill_steps(call)

    def _verify_steps(self, call: VerifyCall):
        n = call.rows
        self.cache.begin_forward(n)
        plan = AttentionPlan.verify(self.cache.length, call.draft)
        hidden, layers = yield SequenceRows(self.cache, (call.root,) + call.draft.tokens, plan,
                                     call.needs.layers)
        self.cache.pending = n
        return Pass(hidden, slice(None), self.head, call.needs.final_hidden, layers)

    def _prefill_steps(self, call: PrefillCall):
        ids, needs = call.ids, call.needs
        if call.start == 0:
            self.cache.reset()
            self._prefill_blocks = []
        blocks = []
        for first in range(call.start, call.stop, PREFILL_BLOCK):  # append's blocks
            block = ids[first:min(call.stop, first + PREFILL_BLOCK)]
            plan = AttentionPlan.chain(self.cache.length, len(block))
            blocks.append((yield SequenceRows(self.cache, block, plan, needs.layers, prefill=True)))
            self.cache.append(len(block))
        # the earlier parts' blocks are kept only where the features of every prompt row are
        # asked for; the logits need the last block alone
        keep = needs.final_hidden or bool(needs.layers)
        self._prefill_blocks = (self._prefill_blocks + blocks) if keep else blocks[-1:]
        if call.stop < len(ids):
            return None
        blocks, self._prefill_blocks = self._prefill_blocks, []
        layers = {layer: torch.cat([captured[layer] for _, captured in blocks])
                  for layer in needs.layers}
        return Pass(torch.cat([hidden for hidden, _ in blocks]), slice(-1, None),
                     self.prefill_head, needs.final_hidden, layers)

    def _run_round(self, items: list[SequenceRows]) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """One forward for every item the decode layers run; a prompt block that goes through
        other prompt layers (ATen's GEMMs, not row invariant) runs in a forward of its own."""
        out = [None] * len(items)
        alone = {i for i, item in enumerate(items)
                 if item.prefill and self.prefill_layers is not self.layers}
        shared = [i for i in range(len(items)) if i not in alone]
        if shared:
            for i, result in zip(shared, self.run_items([items[i] for i in shared])):
                out[i] = result
        for i in alone:
            out[i] = self.run_items([items[i]], prefill=True)[0]
        return out

    def _outputs(self, passes: list[Pass | None]) -> list[ForwardOutput | None]:
        """The final norm and the LM head of every pass: the rows whose logits are asked for go
        through the decode head in one call; a prompt's last row, where the prompt head is
        another, through that one alone."""
        norm = self.final_norm
        finals = [self._norm(p.hidden, norm) if p and p.final_hidden else None for p in passes]
        normed = {i: finals[i][p.logit_rows] if finals[i] is not None
                  else self._norm(p.hidden[p.logit_rows], norm)
                  for i, p in enumerate(passes) if p is not None}
        shared = [i for i in normed if passes[i].head is self.head]
        logits = {}
        if len(shared) == 1:
            logits[shared[0]] = self.head(normed[shared[0]])
        elif shared:
            together = self.head(torch.cat([normed[i] for i in shared]))
            logits.update(zip(shared, together.split([len(normed[i]) for i in shared])))
        for i in normed.keys() - logits.keys():
            logits[i] = passes[i].head(normed[i])
        return [None if p is None else ForwardOutput(self._capped(logits[i]), finals[i], p.layers)
                for i, p in enumerate(passes)]


def packed_plan(items: Sequence[SequenceRows]) -> tuple[torch.Tensor, object]:
    """The items' plans as one forward's: every row's position [n], and the kernels'
    ``PackedPlan`` (each item's cache, slots and keys, its rows after the items before it)."""
    plans = [item.plan for item in items]
    for item in items:
        item.cache.reserve(item.plan.end)
    positions = plans[0].positions if len(plans) == 1 else torch.cat([p.positions for p in plans])
    plan = kernels.packed_plan([item.cache.keys for item in items],
                               [item.cache.values for item in items], [p.past for p in plans],
                               [p.slots for p in plans], [p.keys for p in plans],
                               [p.lengths for p in plans])
    return positions, plan
