"""Mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE) on the native runner: logits against transformers,
rows that choose other experts still bitwise what they are alone, every method exact against
``ar``, and GGUF files with llama.cpp's stacked expert tensors."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.api import Decoder
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.models.llama import LlamaRunner
from specdecode.models.moe import MoEMLP
from specdecode.models.quant import WEIGHT_FORMATS

from conftest import close_gguf, gguf_writer, repetitive_prompts
from model_checks import (assert_close, check_fused_experts, check_greedy_matches_generate,
                          check_method_equals_ar, check_rows_alone_bitwise, check_tree_logits,
                          reference)
from test_exactness import METHODS
from tiny_models import tiny_model

#: 8 experts, 2 or 3 per row: every layer sparse; layer 0 dense and raw top-k weights;
#: Qwen2-MoE's sigmoid-gated shared expert beside them
VARIANTS = {
    "sparse": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=64, norm_topk_prob=True),
    "mixed": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=3,
                  moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[0]),
    "shared": dict(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=64,
                   norm_topk_prob=False),
}


def build(variant: str = "sparse", seed: int = 0, **kw):
    spec = {**VARIANTS[variant], **kw}
    return tiny_model(spec.pop("model_type"), seed=seed, **spec)


@pytest.fixture
def routes(monkeypatch):
    """Every expert set a MoE layer gives a row, as a list of tuples."""
    seen = []
    route = MoEMLP.route

    def recording(self, h):
        weights, chosen = route(self, h)
        seen.extend(tuple(sorted(row)) for row in chosen.tolist())
        return weights, chosen

    monkeypatch.setattr(MoEMLP, "route", recording)
    return seen


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_of_chains_and_trees_match_transformers(variant):
    model = build(variant, seed=3)
    native = LlamaRunner.from_transformers(model)
    assert [layer.moe is None for layer in native.layers] == [variant == "mixed", False]
    assert all((layer.moe.shared is not None) == (variant == "shared") for layer in native.layers
               if layer.moe is not None)
    rng = random.Random(0)
    check_tree_logits(model, native, [rng.randrange(96) for _ in range(20)],
                      Draft.from_paths([[3, 4, 5], [3, 7], [9, 10, 11]]))


@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
@pytest.mark.parametrize("variant", ["sparse", "shared"])
def test_rows_choosing_other_experts_keep_their_bits(variant, weights, routes):
    runner = LlamaRunner.from_transformers(build(variant, seed=5), weights)
    check_rows_alone_bitwise(runner, 9, before_forward=routes.clear)
    # the verify step's 16 rows (layer 0's routes, the first after the prefill) did not all read
    # the same experts: the case row invariance must survive
    assert len(set(routes[:16])) > 2, routes[:16]


def test_greedy_tokens_identical_to_transformers_generate():
    model = build("mixed", seed=4)
    check_greedy_matches_generate(model, LlamaRunner.from_transformers(model), repetitive_prompts()[:2], 16)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("variant", ["sparse", "shared"])
def test_every_method_equals_ar(variant, method):
    check_method_equals_ar(build(variant, seed=6), method, repetitive_prompts()[:2], 20)


def test_bad_expert_counts_are_named():
    with pytest.raises(SpecDecodeError, match="num_experts_per_tok must be 1..8"):
        LlamaRunner.from_transformers(build(num_experts_per_tok=9))


# ---- GGUF files: experts stacked in one tensor per layer and matrix -----------------------------

_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
#: matrices llama.cpp keeps in float32 (routers)
_FLOAT = ("mlp.gate", "mlp.shared_expert_gate")
_STACKED = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def write_moe_gguf(model, path, arch: str = "qwen3moe") -> None:
    """``model`` as llama.cpp's converter writes a Qwen3-MoE or Qwen2-MoE: each layer's experts
    stacked into ``ffn_{gate,up,down}_exps`` [experts, out, in] in Q4_1, routers in float32,
    the shared expert's matrices in Q4_1, Q8_0 embeddings and head. The model's weights become
    the file's dequantised ones."""
    import gguf

    c, q = model.config, gguf.GGMLQuantizationType
    writer = gguf_writer(c, path, arch)
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    state = model.state_dict()

    def add(name: str, w: torch.Tensor, qtype) -> torch.Tensor:
        data = w.float().numpy()
        if qtype == q.F32:
            writer.add_tensor(name, data)
            return w
        data = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        return torch.from_numpy(gguf.quants.dequantize(data, qtype)).reshape(w.shape)

    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
            state[name].copy_(add(gguf_name, state[name], q.F32 if "norm" in name else q.Q8_0))
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            for hf, short in _GGUF.items():
                for kind in ("weight", "bias"):
                    w = state.get(f"{p}{hf}.{kind}")
                    if w is not None:
                        float32 = w.ndim == 1 or hf in _FLOAT
                        w.copy_(add(f"blk.{i}.{short}.{kind}", w, q.F32 if float32 else q.Q4_1))
            for proj, short in _STACKED.items():
                parts = [state[f"{p}mlp.experts.{j}.{proj}.weight"] for j in range(c.num_experts)]
                back = add(f"blk.{i}.{short}.weight", torch.stack(parts), q.Q4_1)
                for part, value in zip(parts, back):
                    part.copy_(value)
    close_gguf(writer)


