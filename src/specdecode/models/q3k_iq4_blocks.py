"""GGUF's Q3_K, IQ4_NL and IQ4_XS blocks as block int8, every weight the file's own value.

No Q4_1 block holds these types exactly: Q3_K has a scale per 16 weights (a 32-weight block
would need two), and the IQ4 types' sixteen values are not evenly spaced. Re-quantised to
int4's Q4_1 they move the model (Qwen2.5-Coder-1.5B IQ4_XS: perplexity 3.2% above
``llama-perplexity``'s on the same file, against 0.3% below kept: docs/native-runner.md). As
block int8 they keep their values (ggml-common.h's block layouts, decoded here in numpy; tested
bit for bit against ``gguf.quants.dequantize``):

    type    weights a block  codes                         scale                    group
    Q3_K    256 (16 x 16)    -4..3                         d * (sc - 32), 6-bit sc  16
    IQ4_NL  32               kvalues_iq4nl[q], -127..113   d                        32
    IQ4_XS  256 (8 x 32)     kvalues_iq4nl[q], -127..113   d * (ls - 32), 6-bit ls  32

Q3_K has Q6_K's form (signed codes, a signed integer scale per 16 weights under a float16
super-block scale), so ``int8_blocks.decode_gguf_blocks`` makes it a ``Q6KWeight`` and the
kernels fold its scales in integers as Q6_K's; on a CPU without AMX they hold its codes in 4
bits (0.58 bytes a weight: small_codes.h's Q3K layout), with AMX in Q6_K's 6.6 (whose tile
kernel takes many rows). The IQ4 types are block int8, held on a CPU without AMX as 4-bit
indices into IQ4_VALUES with their scales (kernels/small_codes.h: 0.56 bytes a weight for
IQ4_NL's float16 scales, 0.63 for IQ4_XS's products, computing block int8's bits), with AMX as
block int8 (1.06, 1.13). IQ4_XS keeps its scales' factors too (an ``IQ4XSWeight``): on an
AVX-512 VNNI CPU without AMX the kernels hold its indices with its integer sub-block scales and
fold them in integers as Q6_K's (0.55 bytes a weight: small_codes.h's IQ4XS layout).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

#: bytes and weights of one block, per type
BLOCK_BYTES = {"Q3_K": 110, "IQ4_NL": 18, "IQ4_XS": 136}
BLOCK_WEIGHTS = {"Q3_K": 256, "IQ4_NL": 32, "IQ4_XS": 256}
#: the IQ4 types' sixteen values (ggml-common.h's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      np.int8)

#: the bit shifts of Q3_K's 2-bit (four a byte) and 1-bit (eight a byte) code parts
_SHIFTS_2 = np.arange(0, 8, 2, dtype=np.uint8)
_SHIFTS_1 = np.arange(8, dtype=np.uint8)


class Decoded(NamedTuple):
    """One tensor's blocks decoded, a row per block: ``codes`` int8 [blocks, weights a block],
    ``scale`` float32 [blocks, groups a block]; Q3_K's and IQ4_XS's also their scales' factors,
    ``sub_scale`` int8 [blocks, groups a block] and ``super_scale`` float16 [blocks, 1]."""

    codes: np.ndarray
    scale: np.ndarray
    group: int
    sub_scale: np.ndarray | None = None
    super_scale: np.ndarray | None = None


def _float16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 number at byte ``at`` of every block, float32 [blocks]."""
    return blocks[:, at:at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] 4-bit numbers: the n low nibbles, then the n high ones (the
    IQ4 types' order of weights)."""
    return np.concatenate([packed & 15, packed >> 4], -1)


def _q3k(blocks: np.ndarray) -> Decoded:
    # block_q3_K: hmask[32], qs[64], scales[12], d. Weight j = 128 h + 32 s + l (of 256): its
    # 2 low bits at bit 2 s of qs byte 32 h + l; its high bit at bit j // 32 of hmask byte l,
    # and a clear high bit means 4 less. Sub-block s's 6-bit scale: the low nibbles of bytes
    # 0..7 then their high nibbles, with 2 more bits from bytes 8..11.
    n = len(blocks)
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    low = qs.reshape(n, 2, 1, 32) >> _SHIFTS_2[:, None] & 3
    high = hmask.reshape(n, 1, 32) >> _SHIFTS_1[:, None] & 1
    codes = low.reshape(n, 256).view(np.int8) - (4 - 4 * high.reshape(n, 256).view(np.int8))
    sub = _nibbles(packed[:, :8]) | np.concatenate(
        [(packed[:, 8:12] >> shift & 3) << 4 for shift in (0, 2, 4, 6)], 1)
    sub_scale = sub.astype(np.int8) - 32
    scale = _float16(blocks, 108)[:, None] * sub_scale.astype(np.float32)
    return Decoded(codes, scale, 16, sub_scale, blocks[:, 108:110].copy().view(np.float16))


def _iq4_nl(blocks: np.ndarray) -> Decoded:
    # block_iq4_nl: d, qs[16]
    return Decoded(IQ4_VALUES[_nibbles(blocks[:, 2:18])], _float16(blocks, 0)[:, None], 32)


def _iq4_xs(blocks: np.ndarray) -> Decoded:
    # block_iq4_xs: d, scales_h (16 bits), scales_l[4], qs[128]: sub-block s's 6-bit ls is the
    # nibble s of scales_l (low nibble first) with bits 2s, 2s + 1 of scales_h above it
    n = len(blocks)
    codes = IQ4_VALUES[_nibbles(blocks[:, 8:136].reshape(n, 8, 16))]
    high = blocks[:, 2:4].copy().view(np.uint16)[:, :1] >> (2 * np.arange(8, dtype=np.uint16)) & 3
    ls = _nibbles(blocks[:, 4:8]).reshape(n, 2, 4).transpose(0, 2, 1).reshape(n, 8) | high << 4
    sub_scale = ls.astype(np.int8) - 32
    scale = _float16(blocks, 0)[:, None] * sub_scale.astype(np.float32)
    return Decoded(codes.reshape(n, 256), scale, 32, sub_scale,
                   blocks[:, 0:2].copy().view(np.float16))


_DECODERS = {"Q3_K": _q3k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}


def decode_q3k_iq4(blocks: np.ndarray, qtype: str) -> Decoded:
    """``qtype`` blocks, uint8 [blocks, ``BLOCK_BYTES[qtype]``], decoded."""
    return _DECODERS[qtype](blocks)
