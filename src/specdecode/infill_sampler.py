"""llama.cpp's ``infill`` sampler: the cut of the candidates that code-completion plugins
(llama.vim, llama.vscode) put in llama-server's chain after top-k and top-p (``"samplers":
["top_k", "top_p", "infill"]``); llama.cpp's ``llama_sampler_infill_apply``
(src/llama-sampler.cpp), read and written again here.

On the candidates the cuts before it leave, their probabilities renormalised over them and
taken from the most likely down:

1. if the ends of generation hold enough of the mass (3 x their mass x the number of
   candidates above the text tokens' mass), only the ends stay;
2. otherwise a token whose text begins another candidate's text and the other are merged: the
   more likely of the two takes both probabilities, the other is dropped;
3. text tokens below 0.2 are dropped, and if no text token is left the answer ends (the
   model's end token is the only candidate);
4. what is left renormalised, text tokens below 1 / (text tokens left + 1) are dropped too.

The token is then drawn from the original probabilities of the survivors: llama.cpp's last
sampler reads the logits again, so the merged probabilities decide only what survives. The
cut is a function of a node's logits alone, like top-p, so every method samples from it
exactly (:func:`specdecode.sampling.filtered_probs` applies it after top-k, top-p and min-p).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: llama.cpp's threshold for a text token after the merge
TEXT_FLOOR = 0.2
#: the most candidates the cut takes (it compares every pair): top-k at most this
MAX_CANDIDATES = 256


@dataclass(frozen=True, eq=False)
class InfillSampler:
    """The cut for one model: ``pieces`` maps a token id to the bytes of its text (a special
    token's are empty: it merges with none), ``ends`` holds the tokens that end generation, and
    ``end`` is the token an answer ends with where no text token survives."""

    pieces: Sequence[bytes]
    ends: frozenset[int]
    end: int

    def cut(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs`` [V] (zero outside the candidates) with the dropped candidates zeroed
        (not renormalised), or the end token alone."""
        ids = probs.nonzero().flatten()
        values = probs[ids].double()
        order = torch.argsort(values, descending=True, stable=True)
        ids, values = ids[order].tolist(), (values[order] / values.sum()).tolist()
        kept = self._kept(ids, values)
        out = torch.zeros_like(probs)
        if kept:
            index = torch.tensor(kept)
            out[index] = probs[index]
        else:
            out[self.end] = 1.0
        return out

    def _kept(self, ids: list[int], probs: list[float]) -> list[int]:
        """The surviving token ids among ``ids`` (most likely first, ``probs`` summing to 1);
        none: the answer ends."""
        ending = [token in self.ends for token in ids]
        end_mass = sum(p for p, e in zip(probs, ending) if e)
        if 3 * end_mass * len(ids) > 1.0 - end_mass:
            return [token for token, e in zip(ids, ending) if e]
        merged, alive = self._merged(ids, probs)
        first = [i for i in range(len(ids)) if ending[i] or merged[i] >= TEXT_FLOOR]
        text = sum(not ending[i] for i in first)
        if text == 0:
            return []
        total = sum(merged[i] for i in first)
        floor = 1.0 / (text + 1)
        return [ids[i] for i in first
                if alive[i] and (ending[i] or merged[i] / total >= floor)]

    def _merged(self, ids: list[int], probs: list[float]) -> tuple[list[float], list[bool]]:
        """Each candidate's probability after the merge of tokens whose text begins another's,
        in llama.cpp's order (each candidate from the most likely, against every other in
        turn), and whether it survived the merge."""
        pieces = [self.pieces[t] if t < len(self.pieces) else b"" for t in ids]
        merged, alive = list(probs), [True] * len(ids)
        for i, head in enumerate(pieces):
            if not head:
                continue
            for j, piece in enumerate(pieces):
                if not alive[i]:
                    break
                if j == i or not alive[j] or not piece.startswith(head):
                    continue
                keep, drop = (j, i) if merged[j] > merged[i] else (i, j)
                merged[keep] += merged[drop]
                merged[drop], alive[drop] = 0.0, False
        return merged, alive
