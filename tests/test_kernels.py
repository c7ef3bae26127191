"""The native runner's CPU kernels: right answers, every row count and every position of a row
in a call bitwise the same, and the same bits from every instruction-set variant (AMX,
AVX-512, AVX2, baseline x86-64): each test runs once per variant this CPU supports, against
the baseline variant's bits, and is skipped, naming the missing CPU flag, for the others."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import assert_row_invariant, cpu_flags
from specdecode import kernels
from specdecode.models.quant import int4_weights, quantize_int4

ROWS = 64
GENERIC = 0
#: /proc/cpuinfo flags each variant needs beyond the one below it
ISA_FLAGS = {"avx2": ("avx2", "fma"),
             "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
             "amx": ("amx_tile", "amx_int8")}


def require_isa(name: str) -> int:
    """The level of variant ``name``; skips, naming what is missing, where this CPU cannot run it."""
    level = kernels.ISA_LEVELS.index(name)
    if level <= kernels.load().isa_level():
        return level
    needed = [flag for lower in kernels.ISA_LEVELS[1:level + 1] for flag in ISA_FLAGS[lower]]
    missing = [flag for flag in needed if flag not in cpu_flags()]
    if missing:
        pytest.skip(f"this CPU has no {', '.join(missing)}: the {name} kernels cannot run here")
    pytest.skip(f"the OS did not grant this process the {name} state (for AMX: "
                "arch_prctl(ARCH_REQ_XCOMP_PERM), Linux 5.16 or later)")


@pytest.fixture(scope="module")
def ext():
    if not kernels.available():
        pytest.skip("the CPU kernels cannot be built here (g++ and the Python headers are needed)")
    return kernels.load()


@pytest.fixture(params=kernels.ISA_LEVELS)
def isa(request, ext) -> int:
    """Each instruction-set variant in turn (its level), skipped where this CPU lacks it."""
    return require_isa(request.param)


def test_dense_formats(ext, isa):
    gen = torch.Generator().manual_seed(0)
    n, k = 200, 96  # a last, partial tile of columns
    w, x = torch.randn(n, k, generator=gen), torch.randn(ROWS, k, generator=gen)
    scale = torch.rand(n, generator=gen) + 0.5
    for dtype, sc in ((torch.float32, None), (torch.bfloat16, None), (torch.int8, scale)):
        wq = (w * 20).round().clamp(-127, 127).to(torch.int8) if dtype == torch.int8 else w.to(dtype)
        packed = kernels.pack_dense(wq)
        out = assert_row_invariant(lambda rows: ext.dense_linear(rows, packed, sc, None, n, isa), x)
        assert torch.equal(out, ext.dense_linear(x, packed, sc, None, n, GENERIC)), dtype
        expected = x.double() @ wq.double().T * (1 if sc is None else sc.double())
        assert (out - expected).abs().max() < 1e-3, dtype
    residual = torch.randn(ROWS, n, generator=gen)
    packed = kernels.pack_dense(w)
    with_residual = ext.dense_linear(x, packed, None, residual, n, isa)
    assert torch.equal(with_residual, residual + ext.dense_linear(x, packed, None, None, n, isa))


# (72, 128): a last, partial tile of columns; (200, 96): an odd number of groups
@pytest.mark.parametrize("n,k", [(72, 128), (200, 96)])
def test_q4_times_int8_activations(ext, isa, n, k):
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(n, k, generator=gen), torch.randn(ROWS, k, generator=gen)
    codes, scale, minimum = quantize_int4(w)
    packed = kernels.pack_q4(codes, scale, minimum)
    out = assert_row_invariant(lambda rows: ext.q4_linear(rows, packed, None, n, isa), x)
    assert torch.equal(out, ext.q4_linear(x, packed, None, n, GENERIC))
    # the file's weights times activations rounded to int8 per 32: about 1% of the scale
    exact = x @ int4_weights(codes, scale, minimum).T
    relative = float((out - exact).abs().max() / exact.abs().max())
    assert 0 < relative < 0.02, relative
    assert torch.equal(ext.q4_linear(torch.zeros(ROWS, k), packed, None, n, isa), torch.zeros(ROWS, n))


@pytest.mark.parametrize("n", [75, 83])  # a last tile cut inside its first and second 8 columns
def test_q4_extreme_codes_and_cut_tiles_with_a_residual(ext, isa, n):
    """Codes of 15 against activations quantised to +-127 give the largest sums a group holds
    (AVX2 adds a group's products in 16-bit lanes: they must not saturate)."""
    k = 256
    gen = torch.Generator().manual_seed(2)
    codes = torch.full((n, k), 15, dtype=torch.uint8)
    codes[::3] = torch.randint(0, 16, (codes[::3].shape), generator=gen, dtype=torch.uint8)
    scale, minimum = torch.rand(n, k // 32, generator=gen) / 8, -torch.rand(n, k // 32, generator=gen)
    packed = kernels.pack_q4(codes, scale.half().float(), minimum.half().float())
    x = torch.ones(ROWS, k)  # every input at +-max|x|: xq = +-127, one sign a row
    x[1::2] = -1
    x[2] = torch.randn(k, generator=gen).sign()
    residual = torch.randn(ROWS, n, generator=gen)
    out = assert_row_invariant(lambda rows: ext.q4_linear(rows, packed, None, n, isa), x)
    assert torch.equal(out, ext.q4_linear(x, packed, None, n, GENERIC))
    exact = x.double() @ int4_weights(codes, scale.half().float(), minimum.half().float()).double().T
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-3)
    assert torch.equal(ext.q4_linear(x, packed, residual, n, isa), residual + out)


def test_norm_and_swiglu(ext, isa):
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(ROWS, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    out = assert_row_invariant(lambda rows: ext.rms_norm(rows, w, 1e-5, isa), h)
    assert torch.equal(out, ext.rms_norm(h, w, 1e-5, GENERIC))
    assert (out - torch.nn.functional.rms_norm(h, (576,), w, 1e-5)).abs().max() < 1e-5
    # 203 columns: whole vectors and a tail; a few gates past exp's clamp at -87 and 88
    gu = torch.randn(ROWS, 2 * 203, generator=gen) * 6
    gu[::5, :7] = torch.tensor([-200.0, -88.0, -87.5, 87.5, 88.5, 200.0, -0.0])
    out = assert_row_invariant(lambda rows: ext.swiglu(rows, isa), gu)
    assert torch.equal(out, ext.swiglu(gu, GENERIC))
    gate, up = gu.chunk(2, -1)
    expected = torch.nn.functional.silu(gate) * up
    assert (out - expected).abs().max() / expected.abs().max() < 1e-6


def test_geglu_and_softcap(ext, isa):
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(ROWS, 2 * 200, generator=gen) * 6
    out = assert_row_invariant(lambda rows: ext.geglu(rows, isa), gu)
    assert torch.equal(out, ext.geglu(gu, GENERIC))
    gate, up = gu.chunk(2, -1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert (out - expected).abs().max() / expected.abs().max() < 1e-6
    logits = torch.randn(ROWS, 300, generator=gen) * 40
    out = assert_row_invariant(lambda rows: ext.softcap(rows, 30.0, isa), logits)
    assert torch.equal(out, ext.softcap(logits, 30.0, GENERIC))
    assert (out - torch.tanh(logits / 30) * 30).abs().max() < 1e-5
    assert out.abs().max() <= 30


def test_draw_tokens_every_variant_and_row_alike(ext, isa):
    """The data writer's sampler: each row's token from its own operations (every row count
    and position of a row, every variant give the same tokens); the first largest at
    temperature 0; a drawn token inside the top-p nucleus; -1 where no uniform lands in it."""
    gen = torch.Generator().manual_seed(5)
    vocab = 1000 + 7  # a partial last block and a partial last vector
    logits = torch.randn(24, vocab, generator=gen) * 4
    logits[3, 10] = logits[3, 900] = logits[3].max() + 1  # a tie: the first one wins
    temperatures = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.7] * 4)
    uniforms = torch.rand(24, 3, generator=gen)
    together = ext.draw_tokens(logits, temperatures, uniforms, 0.9, isa)
    for m in (1, 5, 24):
        for start in (0, 24 - m):
            part = ext.draw_tokens(logits[start:start + m], temperatures[start:start + m],
                                   uniforms[start:start + m], 0.9, isa)
            assert torch.equal(part, together[start:start + m])
    assert torch.equal(together, ext.draw_tokens(logits, temperatures, uniforms, 0.9, GENERIC))
    greedy = temperatures == 0
    assert torch.equal(together[greedy], logits[greedy].argmax(-1)) and together[3] == 10
    for r in torch.nonzero(~greedy).flatten().tolist():
        probs = (logits[r] / temperatures[r]).softmax(-1)
        token = int(together[r])
        assert token >= 0 and probs[probs > probs[token]].sum() <= 0.9 + 1e-5
    # token 0 holds 0.957 of the mass, so the nucleus of 0.9 is token 0 alone: a uniform past
    # 0.957 lands outside it and the next one is tried; -1 when every one does
    peaked = torch.cat([torch.tensor([[10.0]]), torch.zeros(1, 999)], 1)
    one = torch.tensor([1.0])
    assert ext.draw_tokens(peaked, one, torch.tensor([[0.99, 0.5]]), 0.9, isa).item() == 0
    assert ext.draw_tokens(peaked, one, torch.tensor([[0.99, 0.98]]), 0.9, isa).item() == -1


def test_top_probs_ranks_as_softmax_topk(ext, isa):
    """A drafter's children in one call: torch's softmax and top-k (the same order, the
    probabilities within float rounding), equal ones by index, a -inf logit never ranked, the
    same bits in every variant and however many rows share the call."""
    gen = torch.Generator().manual_seed(7)
    vocab = 1000 + 7  # a partial last vector
    logits = torch.randn(9, vocab, generator=gen) * 3
    logits[2, 500] = logits[2, 40] = logits[2].max() + 1  # a tie: the lower index first
    logits[4, :] = float("-inf")
    logits[4, 17], logits[4, 3] = 1.0, 2.0  # two finite logits: 6 places left empty
    probs, ids = ext.top_probs(logits, 8, isa)
    reference = logits.softmax(-1).topk(8, -1)
    finite = [r for r in range(9) if r != 4]
    assert torch.equal(ids[finite], reference.indices[finite])
    assert torch.allclose(probs[finite], reference.values[finite], rtol=1e-5, atol=1e-7)
    assert ids[2, :2].tolist() == [40, 500]
    assert ids[4].tolist() == [3, 17] + [-1] * 6 and probs[4, 2:].eq(0).all()
    assert torch.allclose(probs[4, :2], torch.tensor([2.0, 1.0]).softmax(-1))
    for start, m in ((0, 1), (3, 4), (8, 1)):
        part = ext.top_probs(logits[start:start + m], 8, isa)
        assert torch.equal(part[0], probs[start:start + m])
        assert torch.equal(part[1], ids[start:start + m])
    generic = ext.top_probs(logits, 8, GENERIC)
    assert torch.equal(generic[0], probs) and torch.equal(generic[1], ids)
    with pytest.raises(RuntimeError, match="limit must be in 1 .. 1007"):
        ext.top_probs(logits, vocab + 1, isa)


@pytest.fixture(scope="module")
def amx(ext) -> int:
    return require_isa("amx")


# the default model's qkv (576 -> 960), gate/up (576 -> 3072) and down (1536 -> 576), a 2048 x
# 8192 layer, and a partial column tile with an odd number of groups
@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536), (8192, 2048), (200, 96)])
def test_q4_amx_equals_vnni_bitwise(ext, amx, n, k):
    """The AMX tiles' group sums are VPDPBUSD's exact integers, folded in the same order: the
    same bits for every row count, with and without a residual."""
    gen = torch.Generator().manual_seed(n + k)
    codes, scale, minimum = quantize_int4(torch.randn(n, k, generator=gen))
    packed = kernels.pack_q4(codes, scale, minimum)
    x, residual = torch.randn(ROWS, k, generator=gen), torch.randn(ROWS, n, generator=gen)
    vnni = kernels.ISA_LEVELS.index("avx512")
    assert ext.q4_uses_amx(ROWS, amx) and not ext.q4_uses_amx(ROWS, vnni)
    for m in range(1, ROWS + 1):
        rows, res = x[:m].contiguous(), residual[:m].contiguous()
        assert torch.equal(ext.q4_linear(rows, packed, res, n, amx),
                           ext.q4_linear(rows, packed, res, n, vnni)), m
        if m in (1, 16, 37):
            assert torch.equal(ext.q4_linear(rows, packed, None, n, amx),
                               ext.q4_linear(rows, packed, None, n, vnni)), m


