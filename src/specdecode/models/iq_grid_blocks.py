"""GGUF's grid I-quants IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S and IQ1_S as block int8, every
weight the file's own value.

These types store each group of 4 or 8 weights as an index into a grid of value vectors (Tseng
et al., "QuIP#: Even Better LLM Quantization with Hadamard Incoherence and Lattice Codebooks",
2024, as llama.cpp adapted it), with sign bits and a small integer scale per 32 (IQ2_XS, IQ2_S:
16) weights under a float16 super-block scale d. Their values are not evenly spaced (IQ3_XXS's
magnitudes 4, 12, .., 52, 62; IQ2_XXS's 8, 25, 43), so no Q4_1 block holds them, but every one
of them is d times a small integer: a weight is scale * code exactly, with an int8 code from a
table of at most sixteen values and a float32 scale per group (ggml-common.h's block layouts;
the grids are ``gguf.quants``' own; tested bit for bit against ``gguf.quants.dequantize``):

    type     bytes a block of 256  code                             scale                  group
    IQ3_XXS  98                    grid(4, 12, .., 52, 62) * sign   d * (0.5 + ls) * 0.5   32
    IQ3_S    110                   grid(1, 3, .., 15) * sign        d * (1 + 2 ls)         32
    IQ2_XXS  66                    grid(8, 25, 43) * sign           d * (0.5 + ls) * 0.25  32
    IQ2_XS   74                    grid(8, 25, 43) * sign           d * (0.5 + ls) * 0.25  16
    IQ2_S    82                    grid(8, 25, 43) * sign           d * (0.5 + ls) * 0.25  16
    IQ1_S    50                    8 grid(-1, 0, 1) + (1 or -1)     d * (1 + 2 ls) / 8     32

(IQ1_S's weight is d (1 + 2 ls) (grid + delta), delta = +-1/8 per 32 weights: times 8 an odd
integer.) IQ3_S's and IQ1_S's codes are odd, -15..15, so each of their 32-weight groups is a
Q4_1 block, code = 2 q - 15 for q = 0..15, scale 2 s and minimum -15 s: the int4 runner holds
them so (``ODD_GRID_TYPES``, :func:`odd_grid_q4`), in int4's kernels, with those two numbers
rounded to float16 as int4 keeps them (as Q4_K's products are: within 2^-11 of themselves).
The others' codes are held by ``int8_blocks.Int8BlockLinear`` as 4-bit indices into their
grid's ``CODEBOOKS`` entry with the float32 scales (kernels/small_codes.h's codebook layouts,
0.63 bytes a weight, 0.75 with a scale per 16, computing block int8's bits). IQ1_M (3-bit scales
per 16 weights under a super-block scale spread over their top bits) is not decoded here.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import quants

BLOCK_BYTES = {"IQ3_XXS": 98, "IQ3_S": 110, "IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82,
               "IQ1_S": 50}
BLOCK_WEIGHTS = {name: 256 for name in BLOCK_BYTES}


@functools.cache
def _grid(kind) -> np.ndarray:
    """A type's grid of value vectors as int8 [entries, 4 or 8] (``gguf.quants``' float32 one,
    built from ggml's packed table on first use)."""
    kind.init_grid()
    grid = kind.grid.reshape(kind.grid_shape)
    return grid.astype(np.int8)


def _signed_table(magnitudes) -> np.ndarray:
    """Sixteen int8 values: ``magnitudes`` and their negatives, ascending, zeros after them."""
    values = sorted({s * m for m in magnitudes for s in (-1, 1)})
    return np.array(values + [0] * (16 - len(values)), np.int8)


#: the tables of sixteen values the codebook layouts index, by grid (the IQ4 types' is
#: q3k_iq4_blocks.IQ4_VALUES): IQ3_XXS's, and IQ2_XXS's, IQ2_XS's and IQ2_S's
CODEBOOKS = {"IQ3_XXS": _signed_table(quants.IQ3_XXS.grid_map),
             "IQ2": _signed_table(quants.IQ2_XXS.grid_map)}
