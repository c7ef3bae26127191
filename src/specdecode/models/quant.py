"""Weight formats of the native runner: one linear layer per format, all batch-invariant.

Every layer takes activations [m, in] in its ``in_dtype`` and returns [m, out] in the same dtype
(the caller converts: the model keeps its residual stream in float32, and the quantised layers
do not check, one call fewer per layer); what
differs is how the weight is held and which PyTorch CPU kernel multiplies by it:

    fp32  the weight as given; MKL sgemm, rows padded to a multiple of 4 (see below)
    bf16  bfloat16 weight and activations, float32 accumulation (oneDNN, AVX-512 BF16)
    int8  int8 weight with one bfloat16 scale per output channel: w = s[n] * q
          (``aten._weight_int8pack_mm``; its scales are per channel, not per group)
    int4  4-bit codes q in 0..15 in groups of 32 along the input dimension, a bfloat16 scale s
          and offset z per group: w = (q - 8) * s + z, i.e. w = s * q + (z - 8 s)
          (``aten._weight_int4pack_mm_for_cpu``; the same scheme as GGUF's Q4_1, w = d * q + m,
          as in gpt-fast's quantize.py)

The quantised kernels take bfloat16 activations on x86 (their float32 paths are scalar
fallbacks, 50-100x slower) and return bfloat16.

Batch invariance, measured on this CPU for each layer shape of SmolLM2, every row count 1..20
and every position of a row in the call: a row's result is bitwise the same whatever other rows
share the call for the int8 and int4 kernels. MKL's sgemm takes another kernel for 1, 2, 3, 5,
6, 7, 9, 10 or 11 rows, and oneDNN's bf16 GEMM another for one row when the input is 1536 wide
(about one row in 80 differs), so the fp32 and bf16 layers take a multiple of 4 rows
(``row_multiple``; 4, 8, 12, ... all agree); the runner pads once, before the first layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.errors import require

#: weight formats the native runner accepts, cheapest to compute first on a CPU
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
#: weights per int4 group: GGUF's Q4_0/Q4_1 block size
INT4_GROUP = 32
#: row multiple that keeps MKL's sgemm and oneDNN's bf16 GEMM on one kernel path (measured;
#: see the module docstring)
FP32_ROW_MULTIPLE = 4


def check_format(weights: str) -> None:
    require(weights in WEIGHT_FORMATS,
            f"unknown weight format {weights!r}; known formats: {', '.join(WEIGHT_FORMATS)}")


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -x.shape[0] % multiple
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


class Fp32Linear:
    fmt = "fp32"
    in_dtype = torch.float32
    row_multiple = FP32_ROW_MULTIPLE

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.float().contiguous()  # [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        return F.linear(pad_rows(x, FP32_ROW_MULTIPLE), self.weight)[:m]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 4


class Bf16Linear:
    fmt = "bf16"
    in_dtype = torch.bfloat16
    row_multiple = FP32_ROW_MULTIPLE

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        return F.linear(pad_rows(x.to(torch.bfloat16), FP32_ROW_MULTIPLE), self.weight)[:m]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 2


class Int8Linear:
    """Symmetric per-channel int8: s[n] = max|w[n]| / 127, q = round(w / s)."""

    fmt = "int8"
    in_dtype = torch.bfloat16
    row_multiple = 1

    def __init__(self, weight: torch.Tensor):
        require(hasattr(torch.ops.aten, "_weight_int8pack_mm"),
                f"int8 weights need torch.ops.aten._weight_int8pack_mm (torch >= 2.3); this is "
                f"torch {torch.__version__}: use --weights bf16")
        w = weight.float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12).to(torch.bfloat16)
        self.qweight = (w / scale.float()[:, None]).round().clamp(-128, 127).to(torch.int8)
        self.scale = scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm.default(x, self.qweight, self.scale)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 2


class Int4Linear:
    """Asymmetric group-wise int4 (Q4_1's scheme): per group of 32 inputs, d = (max - min) / 15,
    q = round((w - min) / d) in 0..15, so w ~ d * q + min."""

    fmt = "int4"
    in_dtype = torch.bfloat16
    row_multiple = 1

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor):
        """``codes`` [out, in] integers 0..15; ``scale``, ``minimum`` [out, in / 32]:
        w = scale * codes + minimum (GGUF Q4_1's d and m)."""
        require(hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                f"int4 weights need torch.ops.aten._weight_int4pack_mm_for_cpu (torch >= 2.6); "
                f"this is torch {torch.__version__}: use --weights int8 or bf16")
        out, inp = codes.shape
        require(inp % INT4_GROUP == 0,
                f"int4 needs input sizes divisible by {INT4_GROUP}, got {inp}; use --weights int8")
        # the kernel packs 16 output rows at a time: pad with zero rows, cut them off after
        extra = -out % 16
        codes, scale, minimum = (F.pad(t.float(), (0, 0, 0, extra)) for t in (codes, scale, minimum))
        # the kernel computes w = (q - 8) * s + z, so z = m + 8 d; [groups, out, 2]
        zero = minimum + 8 * scale
        self.scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).to(torch.bfloat16).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 2)
        self.out_features = out
        self.padded = extra > 0

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Linear:
        return cls(*quantize_int4(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu.default(
            x, self.packed, INT4_GROUP, self.scale_zero)
        return y[:, :self.out_features] if self.padded else y

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scale_zero.numel() * 2


def quantize_int4(weight: torch.Tensor):
    """(codes, scale, minimum) of ``weight`` [out, in], groups of 32 along ``in``."""
    out, inp = weight.shape
    require(inp % INT4_GROUP == 0,
            f"int4 needs input sizes divisible by {INT4_GROUP}, got {inp}; use --weights int8")
    groups = weight.float().reshape(out, inp // INT4_GROUP, INT4_GROUP)
    low = groups.amin(-1)
    scale = ((groups.amax(-1) - low) / 15).clamp_min(1e-12)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    return codes.reshape(out, inp), scale, low


def int4_kernel_weights(codes: torch.Tensor, scale: torch.Tensor,
                        minimum: torch.Tensor) -> torch.Tensor:
    """The float32 weights the int4 kernel multiplies by for these codes: it rounds the scale
    and offset to bfloat16 and dequantises with a fused multiply-add, (q - 8) * s + z."""
    s = scale.to(torch.bfloat16).float()
    z = (minimum.float() + 8 * scale.float()).to(torch.bfloat16).float()
    q = codes.float().reshape(*s.shape, INT4_GROUP) - 8
    return torch.addcmul(z[..., None], q, s[..., None]).reshape(codes.shape)


_LINEARS = {"fp32": Fp32Linear, "bf16": Bf16Linear, "int8": Int8Linear,
            "int4": Int4Linear.quantize}


def make_linear(weight: torch.Tensor, weights: str):
    """A linear layer holding ``weight`` [out, in] (float) in format ``weights``."""
    check_format(weights)
    return _LINEARS[weights](weight)
