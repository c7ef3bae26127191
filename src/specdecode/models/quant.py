"""Weight formats of the native runner: one linear layer per format, every one row-invariant
by construction.

Every layer takes float32 activations [m, in] and returns float32 [m, out] (optionally plus a
residual [m, out], added once at the end). What differs is how the weight is held:

    fp32  the weight as given
    bf16  bfloat16 weights (widened to float32 exactly, float32 products and sums)
    int8  int8 codes q with a float32 or float16 scale s (and minimum m) per 16 or 32 inputs,
          w = s * q (+ m): GGUF's 8, 6, 5 and 4-bit blocks as the file holds them, or float
          weights in Q8_0's scheme (``int8_blocks``); activations quantised as for int4
    int4  4-bit codes q in 0..15 in groups of 32 along the input dimension with a float16 scale
          d and minimum m per group, w = d * q + m: GGUF's Q4_1 block, held as the file holds
          it; the activations are quantised to int8 per row and per 32 inputs inside the
          kernel, and each group's integer dot product is exact (AVX-512 VNNI where the CPU
          has it)

The rule that makes a row's result independent of the rows beside it, on every x86-64 CPU:
the products that build a decode or verify row are never issued to a library whose kernel
choice depends on the call's shape (MKL, oneDNN and ATen pick other kernels, with other
orders of addition, for other row counts and on other CPUs). They run in our own kernels
(``specdecode/kernels``), where each output element is one thread's sum over the inputs in a
fixed order: for fp32 and bf16 one fused multiply-add per input, in input order; for int8 and
int4 an exact integer sum per group, then one or two fused multiply-adds per group, in group
order. The instruction set changes only the speed.

Prompts of the fp32 and bf16 formats are the exception: ``LibraryLinear`` runs them through
ATen's GEMM in their own precision, many rows at a time (int8 and int4 prompts go through
their own kernels, which are faster there). A prompt is the same computation for every method
(the same blocks of rows, in the same calls), so prefill needs no row invariance, only
determinism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdecode import kernels
from specdecode.errors import require
from specdecode.models.int8_blocks import Int8BlockLinear

#: weight formats the native runner accepts
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
#: weights per int4 group: GGUF's Q4_0/Q4_1 block size
INT4_GROUP = 32


@dataclass(frozen=True)
class Q4Weight:
    """A 4-bit weight as a GGUF file holds it (Q4_0/Q4_1): w = scale * codes + minimum, with
    ``codes`` [out, in] in 0..15 and ``scale``, ``minimum`` [out, in / 32]."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        # the same float32 operations as gguf's dequantisation (product, then sum)
        q = self.codes.float().reshape(*self.scale.shape, -1)
        return (self.scale[..., None] * q + self.minimum[..., None]).reshape(self.codes.shape)

    @staticmethod
    def cat(parts: Sequence[Q4Weight]) -> Q4Weight:
        return Q4Weight(*(torch.cat([getattr(p, f) for p in parts])
                          for f in ("codes", "scale", "minimum")))


def check_format(weights: str) -> None:
    require(weights in WEIGHT_FORMATS,
            f"unknown weight format {weights!r}; known formats: {', '.join(WEIGHT_FORMATS)}")


