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
``models/architectures.py`` holds them as data. Rope scaling comes from the config through
transformers' own initialisers (llama3, linear, yarn; longrope's short factors, or its long
ones for a cache past original_max_position_embeddings), or from a GGUF file's rope_freqs
factors (Llama 3.1+), which the frequencies are divided by. The static cache written at
explicit positions follows gpt-fast (pytorch-labs/gpt-fast, model.py); tree attention over a
draft follows SpecInfer (Miao et al. 2023). What this file adds is *batch
invariance*: a token's logits are bitwise the same whether it is computed alone (``ar``), in a
chain or in a 64-node tree, so every speculative method reproduces this runner's ``ar``
exactly, not just up to rounding.

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

Row invariance also lets one forward serve many sequences (``run_packed``, as a server decodes
its users together; continuous batching, Yu et al. 2022, "Orca"): each sequence is a
``replica()`` with a cache of its own, the linear layers run over every sequence's rows at once
(their weights read once), and rotary embedding, the cache write and attention run per
sequence on its cache, so each sequence's logits are bitwise what its own forward gives.

Defaults: int4 weights (``DEFAULT_WEIGHTS``: GGUF Q4_1 blocks times int8 activations, the
fastest forward of the four formats; docs/native-runner.md), prompts prefilled through the
same int4 layers (int8 and bf16 through ATen's GEMMs on bf16 copies of the weights, fp32 on
fp32 ones: ``PREFILL_WEIGHTS``); the cache holds ``max_context`` (default min(the model's context,
DEFAULT_MAX_CONTEXT = 4096)) plus ``max_draft`` = 256 rows.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode import kernels
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError, require
from specdecode.models.architectures import ACTIVATIONS, ARCHITECTURES, Architecture
from specdecode.models.base import (NOTHING, Call, ForwardOutput, Needs, PrefillCall, Runner,
                                    VerifyCall)
from specdecode.models.embedding import embedding_table
from specdecode.models.gguf_reader import ROPE_FACTORS, Q4Blocks
from specdecode.models.int8_blocks import Int8BlockWeight
from specdecode.models.kv_cache import KEY_BLOCK, AttentionPlan, BlockedKVCache, SavedRows
from specdecode.models.moe import MoEMLP, MoEShape, activation_kernel, unstacked_experts
from specdecode.models.quant import INT4_GROUP, LibraryLinear, Q4Weight, check_format
from specdecode.models.weights import (FileTensors, _linear_for, as_float, check_fits,
                                        resident_bytes, return_freed_memory)

#: prefill runs prompts in blocks of this many rows (bounds the attention score buffer)
PREFILL_BLOCK = 128
#: architectures (transformers ``model_type``) this runner runs
SUPPORTED = tuple(ARCHITECTURES)
#: weight format ``make_runner`` picks when none is asked for (see docs/native-runner.md)
DEFAULT_WEIGHTS = "int4"
#: the layers prompts go through, per decode format: ATen's GEMMs in fp32 or bf16, which
#: amortise their weights over many rows better than our dense kernels (fp32 keeps its exact
#: weights), or (None) the decode layers themselves: the int4 and int8 kernels prefill faster
#: than bf16 GEMMs since their passes overlap memory and arithmetic, and need no bf16 copy of
#: the weights (measured in docs/native-runner.md)
PREFILL_WEIGHTS = {"fp32": "fp32", "bf16": "bf16", "int8": None, "int4": None}
#: the KV cache's precision per weight format: fp32 keeps transformers' float32 cache; the
#: others store bfloat16 (rounded once when written, read exactly), which halves what attention
#: reads: past ~1,600 positions a float32 cache is more bytes a token than the int4 weights
KV_CACHE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16,
            "int4": torch.bfloat16}
