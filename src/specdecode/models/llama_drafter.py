"""The native runner as a drafter: its forward and KV cache behind the drafting verbs.

A draft model (``draft_model``, ``dyspec``) keeps every token it has read in its cache and reads
each step's draft after them: a chain, or a tree a few nodes a call (:meth:`read_tree`), whose
rows attend to their ancestors through the same slot tables as the target's verify pass
(``AttentionPlan.tree_rows``). :meth:`keep_tree` keeps the accepted path's rows, so accepted
draft tokens are not computed again; :meth:`rewind` forgets a suffix. Nothing a drafter computes
must match another pass bit for bit, so blocks of ``BULK_ROWS`` or more take the prefill layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.errors import require
from specdecode.models.kv_cache import AttentionPlan
from specdecode.models.layer_loop import final_norm, lm_head
from specdecode.models.llama import LlamaRunner

#: ``extend`` runs blocks of at least this many rows (a prompt) through the prefill layers
BULK_ROWS = 16


class LlamaDrafter:
    """Drafting verbs over a :class:`LlamaRunner`'s forward and cache (it owns the runner)."""

    def __init__(self, runner: LlamaRunner):
        self.runner = runner
        self.loop = runner.layer_loop
        self.vocab_size = runner.vocab_size
        self.hidden_size = runner.shape.hidden_size

    @property
    def cache(self):
        return self.runner.cache

    @torch.inference_mode()
    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` to the cache as read tokens; their hidden states after the final
        norm [n, H], float32."""
        hidden = [block for block, _ in self.loop.append(tokens, BULK_ROWS)]
        return final_norm(self.runner, torch.cat(hidden))

    @torch.inference_mode()
    def read_tree(self, tokens: Sequence[int], paths: Sequence[Sequence[int]], start: int) -> torch.Tensor:
        """Read draft-tree rows after the cache without keeping them: row ``start + j`` holds
        ``tokens[j]``, whose ancestors are the tree rows ``paths[j]`` (root to parent, all
        below ``start + j``; empty: a child of the last cached token). A row attends to every
        cached token, its ancestors and itself. Their hidden states after the final norm [n, H];
        :meth:`keep_tree` keeps a path."""
        tokens = list(tokens)
        require(self.cache.pending == 0, "read_tree called between forward and commit")
        self.cache.check_room(start + len(tokens), f"a tree of {start + len(tokens)} rows")
        plan = AttentionPlan.tree_rows(self.cache.length, start, paths)
        hidden, _ = self.loop.run(tokens, plan)
        return final_norm(self.runner, hidden)

    @torch.inference_mode()
    def keep_tree(self, rows: Sequence[int]) -> None:
        """Keep the tree rows ``rows`` (a root-to-node path, in order) as cached tokens after
        the cache; the other tree rows are forgotten."""
        self.cache.keep_tree(rows)

    def rewind(self, length: int) -> None:
        """Forget every cached token from position ``length`` on."""
        self.cache.rewind(length)

    def lm_head(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, V] from normed states [n, H]."""
        return lm_head(self.runner, normed)

    def head_rows(self, ids: Sequence[int]) -> torch.Tensor:
        """float32 [n, H]: the LM head's rows of the vocabulary ``ids`` (see
        :meth:`LlamaRunner.head_rows`)."""
        return self.runner.head_rows(ids)

    @torch.inference_mode()
    def score(self, normed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, len(rows)] of normed states [n, H] against head rows, capped and
        scaled as :meth:`lm_head`'s."""
        return self.runner._capped(normed.float() @ rows.T)