# block int8 of groups of 32 (the int4 runner's Q8_0 LM head: float16 scales; --weights int8;
# Q4_1 and Q5_1 layers read as int8: minimums), the default model's head width (576) and a
# partial column tile with an odd number of groups
@pytest.mark.parametrize("minimum,half", [(False, True), (False, False), (True, True), (True, False)])
@pytest.mark.parametrize("n,k", [(1000, 576), (200, 96)])
def test_q8_amx_equals_vnni_bitwise(ext, amx, n, k, minimum, half):
    """Block int8 groups of 32 on the AMX tiles from 7 rows (Q8_AMX_MIN_ROWS): a group's block
    of codes is a weight tile, its sums VPDPBUSD's exact integers, folded in the same order: the
    same bits for every row count, with and without a residual, as VNNI and the portable code."""
    gen = torch.Generator().manual_seed(n + k + 2 * minimum + half)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    low = ((torch.rand(n, k // 32, generator=gen) - 0.5) * 0.01).half().float() if minimum else None
    packed = kernels.pack_q8_blocks(codes, scale, low, 32, half)
    x, residual = torch.randn(ROWS, k, generator=gen), torch.randn(ROWS, n, generator=gen)
    vnni = kernels.ISA_LEVELS.index("avx512")
    for m in range(1, ROWS + 1):
        rows, res = x[:m].contiguous(), residual[:m].contiguous()
        tiles = ext.q8_linear(rows, packed, 32, minimum, half, res, n, amx)
        assert torch.equal(tiles, ext.q8_linear(rows, packed, 32, minimum, half, res, n, vnni)), m
        if m in (1, 7, 16, 37):
            assert torch.equal(ext.q8_linear(rows, packed, 32, minimum, half, None, n, amx),
                               ext.q8_linear(rows, packed, 32, minimum, half, None, n, GENERIC)), m


def test_q4_stack_amx_equals_vnni_bitwise(ext, amx):
    """The int4 layers in one call (LayerStack) with the AMX tiles: VNNI's bits for chains of every
    size, and a chain's first rows alone give the same bits as inside the longer chain."""
    gen = torch.Generator().manual_seed(5)
    layers, hidden, heads, kv, d, inter, cap, past = 2, 64, 4, 2, 16, 96, 128, 20

    def q4(n, k):
        packed = kernels.pack_q4(*quantize_int4(torch.randn(n, k, generator=gen) / k ** 0.5))
        return kernels.packed_linear(packed, kernels.INT4_KIND, n)

    norms = [torch.rand(hidden, generator=gen) + 0.5 for _ in range(2 * layers)]
    stack = kernels.layer_stack(norms[:layers],
                                [q4((heads + 2 * kv) * d, hidden) for _ in range(layers)],
                                [q4(hidden, heads * d) for _ in range(layers)], norms[layers:],
                                [q4(2 * inter, hidden) for _ in range(layers)],
                                [q4(hidden, inter) for _ in range(layers)], [0] * layers, heads,
                                kv, d, hidden, 1e-5)
    k_cache = torch.randn(layers, kv, cap // 16, d, 16, generator=gen)
    v_cache = torch.randn(layers, kv, cap, d, generator=gen)
    x = torch.randn(ROWS, hidden, generator=gen)
    angles = torch.rand(ROWS, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    slots = past + torch.arange(ROWS)
    table = slots.to(torch.int32).expand(ROWS, ROWS).contiguous()
    lens = torch.arange(1, ROWS + 1, dtype=torch.int32)

    def chain(m, level):
        plan = kernels.packed_plan([k_cache.clone()], [v_cache.clone()], [past],
                                   [slots[:m].contiguous()], [table[:m, :m].contiguous()],
                                   [lens[:m].contiguous()])
        return stack.forward(x[:m].contiguous(), 0, layers, plan, cos[:m].contiguous(),
                             sin[:m].contiguous(), level)

    together = chain(ROWS, amx)
    assert torch.equal(together, chain(ROWS, kernels.ISA_LEVELS.index("avx512")))
    for m in (1, 7, 8, 16, 33):
        assert torch.equal(chain(m, amx), together[:m]), m


def caches(kv: int, d: int, cap: int, dtype: torch.dtype, gen: torch.Generator):
    """Random keys [KV, D, cap] and values [KV, cap, D] (float32, exactly representable in
    ``dtype``) and the cache tensors holding them in ``dtype``: keys in blocks of 16 slots."""
    keys = torch.randn(kv, d, cap, generator=gen).to(dtype).float()
    values = torch.randn(kv, cap, d, generator=gen).to(dtype).float()
    blocked = keys.view(kv, d, cap // 16, 16).transpose(1, 2).contiguous()
    return keys, values, blocked.to(dtype), values.to(dtype)


def strided_paths(past: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree rows whose ancestors are not contiguous: row r's path is the draft slots r % stride,
    r % stride + stride, .. r after the ``past`` cached ones; the slot table and lengths."""
    table = torch.zeros(ROWS, ROWS // stride + 1, dtype=torch.int32)
    lens = torch.zeros(ROWS, dtype=torch.int32)
    for r in range(ROWS):
        path = list(range(r % stride, r + 1, stride))
        table[r, :len(path)] = past + torch.tensor(path, dtype=torch.int32)
        lens[r] = len(path)
    return table, lens


def test_bfloat16_cache_reads_exactly_what_float32_holds(ext, isa):
    """A bfloat16 cache gives the bits of a float32 cache holding the same (rounded) values:
    reading is exact, so only the write rounds."""
    gen = torch.Generator().manual_seed(1)
    heads, kv, d, cap, past = 9, 3, 64, 304, 70
    _, _, k16, v16 = caches(kv, d, cap, torch.bfloat16, gen)
    k32, v32 = k16.float(), v16.float()
    q = torch.randn(ROWS, heads, d, generator=gen)
    # tree rows: row r sees the slots of rows r % 3, r % 3 + 3, .. r (odd and even slots gathered)
    table, lens = strided_paths(past, 3)
    for window in (0, 9):
        assert torch.equal(ext.attention(q, k16, v16, past, table, lens, window, 0.0, isa),
                           ext.attention(q, k32, v32, past, table, lens, window, 0.0, isa)), window
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        ext.attention(q, k16, v32, past, table, lens, 0, 0.0, isa)


def test_rope_store_rounds_the_cache_to_nearest_even(ext, isa):
    """Writing a bfloat16 cache rounds as torch does (to nearest, ties to even; a NaN stays a
    NaN), the same bits as a float32 cache rounded afterwards; q stays float32; every variant
    writes the baseline's bits."""
    gen = torch.Generator().manual_seed(2)
    heads, kv, d, m, cap = 3, 1, 64, 40, 64
    qkv = torch.randn(m, (heads + 2 * kv) * d, generator=gen)
    qkv[0, -d:] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -9] * (d // 4))  # ties
    qkv[1, -1] = float("nan")
    angles = torch.rand(m, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    slots = torch.randperm(cap, generator=gen)[:m]
    stored = {}
    for dtype in (torch.float32, torch.bfloat16):
        for level in (isa, GENERIC):
            k_cache = torch.zeros(kv, cap // 16, d, 16, dtype=dtype)
            v_cache = torch.zeros(kv, cap, d, dtype=dtype)
            q = ext.rope_store(qkv, cos, sin, heads, kv, k_cache, v_cache, slots, level)
            stored[dtype, level] = (q, k_cache, v_cache)
        assert all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))
                   for a, b in zip(stored[dtype, isa], stored[dtype, GENERIC]))
    q32, k32, v32 = stored[torch.float32, isa]
    q16, k16, v16 = stored[torch.bfloat16, isa]
    assert torch.equal(q16, q32)
    assert torch.equal(k16, k32.to(torch.bfloat16))
    assert torch.equal(v16.nan_to_num(), v32.to(torch.bfloat16).nan_to_num())
    assert v16[0, slots[0], :4].tolist() == [1.0, 1 + 2 ** -6, -1.0, 1.0]
    assert v16[0, slots[1], -1].isnan()


# window 0: no window, tree rows whose ancestors are not contiguous slots
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 1, 7, 20, 70])
def test_sliding_window_attention(ext, isa, window, dtype):
    gen = torch.Generator().manual_seed(window)
    heads, kv, d, cap, past = 4, 2, 32, 304, 90
    keys, values, blocked, cached_values = caches(kv, d, cap, dtype, gen)
    q = torch.randn(ROWS, heads, d, generator=gen)
    # rows in tree order: row r's keys are the cached ones, then the slots of rows 0, 2, 4 ..
    # up to r (every other row), so a row's window covers slots that are not contiguous
    table, lens = strided_paths(past, 2)
    out = ext.attention(q, blocked, cached_values, past, table, lens, window, 0.0, isa)
    assert torch.equal(out, ext.attention(q, blocked, cached_values, past, table, lens, window, 0.0, GENERIC))
    for r in (0, 1, 33, ROWS - 1):
        alone = ext.attention(q[r:r + 1].contiguous(), blocked, cached_values, past, table[r:r + 1].contiguous(),
                              lens[r:r + 1], window, 0.0, isa)
        assert torch.equal(alone[0], out[r]), r
        slots = list(range(past)) + table[r, :lens[r]].tolist()
        seen = torch.tensor(slots[-window:] if window else slots)  # the last `window` positions
        scores = torch.einsum("hd,hdl->hl", q[r], keys[:, :, seen].repeat_interleave(2, 0))
        expected = torch.einsum("hl,hld->hd", torch.softmax(scores, -1),
                                values[:, seen].repeat_interleave(2, 0))
        assert (out[r] - expected.reshape(-1)).abs().max() < 1e-4


def check_attention_variant(q, past: int, attention, plain, expected) -> None:
    """What a variant of attention's scores (soft-capping, sinks) keeps: ``attention(rows,
    past, table, lens, level=isa)`` gives every ISA level the baseline's bits and other output
    than ``plain`` (the same call without the variant), a tree row alone the bits it has among
    others, a chain row the bits it has alone after its earlier rows are committed (its keys
    then read as cached blocks), and within 1e-4 of ``expected(row, slots)`` (plain PyTorch)."""
    table, lens = strided_paths(past, 2)  # tree rows: every other row's slot, then their own
    out = attention(q, past, table, lens)
    assert torch.equal(out, attention(q, past, table, lens, GENERIC))
    assert not torch.allclose(out, plain(q, past, table, lens), atol=1e-3)
    for r in (0, 1, 33, ROWS - 1):
        alone = attention(q[r:r + 1].contiguous(), past, table[r:r + 1].contiguous(), lens[r:r + 1])
        assert torch.equal(alone[0], out[r]), r
        assert (out[r] - expected(r, list(range(past)) + table[r, :lens[r]].tolist())).abs().max() < 1e-4
    chain = (past + torch.arange(ROWS, dtype=torch.int32)).expand(ROWS, ROWS).contiguous()
    out = attention(q, past, chain, torch.arange(1, ROWS + 1, dtype=torch.int32))
    for r in (0, 17, ROWS - 1):
        alone = attention(q[r:r + 1].contiguous(), past + r, torch.tensor([[past + r]], dtype=torch.int32),
                          torch.tensor([1], dtype=torch.int32))
        assert torch.equal(alone[0], out[r]), r
        assert (out[r] - expected(r, list(range(past + r + 1)))).abs().max() < 1e-4


# head sizes 32 (the AVX2 and AVX-512 blocks) and 24 (attend_one in every variant); no window and one
# that tree rows cross
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,window", [(32, 0), (32, 20), (24, 0), (24, 20)])
def test_soft_capped_attention(ext, isa, d, window, dtype):
    """Scores cap * tanh(score / cap) before the softmax (Gemma 2): every variant the baseline's
    bits, a tree row alone the bits it has among others, a chain row the bits it has alone after
    its earlier rows are committed (its keys then read as cached blocks), and plain PyTorch's
    answer. Random scores here are several times the cap, so tanh bends them."""
    gen = torch.Generator().manual_seed(d + window)
    heads, kv, cap, past, softcap = 4, 2, 304, 90, 2.0
    keys, values, blocked, cached_values = caches(kv, d, cap, dtype, gen)
    q = torch.randn(ROWS, heads, d, generator=gen)

    def attention(rows, past, table, lens, level=isa):
        return ext.attention(rows, blocked, cached_values, past, table, lens, window, softcap, level)

    def expected(r, slots):
        seen = torch.tensor(slots[-window:] if window else slots)
        scores = torch.einsum("hd,hdl->hl", q[r], keys[:, :, seen].repeat_interleave(2, 0))
        capped = softcap * torch.tanh(scores / softcap)
        return torch.einsum("hl,hld->hd", torch.softmax(capped, -1),
                            values[:, seen].repeat_interleave(2, 0)).reshape(-1)

    plain = lambda rows, past, table, lens: ext.attention(  # noqa: E731
        rows, blocked, cached_values, past, table, lens, window, 0.0, isa)
    check_attention_variant(q, past, attention, plain, expected)


# head sizes: 16, 64 and one the blocks do not fit; groups of query heads per key/value head: 2,
# SmolLM2's 3 (AVX-512: blocks of 4 rows; AVX2: 2 rows), Qwen2.5-1.5B's 6 (AVX-512: 4 + 2 heads
# in blocks of 3 rows; AVX2: 6 heads, 1 row) and the 0.5B's 7 (AVX-512: 4 + 3; AVX2: 6 + 1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,heads,kv", [(16, 4, 2), (64, 4, 2), (24, 4, 2), (64, 9, 3), (32, 6, 1),
                                        (32, 14, 2)])
def test_attention_rows_see_their_keys_in_order(ext, isa, d, heads, kv, dtype):
    gen = torch.Generator().manual_seed(d + heads)
    group, cap = heads // kv, 304
    keys, values, blocked, cached_values = caches(kv, d, cap, dtype, gen)
    for past in (0, 5, 64, 130):
        q = torch.randn(ROWS, heads, d, generator=gen)

        def chain(rows, level):  # row r of a block sees past..past+r, as in a chain forward
            m = len(rows)
            table = (past + torch.arange(m, dtype=torch.int32)).expand(m, m).contiguous()
            return ext.attention(rows, blocked, cached_values, past, table,
                                 torch.arange(1, m + 1, dtype=torch.int32), 0, 0.0, level)

        out = chain(q, isa)
        assert torch.equal(out, chain(q, GENERIC)), past
        for r in (0, 17, ROWS - 1):
            # the same row alone, its earlier rows committed: the same keys, the same bits
            alone = ext.attention(q[r:r + 1].contiguous(), blocked, cached_values, past + r,
                                  torch.tensor([[past + r]], dtype=torch.int32),
                                  torch.tensor([1], dtype=torch.int32), 0, 0.0, isa)
            assert torch.equal(alone[0], out[r]), (past, r)
            n = past + r + 1
            scores = torch.einsum("hd,hdl->hl", q[r], keys[:, :, :n].repeat_interleave(group, 0))
            expected = torch.einsum("hl,hld->hd", torch.softmax(scores, -1),
                                    values[:, :n].repeat_interleave(group, 0))
            assert (out[r] - expected.reshape(-1)).abs().max() < 1e-4


@pytest.fixture
def two_threads():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: the kernels' threads cannot be tested here")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_kernels_run_on_every_thread(ext, two_threads):
    """The extension is built with OpenMP: without it, at::parallel_for inside it runs on one
    thread whatever torch.set_num_threads says (it did, unnoticed, for a whole session)."""
    assert ext.parallel_threads(64) == 2


def test_thread_count_changes_no_bit(ext, isa, two_threads):
    gen = torch.Generator().manual_seed(3)
    n, k = 200, 128
    x = torch.randn(ROWS, k, generator=gen)
    codes, scale, minimum = quantize_int4(torch.randn(n, k, generator=gen))
    q4 = kernels.pack_q4(codes, scale, minimum)
    dense = kernels.pack_dense(torch.randn(n, k, generator=gen))
    heads, kv, d, cap, past = 4, 2, 64, 160, 70
    keys = torch.randn(kv, cap // 16, d, 16, generator=gen)
    values = torch.randn(kv, cap, d, generator=gen)
    q = torch.randn(ROWS, heads, d, generator=gen)
    table = (past + torch.arange(ROWS, dtype=torch.int32)).expand(ROWS, ROWS).contiguous()
    lens = torch.arange(1, ROWS + 1, dtype=torch.int32)

    gate_up = torch.randn(ROWS, 2 * n, generator=gen)
    qkv = torch.randn(ROWS, (heads + 2 * kv) * d, generator=gen)
    angles = torch.rand(ROWS, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    slots = torch.randperm(cap, generator=gen)[:ROWS]

    def rope_store():  # the query rows and both caches a thread's share of the rows wrote
        k_cache = torch.zeros(kv, cap // 16, d, 16, dtype=torch.bfloat16)
        v_cache = torch.zeros(kv, cap, d, dtype=torch.bfloat16)
        return [ext.rope_store(qkv, cos, sin, heads, kv, k_cache, v_cache, slots, isa), k_cache, v_cache]

    def run_all():
        return [ext.q4_linear(x, q4, None, n, isa), ext.dense_linear(x, dense, None, None, n, isa),
                ext.attention(q, keys, values, past, table, lens, 0, 0.0, isa),
                ext.rms_norm(x, torch.rand(k, generator=gen), 1e-5, isa),
                ext.swiglu(gate_up, isa), ext.geglu(gate_up, isa), *rope_store()]

    gen.manual_seed(4)
    together = run_all()
    gen.manual_seed(4)
    torch.set_num_threads(1)
    alone = run_all()
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def test_unknown_isa_limit_is_named(monkeypatch):
    monkeypatch.setenv("SPECDECODE_KERNEL_ISA", "sse9")
    kernels.isa.cache_clear()
    try:
        with pytest.raises(ValueError, match="SPECDECODE_KERNEL_ISA='sse9'; known: generic, avx2, avx512, amx"):
            kernels.isa()
    finally:
        monkeypatch.undo()
        kernels.isa.cache_clear()
