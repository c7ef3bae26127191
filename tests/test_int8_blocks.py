"""Block int8 weights (models/int8_blocks.py, kernels/q8_blocks.h): every GGUF block type
decoded to gguf's own float32 weights bit for bit; the kernel within the bound of its int8
activations, row invariant, and the same bits from every instruction-set variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_row_invariant
from specdecode import kernels
from specdecode.errors import SpecDecodeError
from specdecode.models.int8_blocks import (BLOCK_BYTES, BLOCK_WEIGHTS, HELD_BYTES,
                                           IQ4XSWeight, Int8BlockLinear, Int8BlockWeight, Q2KWeight,
                                           Q4KWeight, Q5KWeight, Q6KWeight, decode_gguf_blocks,
                                           held_bytes_per_weight, quantize_int8_blocks,
                                           vnni_own_layouts)
from specdecode.models.gguf_reader import q4_nibbles
from specdecode.models.iq_grid_blocks import CODEBOOKS, ODD_GRID_TYPES
from specdecode.models.q3k_iq4_blocks import IQ4_VALUES
from specdecode.models.quant import make_linear
from specdecode.models.weights import as_int8_blocks

gguf = pytest.importorskip("gguf", reason="the gguf package (llama.cpp's reader) is not installed")

ROWS = 64
#: types gguf can quantise (the K-quants it only dequantises: random blocks for those)
QUANTISED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")


@pytest.fixture(scope="module")
def ext():
    if not kernels.available():
        pytest.skip("the native kernels do not build here (x86-64 Linux with g++ needed)")
    return kernels.load()


def isas(ext) -> range:
    """Every instruction-set variant this CPU runs (all three where it has AVX-512 VNNI)."""
    return range(ext.isa_level() + 1)


def gguf_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes] of ``qtype``: gguf's own quantisation of random weights where it has
    one, else random bytes with float16 scales of a plausible size (every byte pattern of the
    codes and sub-block scales is valid)."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in QUANTISED:
        return gguf.quants.quantize(rng.normal(0, 0.02, (rows, cols)).astype(np.float32), kind)
    blocks = rng.integers(0, 256, (rows, cols // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype]),
                          dtype=np.uint8)
    def halves(count: int) -> np.ndarray:
        values = rng.uniform(-3e-3, 3e-3, (rows, cols // BLOCK_WEIGHTS[qtype], count))
        return values.astype(np.float16).view(np.uint8)

    if qtype in ("Q6_K", "Q3_K"):
        blocks[..., -2:] = halves(1)  # d last
    elif qtype == "Q2_K":
        blocks[..., -4:] = halves(2)  # d, dmin last
    elif qtype in ("Q4_K", "Q5_K"):
        blocks[..., 0:4] = halves(2)  # d, dmin first
    else:
        blocks[..., 0:2] = halves(1)  # d first
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(BLOCK_BYTES))
def test_decode_equals_gguf_dequantize_bitwise(qtype):
    raw = gguf_blocks(qtype, 6, 512)
    weight = decode_gguf_blocks(raw, qtype)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    got = weight.dequantize().numpy()
    assert got.shape == expected.shape == (6, 512)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), qtype
    assert weight.group == (16 if qtype in ("Q6_K", "Q3_K", "Q2_K", "IQ2_XS", "IQ2_S") else 32)
    assert isinstance(weight, Q6KWeight) == (qtype in ("Q6_K", "Q3_K"))
    assert isinstance(weight, Q2KWeight) == (qtype == "Q2_K")
    assert type(weight) is {"Q4_K": Q4KWeight, "Q5_K": Q5KWeight}.get(qtype, type(weight))
    assert (weight.minimum is not None) == (qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K"))
    bits = {"Q8_0": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q3_K": 3,
            "Q2_K": 2}.get(qtype, 4)
    signed = qtype in ("Q8_0", "Q4_0", "Q5_0", "Q6_K", "Q3_K")
    low, high = (-(1 << bits - 1), (1 << bits - 1) - 1) if signed else (0, (1 << bits) - 1)
    # MXFP4: e2m1 values doubled; the IQ4 types: ggml's sixteen values; the grid I-quants:
    # their grids' largest values (IQ1_S's 8 + 1)
    low, high = {"MXFP4": (-12, 12), "IQ4_NL": (-127, 113), "IQ4_XS": (-127, 113),
                 "IQ3_XXS": (-62, 62), "IQ3_S": (-15, 15), "IQ2_XXS": (-43, 43),
                 "IQ2_XS": (-43, 43), "IQ2_S": (-43, 43), "IQ1_S": (-9, 9)}.get(qtype, (low, high))
    assert low <= int(weight.codes.min()) and int(weight.codes.max()) <= high


def test_cat_regroups_exactly():
    # a Q4_K_M layer's q/k (Q4_K: groups of 32, minimums) fused with its v (Q6_K: groups of
    # 16, none): the finer group, -0.0 minimums, every weight unchanged
    parts = [decode_gguf_blocks(gguf_blocks(t, 3, 256, seed), t)
             for seed, t in enumerate(("Q4_K", "Q6_K", "Q8_0"))]
    fused = Int8BlockWeight.cat(parts)
    assert fused.group == 16 and fused.minimum is not None
    expected = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(fused.dequantize().view(torch.int32), expected.view(torch.int32))
    same = Int8BlockWeight.cat(parts[2:] * 2)
    assert same.group == 32 and same.minimum is None
    with pytest.raises(SpecDecodeError, match="share their input size"):
        Int8BlockWeight.cat([parts[0], quantize_int8_blocks(torch.randn(2, 64))])


def activation_bound(x: torch.Tensor, weight: torch.Tensor, inputs: int = 32) -> torch.Tensor:
    """[m, n]: how far int8 activations per row and per ``inputs`` inputs (x ~ dx * round(x /
    dx), dx = max|x| / 127, so within dx / 2) can move x @ weight.T."""
    m, k = x.shape
    half_step = (x.abs().view(m, -1, inputs).amax(-1) / 254).repeat_interleave(inputs, 1)
    return half_step.double() @ weight.abs().double().T


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q4_K", "Q5_1", "Q3_K", "IQ4_XS", "Q2_K"])
def test_linear_within_the_activation_bound(ext, qtype):
    weight = decode_gguf_blocks(gguf_blocks(qtype, 40, 512, seed=3), qtype)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4))
    w = weight.dequantize()
    exact = x.double() @ w.double().T
    layer = Int8BlockLinear(weight)
    # Q6_K, Q3_K, Q2_K: activations per super-block
    inputs = 256 if layer.layout in ("q6k", "q3k", "q2k") else 32
    bound = activation_bound(x, w, inputs) * 1.0001 + 1e-6 * (x.abs().double() @ w.abs().double().T)
    got = layer(x).double()
    error = (got - exact).abs()
    assert (error <= bound).all(), float((error / bound).max())
    assert error.max() > 0  # the activations were quantised: not the float product


@pytest.mark.parametrize("group,with_minimum,half", [(32, False, False), (32, True, False),
                                                     (16, False, False), (16, True, False),
                                                     (32, False, True), (32, True, True)])
def test_row_invariant_and_every_isa_the_same_bits(ext, group, with_minimum, half):
    gen = torch.Generator().manual_seed(group + with_minimum + 2 * half)
    n, k = 72, 96  # a last, partial tile of columns; an odd number of groups of 32
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    numbers = lambda: torch.randn(n, k // group, generator=gen).half().float() * 0.01  # noqa: E731
    scale, minimum = numbers(), numbers() if with_minimum else None
    packed = kernels.pack_q8_blocks(codes, scale, minimum, group, half)
    x = torch.randn(ROWS, k, generator=gen)
    outs = [assert_row_invariant(lambda rows: ext.q8_linear(rows, packed, group, with_minimum,
                                                            half, None, n, isa), x)
            for isa in isas(ext)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    w = Int8BlockWeight(codes, scale, minimum, group).dequantize()
    error = (outs[0].double() - x.double() @ w.double().T).abs()
    assert (error <= activation_bound(x, w) * 1.0001 + 1e-4).all()
    zeros = torch.zeros(3, k)
    assert torch.equal(ext.q8_linear(zeros, packed, group, with_minimum, half, None, n, 0),
                       torch.zeros(3, n))
    # the largest products: codes -128 and 127 against activations of +-127 (AVX2 multiplies
    # |code| by the signed activation in 16-bit pairs: they must not saturate)
    extreme = torch.where(torch.arange(n)[:, None] % 2 == 0, -128, 127).expand(n, k).to(torch.int8)
    packed = kernels.pack_q8_blocks(extreme, scale, minimum, group, half)
    xe = torch.ones(4, k)
    xe[1], xe[3, ::3] = -1, -1
    outs = [ext.q8_linear(xe, packed, group, with_minimum, half, None, n, isa) for isa in isas(ext)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    stored = (lambda v: v.half().float()) if half else (lambda v: v)  # noqa: E731
    w = Int8BlockWeight(extreme, stored(scale), None if minimum is None else stored(minimum),
                        group).dequantize()
    assert torch.allclose(outs[0].double(), xe.double() @ w.double().T, rtol=1e-5, atol=1e-4)


def assert_small_codes_bits(ext, x, packed, layout: str, minimum: bool, n: int, expected,
                            input_scale: float = 1.0, codebook: torch.Tensor | None = None):
    """``packed`` in ``layout`` gives ``expected``'s bits on every instruction set, every row
    count and position of ``x``, and in one call of more rows than SUPER_DECODE_MIN_ROWS (72,
    small_codes.h: from there the VNNI passes of the super-block layouts read each super-block
    decoded once), ``x``'s rows and 16 of them again."""
    code = kernels.SMALL_CODES_LAYOUTS[layout]
    many = torch.cat([x, x[:16]])
    for isa in isas(ext):
        linear = lambda rows: ext.small_codes_linear(  # noqa: E731
            rows, packed, code, minimum, None, n, isa, input_scale, codebook)
        got = assert_row_invariant(linear, x)
        assert torch.equal(got, expected), isa
        assert torch.equal(linear(many), torch.cat([expected, expected[:16]])), isa


