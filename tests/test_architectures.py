"""Qwen2, Qwen3, Gemma 2 and Gemma 3 on the native runner: each tiny random-weight model of that
config against transformers (logits of chains and trees, greedy tokens), bitwise row invariance
in every weight format across a sliding window, every method exact against ``ar``, and GGUF
files of these architectures (Gemma's stored 1 + w norms, Q4_K blocks)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdecode.api import Decoder
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.kernels import ISA_LEVELS
from specdecode.models.hf import HFRunner
from specdecode.models.llama import LlamaRunner
from specdecode.models.quant import WEIGHT_FORMATS, Q4Weight

from conftest import _permute, close_gguf, gguf_writer, repetitive_prompts
from model_checks import (assert_close, check_greedy_matches_generate, check_method_equals_ar,
                          check_rows_alone_bitwise, reference)
from tiny_models import tiny_model

from test_exactness import METHODS

WINDOW = 8
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
#: tiny configs: every piece an architecture switches on, sliding windows short enough for
#: short prompts to cross them
ARCHS = {
    "qwen2": dict(model_type="qwen2"),
    # Qwen2's own sliding-window layers (from max_window_layers on): the same piece as Gemma's
    "qwen2-window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1),
    "qwen3": dict(model_type="qwen3"),
    # layer 0 sliding (local rope base 10000), layer 1 global (rope_theta 1e6); query scale
    # query_pre_attn_scalar ** -0.5 = 1/16
    "gemma3": dict(model_type="gemma3_text", sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention"]),
    "gemma3-softcap": dict(model_type="gemma3_text", sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention"],
                           final_logit_softcapping=5.0, tie_word_embeddings=True),
    # Gemma 2: layer 0 sliding, layer 1 global, one rope base, no head norms; the attention
    # scores soft-capped at 0.25, near the tiny model's scores, so that tanh bends them (the
    # real models' 50.0 would barely touch them: the tests could not tell it from no cap);
    # query_pre_attn_scalar the head size (as in the 2B and 9B); transformers' eager attention
    # (its sdpa path skips the cap)
    "gemma2": dict(model_type="gemma2", attn_logit_softcapping=0.25, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=16, attn_implementation="eager"),
    "gemma2-window": dict(model_type="gemma2", attn_logit_softcapping=0.25,
                          final_logit_softcapping=5.0, query_pre_attn_scalar=16,
                          attn_implementation="eager", sliding_window=WINDOW,
                          tie_word_embeddings=True),
}
ARCHS.update({
    # Llama 3.1+: llama3 rope scaling (frequencies 1, 2 and 3-7 of 8: kept, smoothed, divided)
    "llama3": dict(model_type="llama", rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    # Mistral: its sliding window in every layer (no layer_types)
    "mistral": dict(model_type="mistral", sliding_window=WINDOW),
    "ministral": dict(model_type="ministral", sliding_window=WINDOW,
                      layer_types=["sliding_attention", "full_attention"]),
    # Phi-3: fused q/k/v and gate/up, a window in every layer, rotary on 12 of 16 dimensions
    # (Phi-4-mini's 0.75), longrope's short factors (float32 numbers, as a GGUF file holds
    # them) with an attention factor of sqrt(1 + ln 4 / ln 1024)
    "phi3": dict(model_type="phi3", sliding_window=WINDOW, partial_rotary_factor=0.75,
                 max_position_embeddings=4096, original_max_position_embeddings=1024,
                 rope_scaling={"type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.0],
                               "long_factor": [2.0, 4.0, 8.0, 16.0, 32.0, 64.0]}),
    # Granite: its four multipliers (powers of two: a GGUF file holds them as float32)
    "granite": dict(model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.25,
                    attention_multiplier=0.125, logits_scaling=8.0),
    "olmo2": dict(model_type="olmo2"),
    # SmolLM3: layer 1 without rotary embedding
    "smollm3": dict(model_type="smollm3", no_rope_layers=[1, 0]),
})
TREE = Draft.from_paths([[3, 4, 5], [3, 7], [9, 10, 11, 12], [9, 10, 13]])


def build(name: str, seed: int = 0, **kw):
    spec = dict(ARCHS[name])
    return tiny_model(spec.pop("model_type"), seed=seed, **{**spec, **kw})


@pytest.mark.parametrize("name", ARCHS)
def test_logits_of_chains_and_trees_match_transformers(name):
    model = build(name, seed=3)
    native = LlamaRunner.from_transformers(model)
    rng = random.Random(0)
    prompt = [rng.randrange(96) for _ in range(3 * WINDOW)]
    assert_close(native.prefill(prompt).logits[0], reference(model, prompt))
    context = list(prompt)
    for root, draft in ((5, TREE), (6, Draft.chain([7, 8, 9])), (11, TREE)):
        logits = native.forward(root, draft).logits
        for node in range(-1, len(draft)):
            path = draft.path_to(node) if node >= 0 else []
            expected = reference(model, context + [root] + [draft.tokens[i] for i in path])
            assert_close(logits[node + 1], expected)
        # keep the path to the last node (not the first rows: its KV rows move), then go on
        path = draft.path_to(len(draft) - 1)
        native.commit(path)
        context += [root] + [draft.tokens[i] for i in path]
        assert native.cache_len == len(context)


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_ar_tokens_identical_to_transformers_generate(name):
    model = build(name, seed=4)
    check_greedy_matches_generate(model, LlamaRunner.from_transformers(model),
                                  repetitive_prompts()[:3], 3 * WINDOW)


@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
@pytest.mark.parametrize("name", ["qwen2-window", "qwen3", "gemma3-softcap", "gemma2-window",
                                  "mistral", "phi3", "granite", "olmo2", "smollm3"])
def test_position_alone_equals_position_in_tree_bitwise(name, weights):
    # the prompt ends inside the window; the tree's rows cross its edge
    check_rows_alone_bitwise(LlamaRunner.from_transformers(build(name, seed=5), weights), WINDOW - 3)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma3", "gemma3-softcap", "gemma2",
                                  "gemma2-window", "phi3", "granite", "olmo2", "smollm3"])
def test_every_method_equals_ar_on_the_native_runner(name, method):
    check_method_equals_ar(build(name, seed=6), method, repetitive_prompts()[:3], 3 * WINDOW)


def test_unsupported_pieces_are_named():
    with pytest.raises(SpecDecodeError, match="bidirectional attention.*--runner hf"):
        LlamaRunner.from_transformers(build("gemma3", use_bidirectional_attention=True))
    with pytest.raises(SpecDecodeError, match="'gelu'.*--runner hf"):
        LlamaRunner.from_transformers(build("qwen3", hidden_act="gelu"))


# ---- GGUF files of these architectures ----------------------------------------------------------

#: Hugging Face -> GGUF layer tensor names, per architecture (llama.cpp's convert_hf_to_gguf)
_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm"}
_GEMMA = {"pre_feedforward_layernorm": "ffn_norm", "post_attention_layernorm": "post_attention_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}
_FAMILY_NAMES = {"phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
                 "olmo2": {"post_attention_layernorm": "post_attention_norm",
                           "post_feedforward_layernorm": "post_ffw_norm"}}
#: families whose q/k rows llama.cpp's converter permutes (LlamaModel.permute)
_PERMUTED = ("llama", "granite", "smollm3")


def add_family_metadata(writer, c, arch: str) -> None:
    """What llama.cpp's converter writes beyond the common hyper-parameters: Llama 3's
    rope_freqs (LlamaModel.generate_extra_tensors), Phi-3's rotary dimensions, original
    context and longrope factors (Phi3MiniModel), Granite's four scales (GraniteModel)."""
    from specdecode.bench.shapes import llama3_rope_factors

    scaling = getattr(c, "rope_scaling", None) or {}
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(c.head_dim, c.rope_theta, scaling))
    if arch == "phi3":
        writer.add_rope_dimension_count(int(c.head_dim * c.partial_rotary_factor))
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    if arch == "granite":
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_logit_scale(c.logits_scaling)


