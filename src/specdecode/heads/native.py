"""Any drafter network on the native kernels, converted when it is loaded for drafting.

Drafter networks are trained as plain torch modules; drafting reads their weights a few rows at
a time, which is bound by reading weights and by Python's dispatch of many small operations.
:func:`to_native` walks a module once, at load time, and replaces in place

- every ``nn.Linear`` (whatever network holds it) by a :class:`NativeLinear`: the same map in
  the native kernels with int4 weights (Q4_1's blocks, as the default runner's: an eighth of
  float32's bytes), int8 (Q8_0's blocks: a quarter) or bf16 (half), bias and residual added in
  the kernel's output;
- the networks' own :class:`~specdecode.heads.layers.RMSNorm` by the kernels' RMSNorm and
  their SwiGLU :class:`~specdecode.heads.layers.MLP` by the kernels' fused gate (one call for
  the five small operations of each).

So a new drafter built of these parts (or of any ``nn.Linear``) drafts on the kernels with no
code of its own. Its drafts may change slightly (4- or 8-bit weights, int8 activations per 32
inputs): exactness is the verifier's, and the draft quality is measured in docs/draft-heads.md.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode import kernels
from specdecode.errors import require
from specdecode.heads.layers import MLP, RMSNorm

#: weight formats of a converted network: the kernels' int4, int8 or bf16, or fp32 = left in
#: torch (int4 is the heads' default: a draft step reads its weights a row or a few at a time,
#: so half of int8's bytes is what makes it faster, at the same acceptance, docs/draft-heads.md)
DRAFT_WEIGHTS = ("int4", "int8", "bf16", "fp32")


def scoring_layer(weight: torch.Tensor, fmt: str = "int8"):
    """``weight`` [out, in] as a linear layer in the native kernels where they load (``fmt``;
    int4 falls back to int8 where ``in`` is not a multiple of its group), else float32
    through ATen."""
    from specdecode.models.quant import INT4_GROUP, LibraryLinear, make_linear

    if not kernels.available():
        return LibraryLinear(weight.float(), torch.float32)
    if fmt == "int4" and weight.shape[1] % INT4_GROUP:
        fmt = "int8"
    return make_linear(weight.float(), fmt)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] as the contiguous float32 [rows, k] the kernels take (a view where it is one)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    return flat


class NativeLinear(nn.Module):
    """A trained ``nn.Linear`` in the native kernels (``fmt``: int4, int8 or bf16 weights), over
    activations of any leading shape; ``residual`` (the output's shape) is added in the
    kernel."""

    def __init__(self, linear: nn.Linear, fmt: str = "int8"):
        super().__init__()
        self.out_features = linear.out_features
        self.layer = scoring_layer(linear.weight.detach(), fmt)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        if self.bias is not None:
            residual = self.bias if residual is None else residual + self.bias
            residual = residual.expand(shape)
        y = self.layer(_rows(x), None if residual is None else _rows(residual))
        return y.view(shape)


class NativeRMSNorm(nn.Module):
    """:class:`RMSNorm` in the kernels (one call)."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight = norm.weight.detach().float().contiguous()
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(_rows(x), self.weight, self.eps).view(x.shape)


class NativeMLP(nn.Module):
    """:class:`MLP` (SwiGLU) in the kernels: gate and up, the gate, down plus the residual
    (three calls)."""

    def __init__(self, mlp: MLP, fmt: str):
        super().__init__()
        self.gate_up = NativeLinear(mlp.gate_up, fmt)
        self.down = NativeLinear(mlp.down, fmt)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        hidden = kernels.swiglu(_rows(self.gate_up(x)))
        return self.down(hidden, residual).view(*x.shape[:-1], -1)


def _native(child: nn.Module, fmt: str) -> nn.Module | None:
    if isinstance(child, nn.Linear):
        return NativeLinear(child, fmt)
    if type(child) is RMSNorm:  # not a subclass that norms otherwise (EAGLE-3's PartNorm)
        return NativeRMSNorm(child)
    if isinstance(child, MLP):
        return NativeMLP(child, fmt)
    return None


def to_native(module: nn.Module, fmt: str = "int8") -> nn.Module:
    """``module`` with its linear maps, norms and MLPs converted in place (see the module
    docstring); for drafting only (the kernels do not backpropagate). ``fmt`` fp32, or kernels
    that do not build here: the module unchanged."""
    require(fmt in DRAFT_WEIGHTS, f"unknown draft weight format {fmt!r}; known: "
                                  f"{', '.join(DRAFT_WEIGHTS)}")
    if fmt == "fp32" or not kernels.available():
        return module
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            converted = _native(child, fmt)
            if converted is not None:
                setattr(parent, name, converted)
    return module
