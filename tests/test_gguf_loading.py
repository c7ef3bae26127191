"""GGUF files straight into the native runner: the same logits as the old path through
transformers, the tokenizer from the file's metadata, the memory it plans for, clear errors.

Files are written by ``specdecode.bench.shapes`` (random weights of tiny shapes, a 512-token
vocabulary unless the test needs the default tokenizer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdecode.api import Decoder, eos_ids
from specdecode.bench.shapes import SHAPES, Shape, tensor_type, write_shape
from specdecode.errors import SpecDecodeError
from specdecode.models.gguf_reader import GGUFFile, read_header
from specdecode.models.llama import LlamaRunner
from specdecode.models.native_shape import DEFAULT_MAX_CONTEXT, cache_rows, kv_cache_bytes
from specdecode.models.loading import (default_gguf_path, load_gguf, make_runner,
                                       named_templates)
from specdecode.models.weights import resident_bytes

from conftest import write_gguf
from tiny_models import tiny_llama
from tiny_server import build_tokenizer

PROMPT = [1, 5, 9, 200, 300, 41, 7, 88, 5, 9, 200]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    cache = {}

    def get(shape: str, mix: str):
        if (shape, mix) not in cache:
            cache[shape, mix] = write_shape(folder / f"{shape}-{mix}.gguf", shape, mix, vocab=512)
        return cache[shape, mix]

    return get


def old_path(path, weights="int4"):
    """What load_gguf + make_runner did before: transformers dequantises the file to fp32,
    then the runner takes the file's 4-bit blocks (``gguf_path``) for int4."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return LlamaRunner.from_transformers(model.eval(), weights, gguf_path=path)


@pytest.mark.parametrize("shape,mix", [("tiny", "Q4_1"), ("tiny", "Q4_0"), ("tiny-qwen2", "Q4_1"),
                                       ("tiny-qwen3", "Q4_1"), ("tiny-gemma3", "Q4_0")])
def test_direct_load_gives_the_old_paths_logits_bitwise(files, shape, mix):
    path = files(shape, mix)
    new, old = LlamaRunner.from_gguf(path, "int4"), old_path(path)
    assert torch.equal(new.prefill(PROMPT).logits, old.prefill(PROMPT).logits)
    for token in (3, 77, 500):
        from specdecode.draft import Draft

        a, b = new.forward(token, Draft.empty()).logits, old.forward(token, Draft.empty()).logits
        assert torch.equal(a, b)
        new.commit([])
        old.commit([])


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2", "tiny-gemma3"])
def test_a_q4_k_m_files_6_bit_tensors_keep_their_values(files, shape):
    """A Q4_K_M file's attn_v (Q6_K) beside q and k (Q4_K): the q/k/v layer runs q and k as int4
    (on a VNNI CPU without AMX: fused in Q4_K's own layout, q's query scale on its columns
    alone) and v in Q6_K's own layout (v's own values: gguf's dequantisation, bitwise), each
    row's outputs those of each matrix alone, and the layer stack's forward gives the Python
    loop's bits."""
    import gguf

    from specdecode.models.int8_blocks import Int8BlockLinear, Int8BlockWeight, vnni_own_layouts
    from specdecode.models.quant import Int4Linear, SplitLinear
    from specdecode.models.weights import _linear_for

    path = files(shape, "Q4_K_M")
    f = GGUFFile(path)
    layers = f.config.num_hidden_layers
    layer = next(i for i in range(layers) if tensor_type("attn_v", i, layers, "Q4_K_M") == "Q6_K")
    p = f"model.layers.{layer}.self_attn."
    assert f.entries[p + "v_proj.weight"].qtype == "Q6_K"
    assert f.entries[p + "q_proj.weight"].qtype == "Q4_K"
    v = f.read_blocks(p + "v_proj.weight")
    assert isinstance(v, Int8BlockWeight)
    exact = gguf.quants.dequantize(f.raw(p + "v_proj.weight"), gguf.GGMLQuantizationType.Q6_K)
    assert torch.equal(v.dequantize(), torch.from_numpy(np.asarray(exact, np.float32)))
    runner = LlamaRunner.from_gguf(path, "int4")
    qkv = runner.layers[layer].qkv
    assert isinstance(qkv, SplitLinear)
    q4k = vnni_own_layouts()
    assert [type(part) for part in qkv.parts] == [Int8BlockLinear if q4k else Int4Linear,
                                                  Int8BlockLinear]
    assert [getattr(part, "layout", "int4") for part in qkv.parts] == ["q4k" if q4k else "int4",
                                                                      "q6k"]
    assert qkv.in_features == f.config.hidden_size
    x = torch.randn(3, f.config.hidden_size)
    out = qkv(x)
    assert torch.equal(out[:, -v.codes.shape[0]:], Int8BlockLinear(v)(x))
    if not runner.shape.arch.qk_norm:  # (else the query scale goes into the head norm)
        q = f.read_blocks(p + "q_proj.weight").scaled(runner.shape.query_scale)
        alone = _linear_for([q], "int4")(x)
        assert torch.equal(out[:, :alone.shape[1]], alone)
        k = _linear_for([f.read_blocks(p + "k_proj.weight")], "int4")(x)
        assert torch.equal(out[:, alone.shape[1]:alone.shape[1] + k.shape[1]], k)
    assert (runner._stack is None) == (shape == "tiny-gemma3")  # Gemma's norms: no stack
    stacked = runner.prefill(PROMPT).logits
    runner._stack = None
    runner.keep_prefix(0)
    assert torch.equal(runner.prefill(PROMPT).logits, stacked)