#: where a block type's float16 scales are: (first byte, how many); the other bytes (codes,
#: sub-block scales) are valid whatever their bits
_SCALES_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q3_K": (108, 1), "IQ4_XS": (0, 1),
              "Q2_K": (80, 2), "Q6_K": (208, 1), "IQ3_XXS": (0, 1), "IQ3_S": (0, 1),
              "IQ1_S": (0, 1), "IQ2_S": (0, 1)}


def random_k_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Data of a type of 256-weight blocks (``_SCALES_AT``) [rows, cols / 256 x its block's
    bytes]: random codes and sub-block scales, small float16 super-block scales."""
    from specdecode.models.int8_blocks import BLOCK_BYTES

    blocks = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)
    at, count = _SCALES_AT[qtype]
    scales = rng.uniform(1e-4, 2e-3, (rows, cols // 256, count)).astype(np.float16)
    blocks[..., at:at + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(model, path, arch: str, random_blocks: dict[str, str] | None = None,
               extra: dict | None = None) -> None:
    """``model`` as llama.cpp writes it: Q8_0 embeddings, Q5_0 q/k/v, Q4_1 for the rest, and
    random blocks of the type ``random_blocks`` names for matrices whose name holds its key
    ({"down_proj": "Q4_K"}: ``random_k_blocks``); f32 norms (Gemma's as 1 + w) and biases;
    ``extra``: more tensors (GGUF name: float32 array). The model's weights become the file's
    dequantised ones."""
    import gguf

    c = model.config
    gemma = arch in ("gemma2", "gemma3")
    names = {**_GGUF, **(_GEMMA if gemma else {}), **_FAMILY_NAMES.get(arch, {})}
    q = gguf.GGMLQuantizationType
    writer = gguf_writer(c, path, arch)
    add_family_metadata(writer, c, arch)
    for gguf_name, value in (extra or {}).items():
        writer.add_tensor(gguf_name, value)
    if arch == "gemma2":  # as llama.cpp's converter writes them
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}.get(name)
            if gguf_name is None:
                parts = name.split(".")
                gguf_name = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
            w = param.float().numpy()
            if w.ndim == 1:
                shift = 1 if gemma and "norm" in name else 0
                writer.add_tensor(gguf_name, w + shift)
                param.copy_(torch.from_numpy((w + shift) - shift))  # as a reader gets it back
                continue
            kind = next((k for part, k in (random_blocks or {}).items() if part in name), None)
            if kind is not None:
                qtype, data = q[kind], random_k_blocks(kind, *w.shape, rng)
            else:
                qtype = (q.Q8_0 if "embed" in name or "lm_head" in name else
                         q.Q5_0 if "self_attn" in name and "o_proj" not in name else q.Q4_1)
                data = gguf.quants.quantize(w, qtype)
            heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(
                name.split(".")[-2], 0) if arch in _PERMUTED else 0
            # (a block never spans rows: the permuted rows of the quantised matrix are the
            # quantised rows of the permuted one)
            writer.add_tensor(gguf_name, _permute(data, heads) if heads else data, raw_dtype=qtype)
            param.copy_(torch.from_numpy(gguf.quants.dequantize(data, qtype)))
    close_gguf(writer)


@pytest.mark.parametrize("name,arch", [("qwen2", "qwen2"), ("qwen3", "qwen3"), ("gemma3", "gemma3"),
                                       ("gemma2-window", "gemma2"), ("phi3", "phi3"),
                                       ("granite", "granite"), ("olmo2", "olmo2"),
                                       ("smollm3", "smollm3")])
def test_gguf_files_read_like_the_model(tmp_path, name, arch):
    from specdecode.models.gguf_reader import read_gguf

    # intermediate 256: the down projection's rows are one Q4_K super-block. A GGUF file has
    # no layer types (llama.cpp makes every sixth Gemma 3 layer global, as transformers'
    # default does): six layers with the default pattern
    # SmolLM3: llama.cpp leaves out the rotary embedding of every fourth layer, as
    # transformers' default no_rope_layers does
    pattern = {"gemma3": {"layers": 6, "layer_types": None},
               "smollm3": {"layers": 4, "no_rope_layers": None}}.get(arch, {})
    model = build(name, seed=8, intermediate_size=256, **pattern)
    path = tmp_path / f"{name}.gguf"
    write_gguf(model, path, arch, {"down_proj": "Q4_K"})
    config, tensors = read_gguf(path)
    assert config.model_type == model.config.model_type
    for field in ("sliding_window", "layer_types", "head_dim", "rope_theta",
                  "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                  "partial_rotary_factor", "rope_scaling", "original_max_position_embeddings",
                  "no_rope_layers", "embedding_multiplier", "residual_multiplier",
                  "attention_multiplier", "logits_scaling"):
        assert getattr(config, field, None) == getattr(model.config, field, None), field
    state = model.state_dict()
    for key, w in tensors.items():
        if isinstance(w, Q4Weight) and "down_proj" in key:
            # Q4_K: the file's codes; scales and minimums as float16, within 2^-11 of ggml's
            bound = 2 ** -11 * (15 * w.scale + w.minimum.abs()).max()
            assert (w.dequantize() - state[key]).abs().max() <= bound * (1 + 1e-6)
        else:
            assert torch.equal(w.dequantize() if isinstance(w, Q4Weight) else w, state[key]), key
    native, prompt = LlamaRunner.from_gguf(path), repetitive_prompts()[2]
    # the fp32 runner dequantises through our Q4_K scales: equal to transformers up to them
    assert (native.prefill(prompt).logits[0] - reference(model, prompt)).abs().max() < 1e-2
    runner = LlamaRunner.from_gguf(path, "int4")
    for prompt in repetitive_prompts()[:3]:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
        assert Decoder(runner, None, "suffix", eos_token_ids=[]).start(prompt, 24).run() == ar


def test_q5_k_matrices_in_five_bit_bytes_give_block_int8s_logits(tmp_path, monkeypatch):
    """A file's Q5_K matrices (float32 scales d * sc) in the five-bit layout, as AVX2-only CPUs
    hold them, and as block int8, as AMX CPUs do: the same logits, bit for bit, through the
    layer stack (prefill and a verify chain), and every method's tokens ar's; in Q5_K's own
    layout, as AVX-512 VNNI CPUs without AMX hold them (its scales and minimums folded in
    integers: other numbers), logits within the int8 activations of the fp32 runner's."""
    from specdecode.models import int8_blocks

    # intermediate 256: the down projection's rows are one Q5_K super-block
    model = build("qwen2", seed=8, intermediate_size=256)
    path = tmp_path / "q5k.gguf"
    write_gguf(model, path, "qwen2", {"down_proj": "Q5_K"})
    runners = {}
    for layout, level in (("five_bit32", "avx2"), ("block", "amx"), ("q5k", "avx512")):
        monkeypatch.setattr(int8_blocks.kernels, "isa", lambda level=level: ISA_LEVELS.index(level))
        runners[layout] = LlamaRunner.from_gguf(path, "int4")
        downs = [layer.down.layout for layer in runners[layout].layers]
        assert downs == [layout] * len(downs)
    monkeypatch.undo()
    prompt = repetitive_prompts()[2]
    outs = []
    for layout in ("five_bit32", "block"):
        first = runners[layout].prefill(prompt).logits
        chain = runners[layout].forward(prompt[-1], Draft.chain(prompt[:5])).logits
        outs.append((first, chain))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    runner = runners["five_bit32"]
    for prompt in repetitive_prompts()[:2]:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
        assert Decoder(runner, None, "suffix", eos_token_ids=[]).start(prompt, 24).run() == ar
    assert_near_fp32_and_suffix_is_ar(runners["q5k"], path)


def assert_near_fp32_and_suffix_is_ar(runner: LlamaRunner, path) -> None:
    """``runner``'s logits within the int8 activations of the fp32 runner's (gguf's dequantised
    weights of the file at ``path``), and its suffix answers ar's."""
    prompt = repetitive_prompts()[2]
    exact = LlamaRunner.from_gguf(path).prefill(prompt).logits
    assert (runner.prefill(prompt).logits - exact).abs().max() < 0.05 * exact.abs().max()
    for prompt in repetitive_prompts()[:2]:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
        assert Decoder(runner, None, "suffix", eos_token_ids=[]).start(prompt, 24).run() == ar


@pytest.mark.parametrize("qtype,layout,amx_layout,avx2_layout", [
    ("Q3_K", "q3k", "q6k", "q3k"), ("IQ4_XS", "iq4xs", "block", "codebook32"),
    ("IQ3_XXS", "codebook32", "codebook32", "codebook32"),
    ("IQ2_S", "codebook16", "codebook16", "codebook16"), ("Q2_K", "q2k", "q2k", "q2k")])
def test_types_without_a_q4_1_form_keep_the_files_values(tmp_path, qtype, layout, amx_layout,
                                                         avx2_layout):
    """Q2_K, Q3_K, IQ4_XS, IQ3_XXS and IQ2_S hold no Q4_1 block exactly: the int4 runner keeps a
    file's such matrices with their own values (Q2_K in its own layout; on a CPU without AMX
    Q3_K's codes in nibbles and IQ4_XS's as indices into its sixteen values (with its integer
    sub-block scales where the best kernels are VNNI), with AMX Q6_K's layout and block int8;
    IQ3_XXS's and IQ2_S's as indices on every CPU), not re-quantised; logits within the int8
    activations of the fp32 runner's (gguf's dequantised weights), and suffix = ar."""
    import gguf

    from specdecode import kernels
    from specdecode.models.gguf_reader import GGUFFile
    from specdecode.models.int8_blocks import Int8BlockWeight
    from specdecode.models.weights import resident_bytes

    from test_gguf_loading import held_bytes

    model = build("qwen2", seed=8, intermediate_size=256)
    path = tmp_path / f"{qtype}.gguf"
    write_gguf(model, path, "qwen2", {"down_proj": qtype})
    file = GGUFFile(path)
    name = "model.layers.0.mlp.down_proj.weight"
    weight = file.read_blocks(name)
    assert isinstance(weight, Int8BlockWeight)
    raw = file.raw(name)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(weight.dequantize().numpy(), expected)
    runner = LlamaRunner.from_gguf(path, "int4")
    if kernels.isa() > ISA_LEVELS.index("avx512"):
        layout = amx_layout
    elif kernels.isa() < ISA_LEVELS.index("avx512"):
        layout = avx2_layout
    assert [layer.down.layout for layer in runner.layers] == [layout] * len(runner.layers)
    # the memory the file is refused by before it loads bounds what the runner holds
    assert resident_bytes(file, "int4") >= held_bytes(runner)
    assert_near_fp32_and_suffix_is_ar(runner, path)


@pytest.mark.parametrize("types,layouts", [
    ({"q_proj": "Q2_K", "k_proj": "Q2_K", "v_proj": "Q4_K"}, ["q2k", "q4k or int4"]),
    ({"q_proj": "Q6_K", "k_proj": "Q6_K", "v_proj": "Q6_K"}, ["q6k"]),
    ({"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K"}, ["q4k", "q6k"]),
    ({"q_proj": "IQ4_XS", "k_proj": "IQ4_XS", "v_proj": "Q6_K"}, ["iq4xs", "q6k"])])
def test_a_query_scale_keeps_a_super_block_projection_in_its_layout(tmp_path, types, layouts):
    """The query scale (1/sqrt(head size), not a power of two here) is folded into q; the
    float16 super-block scales of a Q2_K, Q6_K, Q4_K or IQ4_XS (their own layouts) q cannot
    take it, so q carries it as its input scale (the kernel multiplies the activations' scales
    by it, for q's columns alone) and keeps its own layout, fused with a k (and v) of its type
    (it was block int8 with k, 1.13-1.5 bytes a weight); the memory check counts exactly what
    the runner holds; logits within the int8 activations of the fp32 runner's, and suffix =
    ar."""
    from specdecode.models.gguf_reader import GGUFFile
    from specdecode.models.int8_blocks import vnni_own_layouts
    from specdecode.models.weights import resident_bytes

    from test_gguf_loading import held_bytes

    own = vnni_own_layouts()
    if layouts[0] in ("q4k", "iq4xs") and not own:
        pytest.skip(f"{layouts[0]}, an own layout, is held where the best kernels are AVX-512 "
                    "VNNI without AMX")
    layouts = [{"q4k or int4": "q4k" if own else None}.get(name, name) for name in layouts]
    model = build("qwen2", seed=8, hidden_size=256, intermediate_size=256)
    path = tmp_path / "super-q.gguf"
    write_gguf(model, path, "qwen2", types)
    runner = LlamaRunner.from_gguf(path, "int4")
    qkv = runner.layers[0].qkv
    parts = getattr(qkv, "parts", [qkv])  # (one layer where q, k and v are of one type)
    assert [getattr(part, "layout", None) for part in parts] == layouts
    assert parts[0].input_scale == pytest.approx(runner.shape.query_scale) != 1.0
    assert all(part.input_scale == 1.0 for part in parts[1:] if hasattr(part, "input_scale"))
    assert parts[0].scaled_columns == 256  # (q's rows: the scale of its columns alone)
    assert resident_bytes(GGUFFile(path), "int4") == held_bytes(runner)
    assert_near_fp32_and_suffix_is_ar(runner, path)


def test_q4_k_blocks_unpack_like_ggml():
    import gguf

    from specdecode.models.gguf_reader import q4k_blocks

    raw = random_k_blocks("Q4_K", 8, 512, np.random.default_rng(1))
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)  # float32 [8, 512]
    codes, scale, minimum, inexact = q4k_blocks(raw)
    assert codes.max() <= 15 and tuple(codes.shape) == (8, 512) and tuple(scale.shape) == (8, 16)
    got = Q4Weight(codes, scale, minimum).dequantize()
    error = np.abs(got.numpy() - expected).reshape(8, 16, 32).max(-1)
    # d * sc has up to 17 significant bits: most are not float16 numbers; rounding moves a
    # scale and a minimum by at most 2^-11 of themselves, so a weight q s + m (q <= 15) by at
    # most 2^-11 (15 s + |m|)
    assert 0 < inexact <= 2 * scale.numel()
    assert (error <= 2 ** -11 * (15 * scale + minimum.abs()).numpy() * (1 + 1e-6)).all()
    # with d and dmin powers of two every product is a float16: exactly ggml's weights
    raw[:, 0:4] = np.array([2 ** -10, 2 ** -9], dtype=np.float16).view(np.uint8)[None].repeat(8, 0)
    raw[:, 144:148] = raw[:, 0:4]
    codes, scale, minimum, inexact = q4k_blocks(raw)
    assert inexact == 0
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(Q4Weight(codes, scale, minimum).dequantize().numpy(), expected)


