"""What the native runner reads from a model's config: its shape, its rotary tables, its cache.

:class:`LlamaShape` holds the sizes and the pieces an architecture switches on
(``models/architectures.py``), read from a ``transformers`` config and refused, with the fix,
where the runner has no such piece. Rope scaling comes from the config through transformers'
own initialisers (llama3, linear, yarn; longrope's short factors, or its long ones for a cache
past original_max_position_embeddings), or from a GGUF file's rope_freqs factors (Llama 3.1+),
which the frequencies are divided by (:func:`rope_tables`). The KV cache holds ``max_context``
(default min(the model's context, ``DEFAULT_MAX_CONTEXT``)) plus a draft's rows, in whole key
blocks, in the precision ``KV_CACHE`` gives each weight format.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from specdecode import kernels
from specdecode.errors import SpecDecodeError, require
from specdecode.models.architectures import ACTIVATIONS, ARCHITECTURES, Architecture
from specdecode.models.gguf_reader import ROPE_FACTORS
from specdecode.models.kv_cache import KEY_BLOCK, whole_blocks
from specdecode.models.moe import MoEShape
from specdecode.models.quant import INT4_GROUP
from specdecode.models.weights import as_float

#: architectures (transformers ``model_type``) this runner runs
SUPPORTED = tuple(ARCHITECTURES)
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
    cache past them takes the long factors: :func:`rope_tables`)."""
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
    return whole_blocks(max_context + max_draft)


def kv_cache_bytes(shape: LlamaShape, rows: int, weights: str) -> int:
    """Bytes of the keys and values of ``rows`` positions in every layer."""
    itemsize = torch.empty(0, dtype=KV_CACHE[weights]).element_size()
    return 2 * shape.num_layers * shape.num_kv_heads * rows * shape.head_dim * itemsize


def rope_tables(shape: LlamaShape, config, capacity: int, kind: str, factors
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [``capacity``, D] of every position for layers of rope ``kind``; the
    dimensions a partial rotary embedding passes through (:func:`rotary_order`), and every
    one of a layer without rotary embedding, get cos 1 and sin 0. ``factors``: llama.cpp's
    rope_freqs, the global frequencies are divided by them. Longrope: the short factors
    where the cache lies within what they serve (every position then turns as in
    transformers), else the long ones for every position, as llama.cpp picks them by its
    context size (transformers switches per forward, by the longest sequence in it)."""
    s = shape
    inv_freq, attention_scaling = torch.zeros(0), 1.0
    if kind != NO_ROPE:
        inv_freq, attention_scaling = rope_frequencies(config, kind == LOCAL_ROPE,
                                                       capacity)
        require(inv_freq.numel() * 2 == s.rotary_dim,
                f"rope has {inv_freq.numel() * 2} dimensions but the config turns "
                f"{s.rotary_dim} of each head; use --runner hf")
    if factors is not None and kind == GLOBAL_ROPE:
        factors = as_float(factors)
        require(factors.shape == inv_freq.shape,
                f"{ROPE_FACTORS} has {factors.numel()} factors for {inv_freq.numel()} "
                "rotary frequencies")
        inv_freq = inv_freq / factors
    freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * inv_freq[None, :]
    passed = (s.head_dim - 2 * inv_freq.numel()) // 2
    cos = torch.cat([freqs.cos() * attention_scaling, torch.ones(capacity, passed)], -1)
    sin = torch.cat([freqs.sin() * attention_scaling, torch.zeros(capacity, passed)], -1)
    # q * cos + rotate_half(q) * sin with rotate_half(q) = (-q2, q1), as transformers
    # computes it, is q * (c, c) + (q2, q1) * (-s, s)
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
