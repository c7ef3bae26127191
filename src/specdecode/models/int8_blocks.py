"""Block int8 weights: int8 codes with a float32 scale (and optionally a minimum) per group of
16 or 32 inputs, w = scale * code (+ minimum). The one format that holds every GGUF block type
of 4 to 8 bits with the file's own values (ggml-quants.c's block layouts; ``gguf.quants``
dequantises them in numpy with the float32 operations that the kernels' ``repack.h`` decodes
them with):

    type   weights a block  codes      scale (float32)   minimum      group
    Q8_0   32               -128..127  d                 -            32
    Q4_0   32               -8..7      d                 -            32
    Q4_1   32               0..15      d                 m            32
    Q5_0   32               -16..15    d                 -            32
    Q5_1   32               0..31      d                 m            32
    Q4_K   256 (8 x 32)     0..15      d * sc            -(dmin * m)  32
    Q5_K   256 (8 x 32)     0..31      d * sc            -(dmin * m)  32
    Q6_K   256 (16 x 16)    -32..31    d * sc            -            16
    MXFP4  32               -12..12    2^(e - 128)       -            32
    Q3_K, IQ4_NL, IQ4_XS: models/q3k_iq4_blocks.py; Q2_K: models/q2k_blocks.py
    IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S: models/iq_grid_blocks.py

d, m and dmin are the file's float16 numbers, sc and m the K-quants' 6-bit (Q6_K: 8-bit signed)
sub-block integers. MXFP4 (gpt-oss's experts) holds an e8m0 exponent byte e and 4-bit e2m1
codes, whose values doubled are the integers 0, 1, 2, 3, 4, 6, 8, 12 and their negatives (hence
the halved scale, as ggml's e8m0_to_fp32_half computes it: a power of two, exact in float32).
Every product d * sc has at most 11 + 7 significant bits and every scale * code at most 23, so
float32 holds them exactly: ``Int8BlockWeight.dequantize`` gives gguf's float32 weights bit for
bit (gguf rounds only where it adds the minimum, and so does
it). The int4 format (``quant.Int4Linear``) keeps float16 scales, which Q4_K's products do not
always fit; this one does not round them.

``Int8BlockLinear`` multiplies by them in the native kernels (``kernels/q8_blocks.h``; where
the codes are 5 bits, ``kernels/small_codes.h`` computes the same numbers from the file's own
bytes):
activations are quantised to int8 per row and per 32 inputs (as in the int4 kernel, and as
finely as llama.cpp's own Q8_0/Q8_1 activations), each group's integer dot product is exact,
and one or two fused multiply-adds per group fold it in, in group order: row invariant by
construction, the same bits on every instruction set. A matrix that is Q6_K throughout
(``Q6KWeight``) keeps the file's bytes and its own numbers (``kernels/small_codes.h``): its
8-bit sub-block scales are folded in integers against activations quantised per 256 inputs,
as llama.cpp folds Q6_K against its Q8_K, one fused multiply-add per 256 inputs instead of 16;
so do Q2_K matrices (``Q2KWeight``) and, on AVX-512 VNNI CPUs without AMX, Q4_K and Q5_K ones
(``Q4KWeight``, ``Q5KWeight``), their minimums folded likewise, and IQ4_XS ones
(``IQ4XSWeight``), their codes as indices into the IQ4 values.
``quantize_int8_blocks`` makes the format from float weights (``--weights int8``): GGUF Q8_0's
scheme, symmetric per 32 inputs with a float16 scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdecode import kernels
from specdecode.errors import SpecDecodeError, require
from specdecode.models import iq_grid_blocks, q2k_blocks, q3k_iq4_blocks

#: inputs per group that the kernel accepts; activations are quantised per 32 in any case
GROUPS = (16, 32)
#: input group of ``quantize_int8_blocks`` (a Q8_0 block)
INT8_GROUP = 32
#: bytes of one block, per GGUF type this module decodes
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24,
               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "MXFP4": 17, **q3k_iq4_blocks.BLOCK_BYTES,
               "Q2_K": q2k_blocks.BLOCK_BYTES, **iq_grid_blocks.BLOCK_BYTES}
#: weights of one block, per GGUF type
BLOCK_WEIGHTS = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32,
                 "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "MXFP4": 32,
                 **q3k_iq4_blocks.BLOCK_WEIGHTS, "Q2_K": q2k_blocks.BLOCK_WEIGHTS,
                 **iq_grid_blocks.BLOCK_WEIGHTS}


def _codebook(values: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """A table of sixteen codes (int8 [16]) and the map code + 128 -> its index in it (255: not
    one of them; a padding 0: any of its slots, which all hold 0)."""
    index = np.full(256, 255, np.uint8)
    index[values.astype(np.int16) + 128] = np.arange(16)
    return torch.from_numpy(values.copy()), index


#: the tables of sixteen codes that the codebook layouts index: the IQ4 types' (first), the
#: grid I-quants'
_CODEBOOKS = [_codebook(q3k_iq4_blocks.IQ4_VALUES),
              *(_codebook(values) for values in iq_grid_blocks.CODEBOOKS.values())]
#: MXFP4's e2m1 code -> its value doubled (ggml-common.h's kvalues_mxfp4)
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


@dataclass(frozen=True)
class Int8BlockWeight:
    """w[o, i] = scale[o, i // group] * codes[o, i] (+ minimum[o, i // group]).

    ``codes`` int8 [out, in]; ``scale`` and ``minimum`` (or None) float32 [out, in / group];
    ``group`` 16 or 32."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    group: int

    def __post_init__(self):
        require(self.group in GROUPS, f"block int8 groups are {GROUPS}, not {self.group}")
        require(self.codes.dtype == torch.int8 and self.codes.dim() == 2,
                f"codes must be int8 [out, in], got {self.codes.dtype} {tuple(self.codes.shape)}")
        out, inp = self.codes.shape
        require(inp % self.group == 0,
                f"codes have {inp} inputs, not a whole number of groups of {self.group}")
        expected = (out, inp // self.group)
        for name, t in (("scale", self.scale), ("minimum", self.minimum)):
            if t is None and name == "minimum":
                continue
            require(t is not None and t.dtype == torch.float32 and tuple(t.shape) == expected,
                    f"{name} must be float32 {list(expected)}, got "
                    f"{None if t is None else (t.dtype, tuple(t.shape))}")

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: scale * code, then + minimum (gguf's float32 operations)."""
        out, inp = self.codes.shape
        w = self.scale[..., None] * self.codes.float().reshape(out, -1, self.group)
        if self.minimum is not None:
            w = w + self.minimum[..., None]
        return w.reshape(out, inp)

    def take(self, index: torch.Tensor) -> Int8BlockWeight:
        """Rows ``index`` (a slice or a tensor of row numbers: q/k rows unpermuted, a head's
        shortlist), in this weight's form (its scales' factors too)."""
        require(getattr(self, "scaled_rows", -1) == -1, "rows of a partly scaled weight")
        return dataclasses.replace(self, **{name: t[index] for name, t in self._tensors()})

    def _tensors(self):
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)]

    def scaled(self, factor: float) -> Int8BlockWeight:
        """The weights times ``factor`` (a query scale folded in): scales and minimums times it
        in float32. A weight whose kernels read its scales' factors (``Q6KWeight``,
        ``IQ4XSWeight``, ``Q4KWeight``, ``Q2KWeight``) keeps those, whose float16 super-block
        scales would not hold the product, and carries ``factor`` as its ``input_scale``, which
        the kernel multiplies the activations' scales by."""
        numbers = {"scale": self.scale * factor,
                   "minimum": None if self.minimum is None else self.minimum * factor}
        if hasattr(self, "input_scale"):
            numbers["input_scale"] = self.input_scale * factor
        return dataclasses.replace(self, **numbers)

    def regroup(self, group: int) -> Int8BlockWeight:
        """The same weights in groups of ``group`` (a divisor of this one's): scales and
        minimums repeated, so every weight is unchanged."""
        require(self.group % group == 0, f"cannot regroup groups of {self.group} into {group}")
        factor = self.group // group
        if factor == 1:
            return self
        spread = lambda t: None if t is None else t.repeat_interleave(factor, 1)  # noqa: E731
        return Int8BlockWeight(self.codes, spread(self.scale), spread(self.minimum), group)

    @staticmethod
    def cat(parts: Sequence[Int8BlockWeight]) -> Int8BlockWeight:
        """``parts`` stacked along ``out`` (fused q/k/v or gate/up), in the finest group among
        them; where some have minimums and others not, the others get -0.0 (w + -0.0 == w for
        every float w, -0.0 included): every weight is unchanged."""
        require(len(parts) > 0 and len({p.codes.shape[1] for p in parts}) == 1,
                "block int8 parts must share their input size")
        if len(parts) == 1:  # (a copy of a whole LM head would be its size again in flight)
            return parts[0]
        kind = type(parts[0])
        if kind is not Int8BlockWeight and all(type(p) is kind for p in parts):
            # Q6_K, Q5_K, Q4_K or Q2_K throughout, one input scale (or a scaled q before its
            # unscaled k, the kernel told which rows): their scales' factors stacked
            one_scale = (len({p.input_scale for p in parts}) == 1
                         and all(p.scaled_rows == -1 for p in parts))
            if one_scale or all(fuses_scaled(parts[0], p) for p in parts[1:]):
                stacked = {name: torch.cat([getattr(p, name) for p in parts])
                           for name, _ in parts[0]._tensors()}
                return dataclasses.replace(parts[0], **stacked, scaled_rows=-1 if one_scale
                                           else parts[0].codes.shape[0])
        group = min(p.group for p in parts)
        parts = [p.regroup(group) for p in parts]
        minimum = None
        if any(p.minimum is not None for p in parts):
            minimum = torch.cat([torch.full_like(p.scale, -0.0) if p.minimum is None else p.minimum
                                 for p in parts])
        return Int8BlockWeight(torch.cat([p.codes for p in parts]),
                               torch.cat([p.scale for p in parts]), minimum, group)


def fuses_scaled(q: Int8BlockWeight, k: Int8BlockWeight) -> bool:
    """Whether :meth:`Int8BlockWeight.cat` keeps ``k`` after ``q`` in their own kind: ``q`` a
    kind that keeps its scales' factors, scaled (a query scale as its ``input_scale``), in whole
    tiles of rows, ``k`` of its kind unscaled, neither partly scaled already; the kernel then
    applies the input scale to ``q``'s rows alone (``scaled_rows``)."""
    return (type(k) is type(q) and getattr(q, "scaled_rows", None) == -1 and k.scaled_rows == -1
            and q.input_scale != 1.0 and k.input_scale == 1.0
            and q.codes.shape[0] % kernels.TILE == 0)


@dataclass(frozen=True)
class SuperScaledWeight(Int8BlockWeight):
    """Block int8 (scale = d * sc) that also keeps the factors of its scales, the integer
    ``sub_scale`` sc int8 [out, in / group] and the float16 ``super_scale`` d [out, in / 256], so
    that the kernels can hold it in the file's codes and fold sc in integers
    (``kernels/small_codes.h``); one of the kinds below."""

    sub_scale: torch.Tensor
    super_scale: torch.Tensor
    #: the kernel's factor on the activations' scales (``scaled``): w = input_scale * d * sc * q
    input_scale: float = 1.0
    #: the leading rows ``input_scale`` is of (-1: all): a scaled q fused with its k (``cat``)
    scaled_rows: int = -1


@dataclass(frozen=True)
class Q6KWeight(SuperScaledWeight):
    """A GGUF Q6_K matrix (groups of 16, 8-bit sc), held in the file's own 6.6 bits a weight
    (``kernels.pack_q6k``); GGUF Q3_K's in this form too (``kernels.pack_q3k``)."""


@dataclass(frozen=True)
class IQ4XSWeight(SuperScaledWeight):
    """A GGUF IQ4_XS matrix (groups of 32, codes from the IQ4 values, sc = ls - 32), which a VNNI
    CPU without AMX holds as indices in 0.55 bytes a weight (``kernels.pack_iq4xs``:
    ``vnni_own_layouts``); other CPUs as block int8 or a codebook layout, which read the
    scales d * sc as floats."""


@dataclass(frozen=True)
class SubMinsWeight(Int8BlockWeight):
    """A K-quant matrix with minimums as block int8 (scale = d * sc, minimum = -(dmin * m)) that
    also keeps the factors, ``sub_scale`` sc and ``sub_min`` m [out, in / group] and
    ``super_scale`` d and ``super_min`` dmin float16 [out, in / 256], so that the kernels hold
    it in the file's codes and fold sc and m in integers (``kernels/small_codes.h``); one of the
    kinds below."""

    sub_scale: torch.Tensor
    sub_min: torch.Tensor
    super_scale: torch.Tensor
    super_min: torch.Tensor
    #: as ``Q6KWeight``'s
    input_scale: float = 1.0
    scaled_rows: int = -1


@dataclass(frozen=True)
class Q4KWeight(SubMinsWeight):
    """A GGUF Q4_K matrix (groups of 32, codes 0..15, sc and m 0..63), which a VNNI CPU without
    AMX holds in 0.58 bytes a weight (``kernels.pack_q4k``; the file's 0.56:
    ``vnni_own_layouts``)."""


@dataclass(frozen=True)
class Q5KWeight(Q4KWeight):
    """A GGUF Q5_K matrix: :class:`Q4KWeight`'s form with codes 0..31, held in 0.70 bytes a
    weight (``kernels.pack_q5k``; the file's 0.69) where Q4_K's layout is."""


@dataclass(frozen=True)
class Q2KWeight(SubMinsWeight):
    """A GGUF Q2_K matrix (groups of 16, codes 0..3, sc and m 0..15), held in the file's own
    0.33 bytes a weight on every CPU (``kernels.pack_q2k``)."""


def quantize_int8_blocks(weight: torch.Tensor, group: int = INT8_GROUP) -> Int8BlockWeight:
    """Symmetric block int8 of float ``weight`` [out, in], GGUF Q8_0's scheme: per ``group``
    inputs a scale of max|w| / 127 rounded up to a float16 number (up: no code passes 127; the
    kernel reads float16 scales in half the bytes), code = round(w / scale) in -127..127 (from
    the rounded scale, so each weight is within half a step). Scales beyond float16's range stay
    float32. ``in`` is padded with zero weights to a whole number of groups."""
    require(weight.dim() == 2, f"a weight matrix is [out, in], got {tuple(weight.shape)}")
    w = weight.float()
    extra = -w.shape[1] % group
    if extra:
        w = torch.nn.functional.pad(w, (0, extra))
    out, inp = w.shape
    blocks = w.view(out, inp // group, group)
    scale = blocks.abs().amax(-1) / 127
    half = scale.half()
    up = torch.where(half.float() < scale, (half.view(torch.int16) + 1).view(torch.float16), half)
    if up.isfinite().all():
        scale = up.float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (blocks / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Int8BlockWeight(codes.view(out, inp), scale, None, group)


# ---- GGUF blocks ---------------------------------------------------------------------------

def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's scale exponents as float32 2^(e - 128), exactly: a subnormal for e < 2 (ggml's
    e8m0_to_fp32_half builds it from the bits)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def decode_mxfp4_pairs(blocks: torch.Tensor, scales: torch.Tensor) -> Int8BlockWeight:
    """A Hugging Face checkpoint's MXFP4 matrix (gpt-oss's ``*_blocks`` uint8 [out, in / 32,
    16] and ``*_scales`` uint8 [out, in / 32]) as block int8, every weight exact. Byte i of a
    block holds inputs 2i (low nibble) and 2i + 1 (high nibble), transformers'
    ``convert_moe_packed_tensors`` layout; a weight is FP4(code) * 2^(s - 127), which is
    the doubled e2m1 value times 2^(s - 128), as in a GGUF file's MXFP4."""
    b = blocks.numpy()
    require(b.dtype == np.uint8 and b.ndim == 3 and b.shape[2] == 16
            and tuple(scales.shape) == b.shape[:2],
            f"MXFP4 blocks must be uint8 [out, in / 32, 16] with scales [out, in / 32], got "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    codes = np.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1)  # [out, in]
    return Int8BlockWeight(torch.from_numpy(_MXFP4_VALUES[codes]),
                           torch.from_numpy(_e8m0_half(scales.numpy())), None, 32)


def _q4k_factors(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K (Q5_K) blocks' (uint8 [blocks, 144 (176)]) sub-block scales and minimums (uint8
    [blocks, 8], 0..63: ggml-quants.c's get_scale_min_k4 over the 12 bytes after d and dmin)
    and their d and dmin (float16 [blocks, 1])."""
    q = blocks[:, 4:16]
    low, high = q[:, 0:4], q[:, 4:8]  # sub-blocks 0-3 in the low 6 bits; 4-7's top 2 bits
    sc = np.concatenate([low & 63, (q[:, 8:12] & 15) | (low >> 6) << 4], 1)
    m = np.concatenate([high & 63, (q[:, 8:12] >> 4) | (high >> 6) << 4], 1)
    d, dmin = (blocks[:, at:at + 2].copy().view(np.float16) for at in (0, 2))
    return sc, m, d, dmin


def decode_gguf_blocks(raw: np.ndarray, qtype: str) -> Int8BlockWeight:
    """A GGUF tensor's block data (uint8 [rows, bytes a row], as ``gguf.GGUFReader`` maps it)
    of type ``qtype`` (a ``GGMLQuantizationType`` name) as block int8, every weight exact (the
    table above, decoded by the kernels' ``repack.h``)."""
    require(qtype in BLOCK_BYTES, f"block int8 decodes {', '.join(BLOCK_BYTES)}, not {qtype}")
    raw = np.asarray(raw)
    require(raw.dtype == np.uint8 and raw.ndim == 2 and raw.shape[1] % BLOCK_BYTES[qtype] == 0,
            f"{qtype} data must be uint8 [rows, a multiple of {BLOCK_BYTES[qtype]} bytes], got "
            f"{raw.dtype} {raw.shape}")
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, BLOCK_BYTES[qtype])
    if qtype == "Q2_K":  # decoded in numpy (models/q2k_blocks.py)
        codes, scale, minimum, *factors = (torch.from_numpy(t.reshape(rows, -1))
                                           for t in q2k_blocks.decode_q2k(blocks))
        return Q2KWeight(codes, scale, minimum, 16, *factors)
    if qtype in iq_grid_blocks.BLOCK_BYTES:  # decoded in numpy (models/iq_grid_blocks.py)
        codes, scale = iq_grid_blocks.decode_iq_grid(blocks, qtype)
        return Int8BlockWeight(torch.from_numpy(codes.reshape(rows, -1)),
                               torch.from_numpy(scale.reshape(rows, -1)), None,
                               256 // scale.shape[1])
    if qtype in q3k_iq4_blocks.BLOCK_BYTES:  # decoded in numpy (models/q3k_iq4_blocks.py)
        d = q3k_iq4_blocks.decode_q3k_iq4(blocks, qtype)
        codes, scale = (torch.from_numpy(t.reshape(rows, -1)) for t in (d.codes, d.scale))
        if d.sub_scale is None:
            return Int8BlockWeight(codes, scale, None, d.group)
        factors = (torch.from_numpy(t.reshape(rows, -1)) for t in (d.sub_scale, d.super_scale))
        kind = IQ4XSWeight if qtype == "IQ4_XS" else Q6KWeight
        return kind(codes, scale, None, d.group, *factors)
    codes, scale, minimum = kernels.load().decode_blocks(torch.from_numpy(blocks), qtype)
    codes, scale = codes.view(rows, -1), scale.view(rows, -1)
    group = 16 if qtype == "Q6_K" else 32
    if qtype in ("Q4_K", "Q5_K"):  # the scales' factors too
        factors = (torch.from_numpy(t.reshape(rows, -1)) for t in _q4k_factors(blocks))
        kind = Q4KWeight if qtype == "Q4_K" else Q5KWeight
        return kind(codes, scale, minimum.view(rows, -1), group, *factors)
    if qtype == "Q6_K":  # the scales' factors too: sc (bytes 192..207) and d (208..209)
        return Q6KWeight(codes, scale, None, group,
                         torch.from_numpy(blocks[:, 192:208].view(np.int8).copy().reshape(rows, -1)),
                         torch.from_numpy(blocks[:, 208:210].copy().view(np.float16).reshape(rows, -1)))
    return Int8BlockWeight(codes, scale, minimum.view(rows, -1) if minimum.numel() else None, group)


# ---- the linear layer -----------------------------------------------------------------------

#: bytes a weight ``Int8BlockLinear`` holds of a matrix of one GGUF type, by its layout
#: (kernels/small_codes.h, q8_blocks.h): (on a CPU without AMX, with AMX); Q4_0, Q4_1 and
#: Q4_K are the int8 runner's (Q4_K's, Q5_K's and IQ4_XS's on AVX-512 VNNI without AMX:
#: ``OWN_LAYOUT_BYTES``)
HELD_BYTES = {"Q8_0": (1.0625, 1.0625), "Q5_0": (0.6875, 0.6875), "Q5_1": (0.75, 0.75),
              "MXFP4": (0.6875, 0.6875), "Q6_K": (0.828125, 0.828125), "Q5_K": (0.875, 1.25),
              "Q3_K": (0.578125, 0.828125), "IQ4_NL": (0.5625, 1.0625),
              "IQ4_XS": (0.625, 1.125), "Q4_0": (0.6875, 0.6875), "Q4_1": (0.75, 0.75),
              "Q4_K": (0.875, 1.25), "Q2_K": (0.328125, 0.328125),
              "IQ3_XXS": (0.625, 0.625), "IQ2_XXS": (0.625, 0.625), "IQ2_XS": (0.75, 0.75),
              "IQ2_S": (0.75, 0.75),
              **{qtype: (0.75, 0.75) for qtype in iq_grid_blocks.ODD_GRID_TYPES}}


#: bytes a weight of a Q4_K, Q5_K or IQ4_XS matrix in its own layout (``vnni_own_layouts``)
OWN_LAYOUT_BYTES = {"Q4_K": 0.578125, "Q5_K": 0.703125, "IQ4_XS": 0.546875}


def _without_amx() -> bool:
    """Whether this CPU lacks AMX tiles: Q5_K's, Q3_K's and the IQ4 types' own layouts
    (five_bit32, q3k, the IQ4 codebook) are held only then. With AMX, block int8 and Q6_K's
    layout multiply many rows on the tiles, which those layouts have no kernels for."""
    return kernels.isa() <= kernels.ISA_LEVELS.index("avx512")


def vnni_own_layouts() -> bool:
    """Whether this CPU holds GGUF Q4_K, Q5_K and IQ4_XS matrices in their own layouts (``q4k``,
    for the int4 runner too, ``q5k`` and ``iq4xs``: :class:`Q4KWeight`, :class:`Q5KWeight`,
    :class:`IQ4XSWeight`): where its best kernels are AVX-512 VNNI without AMX. With AMX int4's
    Q4_1 blocks and block int8 take many rows on the tiles; on AVX2 alone int4's Q4 kernel is
    the faster from 4 rows (and IQ4_XS's signed codes need block int8's arithmetic there)."""
    return _without_amx() and kernels.isa() == kernels.ISA_LEVELS.index("avx512")


def held_bytes_per_weight(qtype: str) -> float:
    """Bytes a weight of a matrix all of GGUF ``qtype`` held as block int8 on this CPU
    (``HELD_BYTES``, ``OWN_LAYOUT_BYTES``; a fused layer of several types holds up to 1.5)."""
    if qtype in OWN_LAYOUT_BYTES and vnni_own_layouts():
        return OWN_LAYOUT_BYTES[qtype]
    return HELD_BYTES[qtype][0 if _without_amx() else 1]


def _five_bit_codes(weight: Int8BlockWeight) -> bool:
    """Whether ``weight``'s codes fit in 5 bits as the five-bit layout stores them: -16..15,
    or 0..31 where there are minimums."""
    low, high = (0, 31) if weight.minimum is not None else (-16, 15)
    return weight.group == 32 and low <= int(weight.codes.min()) and int(weight.codes.max()) <= high


def _q3k_codes(weight: Q6KWeight) -> bool:
    """Whether a Q6_K-form ``weight``'s codes fit in the ``q3k`` layout's 4 bits (-8..7: GGUF
    Q3_K's -4..3)."""
    def fits(codes: torch.Tensor) -> bool:
        return -8 <= int(codes.min()) and int(codes.max()) <= 7

    return fits(weight.codes[0]) and fits(weight.codes)  # a first row tells Q6_K apart cheaply


def _codebook_indices(weight: Int8BlockWeight,
                      codebooks) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first of ``codebooks`` (``_CODEBOOKS``' entries) that holds every code of ``weight``
    (int8 [16]) and the codes as indices into it (uint8 [out, in]), where there is one and no
    minimums (GGUF IQ4_NL, IQ4_XS and grid I-quant matrices); else None."""
    if weight.minimum is not None:
        return None
    codes = weight.codes.numpy().view(np.uint8) ^ 0x80  # code + 128
    for codebook, index in codebooks:
        if (index[codes[0]] > 15).any():  # a first row tells other types apart cheaply
            continue
        indices = index[codes]
        if not (indices > 15).any():
            return codebook, torch.from_numpy(indices)
    return None


class Int8BlockLinear:
    """A linear layer of block int8 weights in the native kernels (see the module docstring)."""

    fmt = "int8"

    def __init__(self, weight: Int8BlockWeight, in_features: int | None = None):
        """``in_features``: the inputs a call gives, when ``weight`` has zero weights padded
        after them (``quantize_int8_blocks`` of an odd width); default all of its inputs."""
        own_layouts = vnni_own_layouts()
        if isinstance(weight, IQ4XSWeight) and not own_layouts:
            # (its codebook layout and block int8 read the scales d * sc, a query scale in them)
            weight = Int8BlockWeight(weight.codes, weight.scale, None, weight.group)
        out, inp = weight.codes.shape
        self.in_features = inp if in_features is None else in_features
        require(inp - INT8_GROUP < self.in_features <= inp,
                f"in_features {self.in_features} does not fit a weight of {inp} inputs")
        self.out_features = out
        self.group = weight.group
        self.has_minimum = weight.minimum is not None
        self.input_scale = getattr(weight, "input_scale", 1.0)  # (the super-block layouts')
        # (of its first scaled_columns outputs: a Q4_K q fused with its k; -1: all)
        self.scaled_columns = getattr(weight, "scaled_rows", -1)
        # float16 scales where they are float16 numbers (Q8_0, Q4_0/1, Q5_0/1, --weights int8):
        # the same numbers in fewer bytes (a row reads 1.0625 bytes a weight, not 1.125)
        numbers = [t for t in (weight.scale, weight.minimum) if t is not None]
        self.half = weight.group == 32 and all(torch.equal(t.half().float(), t) for t in numbers)
        # the file's own bytes where the codes are 2 to 6 bits (kernels/small_codes.h): a Q6_K
        # matrix in 0.83 bytes a weight, not 1.25, with its sub-block scales folded in
        # integers; a Q2_K one in 0.33, not 1.5 (its minimums folded in integers too), on any
        # CPU; Q5_0, Q5_1 or MXFP4 in 0.69-0.75, not 1.06-1.13: block int8's numbers. On a
        # CPU without AMX likewise (as five_bit32) Q5_K (float32 scales) in 0.875, not 1.25;
        # IQ4_NL or IQ4_XS codes as their 4-bit indices, 0.56 or 0.63 bytes a weight, not 1.06
        # or 1.13; Q3_K's codes in Q6_K's layout without the top bits, 0.58, not 0.83.
        # IQ3_XXS or IQ2_XXS codes as indices in 0.63 on every CPU, IQ2_XS or IQ2_S codes (a
        # scale per 16) in 0.75: block int8 would hold 2.9 to 4.4 times the file's bytes. And
        # on a VNNI CPU without AMX a Q4_K matrix in 0.58 (its scales and minimums folded in
        # integers, as Q2_K's), not int4's 0.625 or five_bit32's 0.875, a Q5_K one in 0.70 and
        # an IQ4_XS one in 0.55 (its sub-block scales folded in integers), not codebook32's 0.63
        small = _without_amx()
        # (a Q6_K or Q2_K matrix keeps its own layout, whatever its codes; the IQ4 types' table
        # is the first)
        found = (_codebook_indices(weight, _CODEBOOKS if small else _CODEBOOKS[1:])
                 if type(weight) in (Int8BlockWeight, IQ4XSWeight) else None)
        self.codebook, indices = found if found is not None else (None, None)
        q3k = small and isinstance(weight, Q6KWeight) and _q3k_codes(weight)
        self.layout = ("q2k" if isinstance(weight, Q2KWeight)
                       else {Q4KWeight: "q4k", Q5KWeight: "q5k"}[type(weight)]
                       if isinstance(weight, Q4KWeight) and own_layouts
                       else "iq4xs" if isinstance(weight, IQ4XSWeight) and indices is not None
                       else "q3k" if q3k
                       else "q6k" if isinstance(weight, Q6KWeight)
                       else ("codebook16" if weight.group == 16 else "codebook" if self.half
                             else "codebook32") if indices is not None
                       else "block" if not _five_bit_codes(weight)
                       else "five_bit" if self.half
                       else "five_bit32" if small
                       else "block")
        self.packed = self._packed(weight, indices)

    def _packed(self, weight: Int8BlockWeight, indices: torch.Tensor | None) -> torch.Tensor:
        """``weight`` in the bytes of ``self.layout`` (``indices``: a codebook layout's)."""
        if self.layout in ("q2k", "q4k", "q5k"):
            return getattr(kernels, f"pack_{self.layout}")(weight.codes, weight.sub_scale,
                                                            weight.sub_min, weight.super_scale,
                                                            weight.super_min)
        if self.layout == "iq4xs":
            return kernels.pack_iq4xs(indices, weight.sub_scale, weight.super_scale)
        if self.layout in ("q6k", "q3k"):
            return getattr(kernels, f"pack_{self.layout}")(weight.codes, weight.sub_scale,
                                                            weight.super_scale)
        if indices is not None:
            return kernels.pack_codebook(indices, weight.scale, half=self.half)
        if self.layout != "block":
            return kernels.pack_five_bit(weight.codes, weight.scale, weight.minimum,
                                         half=self.layout == "five_bit")
        return kernels.pack_q8_blocks(weight.codes, weight.scale, weight.minimum, weight.group,
                                      self.half)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8BlockLinear:
        return cls(quantize_int8_blocks(weight), in_features=weight.shape[1])

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        try:
            if self.layout != "block":
                return kernels.small_codes_linear(x, self.packed, self.layout, self.has_minimum,
                                                  self.out_features, residual, self.input_scale,
                                                  self.codebook, self.scaled_columns)
            return kernels.q8_linear(x, self.packed, self.group, self.has_minimum, self.half,
                                     self.out_features, residual)
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0]
            raise SpecDecodeError(f"block int8 linear [{self.out_features} x {self.in_features}]: "
                                  f"{reason}") from None

    def kernel(self):
        """This layer as the kernels' ``PackedLinear`` (for a ``LayerStack``)."""
        if self.layout == "block":
            return kernels.packed_linear(self.packed, kernels.BLOCK_INT8_KIND, self.out_features,
                                         self.group, self.has_minimum, self.half)
        # (the small-code kernel takes its layout's code where block int8 takes its group)
        return kernels.packed_linear(self.packed, kernels.SMALL_CODES_KIND, self.out_features,
                                     kernels.SMALL_CODES_LAYOUTS[self.layout], self.has_minimum,
                                     input_scale=self.input_scale, codebook=self.codebook,
                                     scaled_columns=self.scaled_columns)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()
