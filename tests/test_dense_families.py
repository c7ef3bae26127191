"""What the dense families beyond Llama, Qwen and Gemma bring besides their table entries in
test_architectures.py: Llama 3's rope_freqs in a GGUF file (read, applied, and no bar to the hf
runner), Mistral written as a llama file, Phi-3's longrope context limit, and the one-line
refusals of a file's architecture or tensor type before its weights are read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.llama import LlamaRunner

from conftest import close_gguf, gguf_writer, repetitive_prompts
from model_checks import assert_close, reference
from test_architectures import build, write_gguf


def test_llama3_gguf_rope_freqs_are_read_and_applied(tmp_path):
    """A Llama 3.1+ file holds llama3 scaling only as rope_freqs: its logits are those of the
    model with rope_scaling llama3, which they are not without the factors."""
    from specdecode.models.gguf_reader import ROPE_FACTORS, read_gguf

    model = build("llama3", seed=8)
    path = tmp_path / "llama3.gguf"
    write_gguf(model, path, "llama")
    config, tensors = read_gguf(path)
    assert config.rope_scaling is None and tensors[ROPE_FACTORS].tolist()[:3] == pytest.approx(
        [1.0, 2.4423, 8.0], abs=1e-4)
    prompt = repetitive_prompts()[3] * 4  # 56 positions: the divided frequencies turn far
    assert_close(LlamaRunner.from_gguf(path).prefill(prompt).logits[0], reference(model, prompt))
    unscaled = build("llama3", seed=8, rope_scaling=None)
    unscaled.load_state_dict(model.state_dict())
    assert (reference(unscaled, prompt) - reference(model, prompt)).abs().max() > 1e-3


def test_unknown_tensors_stop_the_native_runner_only(tmp_path, monkeypatch):
    """A file of a supported architecture with a tensor the native runner has no place for
    loads for the hf runner (auto picks it); the native runner names the tensor."""
    from specdecode.models.loading import load_gguf, make_runner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = build("llama3", seed=8)
    path = tmp_path / "extra.gguf"
    write_gguf(model, path, "llama", extra={"blk.0.attn_rot_embd.weight": np.ones(8, np.float32)})
    loaded = load_gguf(path)
    assert loaded.config is None
    assert type(make_runner(loaded)).__name__ == "HFRunner"
    with pytest.raises(SpecDecodeError, match=r"has tensors the native runner does not know "
                                              r"\(blk\.0\.attn_rot_embd\.weight\); use the hf"):
        make_runner(loaded, "native")


def test_mistral_is_written_as_a_llama_file(tmp_path):
    """llama.cpp's converter writes Mistral as general.architecture llama (q/k permuted, no
    sliding window): read back, its logits are the Mistral model's."""
    model = build("mistral", seed=8, sliding_window=None)
    path = tmp_path / "mistral.gguf"
    write_gguf(model, path, "llama")
    runner = LlamaRunner.from_gguf(path)
    assert runner.shape.arch.model_type == "llama"
    prompt = repetitive_prompts()[0]
    assert_close(runner.prefill(prompt).logits[0], reference(model, prompt))


def test_longrope_takes_the_long_factors_past_the_original_context():
    """Phi-3's short factors serve up to original_max_position_embeddings (1024 here): by
    default the cache holds 1024 less the 256 draft rows; a longer one turns every position
    with the long factors, as transformers does a sequence longer than 1024 in one forward."""
    import random

    model = build("phi3")
    assert LlamaRunner.from_transformers(model).max_context == 768
    assert LlamaRunner.from_transformers(model, max_draft=64).max_context == 960
    long = LlamaRunner.from_transformers(model, max_context=2048)
    rng = random.Random(2)
    prompt = [rng.randrange(96) for _ in range(1100)]
    assert_close(long.prefill(prompt).logits[0], reference(model, prompt))


def test_partial_rotary_with_head_norms_is_refused():
    with pytest.raises(SpecDecodeError, match="partial rotary embedding.*--runner hf"):
        LlamaRunner.from_transformers(build("olmo2", partial_rotary_factor=0.5))


def _file(path, arch: str, qtype=None) -> None:
    """A header-only llama-shaped file of ``arch`` whose embedding is of GGUF type ``qtype``
    (default F32)."""
    import gguf

    writer = gguf_writer(build("qwen3").config, path, arch)
    rows = np.zeros((96, 64), np.float32)
    if qtype is None:
        writer.add_tensor("token_embd.weight", rows)
    else:
        writer.add_tensor("token_embd.weight", rows.astype(np.float64), raw_dtype=qtype)
    close_gguf(writer)


def test_unsupported_architecture_and_tensor_type_are_named_from_the_header(tmp_path):
    import gguf

    from specdecode.models.gguf_reader import GGUFFile

    _file(tmp_path / "falcon.gguf", "falcon")
    with pytest.raises(SpecDecodeError, match=r"holds a 'falcon' model; the native runner "
                                              r"supports llama, qwen2, .*phi3, granite, olmo2, smollm3"):
        LlamaRunner.from_gguf(tmp_path / "falcon.gguf")
    _file(tmp_path / "f64.gguf", "qwen3", gguf.GGMLQuantizationType.F64)
    with pytest.raises(SpecDecodeError) as err:
        GGUFFile(tmp_path / "f64.gguf")  # the header alone: nothing of the weights is read
    message = str(err.value)
    assert "\n" not in message and "token_embd.weight is of GGUF type F64" in message
    assert "the readable types are F32, F16, " in message and "Q4_K" in message


def test_a_layer_without_rotary_embedding_is_one():
    """SmolLM3's layer 1 has no rotary embedding: its tables are cos 1 and sin 0, so a
    position's rotation there is the identity, bitwise."""
    runner = LlamaRunner.from_transformers(build("smollm3"))
    assert [layer.rope for layer in runner.layers] == ["global", "none"]
    cos, sin = runner.rope["none"]
    assert torch.equal(cos, torch.ones_like(cos)) and not sin.any()


def test_the_3b_shape_writes_llama_3_2s_rope_freqs(tmp_path):
    """bench/shapes.py's Llama-3.2-3B shape (here one narrow layer of its 128-wide heads)
    writes the rope_freqs its llama3 scaling gives: the runner's frequencies are those of
    transformers' llama3 initialiser for Llama-3.2's rope_scaling."""
    from dataclasses import replace

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specdecode.bench.shapes import SHAPES, write_shape
    from specdecode.models.gguf_reader import ROPE_FACTORS, read_gguf

    shape = replace(SHAPES["3b"], layers=1, hidden=256, ffn=512, heads=2, kv_heads=1, vocab=512)
    path = write_shape(tmp_path / "3b-narrow.gguf", shape, "Q4_1")
    config, tensors = read_gguf(path)
    scaling = {"rope_type": "llama3", **SHAPES["3b"].llama3_rope}
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](
        LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_theta=500000.0,
                    rope_scaling=scaling), "cpu")
    base = 500000.0 ** -(torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    torch.testing.assert_close(base / tensors[ROPE_FACTORS], expected.float(), rtol=1e-6, atol=0)
    assert len(LlamaRunner.from_gguf(path, "int4").prefill([1, 2, 3]).logits[0]) == 512