@pytest.mark.parametrize("method", ["suffix", "recycling"])
def test_methods_match_ar_on_a_directly_loaded_file(files, method):
    runner = LlamaRunner.from_gguf(files("tiny", "Q4_K_M"), "int4")
    for prompt in ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], PROMPT):
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
        assert Decoder(runner, None, method, eos_token_ids=[]).start(prompt, 24).run() == ar


def held_bytes(runner: LlamaRunner) -> int:
    """Bytes of every weight the runner holds (int4 layers, embedding table, norms)."""
    total = runner.embed.nbytes + runner.final_norm.numel() * 4 + runner.head.nbytes
    for layer in runner.layers:
        total += sum(getattr(layer, n).nbytes for n in ("qkv", "o", "gate_up", "down")
                     if getattr(layer, n) is not None)
        if layer.moe is not None:
            moe = layer.moe
            pairs = moe.experts + ([moe.shared] if moe.shared is not None else [])
            total += moe.router.nbytes + sum(gate_up.nbytes + down.nbytes for gate_up, down in pairs)
            total += moe.shared_gate.nbytes if moe.shared_gate is not None else 0
        total += sum(t.numel() * 4 for t in (layer.attn_norm, layer.mlp_norm, layer.qkv_bias,
                                             layer.q_norm, layer.k_norm, layer.post_attn_norm,
                                             layer.post_mlp_norm) if t is not None)
    return total


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-qwen3moe"])
def test_resident_bytes_are_what_the_runner_holds(files, shape):
    path = files(shape, "Q4_1")
    assert resident_bytes(GGUFFile(path), "int4") == held_bytes(LlamaRunner.from_gguf(path, "int4"))


def test_the_cache_holds_the_default_context_not_the_files(tmp_path):
    long = Shape("llama", 1, 256, 512, 4, 2, vocab=512, context=131072)
    path = write_shape(tmp_path / "long.gguf", long, "Q4_1")
    runner = LlamaRunner.from_gguf(path, "int4")
    assert runner.max_context == DEFAULT_MAX_CONTEXT
    assert runner.capacity == cache_rows(DEFAULT_MAX_CONTEXT, 256)
    wide = LlamaRunner.from_gguf(path, "int4", max_context=10000)
    assert wide.max_context == 10000 and wide.cache.capacity == cache_rows(10000, 256)
    with pytest.raises(SpecDecodeError, match=r"max_context must be 1\.\.131072"):
        LlamaRunner.from_gguf(path, "int4", max_context=200000)
    small = LlamaRunner.from_gguf(path, "int4", max_context=8)
    with pytest.raises(SpecDecodeError, match="1..8 tokens"):
        small.prefill(list(range(1, 12)))


def test_a_file_that_cannot_fit_is_refused_naming_the_sizes(files):
    path = files("tiny", "Q4_1")
    f = GGUFFile(path)
    weights = resident_bytes(f, "int4")
    kv = kv_cache_bytes(LlamaRunner.from_gguf(path, "int4").shape, cache_rows(512, 256), "int4")
    with pytest.raises(SpecDecodeError) as err:
        LlamaRunner.from_gguf(path, "int4", available=10 ** 8)
    message = str(err.value)
    assert f"weights int4 {weights / 1e9:.2f} GB" in message
    assert f"KV cache of 512 positions {kv / 1e9:.2f} GB" in message
    assert "0.10 GB of memory is available" in message and "--max-context" in message
    # fp32 holds eight bytes a weight (decode and prefill layers): far more than int4
    assert resident_bytes(f, "fp32") > 5 * resident_bytes(f, "int4")