@pytest.mark.parametrize("qtype", ["IQ3_S", "IQ1_S"])
def test_odd_grid_i_quants_are_q4_1_blocks(tmp_path, qtype):
    """IQ3_S's and IQ1_S's codes are odd, -15..15: each 32-weight group is a Q4_1 block, scale
    2 s and minimum -15 s, those rounded to float16 as int4 keeps them (moving a weight q 2s -
    15 s by at most 2^-11 (15 |2s| + |15 s|)), exactly ggml's weights where they are float16
    numbers; a file of such matrices runs in int4's kernels (its down projections the file's
    4-bit blocks, not re-quantised), within the int8 activations of the fp32 runner, suffix =
    ar, in the memory counted."""
    import gguf

    from specdecode.models.gguf_reader import GGUFFile, q4_nibbles
    from specdecode.models.iq_grid_blocks import BLOCK_BYTES
    from specdecode.models.weights import resident_bytes

    from test_gguf_loading import held_bytes

    raw = random_k_blocks(qtype, 8, 512, np.random.default_rng(1))
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = q4_nibbles(raw, qtype)
    scale, minimum = blocks.scale.float(), blocks.minimum.float()
    error = np.abs(blocks.dequantize().numpy() - gguf.quants.dequantize(raw, kind))
    bound = 2 ** -11 * (15 * scale + minimum.abs()).numpy() * (1 + 1e-6)
    assert (error.reshape(8, 16, 32).max(-1) <= bound).all() and error.max() > 0
    d = raw.reshape(-1, BLOCK_BYTES[qtype])[:, 0:2]
    d[:] = np.array([2 ** -10], np.float16).view(np.uint8)  # d a power of two: exact
    assert np.array_equal(q4_nibbles(raw, qtype).dequantize().numpy(),
                          gguf.quants.dequantize(raw, kind))
    model = build("qwen2", seed=8, intermediate_size=256)
    path = tmp_path / f"{qtype}.gguf"
    write_gguf(model, path, "qwen2", {"down_proj": qtype})
    file = GGUFFile(path)
    runner = LlamaRunner.from_gguf(path, "int4")
    assert all(type(layer.down).__name__ == "Int4Linear" for layer in runner.layers)
    assert resident_bytes(file, "int4") >= held_bytes(runner)
    assert_near_fp32_and_suffix_is_ar(runner, path)


