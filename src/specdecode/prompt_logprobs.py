"""Every prompt token's log-probability under the target: vLLM's ``prompt_logprobs``, and
OpenAI's ``echo`` with ``logprobs`` (how lm-evaluation-harness scores a continuation through
``/v1/completions``).

A prefill computes the LM head for the prompt's last row only. To score the prompt, its first
token is prefilled alone and the rest is read as chains of verify rows (a root and a chain
draft whose every node is committed), :data:`SCORE_ROWS` at a time: each row's logits give the
next prompt token's log-probability, and the last row's are the logits a prefill of the whole
prompt returns. Where the runner's rows are row invariant (the native runner), the cache is
then bitwise what a prefill leaves, so the answer that follows is the same tokens.

The log-probabilities are the model's own: ``log_softmax`` of its logits, before any of the
request's processors (logit bias, penalties, temperature), as vLLM reports prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.draft import Draft
from specdecode.models.base import Call, ForwardOutput, Needs, PrefillCall, Runner, VerifyCall

#: prompt rows read per verify chain while a prompt is scored
SCORE_ROWS = 64


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the ``top`` most likely (token, log-probability) pairs
    at its position, most likely first. A committed token's are under the request's processed
    target distribution (:meth:`~specdecode.sampling.NodeDistributions.logprobs`); a forced
    token (the constraint allowed nothing else) has log-probability 0 and itself as its only
    alternative. A prompt token's are the model's own (:class:`PromptScoring`)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    #: the token's place in its distribution, 1 the most likely (a prompt token's; None where
    #: not counted)
    rank: int | None = None


class PromptScoring:
    """The calls that read a prompt while scoring it, and what they found.

    ``entries[i]`` is prompt token ``i``'s :class:`TokenLogprob` with ``top`` alternatives;
    the first token, which nothing predicts, has None."""

    def __init__(self, ids: Sequence[int], top: int, needs: Needs):
        self.ids = tuple(ids)
        self.top = top
        self.needs = needs
        self.entries: list[TokenLogprob | None] = [None]
        #: prompt tokens whose rows the cache holds
        self.read = 0
        self._hidden: list[torch.Tensor] = []
        self._layers: dict[int, list[torch.Tensor]] = {layer: [] for layer in needs.layers}

    @property
    def done(self) -> bool:
        return self.read == len(self.ids)

    def next_call(self) -> Call:
        """The first token's prefill, then chains of at most :data:`SCORE_ROWS` rows."""
        if self.read == 0:
            return PrefillCall(self.ids[:1], 0, 1, self.needs)
        stop = min(len(self.ids), self.read + SCORE_ROWS)
        return VerifyCall(self.ids[self.read], Draft.chain(self.ids[self.read + 1:stop]),
                          self.needs, forced=True)

    def take(self, runner: Runner, call: Call, out: ForwardOutput) -> ForwardOutput | None:
        """Score the tokens ``call``'s rows predict and keep its rows; after the last part,
        what a prefill of the whole prompt returns (its logits after the prompt, the features
        of every prompt row), else None."""
        rows = out.logits.shape[0]
        first = self.read + 1  # the prompt token the call's first row predicts
        scored = min(rows, len(self.ids) - first)
        if scored > 0:
            self._score(out.logits[:scored], self.ids[first:first + scored])
        if isinstance(call, VerifyCall):
            runner.commit(list(range(len(call.draft))))
        self.read += rows
        if self.needs.final_hidden:
            self._hidden.append(out.final_hidden)
        for layer, parts in self._layers.items():
            parts.append(out.layers[layer])
        if not self.done:
            return None
        return ForwardOutput(
            out.logits[-1:], torch.cat(self._hidden) if self.needs.final_hidden else None,
            {layer: torch.cat(parts) for layer, parts in self._layers.items()})

    def _score(self, logits: torch.Tensor, tokens: Sequence[int]) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        picked = logp[torch.arange(len(tokens)), torch.tensor(tokens)]
        ranks = ((logp > picked[:, None]).sum(-1) + 1).tolist()
        if self.top:
            values, ids = logp.topk(self.top, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            tops = [()] * len(tokens)
        self.entries += [TokenLogprob(t, p, top, rank)
                         for t, p, top, rank in zip(tokens, picked.tolist(), tops, ranks)]
