"""What the native runner offers beside the runner protocol (models/capabilities.py): its early
exit, its tables, and its layer loop, each a small object over a ``LlamaRunner`` (which
imports this module).

The layer loop is the native runner's forward in pieces, for the methods that run its layers in
an order of their own: a draft model keeping its own cache (``models/llama_drafter.py``), block
diffusion's attention plans (``diffusion/model.py``), LoRA-Drop's skipped layers and LUD's
adapters (``lossy/``), Superposed Decoding's mixed input embeddings. Every piece runs the
runner's own kernels, so a row computed here is the row a forward computes where the plan is
the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode import kernels
from specdecode.errors import require
from specdecode.models.capabilities import EarlyExit, Tables
from specdecode.models.kv_cache import AttentionPlan
from specdecode.models.native_shape import GLOBAL_ROPE
from specdecode.models.packing import PREFILL_BLOCK, SequenceRows, packed_plan
from specdecode.models.weights import as_float


def final_norm(runner, hidden: torch.Tensor) -> torch.Tensor:
    """The model's final norm of float32 ``hidden`` [n, H]: what the LM head reads."""
    return runner._norm(hidden.float(), runner.final_norm)


@torch.inference_mode()
def lm_head(runner, normed: torch.Tensor) -> torch.Tensor:
    """float32 logits [n, V] of the decode head, capped as the model's are."""
    return runner._capped(runner.head(normed.float().contiguous()))


class NativeExit(EarlyExit):
    """Early exit on the native runner: a chain's rows lie past the cache (the verify pass
    overwrites them) and run the first layers of the decode forward."""

    def __init__(self, runner):
        self.runner = runner
        self.num_layers = runner.num_layers

    @property
    def pending_rows(self) -> int:
        return self.runner.pending_rows

    @torch.inference_mode()
    def run_chain(self, tokens: list[int], layer: int, offset: int) -> torch.Tensor:
        cache = self.runner.cache
        cache.check_room(offset + len(tokens), "the draft pass")
        plan = AttentionPlan.chain(cache.length + offset, len(tokens))
        hidden, _ = LayerLoop(self.runner).run(tokens, plan, stop=layer)
        return hidden

    def drop_chain(self) -> None:
        self.runner.cache.drop_uncommitted()

    def norm(self, hidden: torch.Tensor, adapter=None) -> torch.Tensor:
        return final_norm(self.runner, hidden) if adapter is None else adapter(hidden)

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        return lm_head(self.runner, normed)


class NativeTables(Tables):
    def __init__(self, runner):
        self.runner = runner

    def input_embeddings(self) -> torch.Tensor:
        # dequantised for the caller (a drafter sharing it keeps it): the runner holds no copy
        return self.runner.embed.dense()

    def output_embeddings(self) -> torch.Tensor:
        # a file's head is read again when asked for, a dict's kept by reference
        return as_float(self.runner._head_weights[self.runner._head_name])


class LayerLoop:
    """The native runner's forward in pieces. ``cache`` is the runner's; the cache's books (what
    is committed) are the caller's unless a method says otherwise."""

    def __init__(self, runner):
        self.runner = runner
        self.shape = runner.shape
        self.layers = runner.layers
        self.num_layers = runner.num_layers
        #: the raw embedding rows (``rows(tokens)``), before any embedding scale
        self.embedding = runner.embed

    @property
    def cache(self):
        return self.runner.cache

    def run(self, tokens: Sequence[int], plan: AttentionPlan, *, stop: int | None = None,
            capture: tuple[int, ...] = (), prefill: bool = False
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run ``tokens`` where ``plan`` puts them (positions, cache slots written, slots
        attended to) through the first ``stop`` layers (all by default); ``prefill``: the prompt
        layers. The last layer's hidden states [n, hidden], float32, and {layer: its output
        [n, hidden]} for the layers in ``capture``."""
        return self.runner.run_items([SequenceRows(self.cache, tokens, plan, capture)], stop=stop,
                                     prefill=prefill)[0]

    def run_embedded(self, x: torch.Tensor, plan: AttentionPlan
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`run` from input embeddings ``x`` [n, H] float32 (rows of :attr:`embedding`,
        or mixtures of them: Superposed Decoding feeds a weighted sum of several tokens')."""
        rows = SequenceRows(self.cache, [0] * len(x), plan)
        return self.runner.run_items([rows], embedded=x)[0]

    def append(self, tokens: Sequence[int], bulk_rows: int, capture: tuple[int, ...] = ()
               ) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """Run ``tokens`` as a chain after the cache, in blocks of ``PREFILL_BLOCK``, and commit
        them; blocks of ``bulk_rows`` rows or more take the prefill layers. Each block's last
        layer hidden states and those of the ``capture`` layers."""
        tokens = list(tokens)
        cache = self.cache
        require(cache.pending == 0, "tokens appended between forward and commit")
        cache.check_room(len(tokens), f"{len(tokens)} more tokens")
        out = []
        for start in range(0, len(tokens), PREFILL_BLOCK):
            block = tokens[start:start + PREFILL_BLOCK]
            plan = AttentionPlan.chain(cache.length, len(block))
            out.append(self.run(block, plan, capture=capture, prefill=len(block) >= bulk_rows))
            cache.append(len(block))
        return out

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        """[n, H] float32 the first layer's input rows of ``tokens``."""
        x = self.embedding.rows(tokens)
        scale = self.runner.embed_scale
        return x if scale is None else x * scale

    def attention_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """[n, H] what layer ``layer``'s q/k/v projections read of its input rows ``x``."""
        return self.runner._input_norm(x, self.layers[layer].attn_norm)

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, plan: AttentionPlan, first: int, last: int,
                   adapter=None) -> torch.Tensor:
        """The decode layers ``first`` .. ``last - 1`` over rows ``x`` [n, H] (float32, the
        input of layer ``first``) where ``plan`` puts them in the cache: LoRA-Drop skips
        layers, LUD gives some layers' rows another plan. ``adapter(i, layer)``: the layer to
        run instead of layer ``i`` (its linear layers wrapped: LUD's LoRA on its slots' rows);
        with one the layers run through the Python loop, without one through the fused stack
        where there is one."""
        runner = self.runner
        positions, packed = packed_plan([SequenceRows(self.cache, (), plan)])
        if adapter is None and runner._stack is not None:
            cos, sin = runner.rope[GLOBAL_ROPE]
            return runner._stack.forward(x.contiguous(), first, last, packed, cos[positions],
                                         sin[positions], kernels.isa())
        rope = {local: (cos[positions], sin[positions]) for local, (cos, sin) in runner.rope.items()}
        layers = [self.layers[i] if adapter is None else adapter(i, self.layers[i])
                  for i in range(first, last)]
        return runner._layers(x, layers, packed, set(), rope, first)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, V] of the last layer's hidden states [n, H]: the final norm and
        the decode head."""
        return lm_head(self.runner, final_norm(self.runner, hidden))
