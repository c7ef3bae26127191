"""GGUF's Q2_K blocks with their own values: 2-bit codes, a 4-bit scale and minimum per 16.

ggml-common.h's ``block_q2_K`` holds 256 weights in 84 bytes: ``scales[16]`` (sub-block s's
scale sc in the low nibble of byte s, its minimum m in the high one), ``qs[64]``, then float16
``d`` and ``dmin``; weight j = 128 n + 32 q + l (of 256) is the 2-bit code at bits 2 q of qs
byte 32 n + l, in sub-block j // 16, and

    w = d * sc * code - dmin * m        codes 0..3, sc and m 0..15

No Q4_1 block of 32 holds this (two sub-blocks of their own scale and minimum): re-quantised to
int4 the 1.5B's Q2_K file read 2.0% above ``llama-perplexity`` (docs/native-runner.md). Here
it becomes block int8 in groups of 16 (scale d * sc, minimum -(dmin * m): gguf's float32
numbers, tested bit for bit against ``gguf.quants.dequantize``) that also keeps those factors,
so the kernels hold it in the file's own 0.33 bytes a weight and fold sc and m in integers
(``kernels.pack_q2k``, kernels/small_codes.h's Q2K layout).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

#: bytes and weights of one block
BLOCK_BYTES = 84
BLOCK_WEIGHTS = 256

_SHIFTS = np.arange(0, 8, 2, dtype=np.uint8)


class Decoded(NamedTuple):
    """Blocks decoded, a row per block: ``codes`` int8 [blocks, 256] (0..3), ``scale`` and
    ``minimum`` float32 [blocks, 16] (d * sc and -(dmin * m)), the factors ``sub_scale`` and
    ``sub_min`` int8 [blocks, 16] (sc and m) and ``super_scale`` and ``super_min`` float16
    [blocks, 1] (d and dmin)."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray
    sub_scale: np.ndarray
    sub_min: np.ndarray
    super_scale: np.ndarray
    super_min: np.ndarray


def decode_q2k(blocks: np.ndarray) -> Decoded:
    """Q2_K blocks, uint8 [blocks, 84], decoded."""
    n = len(blocks)
    packed, qs = blocks[:, :16], blocks[:, 16:80]
    codes = (qs.reshape(n, 2, 1, 32) >> _SHIFTS[:, None] & 3).reshape(n, 256).view(np.int8)
    d, dmin = (blocks[:, at:at + 2].copy().view(np.float16) for at in (80, 82))
    sub_scale, sub_min = (packed & 15).view(np.int8), (packed >> 4).view(np.int8)
    scale = d.astype(np.float32) * sub_scale.astype(np.float32)
    minimum = -(dmin.astype(np.float32) * sub_min.astype(np.float32))
    return Decoded(codes, scale, minimum, sub_scale, sub_min, d, dmin)
