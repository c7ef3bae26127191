"""Draft caches: a drafter and its own KV cache behind one protocol.

A draft cache keeps the committed tokens it has read (a prefix of the request's context) and,
while a step drafts, *tree rows* (draft tokens, each attending to the committed prefix and its
ancestors):

    logits, hidden = cache.catch_up(context)   # read what is new; logits after the root
    logits, hidden = cache.feed(tokens, parents)   # tree rows (parents: tree rows, -1 = root)
    cache.prune(path_rows)                     # keep the accepted path's rows, drop the rest

:class:`DraftLM` runs any ``transformers`` causal LM (a 4-D mask over a ``DynamicCache``);
:class:`NativeDraftLM` runs a Llama-family draft on the native runner
(:class:`~specdecode.models.llama_drafter.LlamaDrafter`); the head proposers' cache
(heads/drafter.py) feeds a head network with the target's features instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdecode.drafting.context_shortlist import ContextShortlist
from specdecode.models.kv_cache import DynamicKVCache, SavedRows

if TYPE_CHECKING:
    from specdecode.models.llama_drafter import LlamaDrafter


#: committed tokens a step right after a draft reads (the bonus token, and the chain's last
#: draft token where it was accepted, which the draft did not read): the drafting seconds the
#: sizer learns (specdecode/sizing.py) hold them already
STEADY_ROWS = 2


class DraftCache:
    """What both draft caches share: the shortlist, and finding the cached prefix to reuse."""

    head_ids: torch.Tensor | None
    vocab_size: int
    hidden_size: int
    tokens: list[int]  # committed tokens whose KV rows are cached, in order

    def draft_seconds(self, context: Sequence[int], cold: bool = False) -> tuple[float, float]:
        """The seconds :meth:`catch_up` would take past a step's usual ``STEADY_ROWS`` (``cold``:
        had the cache held nothing), and a draft level's (a forward of one row); (0, 0) where
        the draft's cost is not known (a ``transformers`` draft)."""
        return 0.0, 0.0

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Shortlist logits [n, V'] -> vocabulary logits [n, V] (-inf off the shortlist)."""
        if self.head_ids is None:
            return logits
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.head_ids] = logits
        return full

    def _reusable(self, context: Sequence[int]) -> int:
        """How many cached tokens ``context`` starts with (at most all but its last, whose
        logits the caller needs)."""
        limit = min(len(self.tokens), len(context) - 1)
        if self.tokens[:limit] == list(context[:limit]):
            return limit
        n = 0
        while n < limit and self.tokens[n] == context[n]:
            n += 1
        return n