def without_amx() -> bool:
    """Whether this CPU lacks AMX tiles (where Q5_K's, Q3_K's and the IQ4 types' own layouts
    are held)."""
    return kernels.isa() <= kernels.ISA_LEVELS.index("avx512")


@pytest.mark.parametrize("qtype,half,bytes_a_weight", [("Q5_0", True, 352 / 512),
                                                       ("Q5_1", True, 384 / 512),
                                                       ("MXFP4", True, 352 / 512),
                                                       ("Q5_K", False, 448 / 512)])
def test_five_bit_codes_in_the_files_bytes_give_block_int8s_bits(ext, qtype, half, bytes_a_weight):
    # a matrix of 5-bit codes held in the file's own bytes computes block int8's numbers
    # (1.06-1.25 bytes a weight) bit for bit: every row count (five_bit on AVX-512: the direct
    # kernel below 13 rows, tiles decoded once from there), every position, every instruction
    # set; 5 column tiles, so the decoded tiles' last pair is one tile. Q5_K's scales d * sc are
    # not float16 numbers: float32 (five_bit32, whose passes never decode)
    weight = decode_gguf_blocks(gguf_blocks(qtype, 72, 512, seed=5), qtype)
    layout = "five_bit" if half else "five_bit32"
    packed = kernels.pack_five_bit(weight.codes, weight.scale, weight.minimum, half=half)
    assert packed.numel() == 80 * 512 * bytes_a_weight
    group, minimum = weight.group, weight.minimum is not None
    block = kernels.pack_q8_blocks(weight.codes, weight.scale, weight.minimum, group, half)
    assert packed.numel() / block.numel() <= 0.7
    x = torch.randn(ROWS, 512, generator=torch.Generator().manual_seed(6))
    expected = ext.q8_linear(x, block, group, minimum, half, None, 72, 0)
    assert_small_codes_bits(ext, x, packed, layout, minimum, 72, expected)
    # the loader's choice: float32 scales stay block int8 where AMX takes many rows; Q5_K's
    # own layout (q5k, its other numbers) where the best kernels are VNNI without AMX
    layer = Int8BlockLinear(weight)
    if qtype == "Q5_K" and vnni_own_layouts():
        assert layer.layout == "q5k"
    else:
        assert layer.layout == (layout if half or without_amx() else "block")
        assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("qtype,half,bytes_a_weight,values", [
    ("IQ4_NL", True, 288 / 512, IQ4_VALUES), ("IQ4_XS", False, 320 / 512, IQ4_VALUES),
    ("IQ3_XXS", False, 320 / 512, CODEBOOKS["IQ3_XXS"]),
    ("IQ2_XXS", False, 320 / 512, CODEBOOKS["IQ2"]),
    ("IQ2_XS", False, 192 / 256, CODEBOOKS["IQ2"]), ("IQ2_S", False, 192 / 256, CODEBOOKS["IQ2"])])
