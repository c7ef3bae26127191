"""The native runner's CPU kernels: right answers, every row count and every position of a row
in a call bitwise the same, and the same bits from every instruction-set variant (AVX-512,
AVX2, baseline x86-64), whichever this CPU would pick."""

from __future__ import annotations

import os

import pytest
import torch

from specdecode import kernels
from specdecode.models.quant import int4_weights, quantize_int4

ISAS = range(len(kernels.ISA_LEVELS))  # every variant runs on any CPU that has the highest
ROWS = 64


@pytest.fixture(scope="module")
def ext():
    ext = kernels.load()
    if ext.isa_level() < kernels.ISA_LEVELS.index("avx512"):
        pytest.skip("this CPU lacks AVX-512 VNNI: the AVX-512 variant cannot run here")
    return ext


def assert_row_invariant(call, x: torch.Tensor) -> torch.Tensor:
    """``call`` on all rows of ``x`` at once equals it on every smaller block of rows, for every
    row count 1..len(x) and every position of a row in the block."""
    together = call(x)
    for m in range(1, len(x) + 1):
        for start in {0, (len(x) - m) // 2, len(x) - m}:
            part = call(x[start:start + m].contiguous())
            assert torch.equal(part, together[start:start + m]), (m, start)
    return together


def test_dense_formats(ext):
    gen = torch.Generator().manual_seed(0)
    n, k = 200, 96  # a last, partial tile of columns
    w, x = torch.randn(n, k, generator=gen), torch.randn(ROWS, k, generator=gen)
    scale = torch.rand(n, generator=gen) + 0.5
    for dtype, sc in ((torch.float32, None), (torch.bfloat16, None), (torch.int8, scale)):
        wq = (w * 20).round().clamp(-127, 127).to(torch.int8) if dtype == torch.int8 else w.to(dtype)
        packed = kernels.pack_dense(wq)
        outs = [assert_row_invariant(lambda rows: ext.dense_linear(rows, packed, sc, None, n, isa), x)
                for isa in ISAS]
        assert all(torch.equal(o, outs[0]) for o in outs), dtype
        expected = x.double() @ wq.double().T * (1 if sc is None else sc.double())
        assert (outs[0] - expected).abs().max() < 1e-3, dtype
    residual = torch.randn(ROWS, n, generator=gen)
    packed = kernels.pack_dense(w)
    with_residual = ext.dense_linear(x, packed, None, residual, n, 2)
    assert torch.equal(with_residual, residual + ext.dense_linear(x, packed, None, None, n, 2))


def test_q4_times_int8_activations(ext):
    gen = torch.Generator().manual_seed(1)
    n, k = 72, 128
    w, x = torch.randn(n, k, generator=gen), torch.randn(ROWS, k, generator=gen)
    codes, scale, minimum = quantize_int4(w)
    packed = kernels.pack_q4(codes, scale, minimum)
    outs = [assert_row_invariant(lambda rows: ext.q4_linear(rows, packed, None, n, isa), x)
            for isa in ISAS]
    assert all(torch.equal(o, outs[0]) for o in outs)
    # the file's weights times activations rounded to int8 per 32: about 1% of the scale
    exact = x @ int4_weights(codes, scale, minimum).T
    relative = float((outs[0] - exact).abs().max() / exact.abs().max())
    assert 0 < relative < 0.02, relative
    assert torch.equal(ext.q4_linear(torch.zeros(1, k), packed, None, n, 2), torch.zeros(1, n))


def test_norm_and_swiglu(ext):
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(ROWS, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    outs = [assert_row_invariant(lambda rows: ext.rms_norm(rows, w, 1e-5, isa), h) for isa in ISAS]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert (outs[0] - torch.nn.functional.rms_norm(h, (576,), w, 1e-5)).abs().max() < 1e-5
    gu = torch.randn(ROWS, 2 * 200, generator=gen) * 6
    outs = [assert_row_invariant(lambda rows: ext.swiglu(rows, isa), gu) for isa in ISAS]
    assert all(torch.equal(o, outs[0]) for o in outs)
    gate, up = gu.chunk(2, -1)
    expected = torch.nn.functional.silu(gate) * up
    assert (outs[0] - expected).abs().max() / expected.abs().max() < 1e-6


def test_geglu_and_softcap(ext):
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(ROWS, 2 * 200, generator=gen) * 6
    outs = [assert_row_invariant(lambda rows: ext.geglu(rows, isa), gu) for isa in ISAS]
    assert all(torch.equal(o, outs[0]) for o in outs)
    gate, up = gu.chunk(2, -1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert (outs[0] - expected).abs().max() / expected.abs().max() < 1e-6
    logits = torch.randn(ROWS, 300, generator=gen) * 40
    outs = [assert_row_invariant(lambda rows: ext.softcap(rows, 30.0, isa), logits) for isa in ISAS]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert (outs[0] - torch.tanh(logits / 30) * 30).abs().max() < 1e-5
    assert outs[0].abs().max() <= 30


# window 0: no window, tree rows whose ancestors are not contiguous slots
@pytest.mark.parametrize("window", [0, 1, 7, 20, 70])
def test_sliding_window_attention(ext, window):
    gen = torch.Generator().manual_seed(window)
    heads, kv, d, cap, past = 4, 2, 32, 304, 90
    keys, values = torch.randn(kv, d, cap, generator=gen), torch.randn(kv, cap, d, generator=gen)
    blocked = keys.view(kv, d, cap // 16, 16).transpose(1, 2).contiguous()
    q = torch.randn(ROWS, heads, d, generator=gen)
    # rows in tree order: row r's keys are the cached ones, then the slots of rows 0, 2, 4 ..
    # up to r (every other row), so a row's window covers slots that are not contiguous
    width = ROWS // 2 + 1
    table = torch.zeros(ROWS, width, dtype=torch.int32)
    lens = torch.zeros(ROWS, dtype=torch.int32)
    for r in range(ROWS):
        path = list(range(r % 2, r + 1, 2))
        table[r, :len(path)] = past + torch.tensor(path, dtype=torch.int32)
        lens[r] = len(path)
    outs = [ext.attention(q, blocked, values, past, table, lens, window, isa) for isa in ISAS]
    assert all(torch.equal(o, outs[0]) for o in outs)
    for r in (0, 1, 33, ROWS - 1):
        alone = ext.attention(q[r:r + 1].contiguous(), blocked, values, past, table[r:r + 1].contiguous(),
                              lens[r:r + 1], window, 2)
        assert torch.equal(alone[0], outs[0][r]), r
        slots = list(range(past)) + table[r, :lens[r]].tolist()
        seen = torch.tensor(slots[-window:] if window else slots)  # the last `window` positions
        scores = torch.einsum("hd,hdl->hl", q[r], keys[:, :, seen].repeat_interleave(2, 0))
        expected = torch.einsum("hl,hld->hd", torch.softmax(scores, -1),
                                values[:, seen].repeat_interleave(2, 0))
        assert (outs[0][r] - expected.reshape(-1)).abs().max() < 1e-4


# head sizes: 16, 64 and one the AVX-512 blocks do not fit; groups of query heads per key/value
# head: 2, SmolLM2's 3 (blocks of 4 rows) and 6 (4 + 2 heads; blocks of 3 rows)
@pytest.mark.parametrize("d,heads,kv", [(16, 4, 2), (64, 4, 2), (24, 4, 2), (64, 9, 3), (32, 6, 1)])
def test_attention_rows_see_their_keys_in_order(ext, d, heads, kv):
    gen = torch.Generator().manual_seed(d + heads)
    group, cap = heads // kv, 304
    keys, values = torch.randn(kv, d, cap, generator=gen), torch.randn(kv, cap, d, generator=gen)
    blocked = keys.view(kv, d, cap // 16, 16).transpose(1, 2).contiguous()  # the cache's layout
    for past in (0, 5, 64, 130):
        q = torch.randn(ROWS, heads, d, generator=gen)

        def chain(rows, isa):  # row r of a block sees past..past+r, as in a chain forward
            m = len(rows)
            table = (past + torch.arange(m, dtype=torch.int32)).expand(m, m).contiguous()
            return ext.attention(rows, blocked, values, past, table, torch.arange(1, m + 1, dtype=torch.int32), 0, isa)

        outs = [chain(q, isa) for isa in ISAS]
        assert all(torch.equal(o, outs[0]) for o in outs), past
        for r in (0, 17, ROWS - 1):
            # the same row alone, its earlier rows committed: the same keys, the same bits
            alone = ext.attention(q[r:r + 1].contiguous(), blocked, values, past + r,
                                  torch.tensor([[past + r]], dtype=torch.int32),
                                  torch.tensor([1], dtype=torch.int32), 0, 2)
            assert torch.equal(alone[0], outs[0][r]), (past, r)
            n = past + r + 1
            scores = torch.einsum("hd,hdl->hl", q[r], keys[:, :, :n].repeat_interleave(group, 0))
            expected = torch.einsum("hl,hld->hd", torch.softmax(scores, -1),
                                    values[:, :n].repeat_interleave(group, 0))
            assert (outs[0][r] - expected.reshape(-1)).abs().max() < 1e-4


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


def test_thread_count_changes_no_bit(ext, two_threads):
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

    def run_all():
        return [ext.q4_linear(x, q4, None, n, 2), ext.dense_linear(x, dense, None, None, n, 2),
                ext.attention(q, keys, values, past, table, lens, 0, 2)]

    together = run_all()
    torch.set_num_threads(1)
    alone = run_all()
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def test_unknown_isa_limit_is_named(monkeypatch):
    monkeypatch.setenv("SPECDECODE_KERNEL_ISA", "sse9")
    kernels.isa.cache_clear()
    try:
        with pytest.raises(ValueError, match="SPECDECODE_KERNEL_ISA='sse9'; known: generic, avx2, avx512"):
            kernels.isa()
    finally:
        monkeypatch.undo()
        kernels.isa.cache_clear()