class DraftLM(DraftCache):
    """A draft model with its own KV cache: committed tokens (a prefix of the request's
    context) plus, while drafting, *tree rows* (draft tokens, each attending to the committed
    prefix and its ancestors). After verification :meth:`prune` keeps the accepted path's rows
    as committed tokens and drops the others, so nothing accepted is computed twice."""

    def __init__(self, model: torch.nn.Module, head_ids: torch.Tensor | None = None):
        self.model = model.eval()
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.head_ids = head_ids
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.hidden_size = int(model.config.hidden_size)
        self.dtype = next(model.parameters()).dtype
        self.reset()

    def reset(self) -> None:
        self.kv = DynamicKVCache()
        self.tokens: list[int] = []
        self._clear_tree()

    def _clear_tree(self) -> None:
        self.tree_tokens: list[int] = []
        self.tree_parents: list[int] = []  # tree row of the parent, -1 = last committed token
        self.tree_depth: list[int] = []
        self.ancestors = torch.zeros(0, 0, dtype=torch.bool)  # [S, S] ancestor-or-self

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.inference_mode()
    def catch_up(self, context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache every token of ``context``; return the logits [V'] and the last hidden state
        [H] after its last token. Reuses the longest cached prefix (from the previous step or
        an earlier request with the same prompt start)."""
        self.prune([])
        n = self._reusable(context)
        if n < len(self.tokens):
            self.kv.rewind(n)
            del self.tokens[n:]
        new = list(context[n:])
        out = self.base(input_ids=torch.tensor([new]), past_key_values=self.kv.model_cache,
                        use_cache=True, position_ids=torch.arange(n, n + len(new)).unsqueeze(0))
        self.tokens.extend(new)
        self.kv.append(len(new))
        hidden = out.last_hidden_state[0, -1]
        return self._logits(hidden[None])[0], hidden

    @torch.inference_mode()
    def feed(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tree rows: ``tokens[j]`` is a child of tree row ``parents[j]`` (-1 = the last
        committed token). Returns logits [k, V'] and hidden states [k, H] after each."""
        committed, old, k = len(self.tokens), len(self.tree_tokens), len(tokens)
        ancestors = torch.zeros(old + k, old + k, dtype=torch.bool)
        ancestors[:old, :old] = self.ancestors
        depth = []
        for j, p in enumerate(parents):
            if p >= 0:
                ancestors[old + j, :old] = self.ancestors[p]
            ancestors[old + j, old + j] = True
            depth.append(1 if p < 0 else self.tree_depth[p] + 1)
        allowed = torch.ones(k, committed + old + k, dtype=torch.bool)
        allowed[:, committed:] = ancestors[old:]
        mask = torch.zeros(1, 1, k, committed + old + k, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        positions = torch.tensor([committed - 1 + d for d in depth]).unsqueeze(0)
        out = self.base(input_ids=torch.tensor([list(tokens)]), position_ids=positions,
                        attention_mask=mask, past_key_values=self.kv.model_cache, use_cache=True)
        self.tree_tokens.extend(tokens)
        self.tree_parents.extend(parents)
        self.tree_depth.extend(depth)
        self.ancestors = ancestors
        hidden = out.last_hidden_state[0]
        return self._logits(hidden), hidden

    def prune(self, path_rows: Sequence[int]) -> None:
        """Keep the tree rows ``path_rows`` (a root-to-node path, in order) as committed
        tokens; drop every other tree row."""
        if not self.tree_tokens:
            return
        self.kv.keep_tree(path_rows)
        self.tokens.extend(self.tree_tokens[r] for r in path_rows)
        self._clear_tree()


class NativeDraftLM(DraftCache):
    """The draft on the native runner (models/llama.py; int4 by default, whose one-token
    forward is several times cheaper than ``transformers'``). The drafter's cache holds the
    committed tokens; this step's draft rows (a chain or a tree, read a few nodes a call) lie
    after them (:meth:`LlamaDrafter.read_tree`), and :meth:`prune` keeps the accepted path's
    rows, so accepted draft tokens are not computed again."""

    def __init__(self, runner: LlamaDrafter, head_ids: torch.Tensor | None = None,
                 widen: bool = False):
        """``head_ids``: the shortlist the runner's head scores (None: the vocabulary);
        ``widen``: it also scores the context's tokens outside it, from the head's rows
        (drafting/context_shortlist.py)."""
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.hidden_size = runner.hidden_size
        self.shortlist = None if head_ids is None else ContextShortlist(
            head_ids, self.vocab_size, runner.head_rows, runner.score)
        self.widen = widen and head_ids is not None
        self.row_costs = None  # the draft runner's curve, once drafting is priced
        self.reset()

    @property
    def head_ids(self) -> torch.Tensor | None:
        """The ids this draft's logits score, ascending (None: the whole vocabulary)."""
        return None if self.shortlist is None else self.shortlist.ids

    def reset(self) -> None:
        self.runner.rewind(0)
        self.tokens: list[int] = []
        if self.shortlist is not None:
            self.shortlist.clear()
        self._clear_tree()

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        logits = self.runner.lm_head(normed)
        return logits if self.shortlist is None else self.shortlist.logits(logits, normed)

    def _clear_tree(self) -> None:
        self.tree_tokens: list[int] = []
        self.tree_paths: list[list[int]] = []  # each row's ancestors, root to parent

    def draft_seconds(self, context: Sequence[int], cold: bool = False) -> tuple[float, float]:
        """By the draft runner's row-cost curve (models/row_costs.py; measured the first time,
        once per draft file, format, CPU and thread count). The curve's forwards compute every
        row's logits, where a catch-up computes the last one's: a long catch-up is priced
        somewhat high."""
        if self.row_costs is None:
            from specdecode.estimates import RowCosts
            from specdecode.models.row_costs import cached_row_costs

            self.row_costs = RowCosts(cached_row_costs(self.runner.runner))
        costs = self.row_costs
        rows = len(context) - (0 if cold else self._reusable(context))
        behind = costs(rows) - costs(STEADY_ROWS) if rows > STEADY_ROWS else 0.0
        return max(0.0, behind), costs(1)

    def catch_up(self, context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`DraftLM.catch_up`."""
        self.prune([])
        n = self._reusable(context)
        if self.widen and self.shortlist.holds_any(self.tokens[n:]):
            # the scored tokens are the kept context's alone (a seeded request repeats)
            self.shortlist.clear()
            self.shortlist.read(self.tokens[:n])
        del self.tokens[n:]
        self.runner.rewind(n)
        hidden = self.runner.extend(context[n:])[-1:]
        self.tokens.extend(context[n:])
        if self.widen:
            self.shortlist.read(context[n:])
        return self._logits(hidden)[0], hidden[0]

    def feed(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`DraftLM.feed`; a parent may also be a row of this same call (a whole
        tree in one forward)."""
        paths = list(self.tree_paths)
        for p in parents:
            paths.append([] if p < 0 else paths[p] + [p])
        paths = paths[len(self.tree_paths):]
        hidden = self.runner.read_tree(tokens, paths, len(self.tree_tokens))
        self.tree_tokens.extend(tokens)
        self.tree_paths.extend(paths)
        return self._logits(hidden), hidden

    def prune(self, path_rows: Sequence[int]) -> None:
        """As :meth:`DraftLM.prune`."""
        if self.tree_tokens:
            self.runner.keep_tree(path_rows)
            self.tokens.extend(self.tree_tokens[r] for r in path_rows)
        self._clear_tree()

    def kept_rows(self) -> tuple[list[int], SavedRows]:
        """The committed tokens and a copy of their rows (for a prompt cache file)."""
        self.prune([])
        return list(self.tokens), self.runner.runner.saved_rows(len(self.tokens))

    def hold_rows(self, ids: Sequence[int], rows: SavedRows) -> int:
        """Hold ``rows`` of the tokens ``ids`` (:meth:`kept_rows`' of this draft, in an earlier
        process) as the committed tokens, as if it had read them: the next :meth:`catch_up`
        reads only what follows. The tokens held (at most the runner's positions)."""
        self.reset()
        length = min(len(ids), self.runner.runner.max_context)
        self.runner.runner.load_rows(rows, length)
        self.tokens = [int(t) for t in ids[:length]]
        if self.widen:
            self.shortlist.read(self.tokens)
        return length