#: positions the KV cache holds when none is asked for (a file may declare 131072: its cache
#: would take more memory than its weights); ``max_context`` asks for more, up to the file's
DEFAULT_MAX_CONTEXT = 4096
#: rope types whose frequencies do not depend on the sequence length, and longrope (Phi-3),
#: whose short or long factors the runner picks once, by its cache's length
_STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")
#: the rotary tables of a layer: the global ones, the sliding-window layers' own (Gemma 3),
#: or none (cos 1, sin 0: SmolLM3's layers without rotary embedding)
GLOBAL_ROPE, LOCAL_ROPE, NO_ROPE = "global", "local", "none"


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_context: int
    tie_embeddings: bool
    arch: Architecture
    #: the MLP gate's activation (transformers' name)
    activation: str
    #: per layer: the sliding window (positions a row sees, itself included), 0 = all
    windows: tuple[int, ...]
    #: attention scores are q.k times this (folded into q)
    query_scale: float
    #: final logits are cap * tanh(logits / cap); 0 = none
    logit_softcap: float
    #: attention scores are cap * tanh(scores / cap) before the softmax, in the attention
    #: kernel (Gemma 2: 50); 0 = none
    attn_softcap: float
    #: mixture-of-experts sizes; None: every layer's MLP is dense
    moe: MoEShape | None = None
    #: dimensions of each head the rotary embedding turns (partial_rotary_factor: Phi-4-mini
    #: turns 96 of 128); the others pass through
    rotary_dim: int = 0
    #: per layer: whether it has a rotary embedding (SmolLM3: every fourth has none)
    rotary: tuple[bool, ...] = ()
    #: positions longrope's short factors serve (Phi-3: original_max_position_embeddings);
    #: 0 = a rope without such a limit
    rope_limit: int = 0
    #: embeddings are multiplied by this (Gemma: sqrt(hidden), Granite: embedding_multiplier)
    embed_scale: float = 1.0
    #: each residual branch (attention, MLP) is multiplied by this (Granite)
    residual_scale: float = 1.0
    #: logits are divided by this (Granite's logits_scaling)
    logit_divisor: float = 1.0

    @property
    def fits_int4(self) -> bool:
        """Whether every matrix's input size is a whole number of int4 groups."""
        inputs = (self.hidden_size, self.num_heads * self.head_dim, self.intermediate_size,
                  self.moe.expert_size if self.moe else INT4_GROUP)
        return all(size % INT4_GROUP == 0 for size in inputs)

    @classmethod
    def from_config(cls, config) -> LlamaShape:
        model_type = getattr(config, "model_type", "?")
        require(model_type in SUPPORTED,
                f"the native runner supports {', '.join(SUPPORTED)} models, not '{model_type}'; "
                "use the hf runner (--runner hf)")
        arch = ARCHITECTURES[model_type]
        # Llama's attention_bias puts a bias on o_proj as well: a piece only gpt-oss's entry has
        require(not (getattr(config, "attention_bias", False) and not arch.o_bias)
                and not getattr(config, "mlp_bias", False),
                "the native runner has no attention or MLP biases besides Qwen2's q/k/v and "
                "gpt-oss's; use --runner hf")
        require(not ((getattr(config, "partial_rotary_factor", None) or 1.0) < 1.0
                     and (arch.qk_norm or arch.qkv_bias)),
                "the native runner turns a partial rotary embedding's dimensions by reordering "
                "q and k rows, not their norms or biases; use --runner hf")
        act = getattr(config, arch.activation_attr, "silu")
        require(act in ACTIVATIONS, f"the native runner's MLP gate is {' or '.join(ACTIVATIONS)}, "
                                    f"not '{act}'; use --runner hf")
        require(not getattr(config, "use_bidirectional_attention", None),
                "the native runner has no bidirectional attention; use --runner hf")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = config.num_hidden_layers
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * layers
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        require(not unknown, f"the native runner has no {', '.join(unknown)} layers; use --runner hf")
        window = getattr(config, "sliding_window", None) or 0
        if arch.window_every_layer and window and not getattr(config, "layer_types", None):
            kinds = ["sliding_attention"] * layers
        scale_by = getattr(config, arch.query_scale_attr) if arch.query_scale_attr else head_dim
        rotary = getattr(config, arch.rope_layers_attr) if arch.rope_layers_attr else [1] * layers
        scaling = getattr(config, "rope_scaling", None) or {}
        longrope = scaling.get("rope_type", scaling.get("type")) == "longrope"
        attr = lambda name, default: (getattr(config, name) if name else default)  # noqa: E731
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rms_eps=float(config.rms_norm_eps),
            max_context=int(getattr(config, "max_position_embeddings", 2048)),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            arch=arch, activation=act,
            windows=tuple(int(window) if kind == "sliding_attention" else 0 for kind in kinds),
            query_scale=float(scale_by) ** arch.query_scale_power,
            logit_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
            attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
            moe=MoEShape.from_config(config, arch),
            rotary_dim=int(head_dim * (getattr(config, "partial_rotary_factor", None) or 1.0)),
            rotary=tuple(bool(r) for r in rotary),
            rope_limit=int(getattr(config, "original_max_position_embeddings", None)
                           or config.max_position_embeddings) if longrope else 0,
            embed_scale=(config.hidden_size ** 0.5 if arch.scale_embeddings
                         else float(attr(arch.embedding_multiplier_attr, 1.0))),
            residual_scale=float(attr(arch.residual_multiplier_attr, 1.0)),
            logit_divisor=float(attr(arch.logits_divisor_attr, 1.0)),
        )


