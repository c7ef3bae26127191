"""OpenAI's ``echo`` for completions: each choice's text starts with its prompt, and with
``logprobs`` its log-probabilities start with the prompt tokens' (the first token's null), as
lm-evaluation-harness reads them to score a continuation (``echo``, ``logprobs``,
``max_tokens`` 0 or 1). The prompt is scored by reading it as verify chains
(:mod:`specdecode.prompt_logprobs`), which leaves the cache as a prefill does: the answer after
it is the same.

``max_tokens`` 0 (only with ``echo``) returns the prompt alone: one token is decoded (its
logits come with the prompt's last part, no forward of its own) and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specdecode.api import GenerationResult
from specdecode.server.protocol import CompletionRequest


@dataclass(frozen=True)
class Echo:
    #: per choice (prompt-major, as the request's sequences): its prompt's text and ids
    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    #: ``max_tokens`` 0: the prompt alone
    only: bool

    @classmethod
    def of(cls, req: CompletionRequest, prompts: list[list[int]], decode) -> Echo | None:
        """The request's echo (None where it asks for none); ``decode``: ids -> text, for
        prompts given as ids."""
        if not req.echo:
            return None
        texts = [p if isinstance(p, str) else decode(ids) for p, ids in zip(req.prompts(), prompts)]
        n = req.n
        return cls(tuple(t for t in texts for _ in range(n)),
                   tuple(tuple(ids) for ids in prompts for _ in range(n)), req.max_tokens == 0)

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
