"""What differs between the model families the native runner runs, as data.

The runner (``models/llama.py``) has one forward: embed, then per layer norm -> q/k/v ->
rotary -> attention -> o -> residual, norm -> gated MLP -> down -> residual, then a final norm
and the LM head. A family is that forward with a few named pieces switched on, each read from
the same place ``transformers``' modeling file reads it:

    llama   the forward as it stands (Touvron et al. 2023)
    qwen2   + biases on the q, k and v projections (modeling_qwen2)
    qwen3   + an RMSNorm over each head of q and of k before the rotary embedding, no biases
            (modeling_qwen3)
    gemma2  + (1 + w) RMSNorm weights, norms after attention and after the MLP as well as
            before them, a GeGLU MLP (gelu_pytorch_tanh), embeddings times sqrt(hidden), a
            query scale of query_pre_attn_scalar ** -0.5, attention scores soft-capped to
            cap * tanh(score / cap) before the softmax (attn_logit_softcapping, in the
            attention kernel), and sliding-window layers alternating with global ones, all
            with one rotary base (modeling_gemma2)
    gemma3  gemma2's pieces without the attention soft-capping, with q/k head norms, five
            sliding-window layers to each global one, and a rotary base of
            rope_local_base_freq in the sliding-window layers (modeling_gemma3)
    mistral the llama forward with its sliding_window in every layer (modeling_mistral);
            ministral: the window in the layers its layer_types name (modeling_ministral).
            llama.cpp writes both as ``llama`` files (without the window)
    phi3    + q/k/v and gate/up fused in one matrix each (split at load), a window in every
            layer, a partial rotary embedding (partial_rotary_factor: Phi-4-mini turns 96 of
            128 dimensions; the kernels turn whole heads, so q and k rows are reordered to
            put the passed dimensions where cos is 1 and sin 0), longrope's short factors, or
            its long ones for a cache past original_max_position_embeddings (modeling_phi3)
    granite + embeddings times embedding_multiplier, each residual branch times
            residual_multiplier (folded into o and down), attention_multiplier as the query
            scale, logits divided by logits_scaling (modeling_granite)
    olmo2   norms after attention and after the MLP only, none before them, and q/k norms over
            the whole q and k projections (modeling_olmo2)
    smollm3 the llama forward with no rotary embedding in the layers no_rope_layers marks 0
            (every fourth; modeling_smollm3)
    qwen2_moe  qwen2 with mixture-of-experts MLPs: a router, 4 of 60 experts per row and a
            sigmoid-gated shared expert in Qwen1.5-MoE-A2.7B (modeling_qwen2_moe; models/moe.py)
    qwen3_moe  qwen3 with mixture-of-experts MLPs: a router and 8 of 128 experts per row in
            Qwen3-30B-A3B (modeling_qwen3_moe)
    gpt_oss + biases on q, k, v and o, a learned attention sink per head (a logit that joins
            the softmax's denominator, in the attention kernel), sliding-window (128) layers
            alternating with full ones, YaRN rope, and mixture-of-experts MLPs whose router
            (with a bias) takes the top k logits and softmaxes those k, whose experts have
            biases and gpt-oss's clamped SwiGLU, (up + 1) * g * sigmoid(1.702 g)
            (modeling_gpt_oss: 4 of 32 experts per row in gpt-oss-20b, of 128 in 120b)

Per-layer facts that a config carries for every family (``layer_types`` with
``sliding_window``, ``attn_logit_softcapping``, ``final_logit_softcapping``) are read from the
config by the runner, so a Qwen2 config with sliding-window layers runs them as Gemma's do. A
new family is one more entry here (and its GGUF tensor names), not a copy of the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Architecture:
    #: transformers' ``model_type``
    model_type: str
    #: GGUF ``general.architecture``; None: llama.cpp writes the family as another's files
    #: (Mistral and Ministral as ``llama``)
    gguf_name: str | None
    #: q, k and v projections have biases (Qwen2)
    qkv_bias: bool = False
    #: RMSNorm over each head of q and k, before the rotary embedding (Qwen3, Gemma 3)
    qk_norm: bool = False
    #: norm weights are stored as w - 1 and multiply by (1 + w) (Gemma); added once at load
    norm_offset: float = 0.0
    #: norms after attention and after the MLP, before each residual add (Gemma 2/3)
    post_norms: bool = False
    #: config attribute naming the MLP gate's activation
    activation_attr: str = "hidden_act"
    #: embeddings are multiplied by sqrt(hidden_size) (Gemma)
    scale_embeddings: bool = False
    #: config attribute whose value q is scaled by the inverse square root of (Gemma:
    #: query_pre_attn_scalar); None: the head size
    query_scale_attr: str | None = None
    #: config attribute of the rotary base of sliding-window layers (Gemma 3: they use the
    #: default rope with this base; full layers use rope_theta and rope_scaling); None: one rope
    local_rope_base_attr: str | None = None
    #: llama.cpp permutes q/k rows for its interleaved rotary embedding (Llama only)
    gguf_permuted_qk: bool = False
    #: GGUF layer tensor names that differ from the common ones (see gguf_reader)
    gguf_layer_names: dict = field(default_factory=dict)
    #: GGUF files store Gemma's norm weights as 1 + w (llama.cpp's converter adds the 1)
    gguf_norm_plus_one: bool = False
    #: a ``sliding_window`` the config sets applies to every layer (Mistral, Phi-3: their
    #: configs have no ``layer_types``); None leaves every layer global
    window_every_layer: bool = False
    #: q/k/v in one ``qkv_proj`` and gate/up in one ``gate_up_proj`` (Phi-3), split at load
    fused_projections: bool = False
    #: norms before attention and before the MLP (all but OLMo 2, which norms only after)
    pre_norms: bool = True
    #: the q and k norms run over the whole q and k projections, not over each head (OLMo 2)
    qk_norm_whole: bool = False
    #: the power of the query_scale_attr value q is scaled by: -0.5 its inverse square root
    #: (Gemma), 1 the value itself (Granite's attention_multiplier)
    query_scale_power: float = -0.5
    #: config attributes of Granite's multipliers: embeddings times the first, each residual
    #: branch (attention, MLP) times the second, logits divided by the third
    embedding_multiplier_attr: str | None = None
    residual_multiplier_attr: str | None = None
    logits_divisor_attr: str | None = None
    #: config attribute of a per-layer list, 0 where the layer has no rotary embedding
    #: (SmolLM3's no_rope_layers)
    rope_layers_attr: str | None = None
    #: config attribute of the experts per MoE layer (models/moe.py); None: a dense model
    experts_attr: str | None = None
    #: config attribute saying whether each row's k expert weights are renormalised to sum to
    #: 1; None: always
    normalize_attr: str | None = None
    #: whether llama.cpp's graph renormalises them (a GGUF file does not say: norm_w)
    gguf_normalize: bool = True
    #: the o projection has a bias too (gpt-oss's attention_bias)
    o_bias: bool = False
    #: a learned attention sink logit per head, ``self_attn.sinks`` (gpt-oss)
    attn_sinks: bool = False
    #: the router takes the top k logits and softmaxes those k (gpt-oss), not a softmax over
    #: every expert then its top k; the router and the experts have biases
    moe_topk_softmax: bool = False
    #: the experts' gate activation when it is not ``activation_attr``'s (models/moe.py's
    #: names: "gpt_oss")
    expert_activation: str | None = None


#: llama.cpp's names of Gemma's norms (blk.N.<name>) that differ from the common ones
_GEMMA_GGUF_NAMES = {"ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}

ARCHITECTURES = {a.model_type: a for a in (
    Architecture("llama", "llama", gguf_permuted_qk=True),
    Architecture("mistral", None, window_every_layer=True),
    Architecture("ministral", None),
    Architecture("qwen2", "qwen2", qkv_bias=True),
    Architecture("qwen3", "qwen3", qk_norm=True),
    Architecture("gemma2", "gemma2", norm_offset=1.0, post_norms=True,
                 activation_attr="hidden_activation", scale_embeddings=True,
                 query_scale_attr="query_pre_attn_scalar", gguf_layer_names=_GEMMA_GGUF_NAMES,
                 gguf_norm_plus_one=True),
    Architecture("gemma3_text", "gemma3", qk_norm=True, norm_offset=1.0, post_norms=True,
                 activation_attr="hidden_activation", scale_embeddings=True,
                 query_scale_attr="query_pre_attn_scalar",
                 local_rope_base_attr="rope_local_base_freq",
                 gguf_layer_names=_GEMMA_GGUF_NAMES, gguf_norm_plus_one=True),
    Architecture("phi3", "phi3", window_every_layer=True, fused_projections=True,
                 gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    Architecture("granite", "granite", gguf_permuted_qk=True,
                 query_scale_attr="attention_multiplier", query_scale_power=1.0,
                 embedding_multiplier_attr="embedding_multiplier",
                 residual_multiplier_attr="residual_multiplier",
                 logits_divisor_attr="logits_scaling"),
    Architecture("olmo2", "olmo2", qk_norm=True, qk_norm_whole=True, pre_norms=False,
                 post_norms=True,
                 gguf_layer_names={"post_attention_norm": "post_attention_layernorm",
                                   "post_ffw_norm": "post_feedforward_layernorm"}),
    Architecture("smollm3", "smollm3", gguf_permuted_qk=True, rope_layers_attr="no_rope_layers"),
    Architecture("qwen2_moe", "qwen2moe", qkv_bias=True, experts_attr="num_experts",
                 normalize_attr="norm_topk_prob", gguf_normalize=False),
    Architecture("qwen3_moe", "qwen3moe", qk_norm=True, experts_attr="num_experts",
                 normalize_attr="norm_topk_prob"),
    Architecture("gpt_oss", "gpt-oss", qkv_bias=True, o_bias=True, attn_sinks=True,
                 experts_attr="num_local_experts", moe_topk_softmax=True,
                 expert_activation="gpt_oss",
                 gguf_layer_names={"post_attention_norm": "post_attention_layernorm"}),
)}
#: GGUF ``general.architecture`` -> Architecture
GGUF_ARCHITECTURES = {a.gguf_name: a for a in ARCHITECTURES.values() if a.gguf_name}
#: MLP gate activations with a kernel (transformers' names)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