def test_the_transformers_model_is_built_only_when_asked_for(files, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = files("tiny", "Q4_1")
    loaded = load_gguf(path)
    runner = make_runner(loaded)
    assert isinstance(runner, LlamaRunner) and loaded._model is None
    assert loaded.config.num_hidden_layers == 2 and eos_ids(loaded, None) == []
    from specdecode.models.loading import _gguf_transformers_model

    with pytest.raises(SpecDecodeError, match=r"dequantised by transformers \(fp32\) needs about"):
        _gguf_transformers_model(path, loaded.config, available=10 ** 6)
    hf = make_runner(loaded, "hf")  # now it is built (and cached)
    assert loaded._model is not None and type(hf).__name__ == "HFRunner"
    assert (hf.prefill(PROMPT).logits - runner.prefill(PROMPT).logits).abs().max() < 0.5  # int4 vs fp32


@pytest.mark.slow
def test_tokenizer_from_metadata_encodes_like_transformers(monkeypatch, tmp_path):
    from transformers import AutoTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = default_gguf_path()
    shaped = write_shape(tmp_path / "tok.gguf", Shape("llama", 1, 256, 512, 4, 2), "Q4_1")
    reference = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    texts = ["Hello, how are you?", "  spaces\tand\nnewlines ", "Ünïcødé 数字 1234567 🙂"]
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    # the shaped file carries the source's tokenizer metadata: converted once, then read
    # from the cache (the source's own conversion is the same code on the same metadata)
    for path in (shaped, shaped):
        tokenizer = load_gguf(path).tokenizer
        for text in texts:
            assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
        assert (tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                == reference.apply_chat_template(messages, add_generation_prompt=True))
    assert list(tmp_path.glob("specdecode/tok-*-tokenizer-added"))


def test_a_files_named_chat_templates_reach_the_tokenizer(tmp_path):
    """llama.cpp keeps a tokenizer's ``tool_use`` template (Hermes 2 Pro's and 3's) beside the
    default; transformers' conversion reads the default only. The tokenizer gets both, so a
    prompt with tools renders through ``tool_use`` (and the server reads its call format)."""
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }};{% endfor %}"
    with_tools = "Tools:{% for t in tools %} {{ t.function.name }}{% endfor %};" + plain
    path = write_gguf(tiny_llama(seed=0, layers=1), tmp_path / "hermes.gguf",
                      templates={"default": plain, "tool_use": with_tools})
    tokenizer = build_tokenizer(plain)  # as transformers converts the file: the default only
    named_templates(tokenizer, read_header(path)[0])
    assert tokenizer.chat_template == {"default": plain, "tool_use": with_tools}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) \
        == "Tools: get_time;user: Hi;"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "user: Hi;"
    # a file of one template: the tokenizer's left as it is
    alone = write_gguf(tiny_llama(seed=0, layers=1), tmp_path / "one.gguf",
                       templates={"default": plain})
    tokenizer = build_tokenizer(plain)
    named_templates(tokenizer, read_header(alone)[0])
    assert tokenizer.chat_template == plain


# ---- the writer ---------------------------------------------------------------------------------

def test_writer_follows_q4_k_m_and_writes_valid_blocks(files):
    import gguf

    path = files("tiny", "Q4_K_M")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.1.attn_v.weight"] == "Q6_K" and types["blk.0.attn_v.weight"] == "Q4_K"
    assert types["blk.1.ffn_down.weight"] == "Q6_K" and types["blk.0.attn_norm.weight"] == "F32"
    for t in reader.tensors:
        if t.tensor_type.name != "F32":
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            assert np.isfinite(w).all() and 0.01 < w.std() < 0.04, t.name
            assert abs(w.mean()) < 0.005, t.name


def test_named_shapes_are_real_models_sizes():
    from specdecode.bench.shapes import _tensor_plan

    def weights(name):
        return sum(int(np.prod(dims)) for _, dims, _ in _tensor_plan(SHAPES[name], 49152, "Q4_1"))

    assert 1.6e9 < weights("1.7b") < 1.8e9
    assert 6.4e9 < weights("7b") < 6.9e9  # Llama-2-7B's 6.7e9 with a 49152-token vocabulary
    assert 6.7e9 < weights("qwen2.5-7b") < 7.0e9  # Qwen2.5-7B's 7.6e9 less 0.7e9 of vocabulary
    # Qwen3-30B-A3B's 30.5e9 less 0.4e9 of vocabulary (embedding and head)
    assert 30.0e9 < weights("qwen3-30b-a3b") < 30.3e9


