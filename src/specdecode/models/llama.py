"""Native runner for Llama-family models: a lean PyTorch forward with a static KV cache.

The architecture is LLaMA's (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation
Language Models"), as ``transformers``' ``modeling_llama`` computes it: RMSNorm, rotary position
embeddings with the checkpoint's rope settings, grouped-query attention, a SwiGLU MLP and a tied
or separate LM head. Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, Granite, OLMo 2 and
SmolLM3 run through the same forward with the pieces they change switched on (q/k/v biases,
q/k norms over each head or over all of q and k, (1 + w) norms, norms after attention and MLP
with or without norms before them, GeGLU, scaled embeddings, residual and logit multipliers,
sliding-window layers with their own rotary base, layers without rotary embedding, a partial
rotary embedding, fused projections split at load, soft-capping of the attention scores, in
the attention kernel, and of the final logits); so do the mixture-of-experts families
(Qwen2-MoE, Qwen3-MoE, gpt-oss: ``models/moe.py``), gpt-oss with its o bias and its attention
sinks (a logit per head in each row's softmax, in the attention kernel):
``models/architectures.py`` holds them as data. The static cache written at explicit positions
follows gpt-fast (pytorch-labs/gpt-fast, model.py); tree attention over a draft follows
SpecInfer (Miao et al. 2023). What this runner adds is *batch invariance*: a token's logits are
bitwise the same whether it is computed alone (``ar``), in a chain or in a 64-node tree, so
every speculative method reproduces this runner's ``ar`` exactly, not just up to rounding.

It holds by construction, on every x86-64 CPU: every operation of a decode or verify forward
that adds numbers up (the linear layers of every weight format, RMSNorm, SwiGLU, attention)
runs in our own kernels (``specdecode/kernels``), where each output element is one thread's
sum in an order fixed by the model's sizes alone; the rest (embedding lookup, residual adds,
rotary products) is elementwise. Attention walks a row's keys in its logical order: positions
before the forward from the cache, then the row's ancestors in depth order (a tree node sees
them in the order ``ar`` will see them after the commit), so the same numbers are added in the
same order. Prompts of the int4 runner go through the same kernels; those of the other formats
through ATen's GEMMs (``quant.LibraryLinear``): every method prefills the same prompt in the
same blocks, so prefill needs determinism, not row invariance.

The runner's jobs, a module each: what the config says (``native_shape``: the shape, the rotary
tables, the cache's size), the layers from a checkpoint's tensors in a weight format
(``native_layers``), many sequences' calls in one forward (``packing``: ``run_packed``), what
some methods read besides the protocol (``layer_loop``: early exit, the tables, the forward in
pieces), and here the runner itself: its constructors, the runner protocol and the forward
math.

Defaults: int4 weights (``DEFAULT_WEIGHTS``: GGUF Q4_1 blocks times int8 activations, the
fastest forward of the four formats; docs/native-runner.md), prompts prefilled through the
same int4 layers (int8 and bf16 through ATen's GEMMs on bf16 copies of the weights, fp32 on
fp32 ones: ``PREFILL_WEIGHTS``); the cache holds ``max_context`` (default min(the model's context,
DEFAULT_MAX_CONTEXT = 4096)) plus ``max_draft`` = 256 rows.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from specdecode import kernels
from specdecode.cache import file_version
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import NOTHING, ForwardOutput, Needs, PrefillCall, Runner, VerifyCall
from specdecode.models.embedding import embedding_table
from specdecode.models.gguf_reader import ROPE_FACTORS
from specdecode.models.kv_cache import BlockedKVCache, SavedRows, held_ids
from specdecode.models.layer_loop import LayerLoop, NativeExit, NativeTables
from specdecode.models.moe import activation_kernel
from specdecode.models.native_layers import Layer, LayerBuilder, _dense_parts, _rows, layer_stack
from specdecode.models.native_shape import (GLOBAL_ROPE, KV_CACHE, LlamaShape, cache_rows,
                                            context_size, kv_cache_bytes, rope_tables)
from specdecode.models.packing import PREFILL_BLOCK, PackedForwards, SequenceRows, packed_plan
from specdecode.models.quant import LibraryLinear, check_format
from specdecode.models.weights import (FileTensors, _linear_for, as_float, check_fits,
                                      resident_bytes)

#: weight format ``make_runner`` picks when none is asked for (see docs/native-runner.md)
DEFAULT_WEIGHTS = "int4"
#: the layers prompts go through, per decode format: ATen's GEMMs in fp32 or bf16, which
#: amortise their weights over many rows better than our dense kernels (fp32 keeps its exact
#: weights), or (None) the decode layers themselves: the int4 and int8 kernels prefill faster
#: than bf16 GEMMs since their passes overlap memory and arithmetic, and need no bf16 copy of
#: the weights (measured in docs/native-runner.md)
PREFILL_WEIGHTS = {"fp32": "fp32", "bf16": "bf16", "int8": None, "int4": None}


def _shortlisted_head(tensors, head: str, head_ids: torch.Tensor | None, requantised: bool):
    """(the rows ``head_ids`` of the LM head ``tensors[head]``, or None without them, the head
    then read only once, by the layers' builder; what the two add to a runner's cost key).
    A drafter's decode head may score a shortlist alone, as in FR-Spec (Zhao et al., 2025):
    its logits then index ``head_ids`` (ascending), not the vocabulary. The rows are floats
    where the runner's layers were ``requantised`` from a file's blocks (``from_gguf``), so the
    shortlist is quantised from them too."""
    tag = ":requantised" if requantised else ""
    if head_ids is None:
        return None, tag
    rows = _rows(tensors[head], head_ids)
    return (as_float(rows) if requantised else rows), f"{tag}:head{len(head_ids)}"


class LlamaRunner(PackedForwards, Runner):
    """Llama forward with a static KV cache, tree attention and a choice of weight formats."""

    name = "native"

    def __init__(self, config, tensors, weights: str = "fp32", max_draft: int = 256,
                 source: str = "", max_context: int | None = None,
                 head_ids: torch.Tensor | None = None, requantised: bool = False):
        """``config``: a transformers ``LlamaConfig``; ``tensors``: a mapping of Hugging Face
        parameter names to float tensors or :class:`Q4Weight` (4-bit GGUF tensors, used as
        they are by int4), such as a dict or a file's :class:`FileTensors` (each read once, made
        a layer and dropped); ``max_context``: positions the KV cache holds (default
        min(the model's, ``DEFAULT_MAX_CONTEXT``)). ``head_ids``, ``requantised``: see
        :func:`_shortlisted_head`."""
        check_format(weights)
        shape = LlamaShape.from_config(config)
        self.shape = shape
        self.weights = weights
        self.source = source
        self.vocab_size = shape.vocab_size
        self.max_context = context_size(shape, max_context, max_draft)
        self.num_layers = shape.num_layers

        missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in tensors]
        require(not missing, f"checkpoint lacks {', '.join(missing)}: not a "
                             f"{shape.arch.model_type} checkpoint")
        # [V, H], a GGUF file's rows read from the file when looked up (models/embedding.py)
        self.embed = embedding_table(tensors, "model.embed_tokens.weight")
        require(self.embed.shape == (shape.vocab_size, shape.hidden_size),
                f"embedding is {self.embed.shape}, config says "
                f"({shape.vocab_size}, {shape.hidden_size})")
        # Gemma: embeddings times sqrt(hidden), as float32 (modeling_gemma3's embed_scale);
        # Granite: times embedding_multiplier
        self.embed_scale = torch.tensor(shape.embed_scale) if shape.embed_scale != 1.0 else None
        build = LayerBuilder(shape, tensors)
        self.final_norm = build.norm_weight("model.norm.weight")
        head = "model.embed_tokens.weight" if shape.tie_embeddings else "lm_head.weight"
        if head not in tensors:  # checkpoints that tie the head without saying so
            head = "model.embed_tokens.weight"
        # cost_tag: what besides its file, format and kernels sets its cost (cost_key)
        shortlist, self.cost_tag = _shortlisted_head(tensors, head, head_ids, requantised)
        self.head, self.layers = build.head_and_layers(
            head, lambda parts: _linear_for(parts, weights), shortlist)
        # draft heads read a shortlist of the head: a file's is read again when asked for, a
        # dict's kept by reference
        self._head_weights = tensors if isinstance(tensors, FileTensors) else {head: tensors[head]}
        self._head_name = head
        # prompts go through PREFILL_WEIGHTS' layers (every prefill is the same computation,
        # so exactness holds either way)
        self.prefill_weights = PREFILL_WEIGHTS[weights]
        if self.prefill_weights is None:
            self.prefill_head, self.prefill_layers = self.head, self.layers
        else:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[self.prefill_weights]
            self.prefill_head, self.prefill_layers = build.head_and_layers(
                head, lambda parts: LibraryLinear(_dense_parts(parts), dtype), shortlist)

        self.capacity = cache_rows(self.max_context, max_draft)
        # rotary tables per kind of layer (GLOBAL_ROPE, LOCAL_ROPE, NO_ROPE); a GGUF file of
        # Llama 3.1+ holds the llama3 scaling as factors its frequencies are divided by
        factors = tensors.get(ROPE_FACTORS)
        self.rope = {kind: rope_tables(shape, config, self.capacity, kind, factors)
                     for kind in {layer.rope for layer in self.layers}}
        self._stack = layer_stack(shape, self.layers)
        self._new_cache()
    def _new_cache(self) -> None:
        """An empty KV cache of this runner's own."""
        shape = self.shape
        self.cache = BlockedKVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                    self.capacity, KV_CACHE[self.weights])
        #: the earlier prefill parts' blocks a later part returns features of
        self._prefill_blocks = []
        #: (tokens, cache, its version) noted by note_held: nothing noted yet
        self._held = (held_ids(()), self.cache, -1)

    # ---- constructors ---------------------------------------------------------------------

    @classmethod
    def from_transformers(cls, model, weights: str = "fp32", gguf_path=None,
                          **kwargs) -> LlamaRunner:
        """From a loaded ``transformers`` model of a supported architecture (its weights are
        copied as float32). ``gguf_path``: the GGUF file the model was loaded from; with int4
        weights its 4-bit tensors (Q4_0, Q4_1, Q4_K) are taken from the file as they are, not
        re-quantised from their dequantised values."""
        from specdecode.models.gguf_reader import read_gguf

        require(hasattr(model, "config") and hasattr(model, "state_dict"),
                f"expected a transformers causal LM, got {type(model).__name__}")
        LlamaShape.from_config(model.config)  # reject other architectures before copying
        tensors = {k: v.detach().float() for k, v in model.state_dict().items()}
        if gguf_path is not None and weights == "int4":
            blocks = read_gguf(gguf_path, blocks_only=True)[1]
            unknown = sorted(set(blocks) - set(tensors))
            require(not unknown, f"{gguf_path} is not the file this model was loaded from "
                                 f"(it has {', '.join(unknown[:3])})")
            tensors.update(blocks)
        return cls(model.config, tensors, weights, source=type(model).__name__, **kwargs)

    @classmethod
    def from_safetensors(cls, path, weights: str = "fp32", **kwargs) -> LlamaRunner:
        """From a Hugging Face checkpoint folder (config.json + *.safetensors)."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        path = Path(path)
        files = sorted(path.glob("*.safetensors"))
        require(path.is_dir() and (path / "config.json").is_file() and bool(files),
                f"{path} is not a Hugging Face checkpoint folder (config.json + *.safetensors)")
        try:
            config = AutoConfig.from_pretrained(path)
            tensors = {}
            for file in files:
                tensors.update(load_file(file))
        except (OSError, ValueError, json.JSONDecodeError) as exc:
            raise SpecDecodeError(f"cannot read checkpoint {path}: {exc}") from None
        return cls(config, tensors, weights, source=str(path), **kwargs)

    @classmethod
    def from_gguf(cls, path, weights: str = "fp32", max_context: int | None = None,
                  max_draft: int = 256, available: int | None = None,
                  requantise: bool = False, head_ids: torch.Tensor | None = None,
                  **kwargs) -> LlamaRunner:
        """From a GGUF file read directly, one tensor at a time (``models/weights.py``): 4-bit
        tensors stay 4-bit for int4 weights, the rest are dequantised as ``transformers`` does
        (``requantise``: every layer's tensors dequantised, then quantised to ``weights``, the
        LM head read in its blocks and only ``head_ids``' rows dequantised: a draft's numbers
        never change the output, and int4 streams fewer bytes than a file's 5- to 8-bit
        blocks). Refuses, naming the sizes, a file whose weights in ``weights`` and KV
        cache would not fit in the available memory (``available``: bytes, default what the
        kernel reports), before anything is allocated."""
        from specdecode.models.gguf_reader import GGUFFile

        check_format(weights)
        file = GGUFFile(path)
        file.check_native()
        shape = LlamaShape.from_config(file.config)
        context = context_size(shape, max_context, max_draft)
        kv = kv_cache_bytes(shape, cache_rows(context, max_draft), weights)
        check_fits(f"{Path(path).name} on the native runner ({weights})",
                   {f"weights {weights}": resident_bytes(file, weights),
                    f"KV cache of {context} positions": kv}, available,
                   hint="use a smaller --max-context, the int4 format (--weights int4) or a "
                        "machine with more memory")
        blocks = weights in ("int4", "int8") and not requantise
        return cls(file.config, FileTensors(file, blocks, requantise), weights,
                   source=str(path), max_context=context, max_draft=max_draft,
                   head_ids=head_ids, requantised=requantise, **kwargs)

    def head_rows(self, ids: Sequence[int]) -> torch.Tensor:
        """float32 [n, H]: the LM head's rows of the vocabulary ``ids``, as the whole head's
        dequantisation gives them (a file's read from its blocks: what a drafter's shortlist
        adds for a request, drafting/context_shortlist.py)."""
        tied = self._head_name == "model.embed_tokens.weight"
        return (self.embed if tied else self._head_table).rows(ids)

    @functools.cached_property
    def _head_table(self):
        """An untied head's rows reader (:meth:`head_rows`), made when first asked for."""
        return embedding_table(self._head_weights, self._head_name)

    def replica(self) -> LlamaRunner:
        twin = copy.copy(self)  # weights, rope tables: shared, read-only
        twin._new_cache()
        return twin

    # ---- the runner protocol --------------------------------------------------------------

    @property
    def cache_len(self) -> int:
        return self.cache.length

    @property
    def kv_bytes(self) -> int:
        return self.cache.nbytes

    def fingerprint(self) -> str:
        # The same string the hf runner gives for the same weights: artifacts trained against
        # one runner serve the other (the embedding table is float32 in every weight format).
        rows = self.embed.shape[0]
        sample = self.embed.rows(range(0, rows, max(1, rows // 64)))[:, :8].double().sum().item()
        return f"hf:{self.shape.arch.model_type}:{self.vocab_size}:{self.num_layers}:{sample:.6e}"

    def cost_key(self) -> str | None:
        path = Path(self.source) if self.source else None
        if path is None or not path.is_file():
            return None
        resolved, size, mtime_ns = file_version(path)
        # and the kernels it runs on: a change to them (a layout's bytes) re-measures the curve
        return (f"native:{resolved}:{size}:{mtime_ns}:{self.weights}{self.cost_tag}:"
                f"{kernels.build_id()}")

    @property
    def pending_rows(self) -> int:
        return self.cache.pending

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int], needs: Needs = NOTHING) -> ForwardOutput:
        return self.prefill_part(ids, 0, len(ids), needs)

    #: parts on block boundaries run the very blocks one prefill runs
    prefill_granule = PREFILL_BLOCK

    def prefill_part(self, ids: Sequence[int], start: int, stop: int,
                     needs: Needs = NOTHING) -> ForwardOutput | None:
        return self.run_packed([(self, PrefillCall(tuple(ids), start, stop, needs))])[0]

    def forward(self, root: int, draft: Draft, needs: Needs = NOTHING) -> ForwardOutput:
        return self.run_packed([(self, VerifyCall(root, draft, needs))])[0]

    @property
    def reuses_prefix(self) -> bool:
        # int4 and int8 prompts run the decode layers: a row is the same bits in a prompt block
        # or a verify step; fp32 and bf16 prompts run ATen's GEMMs, whose rows are not
        return self.prefill_layers is self.layers

    def keep_prefix(self, length: int) -> None:
        require(self.reuses_prefix and self.cache.pending == 0,
                f"the {self.weights} runner's prompts run other layers than its decode steps: "
                "an earlier prompt's rows are not what a prefill writes")
        self.cache.rewind(length)
        self._prefill_blocks = []

    def saved_rows(self, length: int) -> SavedRows:
        return self.cache.saved_rows(length)

    def load_rows(self, saved: SavedRows, length: int) -> None:
        self.keep_prefix(0)
        self.cache.load_rows(saved, length)

    def note_held(self, ids: Sequence[int]) -> None:
        self._held = (held_ids(ids[:self.cache.length]), self.cache, self.cache.version)

    def held_tokens(self) -> np.ndarray:
        ids, cache, version = self._held
        unchanged = cache is self.cache and version == cache.version and cache.pending == 0
        return ids if unchanged and self.reuses_prefix else held_ids(())

    @torch.inference_mode()
    def commit(self, accepted: Sequence[int]) -> None:
        self.cache.commit(accepted)

    # ---- what some methods read of the target (models/capabilities.py, models/layer_loop.py)

    @property
    def early_exit(self) -> NativeExit:
        return NativeExit(self)

    @property
    def tables(self) -> NativeTables:
        return NativeTables(self)

    @property
    def layer_loop(self) -> LayerLoop:
        """The forward in pieces, for methods that run the layers in an order of their own."""
        return LayerLoop(self)

    # ---- the model ------------------------------------------------------------------------

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.shape.logit_divisor != 1.0:  # Granite's logits_scaling
            logits = logits / self.shape.logit_divisor
        cap = self.shape.logit_softcap
        return kernels.softcap(logits, cap) if cap else logits

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x.contiguous(), weight, self.shape.rms_eps)

    def _head_norms(self, qkv: torch.Tensor, layer: Layer) -> torch.Tensor:
        """qkv [n, (H + 2 KH) D] with every head of q and of k RMS-normalised over D (OLMo 2:
        the whole of q and of k)."""
        s = self.shape
        n, d = len(qkv), s.head_dim
        q_end, k_end = s.num_heads * d, (s.num_heads + s.num_kv_heads) * d
        qd, kd = (q_end, k_end - q_end) if s.arch.qk_norm_whole else (d, d)
        q = self._norm(qkv[:, :q_end].reshape(-1, qd), layer.q_norm)  # [n H, D] or [n, H D]
        k = self._norm(qkv[:, q_end:k_end].reshape(-1, kd), layer.k_norm)  # [n KH, D] or [n, KH D]
        return torch.cat([q.view(n, -1), k.view(n, -1), qkv[:, k_end:]], 1)

    def _input_norm(self, x: torch.Tensor, weight) -> torch.Tensor:
        """``x`` normed by ``weight``, or ``x`` itself where the layer has no such norm (OLMo 2
        norms only after attention and the MLP)."""
        return x if weight is None else self._norm(x, weight)

    def _residual(self, linear, h: torch.Tensor, x: torch.Tensor, post_norm) -> torch.Tensor:
        """x + linear(h), with the output normed first where the architecture says so (the add
        is folded into the linear layer's kernel otherwise)."""
        return linear(h, x) if post_norm is None else x + self._norm(linear(h), post_norm)

    def run_items(self, items: Sequence[SequenceRows], *, stop: int | None = None,
                  prefill: bool = False, embedded: torch.Tensor | None = None
                  ) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """:meth:`run` for several sequences' rows in one forward, each item on its own cache
        and plan: embeddings, norms and every linear layer over all items' rows at once (the
        kernels are row invariant: a row's result does not depend on the rows beside it),
        rotary embedding, the cache write and attention per item (one kernel call for all
        items). Per item, what :meth:`run` returns for it alone. ``embedded``: the input rows
        [n, H] instead of the tokens' embeddings."""
        layers = self.prefill_layers if prefill else self.layers
        stop = len(layers) if stop is None else stop
        tokens = [token for item in items for token in item.tokens]
        x = self.embed.rows(tokens) if embedded is None else embedded  # [n, H] float32
        if self.embed_scale is not None:
            x = x * self.embed_scale
        positions, plan = packed_plan(items)
        rope = {local: (cos[positions], sin[positions]) for local, (cos, sin) in self.rope.items()}
        capture = {layer for item in items for layer in item.capture if 0 < layer <= stop}
        if self._stack is not None and layers is self.layers:
            x, captured = self._stacked(x, plan, stop, capture, rope[GLOBAL_ROPE])
        else:
            x, captured = self._layers(x, layers[:stop], plan, capture, rope)
        bounds = [0]
        for item in items:
            bounds.append(bounds[-1] + len(item.tokens))
        return [(x[a:b], {layer: captured[layer][a:b] for layer in item.capture if layer in captured})
                for item, a, b in zip(items, bounds, bounds[1:])]

    def _layers(self, x: torch.Tensor, layers: list[Layer], plan, capture: set[int], rope,
                first: int = 0) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """run_items' layer loop in Python (every format and architecture); ``layers`` are the
        model's layers from ``first`` on."""
        s = self.shape
        activation = activation_kernel(s.activation)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(layers, first):
            qkv = layer.qkv(self._input_norm(x, layer.attn_norm))  # [n, (H + 2 KH) D]
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            if layer.q_norm is not None:
                qkv = self._head_norms(qkv, layer)
            cos, sin = rope[layer.rope]  # [n, D]
            q = plan.rope_store(i, qkv, cos, sin, s.num_heads, s.num_kv_heads, kernels.isa())  # [n, H, D]
            attended = plan.attention(i, q, layer.window, s.attn_softcap, kernels.isa(),
                                      layer.sinks)  # [n, H D]
            x = self._residual(layer.o, attended, x, layer.post_attn_norm)
            if layer.o_bias is not None:
                x = x + layer.o_bias
            h = self._input_norm(x, layer.mlp_norm)
            if layer.moe is not None:
                moe = layer.moe(h)
                x = x + (moe if layer.post_mlp_norm is None else self._norm(moe, layer.post_mlp_norm))
            else:
                x = self._residual(layer.down, activation(layer.gate_up(h)), x, layer.post_mlp_norm)
            if i + 1 in capture:
                captured[i + 1] = x.clone()
        return x, captured

    def _stacked(self, x: torch.Tensor, plan, stop: int, capture: set[int], rope
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """run_items' layer loop through the LayerStack: one call, or one a captured layer."""
        cos, sin = rope
        start = 0
        captured = {}
        for end in sorted(capture | {stop}):
            x = self._stack.forward(x, start, end, plan, cos, sin, kernels.isa())
            if end in capture:
                captured[end] = x.clone()
            start = end
        return x, captured
