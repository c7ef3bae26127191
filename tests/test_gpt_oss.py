"""gpt-oss on the native runner: attention sinks in the attention kernel (row invariant, PyTorch's
answer), the clamped SwiGLU and the experts' biases in the kernels, logits against
transformers (eager attention: its sdpa path drops the sinks), rows bitwise what they are alone in
every weight format, every method exact against ``ar``."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode import kernels
from specdecode.api import Decoder
from specdecode.draft import Draft
from specdecode.models.llama import LlamaRunner
from specdecode.models.quant import WEIGHT_FORMATS

from conftest import assert_row_invariant, close_gguf, gguf_writer, repetitive_prompts
from model_checks import (assert_close, check_fused_experts, check_greedy_matches_generate,
                          check_method_equals_ar, check_rows_alone_bitwise, check_tree_logits,
                          reference)
from test_exactness import METHODS
from test_kernels import GENERIC, ROWS, caches, check_attention_variant, ext, isa  # noqa: F401 (fixtures)
from tiny_models import tiny_model

#: a window that prompts cross, so the sliding layer (layer 0) differs from the full one
WINDOW = 6


def build(seed: int = 0, **kw):
    """A tiny gpt-oss: 8 experts, 2 a row, YaRN rope, a sliding layer then a full one. Sinks
    are drawn at the scale of the scores and the experts' gate/up matrices scaled up, so that
    the sinks move the softmax and the clamps at +-7 bite."""
    config = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                  sliding_window=WINDOW, rope_scaling={
                      "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 64})
    model = tiny_model("gpt_oss", seed=seed, **{**config, **kw})
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
            if name.endswith("experts.gate_up_proj"):
                param.mul_(30.0)
    return model


def test_logits_of_chains_and_trees_match_transformers():
    model = build(seed=3)
    native = LlamaRunner.from_transformers(model)
    assert [layer.window for layer in native.layers] == [WINDOW, 0]
    assert all(layer.sinks is not None and layer.o_bias is not None for layer in native.layers)
    rng = random.Random(0)
    check_tree_logits(model, native, [rng.randrange(96) for _ in range(20)],
                      Draft.from_paths([[3, 4, 5], [3, 7], [9, 10, 11]]))


def test_the_experts_clamps_are_reached():
    """The random model exercises the activation's clamps (else a wrong clamp would pass)."""
    model = build(seed=3)
    mlp = model.model.layers[0].mlp
    seen = []
    hook = mlp.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    reference(model, repetitive_prompts()[0])
    hook.remove()
    h = seen[0].reshape(-1, model.config.hidden_size)
    gate_up = torch.einsum("nh,ehf->enf", h, mlp.experts.gate_up_proj) + mlp.experts.gate_up_proj_bias[:, None]
    assert (gate_up[..., 0::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()


@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
def test_rows_choosing_other_experts_keep_their_bits(weights):
    check_rows_alone_bitwise(LlamaRunner.from_transformers(build(seed=5), weights), 9)


def test_greedy_tokens_identical_to_transformers_generate():
    model = build(seed=4)
    check_greedy_matches_generate(model, LlamaRunner.from_transformers(model), repetitive_prompts()[:2], 16)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_ar(method):
    check_method_equals_ar(build(seed=6), method, repetitive_prompts()[:2], 20)


@pytest.mark.parametrize("weights", ["int4", "int8", "bf16"])
def test_the_fused_experts_kernel_computes_the_torch_loops_bits(weights):
    moe = LlamaRunner.from_transformers(build(seed=10), weights).layers[1].moe
    assert moe.expert_biases is not None
    check_fused_experts(moe, 64)


def test_routing_softmaxes_the_top_k_logits():
    model = build(seed=11)
    moe = LlamaRunner.from_transformers(model).layers[0].moe
    router = model.model.layers[0].mlp.router
    h = torch.randn(7, 64)
    weights, chosen = moe.route(h)
    with torch.no_grad():
        scores, indices = router(h)
    assert torch.equal(chosen, indices)
    assert torch.allclose(weights, scores.gather(-1, indices), rtol=1e-6, atol=0)


# ---- kernels ------------------------------------------------------------------------------------

def test_oss_glu(ext, isa):
    """gpt-oss's clamped SwiGLU: every variant the baseline's bits, row invariant, and
    modeling_gpt_oss's formula (gate clamped above at 7, up to +-7)."""
    gen = torch.Generator().manual_seed(0)
    gate_up = 6 * torch.randn(ROWS, 2 * 48, generator=gen)
    out = assert_row_invariant(lambda rows: ext.oss_glu(rows, isa), gate_up)
    assert torch.equal(out, ext.oss_glu(gate_up, GENERIC))
    gate, up = gate_up[:, :48].clamp(max=7.0), gate_up[:, 48:].clamp(-7.0, 7.0)
    assert torch.allclose(out, (up + 1) * gate * torch.sigmoid(1.702 * gate), rtol=1e-5, atol=1e-5)


# query heads per key/value head: 2, and gpt-oss's 8 (64 heads, 8 key/value heads)
@pytest.mark.parametrize("group", [2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,window", [(32, 0), (32, 20), (24, 0), (24, 20)])
def test_attention_with_sinks(ext, isa, d, window, dtype, group):
    """Each head's sink logit joins its softmax's denominator (gpt-oss): every variant the
    baseline's bits, a tree row alone the bits it has among others, a chain row the bits it
    has alone after its earlier rows are committed, and PyTorch's answer (modeling_gpt_oss's
    eager attention: the sink a last column of the scores, dropped after the softmax)."""
    gen = torch.Generator().manual_seed(d + window)
    kv, cap, past = 2, 304, 90
    heads = kv * group
    keys, values, blocked, cached_values = caches(kv, d, cap, dtype, gen)
    q = torch.randn(ROWS, heads, d, generator=gen)
    # sinks across the scores' range (a row's largest score is about 15 here): the largest
    # above most rows' scores (it takes the maximum), the smallest below
    sinks = torch.linspace(-4.0, 16.0, heads)

    def attention(rows, past, table, lens, level=isa):
        return ext.attention(rows, blocked, cached_values, past, table, lens, window, 0.0, level, sinks)

    def expected(r, slots):
        seen = torch.tensor(slots[-window:] if window else slots)
        scores = torch.einsum("hd,hdl->hl", q[r], keys[:, :, seen].repeat_interleave(group, 0))
        probs = torch.softmax(torch.cat([scores, sinks[:, None]], -1), -1)[:, :-1]
        return torch.einsum("hl,hld->hd", probs, values[:, seen].repeat_interleave(group, 0)).reshape(-1)

    plain = lambda rows, past, table, lens: ext.attention(  # noqa: E731
        rows, blocked, cached_values, past, table, lens, window, 0.0, isa)
    check_attention_variant(q, past, attention, plain, expected)


def test_sinks_of_the_wrong_size_are_refused(ext):
    keys, values, blocked, cached_values = caches(2, 32, 304, torch.float32, torch.Generator())
    q = torch.randn(2, 4, 32)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="attention sinks must be float32"):
        ext.attention(q, blocked, cached_values, 0, table, lens, 0, 0.0, GENERIC, torch.zeros(3))


# ---- GGUF files: llama.cpp's layout, experts in MXFP4 -------------------------------------------

_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


def write_gpt_oss_gguf(model, path) -> None:
    """``model`` as llama.cpp's converter writes gpt-oss: each layer's experts de-interleaved
    into ``ffn_{gate,up}_exps`` and ``ffn_down_exps`` [experts, out, in] in MXFP4 with their
    biases [experts, out] beside them, the router and its bias, ``attn_sinks``, Q8_0 attention
    matrices, embeddings and head, YaRN's factor, original context and betas in the header. The
    model's weights become the file's dequantised ones."""
    import gguf

    c, q = model.config, gguf.GGMLQuantizationType
    writer = gguf_writer(c, path, "gpt-oss")
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(c.rope_scaling["factor"])
    writer.add_rope_scaling_orig_ctx_len(c.rope_scaling["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(c.rope_scaling["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(c.rope_scaling["beta_slow"])
    state = model.state_dict()

    def add(name: str, w: torch.Tensor, qtype) -> torch.Tensor:
        data = w.float().contiguous().numpy()
        if qtype == q.F32:
            writer.add_tensor(name, data)
            return w
        data = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        return torch.from_numpy(gguf.quants.dequantize(data, qtype)).reshape(w.shape)

    with torch.no_grad():
        for name, gguf_name in (("model.embed_tokens.weight", "token_embd.weight"),
                                ("model.norm.weight", "output_norm.weight"),
                                ("lm_head.weight", "output.weight")):
            state[name].copy_(add(gguf_name, state[name], q.F32 if "norm" in name else q.Q8_0))
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            for hf, short in _GGUF.items():
                for kind in ("weight", "bias"):
                    w = state.get(f"{p}{hf}.{kind}")
                    if w is not None:
                        float32 = w.ndim == 1 or hf == "mlp.router"
                        w.copy_(add(f"blk.{i}.{short}.{kind}", w, q.F32 if float32 else q.Q8_0))
            add(f"blk.{i}.attn_sinks.weight", state[p + "self_attn.sinks"], q.F32)
            gate_up, down = state[p + "mlp.experts.gate_up_proj"], state[p + "mlp.experts.down_proj"]
            bias = state[p + "mlp.experts.gate_up_proj_bias"]
            for short, part in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                # [E, H, 2 I] (x @ W, interleaved) -> [E, I, H] rows of gate or of up
                back = add(f"blk.{i}.ffn_{short}_exps.weight", gate_up[..., part].transpose(1, 2), q.MXFP4)
                gate_up[..., part] = back.transpose(1, 2)
                add(f"blk.{i}.ffn_{short}_exps.bias", bias[..., part], q.F32)
            down.copy_(add(f"blk.{i}.ffn_down_exps.weight", down.transpose(1, 2), q.MXFP4).transpose(1, 2))
            add(f"blk.{i}.ffn_down_exps.bias", state[p + "mlp.experts.down_proj_bias"], q.F32)
    close_gguf(writer)


def test_gguf_file_reads_like_the_model(tmp_path):
    from specdecode.models.gguf_reader import GGUFFile
    from specdecode.models.int8_blocks import Int8BlockLinear, Int8BlockWeight

    model = build(seed=8)
    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(model, path)
    file = GGUFFile(path)
    file.check_native()
    c, config = model.config, file.config
    assert (config.model_type, config.num_local_experts, config.num_experts_per_tok,
            config.sliding_window, config.layer_types) == ("gpt_oss", 8, 2, WINDOW, c.layer_types)
    assert config.rope_scaling == {**c.rope_scaling, "rope_type": "yarn"}
    # each expert's MXFP4 matrix as block int8 holds the file's values exactly
    gate = file.read_blocks("model.layers.1.mlp.experts.3.gate_proj.weight")
    assert isinstance(gate, Int8BlockWeight) and gate.codes.abs().max() <= 12
    assert torch.equal(gate.dequantize(), model.model.layers[1].mlp.experts.gate_up_proj[3, :, 0::2].t())
    assert torch.equal(file.read("model.layers.1.mlp.experts.3.down_proj.bias"),
                       model.model.layers[1].mlp.experts.down_proj_bias[3])
    assert torch.equal(file.read("model.layers.0.self_attn.sinks"), model.model.layers[0].self_attn.sinks)
    rng = random.Random(2)
    prompt = [rng.randrange(96) for _ in range(20)]
    assert_close(LlamaRunner.from_gguf(path).prefill(prompt).logits[0], reference(model, prompt))
    for weights in ("int4", "int8"):
        runner = LlamaRunner.from_gguf(path, weights)
        assert all(isinstance(layer, Int8BlockLinear) for pair in runner.layers[0].moe.experts
                   for layer in pair)
        for prompt in repetitive_prompts()[:2]:
            ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 20).run()
            assert Decoder(runner, None, "suffix", eos_token_ids=[]).start(prompt, 20).run() == ar


# ---- the released checkpoints' layout: experts in MXFP4 blocks and scales -----------------------

def hf_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [..., out, in] as a gpt-oss checkpoint stores it: (``*_blocks`` uint8 [..., out,
    in / 32, 16], byte i holding inputs 2i and 2i + 1 in its low and high nibbles; ``*_scales``
    uint8 [..., out, in / 32]; the values they hold). Quantised by gguf's MXFP4 (whose blocks
    hold inputs i and 16 + i in a byte) and repacked."""
    import gguf

    kind = gguf.GGMLQuantizationType.MXFP4
    flat = w.reshape(-1, w.shape[-1]).float().contiguous().numpy()
    data = gguf.quants.quantize(flat, kind).reshape(len(flat), -1, 17)
    qs = torch.from_numpy(data[..., 1:].copy())
    codes = torch.cat([qs & 15, qs >> 4], -1)  # [rows, in / 32, 32], input order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    values = torch.from_numpy(gguf.quants.dequantize(data.reshape(len(flat), -1), kind))
    return (blocks.reshape(*w.shape[:-1], -1, 16), torch.from_numpy(data[..., 0].copy()).reshape(
        *w.shape[:-1], -1), values.reshape(w.shape))


def test_a_checkpoint_with_mxfp4_experts_runs_their_values(tmp_path):
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from specdecode.models.int8_blocks import Int8BlockLinear, decode_mxfp4_pairs

    model = build(seed=9)
    state = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # stored [E, out, in] as blocks: gate_up's rows are its 2 I outputs, interleaved
                blocks, scales, values = hf_mxfp4(param.transpose(1, 2))
                param.copy_(values.transpose(1, 2))
                state[name + "_blocks"], state[name + "_scales"] = blocks, scales
                # transformers' own dequantisation of the blocks: the same values, bit for bit
                assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), param)
                assert torch.equal(decode_mxfp4_pairs(blocks[1], scales[1]).dequantize(),
                                   param[1].t())
            else:
                state[name] = param.detach().clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(tmp_path)
    prompt = repetitive_prompts()[3]
    assert_close(LlamaRunner.from_safetensors(tmp_path).prefill(prompt).logits[0], reference(model, prompt))
    runner = LlamaRunner.from_safetensors(tmp_path, "int4")
    assert all(isinstance(layer, Int8BlockLinear) for pair in runner.layers[1].moe.experts for layer in pair)
    for prompt in repetitive_prompts()[:2]:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 20).run()
        assert Decoder(runner, None, "suffix", eos_token_ids=[]).start(prompt, 20).run() == ar