def runs(config) -> bool:
    """Whether the native runner runs a model of this transformers config on this machine
    (its kernels compile here)."""
    try:
        LlamaShape.from_config(config)
        rope_frequencies(config)
    except SpecDecodeError:
        return False
    return kernels.available()


def rope_frequencies(config, local: bool = False, positions: int | None = None
                     ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary dims / 2], attention scaling) from the checkpoint's rope
    settings, computed by ``transformers``' own rope initialisers (llama3, linear and yarn
    scaling from ``rope_scaling``; longrope's short factors, or its long ones where the tables
    hold ``positions`` past original_max_position_embeddings); ``local``: those of the
    sliding-window layers of an architecture that gives them their own base (Gemma 3: the
    default rope at ``rope_local_base_freq``, as modeling_gemma3 builds it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    attr = ARCHITECTURES[config.model_type].local_rope_base_attr
    if local and attr:
        config = copy.deepcopy(config)
        config.rope_theta = getattr(config, attr)
        config.rope_scaling = {"rope_type": "default"}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    require(kind in _STATIC_ROPE,
            f"rope type '{kind}' changes with the sequence length; the native runner supports "
            f"{', '.join(_STATIC_ROPE)}: use --runner hf")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu", positions)
    return inv_freq.float(), float(attention_scaling)


def _dense(tensors, name: str) -> torch.Tensor:
    return as_float(tensors[name])


def _dense_parts(parts: list) -> torch.Tensor:
    return torch.cat([as_float(p) for p in parts])


def _scaled(weight, factor: float):
    """``weight`` times ``factor`` (exact for a power of two, such as 1/sqrt(64))."""
    if factor == 1.0:
        return weight
    if isinstance(weight, Q4Weight):
        return Q4Weight(weight.codes, weight.scale * factor, weight.minimum * factor)
    if isinstance(weight, Q4Blocks):
        return weight.scaled(factor)
    if isinstance(weight, Int8BlockWeight):
        return Int8BlockWeight(weight.codes, weight.scale * factor,
                               None if weight.minimum is None else weight.minimum * factor,
                               weight.group)
    return weight.float() * factor


def _rows(weight, index):
    """Rows ``index`` (a slice or a tensor of row numbers) of a matrix in any of the forms a
    runner is given: float, :class:`Q4Weight`, :class:`Q4Blocks` or :class:`Int8BlockWeight`."""
    if isinstance(weight, Q4Weight):
        return Q4Weight(weight.codes[index], weight.scale[index], weight.minimum[index])
    if isinstance(weight, Q4Blocks):
        return weight.rows(index if isinstance(index, slice) else index.numpy())
    if isinstance(weight, Int8BlockWeight):
        return Int8BlockWeight(weight.codes[index], weight.scale[index],
                               None if weight.minimum is None else weight.minimum[index],
                               weight.group)
    return weight[index]


def rotary_order(shape: LlamaShape, heads: int) -> torch.Tensor | None:
    """Row order of a q or k projection of ``heads`` heads that makes a partial rotary
    embedding the kernels' whole-head one: the kernels turn dimension j with j + D/2, where
    transformers turns the first R dimensions of a head (j with j + R/2) and passes the other
    D - R through. Each head's rows become [R/2 turned | half the passed | R/2 turned | the
    other half], and their cos and sin are 1 and 0 there. q and k are reordered alike, so q.k
    is the same sum. None when the rotary embedding covers the whole head."""
    d, r = shape.head_dim, shape.rotary_dim
    if r == d:
        return None
    half, rest = r // 2, (d - r) // 2
    within = torch.cat([torch.arange(half), r + torch.arange(rest), half + torch.arange(half),
                        r + rest + torch.arange(rest)])
    return (torch.arange(heads)[:, None] * d + within).flatten()


def context_size(shape: LlamaShape, asked: int | None, max_draft: int = 256) -> int:
    """Positions the cache holds: ``asked``, or min(the model's, ``DEFAULT_MAX_CONTEXT``) and,
    with longrope, at most what its short factors serve with a draft of ``max_draft`` rows (a
    cache past them takes the long factors: :meth:`LlamaRunner._rope_tables`)."""
    if asked is None:
        default = min(shape.max_context, DEFAULT_MAX_CONTEXT)
        if shape.rope_limit:
            default = min(default, shape.rope_limit // KEY_BLOCK * KEY_BLOCK - max_draft)
        return default
    require(0 < asked <= shape.max_context,
            f"max_context must be 1..{shape.max_context} (the model's context length), got {asked}")
    return int(asked)


def cache_rows(max_context: int, max_draft: int) -> int:
    """Rows of the KV cache: the context and a draft, in whole key blocks."""
    return -(-(max_context + max_draft) // KEY_BLOCK) * KEY_BLOCK


def kv_cache_bytes(shape: LlamaShape, rows: int, weights: str) -> int:
    """Bytes of the keys and values of ``rows`` positions in every layer."""
    itemsize = torch.empty(0, dtype=KV_CACHE[weights]).element_size()
    return 2 * shape.num_layers * shape.num_kv_heads * rows * shape.head_dim * itemsize


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: object
    o: object
    mlp_norm: torch.Tensor
    #: the dense MLP's layers (None in a mixture-of-experts layer)
    gate_up: object
    down: object
    #: Qwen2: the q/k/v biases [(H + 2 KH) D], q's scaled like its weight
    qkv_bias: torch.Tensor | None = None
    #: Qwen3, Gemma 3: RMSNorm weights [D] over each head of q (times the query scale) and k
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    #: Gemma 3: norms of the attention and MLP outputs, before each residual add
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    #: positions a row sees (itself included) in a sliding-window layer; 0 = all
    window: int = 0
    #: the layer's rotary tables (``GLOBAL_ROPE``, ``LOCAL_ROPE``: Gemma 3's sliding layers,
    #: ``NO_ROPE``: SmolLM3's layers without one)
    rope: str = GLOBAL_ROPE
    #: the mixture-of-experts MLP that replaces gate_up and down (models/moe.py)
    moe: MoEMLP | None = None
    #: gpt-oss: the o projection's bias [H] and each head's attention sink logit [heads]
    o_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None


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
class _Pass:
    """What one call's rows leave for the final norm and the head."""

    #: the last layer's hidden states of the rows the call returns features of [fed, H]
    hidden: torch.Tensor
    #: the rows of ``hidden`` whose logits it returns
    logit_rows: slice
    #: the LM head those logits come from
    head: object
    final_hidden: bool
    layers: dict[int, torch.Tensor]


class LlamaRunner(Runner):
    """Llama forward with a static KV cache, tree attention and a choice of weight formats."""

    name = "native"
    supports_early_exit = True

    def __init__(self, config, tensors, weights: str = "fp32", max_draft: int = 256,
                 source: str = "", max_context: int | None = None):
        """``config``: a transformers ``LlamaConfig``; ``tensors``: a mapping of Hugging Face
        parameter names to float tensors or :class:`Q4Weight` (4-bit GGUF tensors, used as
        they are by int4), such as a dict or a file's :class:`FileTensors` (each read once, made
        a layer and dropped); ``max_context``: positions the KV cache holds (default
        min(the model's, ``DEFAULT_MAX_CONTEXT``))."""
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
        self.final_norm = self._norm_weight(tensors, "model.norm.weight")
        head = "model.embed_tokens.weight" if shape.tie_embeddings else "lm_head.weight"
        if head not in tensors:  # checkpoints that tie the head without saying so
            head = "model.embed_tokens.weight"
        self.head, self.layers = self._linears(tensors, head, lambda parts: _linear_for(parts, weights))
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
            self.prefill_head, self.prefill_layers = self._linears(
                tensors, head, lambda parts: LibraryLinear(_dense_parts(parts), dtype))

        self.capacity = cache_rows(self.max_context, max_draft)
        # rotary tables per kind of layer (GLOBAL_ROPE, LOCAL_ROPE, NO_ROPE); a GGUF file of
        # Llama 3.1+ holds the llama3 scaling as factors its frequencies are divided by
        factors = tensors.get(ROPE_FACTORS)
        self.rope = {kind: self._rope_tables(config, kind, factors)
                     for kind in {layer.rope for layer in self.layers}}
        self._stack = self._layer_stack()
        self._new_cache()

    def _layer_stack(self):
        """The decode layers as one kernel call (``LayerStack``) where they are plain Llama
        layers (SmolLM2 and the like, in any weight format the kernels hold): the same kernels
        in the same order, without Python between them. None for other architectures' extra
        pieces."""
        s, layers = self.shape, self.layers
        plain = all(hasattr(getattr(layer, name), "kernel") and layer.qkv_bias is None
                    and layer.q_norm is None and layer.post_attn_norm is None
                    and layer.post_mlp_norm is None and layer.rope == GLOBAL_ROPE
                    and layer.attn_norm is not None and layer.moe is None
                    and layer.o_bias is None and layer.sinks is None
                    for layer in layers for name in ("qkv", "o", "gate_up", "down"))
        if not plain or s.activation != "silu" or s.attn_softcap or not kernels.available():
            return None
        linears = {name: [getattr(layer, name).kernel() for layer in layers]
                   for name in ("qkv", "o", "gate_up", "down")}
        return kernels.layer_stack(
            [layer.attn_norm for layer in layers], linears["qkv"], linears["o"],
            [layer.mlp_norm for layer in layers], linears["gate_up"], linears["down"],
            [layer.window for layer in layers], s.num_heads, s.num_kv_heads, s.head_dim,
            s.hidden_size, s.rms_eps)

    def _rope_tables(self, config, kind: str, factors) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [capacity, D] of every position for layers of rope ``kind``; the
        dimensions a partial rotary embedding passes through (:func:`rotary_order`), and every
        one of a layer without rotary embedding, get cos 1 and sin 0. ``factors``: llama.cpp's
        rope_freqs, the global frequencies are divided by them. Longrope: the short factors
        where the cache lies within what they serve (every position then turns as in
        transformers), else the long ones for every position, as llama.cpp picks them by its
        context size (transformers switches per forward, by the longest sequence in it)."""
        s = self.shape
        inv_freq, attention_scaling = torch.zeros(0), 1.0
        if kind != NO_ROPE:
            inv_freq, attention_scaling = rope_frequencies(config, kind == LOCAL_ROPE,
                                                           self.capacity)
            require(inv_freq.numel() * 2 == s.rotary_dim,
                    f"rope has {inv_freq.numel() * 2} dimensions but the config turns "
                    f"{s.rotary_dim} of each head; use --runner hf")
        if factors is not None and kind == GLOBAL_ROPE:
            factors = as_float(factors)
            require(factors.shape == inv_freq.shape,
                    f"{ROPE_FACTORS} has {factors.numel()} factors for {inv_freq.numel()} "
                    "rotary frequencies")
            inv_freq = inv_freq / factors
        freqs = torch.arange(self.capacity, dtype=torch.float32)[:, None] * inv_freq[None, :]
        passed = (s.head_dim - 2 * inv_freq.numel()) // 2
        cos = torch.cat([freqs.cos() * attention_scaling, torch.ones(self.capacity, passed)], -1)
        sin = torch.cat([freqs.sin() * attention_scaling, torch.zeros(self.capacity, passed)], -1)
        # q * cos + rotate_half(q) * sin with rotate_half(q) = (-q2, q1), as transformers
        # computes it, is q * (c, c) + (q2, q1) * (-s, s)
        return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)

    def _norm_weight(self, tensors: dict, name: str, factor: float = 1.0) -> torch.Tensor:
        """An RMSNorm weight as the kernel multiplies by it: Gemma's (1 + w), in float32 as
        modeling_gemma3 computes it, times ``factor`` (a query scale folded in)."""
        w = _dense(tensors, name) + self.shape.arch.norm_offset
        return w if factor == 1.0 else w * factor

    def _new_cache(self) -> None:
        """An empty KV cache of this runner's own."""
        shape = self.shape
        self.cache = BlockedKVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                    self.capacity, KV_CACHE[self.weights])
        #: the earlier prefill parts' blocks a later part returns features of
        self._prefill_blocks = []

    def _linears(self, tensors, head: str, linear) -> tuple[object, list[_Layer]]:
        """The LM head and the layers, each matrix (or matrices sharing an input) made a layer
        by ``linear``. The head first: re-quantising a large output matrix from floats takes
        most memory before the layers are held."""
        shape, arch = self.shape, self.shape.arch
        scale = shape.query_scale
        head_linear = linear([tensors[head]])
        return_freed_memory()  # (each matrix's temporaries: see the function)
        layers = []
        h, kv, ffn = (shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim,
                      shape.intermediate_size)
        q_order, k_order = rotary_order(shape, shape.num_heads), rotary_order(shape, shape.num_kv_heads)
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            norm = lambda name, factor=1.0: self._norm_weight(tensors, p + name, factor)  # noqa: E731
            # the attention scale folded into q: into its head norm where it has one (a norm
            # would undo it in the projection), else into the projection (and its bias)
            q_factor = 1.0 if arch.qk_norm else scale
            # Granite's residual multiplier folded into each branch's last linear layer, or
            # into its post norm where it has one (a norm would undo it in the layer)
            branch = 1.0 if arch.post_norms else shape.residual_scale
            q, k, v = self._projections(tensors, p, "self_attn.qkv_proj", "self_attn.{}_proj",
                                        "qkv", (h, kv, kv))
            if q_order is not None:
                q, k = _rows(q, q_order), _rows(k, k_order)
            sparse = shape.moe is not None and shape.moe.sparse[i]
            try:
                layers.append(_Layer(
                    attn_norm=norm("input_layernorm.weight") if arch.pre_norms else None,
                    qkv=linear([_scaled(q, q_factor), k, v]),
                    o=linear([_scaled(tensors[p + "self_attn.o_proj.weight"], branch)]),
                    mlp_norm=(norm("pre_feedforward_layernorm.weight" if arch.post_norms
                                   else "post_attention_layernorm.weight")
                              if arch.pre_norms else None),
                    gate_up=None if sparse else linear(self._projections(
                        tensors, p, "mlp.gate_up_proj", "mlp.{}_proj", ("gate", "up"), (ffn, ffn))),
                    down=None if sparse else linear([_scaled(tensors[p + "mlp.down_proj.weight"],
                                                             branch)]),
                    moe=self._moe(tensors, p, linear) if sparse else None,
                    qkv_bias=torch.cat([_dense(tensors, p + "self_attn.q_proj.bias") * q_factor]
                                       + [_dense(tensors, p + f"self_attn.{x}_proj.bias") for x in "kv"])
                    if arch.qkv_bias else None,
                    o_bias=(_dense(tensors, p + "self_attn.o_proj.bias") * branch
                            if arch.o_bias else None),
                    sinks=_dense(tensors, p + "self_attn.sinks").contiguous() if arch.attn_sinks else None,
                    q_norm=norm("self_attn.q_norm.weight", scale) if arch.qk_norm else None,
                    k_norm=norm("self_attn.k_norm.weight") if arch.qk_norm else None,
                    post_attn_norm=norm("post_attention_layernorm.weight", shape.residual_scale)
                    if arch.post_norms else None,
                    post_mlp_norm=norm("post_feedforward_layernorm.weight", shape.residual_scale)
                    if arch.post_norms else None,
                    window=shape.windows[i],
                    rope=(NO_ROPE if not shape.rotary[i] else
                          LOCAL_ROPE if shape.windows[i] and arch.local_rope_base_attr else GLOBAL_ROPE),
                ))
            except KeyError as exc:
                raise SpecDecodeError(f"checkpoint lacks {exc.args[0]}: not a {arch.model_type} "
                                      "checkpoint of the configured size") from None
            return_freed_memory()
        return head_linear, layers

    def _projections(self, tensors, p: str, fused: str, name: str, parts, sizes) -> list:
        """The matrices ``name.format(part)`` of layer prefix ``p``, in order: each its own
        tensor, or (Phi-3) consecutive rows of the one tensor ``fused``, ``sizes`` rows each."""
        if not self.shape.arch.fused_projections:
            return [tensors[p + name.format(part) + ".weight"] for part in parts]
        whole = tensors[p + fused + ".weight"]
        bounds = torch.tensor((0, *sizes)).cumsum(0).tolist()
        return [_rows(whole, slice(a, b)) for a, b in zip(bounds, bounds[1:])]

    def _moe(self, tensors, prefix: str, linear) -> MoEMLP:
        """Layer ``prefix``'s mixture-of-experts MLP: its router and every expert's gate/up and
        down layers made by ``linear`` (gpt-oss: their biases too)."""
        moe = self.shape.moe
        found = unstacked_experts(tensors, prefix, moe.experts)

        def mlp(p: str) -> tuple[object, object]:
            return (linear([found[p + f"{x}_proj.weight"] for x in ("gate", "up")]),
                    linear([found[p + "down_proj.weight"]]))

        def biases(p: str) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.cat([_dense(found, p + f"{x}_proj.bias") for x in ("gate", "up")]),
                    _dense(found, p + "down_proj.bias"))

        names = [f"{prefix}mlp.experts.{j}." for j in range(moe.experts)]
        shared = moe.shared_size > 0
        return MoEMLP(_dense(found, prefix + "mlp.gate.weight"), [mlp(p) for p in names],
                      moe.per_token, moe.normalize, moe.activation or self.shape.activation,
                      shared=mlp(f"{prefix}mlp.shared_expert.") if shared else None,
                      shared_gate=_dense(tensors, prefix + "mlp.shared_expert_gate.weight") if shared else None,
                      router_bias=_dense(found, prefix + "mlp.gate.bias") if moe.topk_softmax else None,
                      expert_biases=[biases(p) for p in names] if moe.topk_softmax else None,
                      topk_softmax=moe.topk_softmax)

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
                  max_draft: int = 256, available: int | None = None, **kwargs) -> LlamaRunner:
        """From a GGUF file read directly, one tensor at a time (``models/weights.py``): 4-bit
        tensors stay 4-bit for int4 weights, the rest are dequantised as ``transformers`` does.
        Refuses, naming the sizes, a file whose weights in ``weights`` and KV cache would not
        fit in the available memory (``available``: bytes, default what the kernel reports),
        before anything is allocated."""
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
        return cls(file.config, FileTensors(file, blocks=weights in ("int4", "int8")), weights,
                   source=str(path), max_context=context, max_draft=max_draft, **kwargs)

    def replica(self) -> LlamaRunner:
        twin = copy.copy(self)  # weights, rope tables: shared, read-only
        twin._new_cache()
        return twin

    # ---- the runner protocol --------------------------------------------------------------

    @property
    def cache_len(self) -> int:
        return self.cache.length

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
        stat = path.stat()
        return f"native:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{self.weights}"

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
        passes: list[_Pass | None] = [None] * len(work)
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
            if not (isinstance(runner, LlamaRunner) and runner.layers is self.layers):
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
        item's (hidden states, captured layers) and returns the call's :class:`_Pass` (None for
        a prompt part before the last)."""
        return self._verify_steps(call) if isinstance(call, VerifyCall) else self._prefill_steps(call)

    def _verify_steps(self, call: VerifyCall):
        n = call.rows
        self.cache.begin_forward(n)
        plan = AttentionPlan.verify(self.cache.length, call.draft)
        hidden, layers = yield SequenceRows(self.cache, (call.root,) + call.draft.tokens, plan,
                                     call.needs.layers)
        self.cache.pending = n
        return _Pass(hidden, slice(None), self.head, call.needs.final_hidden, layers)

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
        return _Pass(torch.cat([hidden for hidden, _ in blocks]), slice(-1, None),
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

    def _outputs(self, passes: list[_Pass | None]) -> list[ForwardOutput | None]:
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

    @torch.inference_mode()
    def commit(self, accepted: Sequence[int]) -> None:
        self.cache.commit(accepted)

    def append(self, tokens: Sequence[int], bulk_rows: int, capture: tuple[int, ...] = ()
               ) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """Run ``tokens`` as a chain after the cache, in blocks of ``PREFILL_BLOCK``, and keep
        them; blocks of ``bulk_rows`` rows or more take the prefill layers. Each block's last
        layer hidden states and those of the ``capture`` layers."""
        tokens = list(tokens)
        require(self.cache.pending == 0, "tokens appended between forward and commit")
        self.cache.check_room(len(tokens), f"{len(tokens)} more tokens")
        out = []
        for start in range(0, len(tokens), PREFILL_BLOCK):
            block = tokens[start:start + PREFILL_BLOCK]
            plan = AttentionPlan.chain(self.cache.length, len(block))
            out.append(self.run(block, plan, capture=capture, prefill=len(block) >= bulk_rows))
            self.cache.append(len(block))
        return out

    # ---- early exit: shared KV, the chain's rows lie past the cache (the verify pass
    # overwrites them) ---------------------------------------------------------------------

    @torch.inference_mode()
    def _exit_pass(self, tokens: list[int], exit_layer: int, offset: int) -> torch.Tensor:
        self.cache.check_room(offset + len(tokens), "the draft pass")
        plan = AttentionPlan.chain(self.cache.length + offset, len(tokens))
        hidden, _ = self.run(tokens, plan, stop=exit_layer)
        return hidden

    def _drop_exit_rows(self) -> None:
        self.cache.drop_uncommitted()

    def exit_norm(self, hidden: torch.Tensor, adapter=None) -> torch.Tensor:
        return self._norm(hidden.float(), self.final_norm) if adapter is None else adapter(hidden)

    @torch.inference_mode()
    def lm_head(self, normed: torch.Tensor) -> torch.Tensor:
        return self._capped(self.head(normed.float().contiguous()))

    def input_embeddings(self) -> torch.Tensor:
        # dequantised for the caller (a drafter sharing it keeps it): the runner holds no copy
        return self.embed.dense()

    def output_embeddings(self) -> torch.Tensor:
        return as_float(self._head_weights[self._head_name])

    # ---- the model ------------------------------------------------------------------------

    def _logits(self, hidden: torch.Tensor, head=None) -> torch.Tensor:
        return self._capped((head or self.head)(self._norm(hidden, self.final_norm)))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.shape.logit_divisor != 1.0:  # Granite's logits_scaling
            logits = logits / self.shape.logit_divisor
        cap = self.shape.logit_softcap
        return kernels.softcap(logits, cap) if cap else logits

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x.contiguous(), weight, self.shape.rms_eps)

    def _head_norms(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
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

    def run(self, tokens: Sequence[int], plan: AttentionPlan, *, stop: int | None = None,
            capture: tuple[int, ...] = (), prefill: bool = False
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run ``tokens`` where ``plan`` puts them (positions, cache slots written, slots
        attended to) through the first ``stop`` layers (all by default); ``prefill``: the prompt
        layers. The last layer's hidden states [n, hidden], float32, and {layer: its output
        [n, hidden]} for the layers in ``capture``. The cache's books are the caller's."""
        return self.run_items([SequenceRows(self.cache, tokens, plan, capture)], stop=stop,
                              prefill=prefill)[0]

    def run_embedded(self, x: torch.Tensor, plan: AttentionPlan, *, stop: int | None = None,
                     capture: tuple[int, ...] = (), prefill: bool = False
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`run` from input embeddings ``x`` [n, H] float32 (rows of the embedding table,
        or mixtures of them: Superposed Decoding feeds a weighted sum of several tokens')."""
        rows = SequenceRows(self.cache, [0] * len(x), plan, capture)
        return self.run_items([rows], stop=stop, prefill=prefill, embedded=x)[0]

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
        positions, plan = _packed_plan(items)
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

    def _layers(self, x: torch.Tensor, layers: list[_Layer], plan, capture: set[int], rope,
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


    # ---- a layer loop of a lossy method's own (lossy/lora_drop.py, lossy/lud.py) ----------

    def embed_tokens(self, tokens: Sequence[int]) -> torch.Tensor:
        """[n, H] float32 the first layer's input rows of ``tokens``."""
        x = self.embed.rows(tokens)
        return x if self.embed_scale is None else x * self.embed_scale

    def attention_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """[n, H] what layer ``layer``'s q/k/v projections read of its input rows ``x``."""
        return self._input_norm(x, self.layers[layer].attn_norm)

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, plan: AttentionPlan, first: int, last: int,
                   adapter=None) -> torch.Tensor:
        """The decode layers ``first`` .. ``last - 1`` over rows ``x`` [n, H] (float32, the
        input of layer ``first``) where ``plan`` puts them in this runner's cache: the pieces of
        a layer loop of a lossy method's own, which skips layers (LoRA-Drop) or gives some
        layers' rows another plan. ``adapter(i, layer)``: the layer to run instead of layer
        ``i`` (its linear layers wrapped: LUD's LoRA on its slots' rows); with one the layers
        run through the Python loop, without one through the fused stack where there is one.
        The cache's books are the caller's."""
        positions, packed = _packed_plan([SequenceRows(self.cache, (), plan)])
        if adapter is None and self._stack is not None:
            cos, sin = self.rope[GLOBAL_ROPE]
            return self._stack.forward(x.contiguous(), first, last, packed, cos[positions],
                                       sin[positions], kernels.isa())
        rope = {local: (cos[positions], sin[positions]) for local, (cos, sin) in self.rope.items()}
        layers = [self.layers[i] if adapter is None else adapter(i, self.layers[i])
                  for i in range(first, last)]
        return self._layers(x, layers, packed, set(), rope, first)[0]


def _packed_plan(items: Sequence[SequenceRows]) -> tuple[torch.Tensor, object]:
    """The items' plans as one forward's: every row's position [n], and the kernels'
    ``PackedPlan`` (each item's cache, slots and keys, its rows after the items before it)."""
    plans = [item.plan for item in items]
    positions = plans[0].positions if len(plans) == 1 else torch.cat([p.positions for p in plans])
    plan = kernels.packed_plan([item.cache.keys for item in items],
                               [item.cache.values for item in items], [p.past for p in plans],
                               [p.slots for p in plans], [p.keys for p in plans],
                               [p.lengths for p in plans])
    return positions, plan
