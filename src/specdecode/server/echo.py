"""OpenAI's ``echo`` for completions: each choice's text starts with its prompt, and with
``logprobs`` its log-probabilities start with the prompt tokens' (the first token's null), as
lm-evaluation-harness reads them to score a continuation (``echo``, ``logprobs``,
``max_tokens`` 0 or 1). The prompt is scored by reading it as verify chains
(:mod:`specdecode.prompt_logprobs`), which leaves the cache as a prefill does: the answer after
it is the same.

``max_tokens`` 0 (only with ``echo``) returns the prompt alone: one token is decoded (its
logits come with the prompt's last part, no forward of its own) and dropped.

vLLM's ``prompt_logprobs`` field gives the same numbers in vLLM's form (:func:`vllm_form`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from specdecode.api import GenerationResult
from specdecode.server.protocol import CompletionRequest


@dataclass(frozen=True)
class Echo:
    #: per choice (prompt-major, as the request's sequences): its prompt's text and ids
    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    #: ``max_tokens`` 0: the prompt alone
    only: bool
    #: alternatives a token lists (``logprobs``; None: no log-probabilities; the prompt may be
    #: scored with more, for ``prompt_logprobs``)
    top: int | None = None

    @classmethod
    def of(cls, req: CompletionRequest, prompts: list[list[int]], decode) -> Echo | None:
        """The request's echo (None where it asks for none); ``decode``: ids -> text, for
        prompts given as ids."""
        if not req.echo:
            return None
        texts = [p if isinstance(p, str) else decode(ids) for p, ids in zip(req.prompts(), prompts)]
        n = req.n
        return cls(tuple(t for t in texts for _ in range(n)),
                   tuple(tuple(ids) for ids in prompts for _ in range(n)), req.max_tokens == 0,
                   req.top_logprobs_count())

    def scored(self, index: int, entries: list | None) -> tuple | None:
        """Choice ``index``'s prompt as (ids, entries with this request's alternatives) for
        its log-probabilities; None where they are not asked for."""
        if entries is None or self.top is None:
            return None
        return self.ids[index], [e and replace(e, top=e.top[:self.top]) for e in entries]

    def max_tokens(self, requested: int | None) -> int | None:
        """What to decode: one token (dropped) for ``max_tokens`` 0."""
        return 1 if self.only else requested

    def result(self, index: int, result: GenerationResult) -> GenerationResult:
        """Choice ``index`` as echoed: its prompt's text in front (and nothing after it when
        the prompt alone is asked for)."""
        if self.only:
            result = replace(result, text="", token_ids=[], finish_reason="length",
                             logprobs=None if result.logprobs is None else [])
        return replace(result, text=self.texts[index] + result.text)


def vllm_form(entries: list, count: int, text: Callable[[int], str]) -> list[Any]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {"logprob",
    "rank", "decoded_token"}}`` for the token and its ``count`` most likely alternatives."""
    def one(token: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": text(token)}

    out: list[Any] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        chosen = {str(t): one(t, v, i + 1) for i, (t, v) in enumerate(entry.top[:count])}
        chosen[str(entry.token)] = one(entry.token, entry.logprob, entry.rank)
        out.append(chosen)
    return out