@pytest.mark.parametrize("variant,arch", [("sparse", "qwen3moe"), ("shared", "qwen2moe")])
def test_gguf_file_reads_like_the_model(tmp_path, variant, arch):
    from specdecode.models.gguf_reader import GGUFFile, read_gguf
    from specdecode.models.weights import resident_bytes

    from test_gguf_loading import held_bytes

    # llama.cpp renormalises Qwen3-MoE's top-k weights and not Qwen2-MoE's
    model = build(variant, seed=8, norm_topk_prob=arch == "qwen3moe", moe_intermediate_size=64)
    path = tmp_path / "moe.gguf"
    write_moe_gguf(model, path, arch)
    config, tensors = read_gguf(path)
    c = model.config
    assert (config.model_type, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, config.norm_topk_prob) == (
        c.model_type, 8, 2, 64, arch == "qwen3moe")
    # each expert a contiguous slice of its layer's one stacked tensor, in expert order
    entries = [GGUFFile(path).entries[f"model.layers.1.mlp.experts.{j}.down_proj.weight"]
               for j in range(8)]
    assert {e.shape for e in entries} == {(64, 64)}
    assert all(b.offset == a.offset + a.nbytes for a, b in zip(entries, entries[1:]))
    state = model.state_dict()
    assert set(tensors) == set(state)
    for key, w in tensors.items():
        assert torch.equal(w.dequantize() if hasattr(w, "dequantize") else w, state[key]), key
    prompt = repetitive_prompts()[2]
    assert_close(LlamaRunner.from_gguf(path).prefill(prompt).logits[0], reference(model, prompt))
    runner = LlamaRunner.from_gguf(path, "int4")
    # the memory a file is refused by before it loads bounds what the runner holds, float32
    # routers and the shared expert's gate included (the file's Q8_0 blocks are counted at
    # block int8's most)
    assert resident_bytes(GGUFFile(path), "int4") >= held_bytes(runner)
    for prompt in repetitive_prompts()[:2]:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 20).run()
        assert Decoder(runner, None, "suffix", eos_token_ids=[]).start(prompt, 20).run() == ar



@pytest.mark.parametrize("weights", ["int4", "int8", "bf16"])
def test_the_fused_experts_kernel_computes_the_torch_loops_bits(weights):
    check_fused_experts(LlamaRunner.from_transformers(build("mixed", seed=10), weights).layers[1].moe, 64)


def test_the_bench_counts_the_experts_a_token_reads(tmp_path):
    from specdecode.bench.roofline import layer_linears
    from specdecode.bench.runners import gguf_streamed_bytes, weight_bytes
    from specdecode.bench.shapes import SHAPES, write_shape
    from specdecode.models.gguf_reader import GGUFFile

    path = write_shape(tmp_path / "moe.gguf", "tiny-qwen3moe", "Q4_1", vocab=512)
    entries = GGUFFile(path).entries
    shape = SHAPES["tiny-qwen3moe"]
    experts = sum(e.nbytes for name, e in entries.items() if ".experts." in name)
    rest = sum(e.nbytes for name, e in entries.items()
               if ".experts." not in name and name != "model.embed_tokens.weight")
    share = shape.experts_used / shape.experts
    assert gguf_streamed_bytes(path) == int(rest + experts * share)
    runner = LlamaRunner.from_gguf(path, "int4")
    assert len(layer_linears(runner.layers[0])) == 3 + 2 * shape.experts_used
    # per layer: attention, the router and a token's share of the experts (all the same size)
    per_layer = [layer.qkv.nbytes + layer.o.nbytes + layer.moe.router.nbytes
                 + share * sum(g.nbytes + d.nbytes for g, d in layer.moe.experts)
                 for layer in runner.layers]
    assert weight_bytes(runner) == runner.head.nbytes + sum(per_layer)


def test_a_file_transformers_builds_wrong_is_named_with_the_fix(tmp_path):
    from specdecode.bench.shapes import write_shape
    from specdecode.models.loading import load_gguf

    # transformers' GGUF loader leaves Qwen3-MoE's moe_intermediate_size at its default (768)
    path = write_shape(tmp_path / "moe.gguf", "tiny-qwen3moe", "Q4_1", vocab=512)
    loaded = load_gguf(path)
    assert loaded.config.moe_intermediate_size == 256  # the native runner reads it right
    with pytest.raises(SpecDecodeError, match="transformers cannot build.*--runner native"):
        loaded.model


def test_the_row_cost_curve_runs_rows_that_pick_different_experts(routes):
    from specdecode.models.row_costs import measure_row_costs

    measure_row_costs(LlamaRunner.from_transformers(build(seed=11), "int4"), rows=(8,), repeats=1)
    # a forward of one repeated token would read one row's experts and cost one row's
    assert len(set(routes)) > 4, routes