def test_a_rewritten_file_is_read_again(files, tmp_path):
    # headers are parsed once per process and version of a file: a file written anew at the
    # same path is not answered from the parse of the old one
    from specdecode.models.gguf_reader import read_header

    path = tmp_path / "model.gguf"
    path.write_bytes(files("tiny", "Q4_1").read_bytes())
    first = read_header(path)[0]
    path.write_bytes(files("tiny-qwen2", "Q4_1").read_bytes())
    second = read_header(path)[0]
    assert first["general.architecture"] == "llama" and second["general.architecture"] == "qwen2"
    second["general.architecture"] = "changed"  # a caller's copy: the next read is untouched
    assert read_header(path)[0]["general.architecture"] == "qwen2"


def test_generate_json_reports_the_load_time(capsys):
    import json

    from specdecode.cli import main

    assert main(["generate", "Say hi", "--method", "ar", "--max-new-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 2 and 0 < out["load_s"] < 600


# ---- bad input ----------------------------------------------------------------------------------

def test_missing_and_truncated_files(files, tmp_path):
    with pytest.raises(SpecDecodeError, match="does not exist"):
        load_gguf(tmp_path / "nothing.gguf")
    with pytest.raises(SpecDecodeError, match="does not exist"):
        LlamaRunner.from_gguf(tmp_path / "nothing.gguf", "int4")
    data = files("tiny", "Q4_1").read_bytes()
    for size in (100, len(data) // 2, len(data) - 64):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(SpecDecodeError, match="truncated"):
            LlamaRunner.from_gguf(cut, "int4")
        with pytest.raises(SpecDecodeError, match="truncated"):
            load_gguf(cut)


def test_unknown_architecture_names_it_and_the_fallback(tmp_path):
    path = write_shape(tmp_path / "falcon.gguf", Shape("falcon", 1, 256, 512, 4, 2, vocab=512), "Q4_1")
    with pytest.raises(SpecDecodeError, match=r"'falcon'.*--runner hf"):
        LlamaRunner.from_gguf(path, "int4")
    assert load_gguf(path).config is None  # the hf runner's to try (transformers knows falcon)


@pytest.mark.parametrize("qtype,rows", [("Q4_0", 48), ("Q4_1", 40), ("Q4_K", 16), ("Q4_K", 7)])
def test_blocks_repack_to_the_bytes_of_pack_q4(qtype, rows):
    from specdecode import kernels
    from specdecode.bench.shapes import random_blocks
    from specdecode.models.gguf_reader import q4_blocks, q4_nibbles, q4k_blocks
    from specdecode.models.weights import pack_blocks

    raw = random_blocks(qtype, rows, 512, np.random.default_rng(3))
    codes, scale, minimum = q4k_blocks(raw)[:3] if qtype == "Q4_K" else q4_blocks(raw, qtype)
    blocks = q4_nibbles(raw, qtype)
    assert torch.equal(blocks.codes().codes, codes)
    assert torch.equal(blocks.scale.float(), scale) and torch.equal(blocks.minimum.float(), minimum)
    assert torch.equal(pack_blocks(blocks), kernels.pack_q4(codes, scale, minimum))


@pytest.mark.slow
def test_the_files_added_tokens_stay_whole():
    """Qwen's chat template writes <tool_call> around every earlier call: the model's own
    tokenizer keeps it one token (151657), and so must the one read from the file."""
    from specdecode.models.loading import load_model
    from specdecode.models.parted import PARTED_MODELS, is_assembled

    model = PARTED_MODELS["qwen2.5-coder-0.5b"]
    if not is_assembled(model):
        pytest.skip(f"qwen2.5-coder-0.5b is not installed: `{model.install_command}`")
    tokenizer = load_model("qwen2.5-coder-0.5b").tokenizer
    assert tokenizer.encode("<tool_call>\n{}\n</tool_call>") == [151657, 198, 16094, 151658]
    assert tokenizer.encode("<|fim_prefix|>def") == [151659, 750]
    assert tokenizer.encode("a <b> tag") == [64, 366, 65, 29, 4772]  # not added: left alone
    assert tokenizer.decode([151657]) == "<tool_call>"
