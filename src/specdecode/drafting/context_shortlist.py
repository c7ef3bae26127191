"""A draft's shortlisted LM head widened by the tokens of its context.

A GGUF draft's head scores a shortlist (``drafting/artifacts.py``'s ``shortlist_ids``:
FR-Spec's frequency-ranked first ids, Zhao et al., 2025), which misses the rare tokens an answer
takes from its prompt: names, the words of a passage it quotes, a program's identifiers. Of the
tokens Qwen2.5-Coder-1.5B wrote on the Spec-Bench dev half and three code edits, 8% lie outside
Qwen2.5's first 32,768 ids, and more than half of those are in their prompt.
:class:`ContextShortlist` scores, beside the shortlist, every token of the draft's context (the
prompt and the answer so far) that lies outside it, with the head's own rows (read when the
token is first seen). Over those answers, the 0.5B draft's argmax agrees with the 1.5B's next
token at 81.8% of positions with the widened shortlist, 78.0% with the shortlist alone and 82.6%
with the whole vocabulary (summaries 82.2% -> 90.6%, code edits 90.5% -> 96.0%;
scripts/shortlist_agreement.py, docs/draft-model.md); the price is a product with a few hundred
head rows a forward.

The scored tokens are a function of the context alone (the first ``MAX_EXTRA`` such tokens in
its order), so a seeded request drafts the same way whatever ran before it; the widened
shortlist stays ascending by id (its logits are reordered), so a sampled draft's one uniform
picks the token the vocabulary's draw would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

#: context tokens outside the shortlist scored at most (the first in the context's order): a
#: long prompt's rare tokens add as many head rows (14.7 MB at the 0.5B's 896 dimensions) and a
#: product with them to every draft row
MAX_EXTRA = 4096


class ContextShortlist:
    """The ids a shortlisted head scores, ascending (:attr:`ids`): ``base`` and the context's
    tokens outside it. ``rows(ids)``: the head's float rows [n, H] of vocabulary ids;
    ``score(normed, rows)``: logits [n, len(rows)] of normed states against such rows, as the
    head's own are computed (capped, scaled)."""

    def __init__(self, base: torch.Tensor, vocab_size: int,
                 rows: Callable[[list[int]], torch.Tensor],
                 score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.base = base
        self._outside = np.ones(vocab_size, dtype=bool)
        self._outside[base.numpy()] = False
        self._rows_of, self._score = rows, score
        self.clear()

    def clear(self) -> None:
        """Back to the base shortlist (the context is empty)."""
        self.extra: list[int] = []  # the context's tokens outside the base, in its order
        self._scored: set[int] = set()
        self._rows: torch.Tensor | None = None  # [len(extra), H]
        self._order: torch.Tensor | None = None  # base + extra -> ascending ids
        self.ids = self.base

    def read(self, tokens: Sequence[int]) -> None:
        """``tokens`` joined the context: those outside the shortlist join it."""
        room = MAX_EXTRA - len(self.extra)
        if room <= 0 or not tokens:
            return
        ids = np.asarray(tokens, dtype=np.int64)
        outside = ids[self._outside[ids]].tolist()
        new = [t for t in dict.fromkeys(outside) if t not in self._scored][:room]
        if not new:
            return
        rows = self._rows_of(new)
        self._rows = rows if self._rows is None else torch.cat([self._rows, rows])
        self.extra += new
        self._scored.update(new)
        widened = torch.cat([self.base, torch.tensor(self.extra, dtype=self.base.dtype)])
        self._order = torch.argsort(widened)
        self.ids = widened[self._order]

    def holds_any(self, tokens: Sequence[int]) -> bool:
        """Whether one of ``tokens`` is a context token this shortlist scores beyond its base
        (forgetting them changes it)."""
        return bool(self._scored) and any(t in self._scored for t in tokens)

    def logits(self, base_logits: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """Logits [n, len(ids)] over :attr:`ids` from the base head's [n, len(base)] and the
        normed states [n, H] they came from."""
        if self._rows is None:
            return base_logits
        extra = self._score(normed, self._rows)
        return torch.cat([base_logits, extra], -1)[..., self._order]