def test_codebook_indices_give_block_int8s_bits(ext, monkeypatch, qtype, half, bytes_a_weight,
                                                values):
    # IQ4_NL, IQ4_XS, IQ3_XXS and the IQ2 types' matrices held as 4-bit indices into their type's
    # sixteen codes (IQ2_XS, IQ2_S: with a float32 scale per 16 inputs, the codebook16 layout)
    # compute block int8's numbers bit for bit: every row count and position, every
    # instruction set (an AMX CPU's loader keeps the IQ4 types as block int8); the codebook's
    # extreme codes against activations of +-127 included
    weight = decode_gguf_blocks(gguf_blocks(qtype, 72, 512, seed=5), qtype)
    codes = weight.codes.clone()
    codes[0, :64] = int(values.min())
    codes[1, :64] = int(values.max())
    group = weight.group
    weight = Int8BlockWeight(codes, weight.scale, None, group)
    layer = Int8BlockLinear(weight)
    layout = "codebook16" if group == 16 else "codebook" if half else "codebook32"
    held = without_amx() or qtype not in ("IQ4_NL", "IQ4_XS")
    assert layer.layout == (layout if held else "block") and layer.half == half
    codebook = torch.from_numpy(values)
    if held:
        assert torch.equal(layer.codebook, codebook)
    indices = (codes[..., None] == codebook).int().argmax(-1)
    packed = kernels.pack_codebook(indices, weight.scale, half=half)
    assert packed.numel() == 80 * 512 * bytes_a_weight
    block = kernels.pack_q8_blocks(codes, weight.scale, None, group, half)
    x = torch.randn(ROWS, 512, generator=torch.Generator().manual_seed(6))
    x[0, :64] = torch.where(torch.arange(64) % 3 == 0, -1.0, 1.0)
    expected = ext.q8_linear(x, block, group, False, half, None, 72, 0)
    assert_small_codes_bits(ext, x, packed, layout, False, 72, expected, codebook=codebook)
    assert torch.equal(layer(x), expected)
    # the layouts an AMX CPU's loader holds (built, not run: this CPU may lack AMX)
    monkeypatch.setattr(kernels, "isa", lambda: kernels.ISA_LEVELS.index("amx"))
    iq4 = qtype in ("IQ4_NL", "IQ4_XS")
    assert Int8BlockLinear(weight).layout == ("block" if iq4 else layout)
    assert held_bytes_per_weight(qtype) == (1.0625 if half else 1.125) if iq4 else bytes_a_weight
    # codes outside the IQ4 values, or minimums: not this layout
    q8 = decode_gguf_blocks(gguf_blocks("Q8_0", 16, 64), "Q8_0")
    assert Int8BlockLinear(q8).layout == "block"