class DenseLinear:
    """fp32 or bf16 weights, packed once in 16-column tiles for the kernel."""

    def __init__(self, weight: torch.Tensor, fmt: str):
        require(fmt in ("fp32", "bf16"), f"dense layers hold fp32 or bf16 weights, not {fmt}")
        self.fmt = fmt
        self.out_features, self.in_features = weight.shape
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        self.packed = kernels.pack_dense(weight.float().to(dtype))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.dense_linear(x, self.packed, self.out_features, None, residual)

    def kernel(self):
        """This layer as the kernels' ``PackedLinear`` (for a ``LayerStack``)."""
        return kernels.packed_linear(self.packed, kernels.DENSE_KIND, self.out_features)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class Int4Linear:
    """GGUF Q4_1 blocks: w = d * q + m per group of 32 inputs, q in 0..15, d and m float16."""

    fmt = "int4"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor):
        """``codes`` [out, in] integers 0..15; ``scale``, ``minimum`` [out, in / 32]:
        w = scale * codes + minimum (GGUF Q4_1's d and m; rounded to float16 as the file
        stores them)."""
        out, inp = codes.shape
        require(inp % INT4_GROUP == 0,
                f"int4 needs input sizes divisible by {INT4_GROUP}, got {inp}; use --weights int8")
        self.packed = kernels.pack_q4(codes, scale, minimum)
        self.out_features = out

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Linear:
        return cls(*quantize_int4(weight))

    @classmethod
    def from_packed(cls, packed: torch.Tensor, out_features: int) -> Int4Linear:
        """A layer over weights already in ``kernels.pack_q4``'s layout (models/weights.py
        repacks a GGUF file's blocks into it without unpacking the codes)."""
        require(packed.dtype == torch.uint8 and packed.dim() == 3 and packed.shape[-1] == 320
                and packed.shape[0] * kernels.TILE >= out_features,
                f"not pack_q4's layout: {packed.dtype} {tuple(packed.shape)}")
        layer = cls.__new__(cls)
        layer.packed, layer.out_features = packed, out_features
        return layer

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.q4_linear(x, self.packed, self.out_features, residual)

    def kernel(self):
        """This layer as the kernels' ``PackedLinear`` (for a ``LayerStack``)."""
        return kernels.packed_linear(self.packed, kernels.INT4_KIND, self.out_features)

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * INT4_GROUP

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


class SplitLinear:
    """Matrices sharing an input, held in formats of their own and computed one after another,
    their outputs side by side. A Q4_K_M file's q and k are Q4_K and its v Q6_K in half the
    layers: fused, all three would be block int8 in groups of 16 (1.25 bytes a weight and the
    slow kernel of many folds); split, q/k run int4 and v Q6_K's own layout. A row's outputs are
    its parts' rows, each row invariant: so is the whole."""

    def __init__(self, parts: Sequence):
        require(len(parts) >= 2, "a split linear layer needs two parts or more")
        self.parts = list(parts)
        self.out_features = sum(part.out_features for part in parts)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], 1)
        return y if residual is None else y.add_(residual)

    def kernel(self):
        """This layer as the kernels' ``PackedLinear`` (for a ``LayerStack``)."""
        return kernels.split_linear([part.kernel() for part in self.parts])

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


class LibraryLinear:
    """ATen's GEMM for prompts (not row-invariant; see the module docstring), in ``dtype``."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.weight = weight.to(dtype).contiguous()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x.to(self.weight.dtype), self.weight).float()
        return y if residual is None else residual + y


def quantize_int4(weight: torch.Tensor):
    """(codes, scale, minimum) of ``weight`` [out, in] in Q4_1's scheme, groups of 32 along
    ``in``: d = (max - min) / 15 and m = min, both rounded to float16, q = round((w - m) / d)."""
    out, inp = weight.shape
    require(inp % INT4_GROUP == 0,
            f"int4 needs input sizes divisible by {INT4_GROUP}, got {inp}; use --weights int8")
    groups = weight.float().reshape(out, inp // INT4_GROUP, INT4_GROUP)
    low = groups.amin(-1).half().float()
    scale = ((groups.amax(-1) - low) / 15).clamp_min(1e-7).half().float()
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    return codes.reshape(out, inp), scale, low


def int4_weights(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 weights the int4 kernel multiplies by: d * q + m with d, m in float16."""
    d = scale.half().float()
    m = minimum.half().float()
    q = codes.float().reshape(*d.shape, INT4_GROUP)
    return (d[..., None] * q + m[..., None]).reshape(codes.shape)


def make_linear(weight: torch.Tensor, weights: str):
    """A linear layer holding ``weight`` [out, in] (float) in format ``weights``."""
    check_format(weights)
    if weights == "int4":
        return Int4Linear.quantize(weight)
    if weights == "int8":
        return Int8BlockLinear.quantize(weight)
    return DenseLinear(weight, weights)
