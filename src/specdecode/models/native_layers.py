"""A native runner's layers from a checkpoint's tensors, in one weight format.

:class:`LayerBuilder` reads a checkpoint's tensors by their Hugging Face names (a dict, or a GGUF
file's ``FileTensors``: each read once, made a layer and dropped) and makes each matrix, or the
matrices that share an input (q/k/v, gate/up), one linear layer in the runner's format; the
pieces an architecture switches on (``models/architectures.py``) are read where
``transformers``' modeling file reads them, and scales the forward would apply to a whole
matrix are folded into its weights (the attention scale into q, Granite's residual multiplier
into o and down). :func:`layer_stack` makes plain Llama layers one kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode import kernels
from specdecode.errors import SpecDecodeError
from specdecode.models.gguf_reader import Q4Blocks
from specdecode.models.int8_blocks import Int8BlockWeight
from specdecode.models.moe import MoEMLP, unstacked_experts
from specdecode.models.native_shape import (GLOBAL_ROPE, LOCAL_ROPE, NO_ROPE, LlamaShape,
                                            rotary_order)
from specdecode.models.quant import Q4Weight
from specdecode.models.weights import as_float, return_freed_memory

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
        return weight.scaled(factor)
    return weight.float() * factor


def _rows(weight, index):
    """Rows ``index`` (a slice or a tensor of row numbers) of a matrix in any of the forms a
    runner is given: float, :class:`Q4Weight`, :class:`Q4Blocks` or :class:`Int8BlockWeight`."""
    if isinstance(weight, Q4Weight):
        return Q4Weight(weight.codes[index], weight.scale[index], weight.minimum[index])
    if isinstance(weight, Q4Blocks):
        return weight.rows(index if isinstance(index, slice) else index.numpy())
    if isinstance(weight, Int8BlockWeight):
        return weight.take(index)  # a Q6_K head's shortlist keeps Q6_K's layout and numbers
    return weight[index]

@dataclass
class Layer:
    """One decoder layer's weights as the forward uses them."""

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

class LayerBuilder:
    """The LM head and the layers of a model of ``shape`` from ``tensors`` (Hugging Face names
    to float tensors, :class:`Q4Weight`, :class:`Q4Blocks` or :class:`Int8BlockWeight`)."""

    def __init__(self, shape: LlamaShape, tensors):
        self.shape = shape
        self.tensors = tensors

    def norm_weight(self, name: str, factor: float = 1.0) -> torch.Tensor:
        """An RMSNorm weight as the kernel multiplies by it: Gemma's (1 + w), in float32 as
        modeling_gemma3 computes it, times ``factor`` (a query scale folded in)."""
        w = _dense(self.tensors, name) + self.shape.arch.norm_offset
        return w if factor == 1.0 else w * factor
    def head_and_layers(self, head: str, linear, head_rows=None) -> tuple[object, list[Layer]]:
        """The LM head (or ``head_rows``, a drafter's shortlist of it) and the layers, each
        matrix (or matrices sharing an input) made a layer by ``linear``. The head first:
        re-quantising a large output matrix takes most memory before the layers are held."""
        shape, arch, tensors = self.shape, self.shape.arch, self.tensors
        scale = shape.query_scale
        head_linear = linear([tensors[head] if head_rows is None else head_rows])
        return_freed_memory()  # (each matrix's temporaries: see the function)
        layers = []
        h, kv, ffn = (shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim,
                      shape.intermediate_size)
        q_order, k_order = rotary_order(shape, shape.num_heads), rotary_order(shape, shape.num_kv_heads)
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            norm = lambda name, factor=1.0: self.norm_weight(p + name, factor)  # noqa: E731
            # the attention scale folded into q: into its head norm where it has one (a norm
            # would undo it in the projection), else into the projection (and its bias)
            q_factor = 1.0 if arch.qk_norm else scale
            # Granite's residual multiplier folded into each branch's last linear layer, or
            # into its post norm where it has one (a norm would undo it in the layer)
            branch = 1.0 if arch.post_norms else shape.residual_scale
            q, k, v = self._projections(p, "self_attn.qkv_proj", "self_attn.{}_proj",
                                        "qkv", (h, kv, kv))
            if q_order is not None:
                q, k = _rows(q, q_order), _rows(k, k_order)
            sparse = shape.moe is not None and shape.moe.sparse[i]
            try:
                layers.append(Layer(
                    attn_norm=norm("input_layernorm.weight") if arch.pre_norms else None,
                    qkv=linear([_scaled(q, q_factor), k, v]),
                    o=linear([_scaled(tensors[p + "self_attn.o_proj.weight"], branch)]),
                    mlp_norm=(norm("pre_feedforward_layernorm.weight" if arch.post_norms
                                   else "post_attention_layernorm.weight")
                              if arch.pre_norms else None),
                    gate_up=None if sparse else linear(self._projections(
                        p, "mlp.gate_up_proj", "mlp.{}_proj", ("gate", "up"), (ffn, ffn))),
                    down=None if sparse else linear([_scaled(tensors[p + "mlp.down_proj.weight"],
                                                             branch)]),
                    moe=self._moe(p, linear) if sparse else None,
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

    def _projections(self, p: str, fused: str, name: str, parts, sizes) -> list:
        """The matrices ``name.format(part)`` of layer prefix ``p``, in order: each its own
        tensor, or (Phi-3) consecutive rows of the one tensor ``fused``, ``sizes`` rows each."""
        tensors = self.tensors
        if not self.shape.arch.fused_projections:
            return [tensors[p + name.format(part) + ".weight"] for part in parts]
        whole = tensors[p + fused + ".weight"]
        bounds = torch.tensor((0, *sizes)).cumsum(0).tolist()
        return [_rows(whole, slice(a, b)) for a, b in zip(bounds, bounds[1:])]

    def _moe(self, prefix: str, linear) -> MoEMLP:
        """Layer ``prefix``'s mixture-of-experts MLP: its router and every expert's gate/up and
        down layers made by ``linear`` (gpt-oss: their biases too)."""
        moe, tensors = self.shape.moe, self.tensors
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


def layer_stack(shape: LlamaShape, layers: list[Layer]):
    """The decode layers as one kernel call (``LayerStack``) where they are plain Llama
    layers (SmolLM2 and the like, in any weight format the kernels hold), Qwen2's q/k/v biases
    allowed: the same kernels in the same order, without Python between them. None for other
    architectures' extra pieces."""
    s = shape
    biases = [layer.qkv_bias for layer in layers]
    plain = all(hasattr(getattr(layer, name), "kernel") and layer.q_norm is None
                and layer.post_attn_norm is None and layer.post_mlp_norm is None and layer.rope == GLOBAL_ROPE
                and layer.attn_norm is not None and layer.moe is None
                and layer.o_bias is None and layer.sinks is None
                for layer in layers for name in ("qkv", "o", "gate_up", "down"))
    some_biased = any(b is not None for b in biases)
    if (not plain or s.activation != "silu" or s.attn_softcap or not kernels.available()
            or some_biased and not all(b is not None for b in biases)):
        return None
    linears = {name: [getattr(layer, name).kernel() for layer in layers]
               for name in ("qkv", "o", "gate_up", "down")}
    return kernels.layer_stack(
        [layer.attn_norm for layer in layers], linears["qkv"], linears["o"],
        [layer.mlp_norm for layer in layers], linears["gate_up"], linears["down"],
        [layer.window for layer in layers], s.num_heads, s.num_kv_heads, s.head_dim,
        s.hidden_size, s.rms_eps,
        [bias.float().contiguous() for bias in biases] if some_biased else ())
