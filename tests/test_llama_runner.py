"""The native Llama runner: equal to transformers, batch-invariant, exact against its own ar,
loading GGUF and safetensors files, and clear errors for what it cannot run."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.api import Decoder
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.models.base import Needs
from specdecode.models.hf import HFRunner
from specdecode.models.llama import LlamaRunner
from specdecode.models.quant import Q4Weight
from specdecode.models.llama_drafter import LlamaDrafter
from specdecode.models.loading import LoadedModel, make_runner
from specdecode.models.quant import WEIGHT_FORMATS, int4_weights

from conftest import alone_logits, repetitive_prompts, write_gguf
from tiny_models import tiny_llama, tiny_model

#: a context length that prompts in these tests cross (attention scores 64 cached keys at a
#: time, then 16 gathered ones a register)
CHUNK = 64
TREE = Draft.from_paths([[3, 4, 5], [3, 7], [9, 10, 11, 12], [9, 10, 13]])


def tiny(seed=0, tie=False, **kw):
    # int4 needs input sizes divisible by 32; heads 4, kv heads 2: grouped-query attention
    kw = {"hidden_size": 64, "heads": 4, "kv_heads": 2, **kw}
    return tiny_llama(seed=seed, tie_embeddings=tie, **kw)


def random_tree(rng, n, vocab=96) -> Draft:
    return Draft(tuple(rng.randrange(vocab) for _ in range(n)),
                 tuple(rng.randrange(-1, i) for i in range(n)))


# ---- equivalence with transformers (fp32) ----------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(tie):
    model = tiny(seed=3, tie=tie, layers=3)
    hf, native = HFRunner(model), LlamaRunner.from_transformers(model)
    rng = random.Random(0)
    for plen in (1, 9, CHUNK + 3):
        prompt = [rng.randrange(96) for _ in range(plen)]
        assert (hf.prefill(prompt).logits[0] - native.prefill(prompt).logits[0]).abs().max() < 1e-4
        root = rng.randrange(96)
        for step in range(6):
            draft = [TREE, Draft.chain([5, 6, 7]), Draft.empty(), random_tree(rng, 12)][step % 4]
            a, b = hf.forward(root, draft).logits, native.forward(root, draft).logits
            assert a.shape == b.shape
            assert (a - b).abs().max() < 1e-4, (plen, step)
            # accept the path to a leaf, as a verifier would, then continue after it
            path = draft.path_to(len(draft) - 1) if len(draft) else []
            hf.commit(path)
            native.commit(path)
            assert hf.cache_len == native.cache_len
            root = int(a[len(path) and path[-1] + 1].argmax())


@pytest.mark.parametrize("tie", [False, True])
def test_greedy_ar_tokens_identical_to_transformers(tie):
    model = tiny(seed=4, tie=tie)
    native = LlamaRunner.from_transformers(model)
    for prompt in repetitive_prompts()[:3]:
        expected = Decoder(model, None, "ar", eos_token_ids=[]).start(prompt, 40).run()
        assert Decoder(native, None, "ar", eos_token_ids=[]).start(prompt, 40).run() == expected


# ---- batch invariance -------------------------------------------------------------------------

@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
def test_position_alone_equals_position_in_tree_bitwise(weights):
    runner = LlamaRunner.from_transformers(tiny(seed=5, layers=2), weights)
    rng = random.Random(1)
    # prompts end just before, at and after a key-chunk boundary; the tree crosses it
    for plen in (CHUNK - 9, CHUNK + 1):
        prompt = [rng.randrange(96) for _ in range(plen)]
        for draft in (random_tree(rng, 15), Draft.chain([rng.randrange(96) for _ in range(15)])):
            runner.prefill(prompt)
            together = runner.forward(7, draft).logits  # 16 rows: root + 15 nodes
            runner.commit([])
            for node in [-1] + [i for i in range(len(draft)) if not draft.children(i)]:
                path = draft.path_to(node) if node >= 0 else []
                rows = alone_logits(runner, prompt, [7] + [draft.tokens[i] for i in path])
                for row, i in zip(rows, [-1] + path):
                    assert torch.equal(row, together[i + 1]), (weights, plen, node, i)


# ---- every format: speculative output equals its own ar ---------------------------------------

@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
@pytest.mark.parametrize("method", ["ngram", "recycling", "suffix"])
def test_speculative_equals_own_ar(weights, method):
    runner = LlamaRunner.from_transformers(tiny(seed=6, tie=True), weights)
    decoder = Decoder(runner, None, method, eos_token_ids=[])
    for prompt in repetitive_prompts()[:3]:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
        assert decoder.start(prompt, 24).run() == ar, (weights, method, prompt)


def test_quantised_formats_stay_close_to_fp32():
    model = tiny(seed=7)
    prompt = repetitive_prompts()[1]

    def prefill_then_step(runner):
        first = runner.prefill(prompt[:-1]).logits[0]
        return first, runner.forward(prompt[-1], Draft.chain(prompt[:3])).logits

    ref = prefill_then_step(LlamaRunner.from_transformers(model))
    for weights, tolerance in (("bf16", 0.05), ("int8", 0.1), ("int4", 0.5)):
        for logits, expected in zip(prefill_then_step(LlamaRunner.from_transformers(model, weights)), ref):
            err = (logits - expected).abs().max() / expected.abs().max()
            assert 0 < err < tolerance, (weights, float(err))


def test_int8_and_int4_prefill_in_their_own_kernels():
    # bf16 prompts go through ATen's bf16 GEMMs (not the decode kernel's bits); int8 and int4
    # prompts run through their decode layers: a prompt's logits are bitwise those of reading
    # it one token at a time, and no bf16 copy of the weights is kept
    model = tiny(seed=7)
    prompt = repetitive_prompts()[1]
    bf16 = LlamaRunner.from_transformers(model, "bf16")
    assert bf16.prefill_weights == "bf16" and bf16.prefill_layers is not bf16.layers
    expected = bf16.prefill(prompt).logits[0]
    for weights in ("int8", "int4"):
        runner = LlamaRunner.from_transformers(model, weights)
        assert runner.prefill_weights is None and runner.prefill_layers is runner.layers
        prefilled = runner.prefill(prompt).logits[0]
        assert not torch.equal(prefilled, expected), weights
        runner.prefill(prompt[:1])
        for token in prompt[1:]:
            stepped = runner.forward(token, Draft.empty()).logits[0]
            runner.commit([])
        assert torch.equal(prefilled, stepped), weights


@pytest.mark.parametrize("arch, weights", [("llama", "int4"), ("llama", "int8"),
                                           ("llama", "bf16"), ("llama", "fp32"),
                                           ("qwen2", "int4"), ("qwen2", "fp32")])
def test_layers_in_one_call_equal_the_python_loop(arch, weights):
    """Plain layers of every weight format, and Qwen2's with their q/k/v biases, run as one
    kernel call (LayerStack): prompt, tree, captured layers and a cut-short exit pass all give
    the bits of the layer-by-layer loop."""
    model = tiny(seed=8, layers=4) if arch == "llama" else tiny_model("qwen2", seed=8, layers=4)
    stacked, looped = (LlamaRunner.from_transformers(model, weights) for _ in range(2))
    assert stacked._stack is not None
    looped._stack = None
    prompt = repetitive_prompts()[0]
    needs = Needs(layers=(1, 3))
    for step in range(3):
        outs = []
        for runner in (stacked, looped):
            first = runner.prefill(prompt, needs) if step == 0 else None
            out = runner.forward(3 + step, TREE, needs)
            runner.commit([0, 1])
            with runner.early_exit.chain(2) as chain:
                exit_hidden = chain.extend([5]) if step == 2 else None
            outs.append((first, out.logits, dict(out.layers), exit_hidden))
        (a, b, c, d), (e, f, g, h) = outs
        assert a is None or (torch.equal(a.logits, e.logits) and a.layers.keys() == {1, 3}
                             and all(torch.equal(a.layers[k], e.layers[k]) for k in a.layers))
        assert torch.equal(b, f), step
        assert c.keys() == g.keys() == {1, 3} and all(torch.equal(c[k], g[k]) for k in c)
        assert d is None or torch.equal(d, h)


def test_layers_with_extra_pieces_keep_the_python_loop():
    """An architecture whose layers hold more than a plain Llama layer (Gemma 3's post-norms,
    head norms and sliding windows) runs the Python loop."""
    gemma = tiny_model("gemma3_text", seed=8, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"])
    assert LlamaRunner.from_transformers(gemma, "int4")._stack is None


def test_tree_read_in_parts_is_the_verify_pass_and_keeps_its_path():
    """A drafting runner's tree (read_tree, a few nodes a call, after the cache) scores its
    nodes as the verify pass scores the same tree; keep_tree leaves the cache holding the
    kept path, as if it had been read as a chain."""
    model = tiny(seed=9, layers=2)
    prompt = repetitive_prompts()[0]
    drafting, chain = (LlamaDrafter(LlamaRunner.from_transformers(model)) for _ in range(2))
    verifying = LlamaRunner.from_transformers(model)
    drafting.runner.prefill(prompt)
    verifying.prefill(prompt[:-1])
    paths = [list(TREE.path_to(i))[:-1] for i in range(len(TREE))]
    hidden = torch.cat([drafting.read_tree(TREE.tokens[:3], paths[:3], 0),
                        drafting.read_tree(TREE.tokens[3:], paths[3:], 3)])
    expected = verifying.forward(prompt[-1], TREE).logits[1:]
    torch.testing.assert_close(drafting.lm_head(hidden), expected, atol=1e-5, rtol=1e-5)
    kept = list(TREE.path_to(len(TREE) - 1))  # the last node's path: rows not first in the tree
    drafting.keep_tree(kept)
    assert drafting.cache.length == len(prompt) + len(kept)
    chain.runner.prefill(prompt + [TREE.tokens[r] for r in kept])
    torch.testing.assert_close(drafting.lm_head(drafting.extend([7])), chain.lm_head(chain.extend([7])),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(SpecDecodeError, match="ancestors must be earlier rows"):
        drafting.read_tree([1, 2], [[], [1]], 0)


# ---- early exit -------------------------------------------------------------------------------

def test_exit_forward_is_the_full_forward_cut_short():
    model = tiny(seed=14, layers=4)
    native, hf = LlamaRunner.from_transformers(model), HFRunner(model)
    prompt = repetitive_prompts()[0]
    native.prefill(prompt)
    hf.prefill(prompt)
    hidden, hf_hidden = ([], [])
    with native.early_exit.chain(2) as chain, hf.early_exit.chain(2) as hf_chain:
        for tokens in ([12], [13, 14]):
            hidden.append(chain.extend(tokens))
            hf_hidden.append(hf_chain.extend(tokens))
    hidden = torch.cat(hidden)
    assert (hidden - torch.cat(hf_hidden)).abs().max() < 1e-5
    assert (native.early_exit.logits(hidden) - hf.early_exit.logits(hidden)).abs().max() < 1e-5
    # the verify pass overwrites the draft rows; its root row is the exit pass's, bit for bit
    out = native.forward(12, Draft.chain([13, 14]), Needs(layers=(2, 3)))
    assert torch.equal(out.layers[2][:3], hidden)
    native.commit([0, 1])
    plain = LlamaRunner.from_transformers(model)
    plain.prefill(prompt)
    assert torch.equal(plain.forward(12, Draft.chain([13, 14])).logits, out.logits)
    with pytest.raises(SpecDecodeError, match=r"has 4 layers.*1\.\.3"):
        native.early_exit.chain(4)


@pytest.mark.parametrize("weights", ["fp32", "int4"])
@pytest.mark.parametrize("method", ["early_exit", "del"])
def test_self_speculation_equals_own_ar(weights, method):
    runner = LlamaRunner.from_transformers(tiny(seed=15, layers=4), weights)
    config = {"early_exit": {"exit_layer": 3, "adapters": "none"},
              "del": {"adapters": "none", "head_cost": 0.0, "verify_token_cost": 0.0}}[method]
    decoder = Decoder(runner, None, method, eos_token_ids=[], **config)
    drafted = 0
    for prompt in repetitive_prompts()[:3]:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
        generation = decoder.start(prompt, 24)
        assert generation.run() == ar, (weights, method, prompt)
        drafted += generation.stats.draft_tokens
    assert drafted > 0


# ---- loading: safetensors and GGUF -----------------------------------------------------------

def test_safetensors_checkpoint(tmp_path):
    model = tiny(seed=8)
    model.save_pretrained(tmp_path, safe_serialization=True)
    native = LlamaRunner.from_safetensors(tmp_path)
    prompt = repetitive_prompts()[0]
    assert (native.prefill(prompt).logits[0] - HFRunner(model).prefill(prompt).logits[0]).abs().max() < 1e-4
    assert native.fingerprint() == HFRunner(model).fingerprint()


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    model = tiny(seed=9, layers=2)
    path = write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return model, path


def test_gguf_file_matches_transformers(gguf_model):
    model, path = gguf_model
    native = LlamaRunner.from_gguf(path)
    hf = HFRunner(model)
    prompt = repetitive_prompts()[2]
    assert (native.prefill(prompt).logits[0] - hf.prefill(prompt).logits[0]).abs().max() < 1e-4
    assert (native.forward(4, TREE).logits - hf.forward(4, TREE).logits).abs().max() < 1e-4


def test_gguf_q4_1_blocks_are_read_exactly(gguf_model):
    from specdecode.models.gguf_reader import read_gguf

    model, path = gguf_model
    config, tensors = read_gguf(path)
    state = model.state_dict()
    q4 = {k: v for k, v in tensors.items() if isinstance(v, Q4Weight)}
    assert len(q4) == 7 * config.num_hidden_layers
    for name, w in tensors.items():
        dense = w.dequantize() if isinstance(w, Q4Weight) else w
        assert torch.equal(dense, state[name]), name
    # int4 holds the file's blocks exactly: codes, and float16 scales and minimums
    w = q4["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(int4_weights(w.codes, w.scale, w.minimum), w.dequantize())


def test_gguf_int4_runner_is_exact_against_its_own_ar(gguf_model):
    runner = LlamaRunner.from_gguf(gguf_model[1], "int4")
    for prompt in repetitive_prompts()[:3]:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
        assert Decoder(runner, None, "recycling", eos_token_ids=[]).start(prompt, 24).run() == ar


# ---- bad input ----------------------------------------------------------------------------------

def test_gguf_of_another_architecture_names_it_and_the_fallback(tmp_path):
    path = write_gguf(tiny(seed=10, layers=1), tmp_path / "other.gguf", arch="falcon")
    with pytest.raises(SpecDecodeError, match=r"'falcon'.*--runner hf"):
        LlamaRunner.from_gguf(path)


def test_truncated_gguf_file(gguf_model, tmp_path):
    data = gguf_model[1].read_bytes()
    for size in (len(data) // 2, 100, len(data) - 64):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(SpecDecodeError, match="truncated"):
            LlamaRunner.from_gguf(cut)


def test_missing_files():
    with pytest.raises(SpecDecodeError, match="does not exist"):
        LlamaRunner.from_gguf("/nonexistent/model.gguf")
    with pytest.raises(SpecDecodeError, match="not a Hugging Face checkpoint"):
        LlamaRunner.from_safetensors("/nonexistent")


def test_unknown_weight_format_and_runner():
    model = tiny(seed=11, layers=1)
    loaded = LoadedModel(model, None, "tiny")
    with pytest.raises(SpecDecodeError, match="known formats: fp32, bf16, int8, int4"):
        LlamaRunner.from_transformers(model, "fp8")
    with pytest.raises(SpecDecodeError, match="known formats"):
        make_runner(loaded, "native", "q3")
    with pytest.raises(SpecDecodeError, match="--runner native"):
        make_runner(loaded, "hf", "int4")
    with pytest.raises(SpecDecodeError, match="known runners"):
        make_runner(loaded, "fast", "fp32")


def test_other_architectures_are_refused():
    from transformers import PhiConfig, PhiForCausalLM

    # Phi-2: LayerNorm and a parallel attention and MLP, not pieces the native runner has
    model = PhiForCausalLM(PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2))
    with pytest.raises(SpecDecodeError, match="'phi'.*--runner hf"):
        LlamaRunner.from_transformers(model)
    loaded = LoadedModel(model, None, "phi")
    assert isinstance(make_runner(loaded, "auto"), HFRunner)


def test_make_runner_picks_native_for_llama():
    loaded = LoadedModel(tiny(seed=12, layers=1), None, "tiny")
    assert isinstance(make_runner(loaded, "native", "int8"), LlamaRunner)
    assert isinstance(make_runner(loaded, "hf"), HFRunner)


def test_draft_beyond_the_cache_is_refused():
    runner = LlamaRunner.from_transformers(tiny(seed=13, layers=1, max_positions=64), max_draft=8)
    runner.prefill(list(range(60)))
    with pytest.raises(SpecDecodeError, match="smaller draft"):
        runner.forward(1, Draft.chain([5] * 80))


# ---- the real default model -------------------------------------------------------------------

def assert_same_model(native: torch.Tensor, hf: torch.Tensor) -> None:
    """Two fp32 implementations of one model: the same argmax on every row, and logits equal
    to within 1e-5 of their scale. Their sums are ordered differently, so they differ by
    float32 rounding (about 1e-7 relative per operation, 1e-6 after 30 layers); any mistake in
    the model (a norm, a rotary sign, a mask) moves logits by 1e-2 of their scale or more."""
    assert torch.equal(native.argmax(-1), hf.argmax(-1))
    relative = float((native - hf).abs().max() / hf.abs().max())
    assert relative < 1e-5, relative


@pytest.mark.slow
@pytest.mark.ci
def test_real_model_matches_transformers(real_model):
    from test_exactness import dev_prompts

    from specdecode.api import eos_ids

    model, tokenizer = real_model.model, real_model.tokenizer
    native, hf = LlamaRunner.from_transformers(model), HFRunner(model)
    eos = eos_ids(model, tokenizer)
    for prompt in dev_prompts()[:2]:
        ids = Decoder(model, tokenizer, "ar").encode(prompt)
        assert_same_model(native.prefill(ids).logits[0], hf.prefill(ids).logits[0])
        assert_same_model(native.forward(ids[-1], TREE).logits, hf.forward(ids[-1], TREE).logits)
        expected = Decoder(model, tokenizer, "ar", eos_token_ids=eos).generate(prompt, 32)
        got = Decoder(native, tokenizer, "ar", eos_token_ids=eos).generate(prompt, 32)
        assert got.token_ids == expected.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
def test_real_model_position_alone_equals_position_in_tree(real_model, weights):
    runner = LlamaRunner.from_transformers(real_model.model, weights)
    rng = random.Random(2)
    prompt = [rng.randrange(1000, 20000) for _ in range(CHUNK * 2 - 5)]
    draft = random_tree(rng, 15, vocab=20000)
    runner.prefill(prompt)
    together = runner.forward(7, draft).logits
    runner.commit([])
    path = draft.path_to(max(range(len(draft)), key=lambda i: draft.depths[i]))
    rows = alone_logits(runner, prompt, [7] + [draft.tokens[i] for i in path])
    for row, i in zip(rows, [-1] + path):
        assert torch.equal(row, together[i + 1]), (weights, i)


@pytest.mark.slow
def test_real_gguf_reads_like_transformers(real_model):
    from specdecode.models.gguf_reader import read_gguf

    config, tensors = read_gguf(real_model.gguf_path)
    state = real_model.model.state_dict()
    for name, w in tensors.items():
        assert torch.equal(w.dequantize() if isinstance(w, Q4Weight) else w, state[name]), name
    assert config.rope_theta == real_model.model.config.rope_theta


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_replicas_share_weights_and_keep_their_own_cache(kind):
    model = tiny(seed=8)
    runner = LlamaRunner.from_transformers(model, "int4") if kind == "native" else HFRunner(model)
    twin = runner.replica()
    first, second = repetitive_prompts()[:2]
    expected = [Decoder(runner, None, "ar", eos_token_ids=[]).start(p, 12).run() for p in (first, second)]
    # interleaved steps on the two runners: each keeps its own sequence
    a = Decoder(runner, None, "ar", eos_token_ids=[]).start(first, 12)
    b = Decoder(twin, None, "ar", eos_token_ids=[]).start(second, 12)
    for _ in zip(a, b):
        pass
    assert [a.tokens, b.tokens] == expected
    if kind == "native":
        assert twin.layers is runner.layers and twin.cache.keys is not runner.cache.keys