def quantised_per_256(x: torch.Tensor,
                      input_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' int8 activations per row and per 256 inputs: xq int64 [m, k / 256, 256]
    and dx [m, k / 256], x ~ dx * xq; dx times a layer's ``input_scale`` (a float32 product,
    as the kernels take it)."""
    m, k = x.shape
    blocks = x.view(m, k // 256, 256)
    amax = blocks.abs().amax(-1)
    # 127 / amax divided as the kernels divide (a Python number over a tensor is its reciprocal
    # times the number: an ulp off at times, which moves a product that lands on a half)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.clamp(torch.round(blocks * inv[..., None]), -127, 127).to(torch.int64)
    return xq, amax / 127.0 * torch.tensor(input_scale, dtype=torch.float32)


def q6k_reference(x: torch.Tensor, weight: Q6KWeight | IQ4XSWeight) -> torch.Tensor:
    """Q6_K's numbers (kernels/small_codes.h; IQ4_XS's too) computed apart from the kernels:
    activations quantised per row and per 256 inputs, S = sum over a super-block's sub-blocks
    (of 16 or 32 inputs) of sc times the exact sum(code * xq), folded acc = fma(S, d * dx, acc)
    super-block after super-block (S as a float32 number first, as the kernels convert it; each
    fma exact in float64, then rounded once to float32); dx times the weight's input scale
    (float32)."""
    m, k = x.shape
    n, group = weight.codes.shape[0], weight.group
    xq, dx = quantised_per_256(x, weight.input_scale)
    sums = torch.einsum("mgi,ngi->mng", xq.view(m, k // group, group),
                        weight.codes.to(torch.int64).view(n, k // group, group))
    super_sums = (sums * weight.sub_scale.to(torch.int64)[None]).view(m, n, k // 256, 256 // group)
    super_sums = super_sums.sum(-1)
    assert super_sums.abs().max() < 2**28  # int32 in the kernels
    acc = torch.zeros(m, n, dtype=torch.float32)
    for b in range(k // 256):
        scale = weight.super_scale[None, :, b].float() * dx[:, None, b]  # float32 product
        acc = (super_sums[:, :, b].float().double() * scale.double() + acc.double()).float()
    return acc


def test_q6k_folds_sub_block_scales_in_integers(ext):
    # Q6_K held in the file's own bytes (0.83 bytes a weight): its sub-block scales folded in
    # integers against activations quantised per 256 inputs, the same bits from every row
    # count and position (VNNI below Q6K_AMX_MIN_ROWS rows, the AMX tiles from there where the
    # CPU has them: 64 rows run both) and every instruction set, and the numbers of a reference
    # written apart from the kernels; 5 column tiles, 2 super-blocks
    weight = decode_gguf_blocks(gguf_blocks("Q6_K", 72, 512, seed=5), "Q6_K")
    layer = Int8BlockLinear(weight)
    assert layer.layout == "q6k" and layer.nbytes == 80 * 512 * 3392 / 4096
    x = torch.randn(ROWS, 512, generator=torch.Generator().manual_seed(6))
    x[3, :256] = 0  # a super-block of zeros: dx = 0
    expected = ext.small_codes_linear(x, layer.packed, 0, False, None, 72, 0)
    assert torch.equal(expected, q6k_reference(x, weight))
    assert_small_codes_bits(ext, x, layer.packed, "q6k", False, 72, expected)
    assert torch.equal(layer(x), expected)
    # the extreme codes and scales: code -32 times sc -128 (v = 4096, the largest weight byte
    # pair), 31 times -128 (-3968) and -32 times 127 (-4064), against activations of +-127
    codes = torch.tensor([[-32] * 256, [31] * 256, [-32] * 256, [31] * 256] * 4, dtype=torch.int8)
    sub_scale = torch.tensor([[-128] * 16, [-128] * 16, [127] * 16, [127] * 16] * 4, dtype=torch.int8)
    extreme = Q6KWeight(codes, sub_scale.float(), None, 16, sub_scale, torch.ones(16, 1, dtype=torch.float16))
    signs = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)
    xe = torch.stack([signs, -signs, torch.ones(256)] * 6)
    want = q6k_reference(xe, extreme)
    packed = Int8BlockLinear(extreme).packed
    for isa in isas(ext):
        assert torch.equal(ext.small_codes_linear(xe, packed, 0, False, None, 16, isa), want), isa


def iq4_indices(codes: torch.Tensor) -> torch.Tensor:
    """IQ4 codes int8 [N, K] as their indices into IQ4_VALUES (uint8)."""
    return (codes[..., None] == torch.from_numpy(IQ4_VALUES)).to(torch.uint8).argmax(-1)


def test_iq4xs_folds_sub_block_scales_in_integers(ext):
    # IQ4_XS held as 4-bit indices with its integer sub-block scales (0.55 bytes a weight, not
    # codebook32's 0.63): Q6_K's fold against activations quantised per 256 inputs, the same
    # bits from every row count, position and instruction set (AVX2 alone: the portable
    # kernel) and the numbers of a reference written apart from the kernels; the extreme codes
    # and scales against activations of +-127; 5 column tiles, 2 super-blocks
    weight = decode_gguf_blocks(gguf_blocks("IQ4_XS", 72, 512, seed=5), "IQ4_XS")
    assert type(weight) is IQ4XSWeight
    spread = weight.super_scale.float().repeat_interleave(8, 1)  # (per 256 -> per 32)
    assert torch.equal(spread * weight.sub_scale.float(), weight.scale)
    weight.codes[0, :256], weight.sub_scale[0, :8] = -127, -32
    weight.codes[1, :256], weight.sub_scale[1, :8] = 113, 31
    packed = kernels.pack_iq4xs(iq4_indices(weight.codes), weight.sub_scale, weight.super_scale)
    assert packed.numel() == 80 * 512 * 2240 / 4096
    x = torch.randn(ROWS, 512, generator=torch.Generator().manual_seed(6))
    x[0, :256] = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)
    x[1, :256] = -1.0
    x[2, 256:] = 0  # a super-block of zeros: dx = 0
    expected = q6k_reference(x, weight)
    codebook = torch.from_numpy(IQ4_VALUES)
    assert_small_codes_bits(ext, x, packed, "iq4xs", False, 72, expected, codebook=codebook)
    if vnni_own_layouts():
        layer = Int8BlockLinear(weight)
        assert layer.layout == "iq4xs" and layer.nbytes == packed.numel()
        assert torch.equal(layer(x), expected)
        # fused with another IQ4_XS matrix it keeps its layout
        other = decode_gguf_blocks(gguf_blocks("IQ4_XS", 24, 512, 7), "IQ4_XS")
        fused = Int8BlockWeight.cat([weight, other])
        assert type(fused) is IQ4XSWeight and Int8BlockLinear(fused).layout == "iq4xs"
        assert torch.equal(Int8BlockLinear(fused)(x)[:, :72], expected)


def minimums_reference(x: torch.Tensor, weight: Q2KWeight | Q4KWeight) -> torch.Tensor:
    """Q2_K's, Q4_K's and Q5_K's numbers (kernels/small_codes.h) computed apart from the
    kernels: q6k_reference's S and fold, then per super-block M = sum over its sub-blocks (of
    16 or 32 inputs) of m times the sub-block's sum(xq), folded acc = fma(-M, dmin * dx, acc)
    (S and M as float32 numbers first, as the kernels convert them: Q5_K's S passes 2^24)."""
    m, k = x.shape
    n, group = weight.codes.shape[0], weight.group
    xq, dx = quantised_per_256(x, weight.input_scale)
    xq = xq.view(m, k // group, group)

    def per_super_block(sums: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        return (sums * factor.to(torch.int64)[None]).view(m, n, k // 256, 256 // group).sum(-1)

    codes = weight.codes.to(torch.int64).view(n, k // group, group)
    super_sums = per_super_block(torch.einsum("mgi,ngi->mng", xq, codes), weight.sub_scale)
    min_sums = per_super_block(xq.sum(-1)[:, None, :].expand(m, n, k // group), weight.sub_min)
    assert super_sums.abs().max() < 2**26 and min_sums.abs().max() < 2**22  # int32 in the kernels
    acc = torch.zeros(m, n, dtype=torch.float32)
    folds = ((super_sums, weight.super_scale, 1), (min_sums, weight.super_min, -1))
    for b in range(k // 256):
        for sums, factor, sign in folds:
            scale = factor[None, :, b].float() * dx[:, None, b]  # float32 product
            acc = (sign * sums[:, :, b].float().double() * scale.double() + acc.double()).float()
    return acc


@pytest.mark.parametrize("qtype,top_code,top_factor,block_bytes", [("Q2_K", 3, 15, 1344),
                                                                   ("Q4_K", 15, 63, 2368),
                                                                   ("Q5_K", 31, 63, 2880)])
def test_minimums_folded_in_integers_in_the_files_bits(ext, qtype, top_code, top_factor,
                                                        block_bytes):
    # Q2_K in the file's own 0.33 bytes a weight (not block int8's 1.5), Q4_K in 0.58 (int4's
    # Q4_1 blocks hold 0.625, block int8 1.25), Q5_K in 0.70 (five_bit32: 0.875): their
    # sub-block scales and minimums (Q2_K: 4 bits per 16 inputs, Q4_K and Q5_K: 6 bits per
    # 32) folded in integers against activations quantised per 256 inputs (Q5_K on AVX2 four
    # slices at a time), the reference's numbers on every row count (Q2_K on AVX2:
    # direct passes below 5 rows, tiles decoded from there; VNNI's passes at every count),
    # position and instruction set; the extreme codes, sc and m against activations of +-127;
    # the factors are the file's (d * sc and dmin * m the block int8 numbers)
    weight = decode_gguf_blocks(gguf_blocks(qtype, 72, 512, seed=5), qtype)
    assert type(weight) is {"Q2_K": Q2KWeight, "Q4_K": Q4KWeight, "Q5_K": Q5KWeight}[qtype]
    sub = 256 // weight.group  # sub-blocks a super-block
    spread = lambda t: t.float().repeat_interleave(sub, 1)  # noqa: E731 (per 256 -> per group)
    assert torch.equal(spread(weight.super_scale) * weight.sub_scale.float(), weight.scale)
    assert torch.equal(-(spread(weight.super_min) * weight.sub_min.float()), weight.minimum)
    weight.codes[0, :256] = top_code
    weight.sub_scale[0, :sub], weight.sub_min[0, :sub] = top_factor, top_factor
    weight.codes[1, :256], weight.sub_scale[1, :sub], weight.sub_min[1, :sub] = 0, 0, top_factor
    layout = qtype.lower().replace("_", "")
    packed = getattr(kernels, f"pack_{layout}")(weight.codes, weight.sub_scale, weight.sub_min,
                                                weight.super_scale, weight.super_min)
    assert packed.numel() == 80 * 512 * block_bytes / 4096
    x = torch.randn(ROWS, 512, generator=torch.Generator().manual_seed(6))
    x[0, :256] = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)
    x[1, :256] = 1.0
    x[2, 256:] = 0  # a super-block of zeros: dx = 0
    expected = minimums_reference(x, weight)
    assert_small_codes_bits(ext, x, packed, layout, True, 72, expected)
    if layout == "q2k" or vnni_own_layouts():  # (Q4_K's, Q5_K's: VNNI CPUs without AMX)
        layer = Int8BlockLinear(weight)
        assert layer.layout == layout and layer.nbytes == packed.numel()
        assert torch.equal(layer(x), expected)
        # fused with another matrix of its type it keeps its layout
        other = decode_gguf_blocks(gguf_blocks(qtype, 24, 512, 7), qtype)
        fused = Int8BlockWeight.cat([weight, other])
        assert type(fused) is type(weight) and Int8BlockLinear(fused).layout == layout
        assert torch.equal(Int8BlockLinear(fused)(x)[:, :72], expected)
    # beside another type, block int8's groups, every weight unchanged
    mixed = Int8BlockWeight.cat([weight, decode_gguf_blocks(gguf_blocks("Q6_K", 8, 512), "Q6_K")])
    assert type(mixed) is Int8BlockWeight and mixed.group == 16
    assert torch.equal(mixed.dequantize()[:72].view(torch.int32),
                       weight.dequantize().view(torch.int32))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q2_K"])
def test_a_scaled_q_fuses_with_its_k(ext, qtype):
    # a q scaled by the query scale fused with its unscaled k of the same type: one layer, the
    # scale the activations' of q's columns alone (scaled_columns), each part the reference's
    # numbers of its own weight on every instruction set, row count and position; a part that
    # is not whole tiles of rows, or a scaled k, or another type leaves the parts to block int8's
    q = decode_gguf_blocks(gguf_blocks(qtype, 48, 512, seed=11), qtype).scaled(0.125 ** 0.5)
    k = decode_gguf_blocks(gguf_blocks(qtype, 24, 512, seed=12), qtype)
    fused = Int8BlockWeight.cat([q, k])
    assert type(fused) is type(q) and fused.scaled_rows == 48
    assert fused.input_scale == q.input_scale
    x = torch.randn(ROWS, 512, generator=torch.Generator().manual_seed(13))
    reference = q6k_reference if qtype == "Q6_K" else minimums_reference
    expected = torch.cat([reference(x, q), reference(x, k)], 1)
    layout = qtype.lower().replace("_", "")
    factors = ((fused.sub_scale, fused.super_scale) if qtype == "Q6_K" else
               (fused.sub_scale, fused.sub_min, fused.super_scale, fused.super_min))
    packed = getattr(kernels, f"pack_{layout}")(fused.codes, *factors)
    for isa in isas(ext):
        got = assert_row_invariant(lambda rows: ext.small_codes_linear(
            rows, packed, kernels.SMALL_CODES_LAYOUTS[layout], qtype != "Q6_K", None, 72, isa,
            q.input_scale, None, 48), x)
        assert torch.equal(got, expected), isa
    if qtype in ("Q6_K", "Q2_K") or vnni_own_layouts():
        layer = Int8BlockLinear(fused)
        assert layer.layout == layout and layer.scaled_columns == 48
        assert torch.equal(layer(x), expected)
    with pytest.raises(SpecDecodeError, match="rows of a partly scaled weight"):
        fused.take(slice(0, 8))
    other = "Q5_K" if qtype == "Q4_K" else "Q4_K"
    for parts in ([q.take(slice(0, 40)), k], [k, q],
                  [q, decode_gguf_blocks(gguf_blocks(other, 24, 512), other)]):
        assert type(Int8BlockWeight.cat(parts)) is Int8BlockWeight


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "IQ4_XS"])
def test_own_layouts_on_vnni_cpus_without_amx(monkeypatch, isa, qtype):
    # where a CPU's best kernels are AVX-512 VNNI without AMX a Q4_K, Q5_K or IQ4_XS matrix
    # keeps its own layout (and the int4 runner reads Q4_K so); with AMX block int8 (int4: Q4_K
    # as Q4_1 blocks, whose tiles take many rows); on AVX2 alone five_bit32 (int4: Q4_K as
    # Q4_1 blocks, whose AVX2 kernel is the faster from 4 rows), IQ4_XS codebook32. Layers
    # built, not run
    monkeypatch.setattr(kernels, "isa", lambda: kernels.ISA_LEVELS.index(isa))
    weight = decode_gguf_blocks(gguf_blocks(qtype, 16, 256), qtype)
    assert vnni_own_layouts() == (isa == "avx512")
    own = qtype.lower().replace("_", "")
    iq4 = qtype == "IQ4_XS"
    assert Int8BlockLinear(weight).layout == {"amx": "block", "avx512": own,
                                              "avx2": "codebook32" if iq4 else "five_bit32"}[isa]
    own_bytes = {"Q4_K": 0.578125, "Q5_K": 0.703125, "IQ4_XS": 0.546875}[qtype]
    assert held_bytes_per_weight(qtype) == {
        "amx": 1.125 if iq4 else 1.25, "avx512": own_bytes, "avx2": 0.625 if iq4 else 0.875}[isa]


@pytest.mark.parametrize("qtype,layout", [("Q6_K", "q6k"), ("Q2_K", "q2k"), ("Q3_K", None),
                                          ("IQ4_XS", "iq4xs")])
def test_a_scaled_super_block_weight_keeps_its_layout(ext, qtype, layout):
    # a query scale folded into a Q6_K, Q3_K, Q2_K or IQ4_XS projection: the weight keeps its
    # factors and carries the scale as its input scale, which the kernel multiplies the
    # activations' scales by: the reference's numbers with dx times it, every ISA, row count and
    # position; its block int8 numbers (what a fused layer of mixed types would hold) are
    # scaled too
    if qtype == "IQ4_XS" and not vnni_own_layouts():
        pytest.skip("IQ4_XS keeps its own layout only where the best kernels are AVX-512 VNNI "
                    "without AMX")
    weight = decode_gguf_blocks(gguf_blocks(qtype, 40, 512, seed=9), qtype)
    factor = 1 / 128 ** 0.5
    scaled = weight.scaled(factor)
    assert type(scaled) is type(weight) and scaled.input_scale == factor
    assert torch.equal(scaled.dequantize(), Int8BlockWeight(
        weight.codes, weight.scale * factor,
        None if weight.minimum is None else weight.minimum * factor, weight.group).dequantize())
    layer = Int8BlockLinear(scaled)
    layout = layout or ("q3k" if without_amx() else "q6k")
    assert layer.layout == layout and layer.input_scale == factor
    x = torch.randn(ROWS, 512, generator=torch.Generator().manual_seed(10))
    reference = minimums_reference if qtype == "Q2_K" else q6k_reference
    expected = reference(x, scaled)
    assert_small_codes_bits(ext, x, layer.packed, layout, qtype == "Q2_K", 40, expected, factor,
                            layer.codebook)
    assert torch.equal(layer(x), expected)
    assert (expected - reference(x, weight) * factor).abs().max() < 1e-5 * expected.abs().max()
    # fused with an unscaled part, not in whole tiles of rows (40), it is block int8 of the
    # scaled numbers
    fused = Int8BlockWeight.cat([scaled, weight])
    assert type(fused) is Int8BlockWeight
    assert torch.equal(fused.dequantize()[:40], scaled.dequantize())
    with pytest.raises(RuntimeError, match="Q5_K and IQ4_XS layouts take an input scale"):
        five = Int8BlockLinear(decode_gguf_blocks(gguf_blocks("Q5_0", 16, 256), "Q5_0"))
        ext.small_codes_linear(torch.randn(2, 256), five.packed, 1, False, None, 16, 0, 0.5)


def test_q3k_in_nibbles_gives_q6ks_bits(ext):
    # Q3_K is Q6_K's form with codes -4..3: held as u = code + 8 in nibbles alone (0.58 bytes a
    # weight against 0.83) it computes Q6_K's numbers, the reference's, on every row count,
    # position and instruction set (an AMX CPU's loader keeps the Q6_K layout, whose AMX
    # kernel takes many rows); the extreme codes -4 and 3 against sc -32 and 31 included
    weight = decode_gguf_blocks(gguf_blocks("Q3_K", 72, 512, seed=5), "Q3_K")
    assert isinstance(weight, Q6KWeight) and -4 <= int(weight.codes.min()) <= int(weight.codes.max()) <= 3
    weight.codes[0, :256], weight.sub_scale[0, :16] = -4, -32
    weight.codes[1, :256], weight.sub_scale[1, :16] = 3, 31
    packed = kernels.pack_q3k(weight.codes, weight.sub_scale, weight.super_scale)
    assert packed.numel() == 80 * 512 * 2368 / 4096
    x = torch.randn(ROWS, 512, generator=torch.Generator().manual_seed(6))
    x[0, :256] = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)
    expected = q6k_reference(x, weight)
    assert_small_codes_bits(ext, x, packed, "q3k", False, 72, expected)
    layer = Int8BlockLinear(weight)
    assert layer.layout == ("q3k" if without_amx() else "q6k")
    assert torch.equal(layer(x), expected)
    # Q6_K's codes past 4 bits keep the Q6_K layout
    q6 = decode_gguf_blocks(gguf_blocks("Q6_K", 16, 256), "Q6_K")
    assert Int8BlockLinear(q6).layout == "q6k"


@pytest.mark.parametrize("qtype", list(HELD_BYTES))
def test_held_bytes_are_the_layouts(ext, qtype):
    # what the memory check counts a matrix of one type as (weights.resident_bytes) is what
    # its layer holds on this CPU (IQ3_S and IQ1_S: the int8 runner's, from their Q4_1 blocks)
    raw = gguf_blocks(qtype, 32, 512, seed=9)
    weight = (as_int8_blocks(q4_nibbles(raw, qtype)) if qtype in ODD_GRID_TYPES
              else decode_gguf_blocks(raw, qtype))
    assert Int8BlockLinear(weight).nbytes == 32 * 512 * held_bytes_per_weight(qtype)


def test_codes_past_five_bits_stay_block_int8(ext):
    assert Int8BlockLinear(decode_gguf_blocks(gguf_blocks("Q8_0", 16, 64), "Q8_0")).layout == "block"
    assert Int8BlockLinear.quantize(torch.randn(16, 64)).layout == "block"
    # Q6_K's values without the factors of their scales: block int8 in groups of 16
    q6 = decode_gguf_blocks(gguf_blocks("Q6_K", 16, 256), "Q6_K")
    assert Int8BlockLinear(Int8BlockWeight(q6.codes, q6.scale, None, 16)).layout == "block"


def test_q6k_stays_q6k_where_rows_are_taken_or_fused(ext):
    parts = [decode_gguf_blocks(gguf_blocks("Q6_K", rows, 256, seed), "Q6_K")
             for seed, rows in enumerate((32, 16))]
    fused = Int8BlockWeight.cat(parts)
    assert isinstance(fused, Q6KWeight)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    order = torch.arange(31, -1, -1)
    taken = parts[0].take(order)
    assert isinstance(taken, Q6KWeight)
    assert torch.equal(taken.dequantize(), parts[0].dequantize()[order])
    assert torch.equal(Int8BlockLinear(taken)(torch.ones(1, 256)),
                       Int8BlockLinear(parts[0])(torch.ones(1, 256))[:, order])
    # beside another type: block int8 in groups of 16, every weight unchanged
    mixed = Int8BlockWeight.cat([parts[0], decode_gguf_blocks(gguf_blocks("Q4_K", 16, 256), "Q4_K")])
    assert not isinstance(mixed, Q6KWeight) and Int8BlockLinear(mixed).layout == "block"


def test_float16_scales_where_they_are_float16_numbers(ext):
    # the same numbers in fewer bytes: Q8_0's scales are float16, Q4_K's products d * sc not
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(7))
    for qtype, half in (("Q8_0", True), ("Q4_1", True), ("Q4_K", False), ("Q6_K", False)):
        weight = decode_gguf_blocks(gguf_blocks(qtype, 32, 512), qtype)
        layer = Int8BlockLinear(weight)
        assert layer.half == half, qtype
        if half:
            wide = kernels.pack_q8_blocks(weight.codes, weight.scale, weight.minimum, 32, False)
            assert layer.packed.shape[2] < wide.shape[2]
            assert torch.equal(layer(x), ext.q8_linear(x, wide, 32, weight.minimum is not None,
                                                       False, None, 32, kernels.isa()))


def test_thread_count_changes_no_bit(ext):
    # threads split column tiles, never a sum (the tests run on one thread otherwise)
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: the kernel's threads cannot be tested here")
    gen = torch.Generator().manual_seed(8)
    weight = decode_gguf_blocks(gguf_blocks("Q6_K", 200, 512), "Q6_K")
    layer, x = Int8BlockLinear(weight), torch.randn(ROWS, 512, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = layer(x)
        torch.set_num_threads(1)
        assert torch.equal(together, layer(x))
    finally:
        torch.set_num_threads(before)


def test_residual_is_added_once_at_the_end(ext):
    gen = torch.Generator().manual_seed(5)
    layer = Int8BlockLinear.quantize(torch.randn(40, 64, generator=gen))
    x, residual = torch.randn(7, 64, generator=gen), torch.randn(7, 40, generator=gen)
    assert torch.equal(layer(x, residual), residual + layer(x))


def test_float_weights_quantised_per_32_and_padded(ext):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(24, 40, generator=gen)  # 40 inputs: padded to 64 with zero weights
    q = quantize_int8_blocks(w)
    assert q.codes.shape == (24, 64) and q.group == 32 and q.minimum is None
    deq = q.dequantize()
    assert torch.equal(deq[:, 40:], torch.zeros(24, 24))
    assert torch.equal(q.scale.half().float(), q.scale)  # float16 numbers, rounded up
    step = w.abs().amax(1, keepdim=True) / 127 * (1 + 2 ** -10)  # at least every group's scale
    assert ((deq[:, :40] - w).abs() <= step / 2).all()
    layer = make_linear(w, "int8")
    assert isinstance(layer, Int8BlockLinear) and layer.in_features == 40 and layer.half
    x = torch.randn(3, 40, generator=gen)
    exact = x.double() @ deq[:, :40].double().T
    assert ((layer(x).double() - exact).abs() <= activation_bound(
        torch.nn.functional.pad(x, (0, 24)), deq) * 1.0001 + 1e-5).all()


def test_bad_input_gets_clear_errors(ext):
    layer = Int8BlockLinear.quantize(torch.randn(16, 64))
    with pytest.raises(SpecDecodeError, match=r"\[16 x 64\].*float32 \[rows, 64\]"):
        layer(torch.randn(2, 96))
    with pytest.raises(SpecDecodeError, match="float32"):
        layer(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(SpecDecodeError, match="residual"):
        layer(torch.randn(2, 64), torch.randn(3, 16))
    with pytest.raises(SpecDecodeError, match="not IQ1_M"):
        decode_gguf_blocks(np.zeros((2, 56), np.uint8), "IQ1_M")
    with pytest.raises(SpecDecodeError, match="multiple of 34 bytes"):
        decode_gguf_blocks(np.zeros((2, 35), np.uint8), "Q8_0")
    codes = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(SpecDecodeError, match="groups are"):
        Int8BlockWeight(codes, torch.zeros(4, 8), None, 8)
    with pytest.raises(SpecDecodeError, match=r"scale must be float32 \[4, 2\]"):
        Int8BlockWeight(codes, torch.zeros(4, 4), None, 32)
    with pytest.raises(SpecDecodeError, match="codes must be int8"):
        Int8BlockWeight(codes.float(), torch.zeros(4, 2), None, 32)
    q6k = Int8BlockLinear(decode_gguf_blocks(gguf_blocks("Q6_K", 16, 256), "Q6_K"))
    with pytest.raises(RuntimeError, match=r"9 \(Q5_K\) or 10 \(IQ4_XS\), not 11"):
        ext.small_codes_linear(torch.randn(2, 256), q6k.packed, 11, False, None, 16, 0)
    with pytest.raises(RuntimeError, match="Q6_K, Q3_K and codebook layouts have no minimums"):
        ext.small_codes_linear(torch.randn(2, 256), q6k.packed, 0, True, None, 16, 0)
    with pytest.raises(RuntimeError, match="the Q2_K, Q4_K and Q5_K layouts have minimums"):
        ext.small_codes_linear(torch.randn(2, 256), q6k.packed, 6, False, None, 16, 0)
    with pytest.raises(RuntimeError, match="whole tiles of 16 of the 16, not 8"):
        ext.small_codes_linear(torch.randn(2, 256), q6k.packed, 0, False, None, 16, 0, 0.5,
                               None, 8)
    book = kernels.pack_codebook(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2),
                                 half=False)
    with pytest.raises(RuntimeError, match="the codebook layouts, and they alone, take a codebook"):
        ext.small_codes_linear(torch.randn(2, 64), book, 4, False, None, 16, 0)
    with pytest.raises(RuntimeError, match="a codebook is sixteen int8 codes"):
        ext.small_codes_linear(torch.randn(2, 64), book, 4, False, None, 16, 0, 1.0,
                               torch.zeros(8, dtype=torch.int8))
    q2k = decode_gguf_blocks(gguf_blocks("Q2_K", 16, 256), "Q2_K")
    with pytest.raises(SpecDecodeError, match="Q2_K codes are 0..3, its sc and m 0..15"):
        kernels.pack_q2k(q2k.codes + 1, q2k.sub_scale, q2k.sub_min, q2k.super_scale,
                         q2k.super_min)
    q4k = decode_gguf_blocks(gguf_blocks("Q4_K", 16, 256), "Q4_K")
    with pytest.raises(SpecDecodeError, match="Q4_K codes are 0..15, its sc and m 0..63"):
        kernels.pack_q4k(q4k.codes, q4k.sub_scale + 1, q4k.sub_min, q4k.super_scale,
                         q4k.super_min)
    with pytest.raises(SpecDecodeError, match=r"sc and m \[N, K / 32\]"):
        kernels.pack_q4k(q4k.codes, q4k.sub_scale[:, :4], q4k.sub_min, q4k.super_scale,
                         q4k.super_min)


@pytest.mark.slow  # gguf's reader parses the file's 49,152-token vocabulary first (15-20 s)
def test_the_default_models_own_blocks_decode_exactly():
    """The real Q8_0 embedding and a Q4_1 projection of SmolLM2's GGUF file, memory-mapped
    (their first 512 rows: rows are independent)."""
    from specdecode.models.loading import default_gguf_path

    try:
        path = default_gguf_path()
    except SpecDecodeError as exc:
        pytest.skip(str(exc))
    reader = gguf.GGUFReader(path)
    picked = {}
    for t in reader.tensors:
        picked.setdefault(t.tensor_type.name, t)
    for qtype in ("Q8_0", "Q4_1"):
        t = picked[qtype]
        rows = np.asarray(t.data)[:512]
        weight = decode_gguf_blocks(rows, qtype)
        expected = gguf.quants.dequantize(rows, t.tensor_type)
        assert np.array_equal(weight.dequantize().numpy().view(np.uint32),
                              expected.view(np.uint32)), t.name
        assert Int8BlockLinear(weight).half  # the file's float16 scales, kept in float16
