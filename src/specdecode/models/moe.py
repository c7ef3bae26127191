"""Mixture-of-experts MLP layers on the native kernels, row invariant.

A sparse MoE layer (Shazeer et al. 2017, "Outrageously Large Neural Networks"; the top-k
softmax router of Mixtral, Jiang et al. 2024, Qwen2-MoE and Qwen3-MoE) replaces a transformer layer's MLP
with ``E`` expert MLPs and a router: each row's router logits (a linear layer [E, H]) go through
a softmax, the row takes its ``k`` most probable experts (weights renormalised to sum to one
where the model says so, ``norm_topk_prob``) and its output is the weighted sum of those
experts' MLPs. Qwen2-MoE adds a shared expert every row runs, its output weighted by a
sigmoid gate (a linear layer [1, H]). gpt-oss (modeling_gpt_oss) routes the other way round:
its router (with a bias) takes the ``k`` largest logits and softmaxes those ``k``; its experts'
linear layers have biases and their activation is a clamped SwiGLU, (clamp(up, -7, 7) + 1) *
g * sigmoid(1.702 g) with g = min(gate, 7). ``transformers`` stores its experts stacked,
``gate_up_proj`` [E, H, 2 I] (x @ W, gate and up interleaved) and ``down_proj`` [E, I, H];
:func:`unstacked_experts` gives them the per-expert names the other families use. Only ``k``
of ``E`` experts' weights are read per row, which is why such models (Qwen3-30B-A3B: 128
experts, 8 per token, 3.3B of 30.5B parameters active; gpt-oss-20b: 32 experts, 4 per token,
3.6B of 21B active) suit CPUs.

Row invariance, which exact speculation rests on, holds by construction: the router is a dense
float32 kernel (a row's logits do not depend on the rows beside it), softmax and top-k are per
row, every expert's linear layers are the runner's row-invariant kernels run over the rows that
chose that expert, and each row adds its experts' outputs in one fixed order (ascending expert
index, as ``transformers``' ``index_add_`` loop does), elementwise. So a draft row that picks other experts
than the rows beside it still gets the bits it gets alone; what it changes is the cost: a verify
step of ``n`` rows reads the union of their experts (``bench --runners`` measures the curve).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode import kernels
from specdecode.errors import require
from specdecode.models.int8_blocks import Int8BlockWeight, decode_mxfp4_pairs
from specdecode.models.quant import DenseLinear
from specdecode.models.weights import as_float


@dataclass(frozen=True)
class MoEShape:
    """A config's mixture-of-experts sizes (``transformers``' names in brackets)."""

    #: experts per MoE layer (the architecture's ``experts_attr``: num_experts)
    experts: int
    #: experts each row takes (num_experts_per_tok)
    per_token: int
    #: each expert MLP's intermediate size (moe_intermediate_size)
    expert_size: int
    #: the k chosen weights are renormalised to sum to 1 (norm_topk_prob)
    normalize: bool
    #: per layer: whether its MLP is the MoE block (decoder_sparse_step, mlp_only_layers)
    sparse: tuple[bool, ...]
    #: the shared expert's intermediate size (shared_expert_intermediate_size); 0: none
    shared_size: int = 0
    #: the top k router logits softmaxed (gpt-oss), not the top k of a softmax over all; the
    #: router and the experts have biases
    topk_softmax: bool = False
    #: the experts' gate activation where it is not the config's MLP one (gpt-oss: "gpt_oss")
    activation: str | None = None

    @classmethod
    def from_config(cls, config, arch) -> MoEShape | None:
        """The MoE sizes of ``config``, None for a dense model (``arch``: its
        :class:`~specdecode.models.architectures.Architecture`)."""
        experts = int(getattr(config, arch.experts_attr, 0) or 0) if arch.experts_attr else 0
        if experts == 0:
            return None
        per_token = int(config.num_experts_per_tok)
        require(0 < per_token <= experts,
                f"num_experts_per_tok must be 1..{experts} (the experts), got {per_token}")
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        layers = config.num_hidden_layers
        return cls(
            experts=experts, per_token=per_token,
            expert_size=int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size),
            normalize=bool(getattr(config, arch.normalize_attr)) if arch.normalize_attr else True,
            sparse=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
            shared_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
            topk_softmax=arch.moe_topk_softmax, activation=arch.expert_activation)


class MoEMLP:
    """A MoE layer's MLP: the router (float32 dense kernel) and each expert's gate/up and down
    layers in the runner's weight format, and the shared expert if there is one. Called on normed
    rows [n, H], it returns the weighted sum of each row's experts [n, H] float32."""

    def __init__(self, router: torch.Tensor, experts: list[tuple[object, object]], per_token: int,
                 normalize: bool, activation: str, shared: tuple[object, object] | None = None,
                 shared_gate: torch.Tensor | None = None, router_bias: torch.Tensor | None = None,
                 expert_biases: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 topk_softmax: bool = False):
        """``router`` [E, H] float; ``experts``: per expert its (gate_up, down) linear layers;
        ``activation``: the gate's (``transformers``' name, or "gpt_oss"); ``shared``: the
        shared expert's (gate_up, down), weighted by sigmoid(``shared_gate`` [1, H] . h).
        gpt-oss: ``router_bias`` [E], per expert its (gate_up [2 I], down [H]) biases, and
        ``topk_softmax``: a softmax over the top k logits (``normalize`` is then moot)."""
        require(router.shape[0] == len(experts),
                f"the router scores {router.shape[0]} experts but the layer has {len(experts)}")
        require(expert_biases is None or len(expert_biases) == len(experts),
                f"{len(expert_biases or ())} experts' biases for {len(experts)} experts")
        self.router = DenseLinear(router, "fp32")
        self.router_bias = None if router_bias is None else router_bias.float().contiguous()
        self.experts = experts
        self.expert_biases = (None if expert_biases is None else
                              [(g.float().contiguous(), d.float().contiguous()) for g, d in expert_biases])
        self.per_token = per_token
        self.normalize = normalize
        self.topk_softmax = topk_softmax
        self.activation = activation_kernel(activation)
        # the experts in one kernel call where every layer is one of the kernels' (the decode
        # layers); prompt layers through ATen's GEMMs (fp32, bf16) loop in Python
        layers = [layer for pair in experts for layer in pair]
        biases = self.expert_biases or []
        self.fused = (kernels.moe_experts([g.kernel() for g, _ in experts],
                                          [d.kernel() for _, d in experts], activation,
                                          [g for g, _ in biases], [d for _, d in biases])
                      if all(hasattr(layer, "kernel") for layer in layers) else None)
        self.shared = shared
        self.shared_gate = None if shared_gate is None else DenseLinear(shared_gate, "fp32")

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k] float32, experts [n, k]) each row takes, by descending probability."""
        logits = self.router(h)  # [n, E]
        if self.router_bias is not None:
            logits = logits + self.router_bias
        if self.topk_softmax:  # gpt-oss: the k largest logits, then a softmax over those k
            top, chosen = torch.topk(logits, self.per_token, dim=-1)
            return torch.softmax(top, dim=-1), chosen
        probs = torch.softmax(logits, dim=-1)
        weights, chosen = torch.topk(probs, self.per_token, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen

    def picks(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [n, k], weights [n, k]) each row takes, in ascending expert order: the
        order its experts' outputs are added in."""
        weights, chosen = self.route(h)
        chosen, order = chosen.sort(dim=-1)
        return chosen, weights.gather(-1, order)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.picks(h)
        if self.fused is not None:
            out = self.fused.forward(h, chosen, weights, kernels.isa())
        else:
            out = self._experts(h, chosen, weights)
        if self.shared is not None:
            gate_up, down = self.shared
            out = out + torch.sigmoid(self.shared_gate(h)) * down(self.activation(gate_up(h)))
        return out

    def _experts(self, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The fused kernel's sum in torch operations, for layers outside the kernels."""
        n, k = len(h), self.per_token
        picks = chosen.flatten()  # [n k]: row r's picks at r k .. r k + k - 1
        weighted = weights.flatten()[:, None]
        by_expert = torch.argsort(picks, stable=True)
        counts = torch.bincount(picks, minlength=len(self.experts)).tolist()
        terms = h.new_empty(n * k, h.shape[1])  # each pick's weighted expert output
        start = 0
        for expert, count in enumerate(counts):
            if count:
                taken = by_expert[start:start + count]
                gate_up, down = self.experts[expert]
                mixed = gate_up(h[taken // k])
                if self.expert_biases is not None:  # as the fused kernel adds them
                    mixed = mixed + self.expert_biases[expert][0]
                y = down(self.activation(mixed))
                if self.expert_biases is not None:
                    y = y + self.expert_biases[expert][1]
                terms[taken] = y * weighted[taken]
                start += count
        terms = terms.view(n, k, -1)
        out = terms[:, 0]
        for slot in range(1, k):
            out = out + terms[:, slot]
        return out


def activation_kernel(name: str):
    """The gate activation's kernel by ``transformers``' name (or "gpt_oss": its experts')."""
    return {"gelu_pytorch_tanh": kernels.geglu, "gpt_oss": kernels.oss_glu}.get(name, kernels.swiglu)


def unstacked_experts(tensors, prefix: str, experts: int):
    """Layer ``prefix``'s expert tensors under per-expert names
    (``mlp.experts.J.{gate,up,down}_proj.{weight,bias}``, the router as ``mlp.gate.{weight,bias}``):
    ``tensors`` itself where it holds them so (checkpoints of the other families, GGUF files),
    else a dict made from gpt-oss's stacked ones: ``gate_up_proj`` [E, H, 2 I] with gate and
    up interleaved (gate = [..., ::2]) and ``down_proj`` [E, I, H], both applied as x @ W, or
    the released checkpoints' MXFP4 ``*_blocks`` and ``*_scales`` (rows: the outputs, gate and
    up interleaved), kept as block int8 with their exact values."""
    stacked = prefix + "mlp.experts."
    packed = stacked + "gate_up_proj_blocks" in tensors
    if stacked + "gate_up_proj" not in tensors and not packed:
        return tensors
    gate_up_bias = as_float(tensors[stacked + "gate_up_proj_bias"])  # [E, 2 I]
    down_bias = as_float(tensors[stacked + "down_proj_bias"])  # [E, H]
    require(len(gate_up_bias) == experts, f"{stacked}gate_up_proj_bias holds {len(gate_up_bias)} "
                                          f"experts, the config says {experts}")
    out = {prefix + "mlp.gate.weight": tensors[prefix + "mlp.router.weight"],
           prefix + "mlp.gate.bias": tensors[prefix + "mlp.router.bias"]}
    for j in range(experts):
        p = f"{stacked}{j}."
        out[p + "gate_proj.bias"] = gate_up_bias[j, 0::2].contiguous()
        out[p + "up_proj.bias"] = gate_up_bias[j, 1::2].contiguous()
        out[p + "down_proj.bias"] = down_bias[j]
    if packed:  # the released checkpoints: MXFP4 [E, out, in / 32, 16], kept exact as block int8
        for j in range(experts):
            p = f"{stacked}{j}."
            gate_up = decode_mxfp4_pairs(tensors[stacked + "gate_up_proj_blocks"][j],
                                         tensors[stacked + "gate_up_proj_scales"][j])  # [2 I, H]
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = (
                _rows(gate_up, slice(0, None, 2)), _rows(gate_up, slice(1, None, 2)))
            out[p + "down_proj.weight"] = decode_mxfp4_pairs(
                tensors[stacked + "down_proj_blocks"][j], tensors[stacked + "down_proj_scales"][j])
        return out
    gate_up = as_float(tensors[stacked + "gate_up_proj"])  # [E, H, 2 I]
    down = as_float(tensors[stacked + "down_proj"])  # [E, I, H]
    for j in range(experts):
        p = f"{stacked}{j}."
        out[p + "gate_proj.weight"] = gate_up[j, :, 0::2].t().contiguous()  # [I, H]
        out[p + "up_proj.weight"] = gate_up[j, :, 1::2].t().contiguous()
        out[p + "down_proj.weight"] = down[j].t().contiguous()  # [H, I]
    return out


def _rows(weight: Int8BlockWeight, rows: slice) -> Int8BlockWeight:
    return Int8BlockWeight(weight.codes[rows].contiguous(), weight.scale[rows].contiguous(), None,
                           weight.group)