#: the types whose codes are odd, -15..15: Q4_1 blocks (:func:`odd_grid_q4`)
ODD_GRID_TYPES = ("IQ3_S", "IQ1_S")


#: ggml's ksigns: a 7-bit sign index -> its eight sign bits (the eighth makes an even count of
#: minus signs)
_KSIGNS = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)


def _float16(blocks: np.ndarray) -> np.ndarray:
    """Every block's float16 d (its first two bytes) as float32 [blocks, 1]."""
    return blocks[:, :2].copy().view(np.float16).astype(np.float32)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """[..., n] bytes -> [..., n, count] their low ``count`` bits, lowest first, as 0/1."""
    return packed[..., None] >> np.arange(count, dtype=packed.dtype) & 1


def _ksign_bits(words: np.ndarray) -> np.ndarray:
    """IQ2_XXS/IQ3_XXS's sign words (uint32 [blocks, 8]: four 7-bit indices into ``_KSIGNS``)
    -> 0/1 [blocks, 8, 32], 1 for a minus sign."""
    index = words[..., None] >> np.array([0, 7, 14, 21], np.uint32) & 0x7F
    return _bits(_KSIGNS[index], 8).reshape(*words.shape, 32)


def _scale_nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, n] bytes of 4-bit ls, low nibble first (IQ3_S's per 32 weights, IQ2_XS's and
    IQ2_S's per 16) -> float32 [blocks, 2n]."""
    return np.stack([packed & 15, packed >> 4], -1).reshape(len(packed), -1).astype(np.float32)


def _gridded(grid: np.ndarray, index: np.ndarray, minus: np.ndarray) -> np.ndarray:
    """Codes int8 [blocks, 256]: the grid vectors ``index`` names ([blocks, 256 / width]), signed
    by ``minus`` (0/1, broadcast to [blocks, 256])."""
    values = grid[index].reshape(len(index), 256)
    return np.where(minus.reshape(len(index), 256) == 1, -values, values).astype(np.int8)


def _iq3_xxs(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # block_iq3_xxs: d, qs[64] (a grid index per 4 weights), then per 32 weights a uint32: four
    # 7-bit sign indices, the 4-bit ls above them
    n = len(blocks)
    words = blocks[:, 66:98].copy().view(np.uint32)
    codes = _gridded(_grid(quants.IQ3_XXS), blocks[:, 2:66], _ksign_bits(words))
    ls = (words >> 28).astype(np.float32)
    return codes, (_float16(blocks) * (np.float32(0.5) + ls) * np.float32(0.5)).reshape(n, 8)


def _iq3_s(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # block_iq3_s: d, qs[64] (the low 8 bits of a 9-bit grid index per 4 weights), qh[8] (their
    # ninth bits, lowest first), signs[32] (a bit per weight), scales[4] (a nibble per 32
    # weights, low nibble first)
    n = len(blocks)
    high = _bits(blocks[:, 66:74], 8).reshape(n, 64).astype(np.uint16)
    index = blocks[:, 2:66].astype(np.uint16) | high << 8
    codes = _gridded(_grid(quants.IQ3_S), index, _bits(blocks[:, 74:106], 8))
    return codes, _float16(blocks) * (1 + 2 * _scale_nibbles(blocks[:, 106:110]))


def _iq2_xxs(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # block_iq2_xxs: d, then per 32 weights two uint32: four 8-bit grid indices (8 weights
    # each), then four 7-bit sign indices with the 4-bit ls above them
    n = len(blocks)
    words = blocks[:, 2:66].copy().view(np.uint32).reshape(n, 8, 2)
    index = words[..., 0].copy().view(np.uint8).reshape(n, 32)
    codes = _gridded(_grid(quants.IQ2_XXS), index, _ksign_bits(words[..., 1]))
    ls = (words[..., 1] >> 28).astype(np.float32)
    return codes, _float16(blocks) * (np.float32(0.5) + ls) * np.float32(0.25)


def _per_16(blocks: np.ndarray, at: int) -> np.ndarray:
    """IQ2_XS's and IQ2_S's scales (eight bytes at ``at``, a nibble per 16 weights, low nibble
    first) as float32 [blocks, 16]: d * (0.5 + ls) * 0.25."""
    ls = _scale_nibbles(blocks[:, at:at + 8])
    return _float16(blocks) * (np.float32(0.5) + ls) * np.float32(0.25)


def _iq2_xs(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # block_iq2_xs: d, qs[32] uint16 (per 8 weights: a 9-bit grid index, a 7-bit sign index
    # above it), scales[8]
    n = len(blocks)
    qs = blocks[:, 2:66].copy().view(np.uint16)
    signs = _bits(_KSIGNS[qs >> 9], 8)
    codes = _gridded(_grid(quants.IQ2_XS), qs & 511, signs.reshape(n, 256))
    return codes, _per_16(blocks, 66)


def _iq2_s(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # block_iq2_s: d, qs[64] (the low 8 bits of a 10-bit grid index per 8 weights, then a sign
    # bit per weight), qh[8] (the indices' top 2 bits, four to a byte, lowest first), scales[8]
    n = len(blocks)
    high = blocks[:, 66:74, None] >> np.array([0, 2, 4, 6], np.uint8) & 3
    index = blocks[:, 2:34].astype(np.uint16) | high.reshape(n, 32).astype(np.uint16) << 8
    codes = _gridded(_grid(quants.IQ2_S), index, _bits(blocks[:, 34:66], 8))
    return codes, _per_16(blocks, 74)


def _iq1_s(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # block_iq1_s: d, qs[32] (the low 8 bits of an 11-bit grid index per 8 weights), qh[8]
    # uint16 per 32 weights: 3 more index bits per 8 weights (bits 0..11), ls (bits 12..14) and
    # delta's sign (bit 15)
    n = len(blocks)
    qh = blocks[:, 34:50].copy().view(np.uint16)
    high = qh[..., None] >> np.array([0, 3, 6, 9], np.uint16) & 7
    index = blocks[:, 2:34].astype(np.uint16) | high.reshape(n, 32) << 8
    grid = _grid(quants.IQ1_S)[index].reshape(n, 8, 32).astype(np.int16)
    delta = np.where(qh >> 15 == 1, -1, 1).astype(np.int16)
    codes = (8 * grid + delta[..., None]).astype(np.int8).reshape(n, 256)
    ls = (qh >> 12 & 7).astype(np.float32)
    return codes, _float16(blocks) * (1 + 2 * ls) * np.float32(0.125)


_DECODERS = {"IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s, "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs,
             "IQ2_S": _iq2_s, "IQ1_S": _iq1_s}


def decode_iq_grid(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``qtype`` blocks, uint8 [blocks, ``BLOCK_BYTES[qtype]``], decoded: codes int8 [blocks,
    256] and float32 scales [blocks, 8], one per 32 weights (IQ2_XS, IQ2_S: [blocks, 16], one
    per 16)."""
    return _DECODERS[qtype](blocks)


def odd_grid_q4(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ3_S or IQ1_S data [rows, bytes] as Q4_1 blocks: (nibbles uint8 [rows, in / 32, 16],
    byte k of a group holding its q of weight k in the low nibble and of weight k + 16 in the
    high one; scale and minimum float16 [rows, in / 32]), w = scale q + minimum with q = (code +
    15) / 2, scale 2 s and minimum -15 s rounded to float16."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, BLOCK_BYTES[qtype])
    codes, scale = decode_iq_grid(blocks, qtype)
    q = ((codes.astype(np.int16) + 15) >> 1).astype(np.uint8).reshape(rows, -1, 2, 16)
    scale = scale.reshape(rows, -1)
    return (q[:, :, 0] | q[:, :, 1] << 4, (2 * scale).astype(np.float16),
            (-15 * scale).astype(np.float16))