# ---- the real Gemma 3 270M ----------------------------------------------------------------------

@pytest.mark.slow
def test_real_gemma_matches_transformers(gemma_model):
    from test_exactness import dev_prompts

    from specdecode.api import eos_ids

    model, tokenizer = gemma_model.model, gemma_model.tokenizer
    native = LlamaRunner.from_transformers(model)
    assert native.shape.windows.count(512) == 15  # five sliding layers to each global one
    decoder = Decoder(model, tokenizer, "ar")
    # past the 512-position window, within the runner's default context of 4096 positions
    long = decoder.encode(" ".join(dev_prompts(2)))[:1500]
    assert len(long) == 1500
    for ids in (decoder.encode(dev_prompts()[0]), long):
        assert_close(native.prefill(ids).logits[0], reference(model, ids))
    short = decoder.encode(dev_prompts()[0])
    native.prefill(short)
    logits = native.forward(100, TREE).logits
    for node in (-1, 2, 6):  # the root, a depth-3 node, a depth-4 node
        path = TREE.path_to(node) if node >= 0 else []
        assert_close(logits[node + 1], reference(model, short + [100] + [TREE.tokens[i] for i in path]))
    for ids in (short, long):
        theirs = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        generation = Decoder(native, tokenizer, "ar", eos_ids(model, tokenizer)).start(ids, 32, chat=False)
        assert generation.run() == theirs


def test_hf_runner_gives_drafters_the_layers_of_any_architecture():
    """EAGLE-3's and deer's features (hidden states after chosen layers) come from any
    architecture on the hf runner, Gemma 3 included: only an early-exit pass needs a Llama
    layout. A layer outside the model is named as such."""
    from specdecode.models.base import Needs

    model = build("gemma3")
    runner = HFRunner(model)
    ids = [1, 5, 7, 9]
    out = runner.prefill(ids, Needs(layers=(1,)))
    with torch.no_grad():
        expected = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]
    torch.testing.assert_close(out.layers[1], expected)
    with pytest.raises(SpecDecodeError, match="hidden states after layer 2 is outside the "
                                              r"model: it has 2 layers, so it must be in 1\.\.1"):
        runner.prefill(ids, Needs(layers=(2,)))
    with pytest.raises(SpecDecodeError, match="early exit needs a Llama-layout model"):
        runner.early_exit
