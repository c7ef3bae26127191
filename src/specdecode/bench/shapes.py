"""GGUF files of real model shapes with random weights, to measure costs at real sizes.

No model larger than SmolLM2-135M can be installed here, yet users bring 1B-8B GGUF files. A
file of the same shape (layers, widths, heads, tensor types) costs what the real one costs to
load and to run; only its tokens are meaningless. :func:`write_shape` writes one with the
``gguf`` package's ``GGUFWriter``, one tensor at a time (header and tensor table first, then
each tensor's blocks generated and appended), so memory stays at one tensor whatever the size.

Blocks are random but valid: codes, 6-bit sub-block scales and int8 scales are random bytes;
every float16 scale is a small positive normal number chosen so that weights have a standard
deviation near 0.02 (K-quants: each sub-block's minimum equals its scale's code, so weights are
centred). The default model's tokenizer (``tokenizer.*`` metadata, chat template included) is
copied in, so the file is a complete model that llama.cpp and ``specdecode`` load as they
would a real one.

Type mixes (``MIXES``):

    Q4_1    every matrix Q4_1 (as SmolLM2's Q4_1 file), norms float32
    Q4_0    every matrix Q4_0
    Q4_K_M  llama.cpp's Q4_K_M (``llama_tensor_get_type``): Q4_K, with Q6_K for the output
            and for attn_v and ffn_down in the layers ``use_more_bits`` picks (the first and
            last eighth, and every third layer between)
    Q8_0    every matrix Q8_0
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specdecode.errors import SpecDecodeError, require


@dataclass(frozen=True)
class Shape:
    """A model's shape in GGUF terms (``arch`` is GGUF's ``general.architecture``)."""

    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    #: None: the copied tokenizer's vocabulary
    vocab: int | None = None
    head_dim: int | None = None
    tied: bool = False
    context: int = 4096
    rope_base: float = 10000.0
    #: Gemma 3: every sixth layer global, the rest see this many positions
    sliding_window: int = 0
    #: mixture of experts: experts per layer (0: dense MLPs), experts per token, and each
    #: expert's intermediate size; their matrices stacked as llama.cpp writes them
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    #: Llama 3.1+'s rope scaling (transformers' rope_scaling of type llama3), written as the
    #: rope_freqs factors llama.cpp's converter computes from it; None: no scaling
    llama3_rope: dict | None = None


#: named shapes: real models' layouts with the default tokenizer's vocabulary
SHAPES = {
    # SmolLM2-1.7B
    "1.7b": Shape("llama", 24, 2048, 8192, 32, 32, tied=True, context=8192, rope_base=130000.0),
    # Llama-3.2-3B's layout, its llama3 rope scaling as the rope_freqs tensor
    "3b": Shape("llama", 28, 3072, 8192, 24, 8, tied=True, context=131072, rope_base=500000.0,
                llama3_rope={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
    # Llama-2-7B (Mistral-7B differs by 8 kv heads and ffn 14336)
    "7b": Shape("llama", 32, 4096, 11008, 32, 32, context=4096),
    # Qwen2.5-7B
    "qwen2.5-7b": Shape("qwen2", 28, 3584, 18944, 28, 4, context=32768, rope_base=1e6),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token (3.3 B of 30.5 B parameters active)
    "qwen3-30b-a3b": Shape("qwen3moe", 48, 2048, 6144, 32, 4, head_dim=128, context=40960,
                           rope_base=1e6, experts=128, experts_used=8, expert_ffn=768),
    # tiny shapes for tests: widths a multiple of 256 (a K-quant super-block)
    "tiny": Shape("llama", 2, 256, 512, 4, 2, context=512),
    "tiny-qwen2": Shape("qwen2", 2, 256, 512, 4, 2, context=512),
    "tiny-qwen3": Shape("qwen3", 2, 256, 512, 4, 2, head_dim=128, context=512),  # as Qwen3: 128
    "tiny-gemma3": Shape("gemma3", 6, 256, 512, 4, 2, head_dim=64, context=512, sliding_window=32),
    "tiny-qwen3moe": Shape("qwen3moe", 2, 256, 512, 4, 2, head_dim=64, context=512, experts=8,
                           experts_used=2, expert_ffn=256),
}
MIXES = ("Q4_1", "Q4_0", "Q4_K_M", "Q8_0")
#: standard deviation of the random weights (typical of trained 1B-8B checkpoints)
WEIGHT_STD = 0.02


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K for attn_v and ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(kind: str, layer: int, layers: int, mix: str) -> str:
    """The GGUF type of a matrix (``kind``: token_embd, output, attn_q, ..., ffn_down)."""
    if mix != "Q4_K_M":
        return mix
    if kind == "output" or (kind in ("attn_v", "ffn_down") and _use_more_bits(layer, layers)):
        return "Q6_K"
    return "Q4_K"


def _halves(n: tuple, low: float, rng) -> np.ndarray:
    """float16 values in [low, 1.5 low) as bytes [..., 2]."""
    return rng.uniform(low, 1.5 * low, n).astype(np.float16)[..., None].view(np.uint8)


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator,
                  std: float = WEIGHT_STD) -> np.ndarray:
    """Valid random blocks of ``qtype``, uint8 [rows, bytes per row], weights of about ``std``."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    require(cols % block == 0, f"{qtype} needs rows of a multiple of {block} values, got {cols}")
    n = (rows, cols // block)
    b = np.frombuffer(rng.bytes(rows * n[1] * size), np.uint8).reshape(*n, size).copy()
    if qtype in ("Q4_0", "Q4_1"):  # w = d q (+ m), q uniform in 0..15: std 4.6 d
        d = std / 4.6
        b[..., 0:2] = _halves(n, d, rng)
        if qtype == "Q4_1":  # m = -7.5 d centres the weights
            b[..., 2:4] = (-7.5 * b[..., 0:2].view(np.float16)).astype(np.float16).view(np.uint8)
    elif qtype in ("Q5_0", "Q5_1", "Q8_0"):
        b[..., 0:2] = _halves(n, std / {"Q5_0": 9.2, "Q5_1": 9.2, "Q8_0": 74.0}[qtype], rng)
        if qtype == "Q5_1":
            b[..., 2:4] = (-15.5 * b[..., 0:2].view(np.float16)).astype(np.float16).view(np.uint8)
    elif qtype in ("Q4_K", "Q5_K"):  # w = d sc q - dmin m, sc and m 6-bit (mean 31.5)
        levels = 4.6 if qtype == "Q4_K" else 9.2
        d = _halves(n, std / (levels * 31.5), rng)
        b[..., 0:2] = d
        middle = 7.5 if qtype == "Q4_K" else 15.5
        b[..., 2:4] = (middle * d.view(np.float16)).astype(np.float16).view(np.uint8)
        # minimum codes equal to scale codes (bytes 4-7 = 0-3; bytes 8-11: the same nibble
        # twice), so w = d sc (q - middle): centred
        scales = b[..., 4:16]
        scales[..., 4:8] = scales[..., 0:4]
        scales[..., 8:12] = (scales[..., 8:12] & 15) * 17
    elif qtype == "Q6_K":  # w = d s (q - 32), s int8 (std 74), q 0..63 (std 18.5)
        b[..., 208:210] = _halves(n, std / (18.5 * 74.0), rng)
    else:
        raise SpecDecodeError(f"no random blocks for {qtype}; use one of {', '.join(MIXES)}")
    return b.reshape(rows, -1)


def llama3_rope_factors(head_dim: int, base: float, scaling: dict) -> np.ndarray:
    """float32 [head_dim / 2]: the factor llama.cpp divides each rotary frequency by for
    llama3 rope scaling (``scaling``: transformers' rope_scaling), as its converter computes
    them (LlamaModel.generate_extra_tensors): 1 for wavelengths below original / high, factor
    above original / low, and a smooth blend between."""
    freqs = base ** -(np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelength = 2 * np.pi / freqs
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = (original / wavelength - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelength < original / high, 1.0,
                    np.where(wavelength > original / low, factor, blend)).astype(np.float32)


def _tensor_plan(shape: Shape, vocab: int, mix: str):
    """(GGUF name, [rows, cols] or [n], GGUF type) of every tensor, in llama.cpp's order."""
    head_dim = shape.head_dim or shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    plan = [("rope_freqs.weight", (head_dim // 2,), "F32")] if shape.llama3_rope else []
    plan.append(("token_embd.weight", (vocab, shape.hidden), tensor_type("token_embd", 0, 1, mix)))
    for i in range(shape.layers):
        t = lambda kind: tensor_type(kind, i, shape.layers, mix)  # noqa: E731
        p = f"blk.{i}."
        plan.append((p + "attn_norm.weight", (shape.hidden,), "F32"))
        for kind, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            plan.append((p + kind + ".weight", (rows, shape.hidden), t(kind)))
            if shape.arch == "qwen2":
                plan.append((p + kind + ".bias", (rows,), "F32"))
        if shape.arch in ("qwen3", "gemma3", "qwen3moe"):
            plan += [(p + "attn_q_norm.weight", (head_dim,), "F32"),
                     (p + "attn_k_norm.weight", (head_dim,), "F32")]
        plan.append((p + "attn_output.weight", (shape.hidden, q), t("attn_output")))
        if shape.arch == "gemma3":
            plan.append((p + "post_attention_norm.weight", (shape.hidden,), "F32"))
        plan.append((p + "ffn_norm.weight", (shape.hidden,), "F32"))
        if shape.experts:  # the router stays float32 in llama.cpp's quantisations
            e, ff = shape.experts, shape.expert_ffn
            plan += [(p + "ffn_gate_inp.weight", (e, shape.hidden), "F32"),
                     (p + "ffn_gate_exps.weight", (e, ff, shape.hidden), t("ffn_gate")),
                     (p + "ffn_up_exps.weight", (e, ff, shape.hidden), t("ffn_up")),
                     (p + "ffn_down_exps.weight", (e, shape.hidden, ff), t("ffn_down"))]
        else:
            plan += [(p + "ffn_gate.weight", (shape.ffn, shape.hidden), t("ffn_gate")),
                     (p + "ffn_up.weight", (shape.ffn, shape.hidden), t("ffn_up")),
                     (p + "ffn_down.weight", (shape.hidden, shape.ffn), t("ffn_down"))]
        if shape.arch == "gemma3":
            plan.append((p + "post_ffw_norm.weight", (shape.hidden,), "F32"))
    plan.append(("output_norm.weight", (shape.hidden,), "F32"))
    if not shape.tied:
        plan.append(("output.weight", (vocab, shape.hidden), tensor_type("output", 0, 1, mix)))
    return plan


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(path: Path) -> dict:
    """{key: (value, GGUF value type, array item type)} of a file's ``tokenizer.*`` metadata."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            out[key] = (f.contents(), f.types[0], sub)
    return out


def _byte_size(qtype: str, rows: int, cols: int) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return rows * cols // block * size


def add_hyperparameters(writer, shape: Shape, rms_eps: float) -> None:
    """The ``{arch}.*`` hyper-parameters llama.cpp writes for a model of ``shape`` (``writer``:
    a ``gguf.GGUFWriter``)."""
    head_dim = shape.head_dim or shape.hidden // shape.heads
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(rms_eps)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)


def _write_tensor_table(writer, plan) -> None:
    """Each tensor's name, shape and type, before any data (the file's tensor table)."""
    import gguf

    for name, dims, qtype in plan:
        if qtype == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            rows = int(np.prod(dims[:-1]))
            nbytes = _byte_size(qtype, rows, dims[-1])
            writer.add_tensor_info(name, (*dims[:-1], nbytes // rows), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[qtype])


def write_shape(path, shape: str | Shape, mix: str = "Q4_1", seed: int = 0,
                tokenizer_from: Path | None = None, vocab: int | None = None) -> Path:
    """Write a GGUF file of ``shape`` (a name in ``SHAPES`` or a :class:`Shape`) with random
    weights in the type ``mix`` and the tokenizer of ``tokenizer_from`` (default: the default
    model's file; its vocabulary sets the shape's unless the shape or ``vocab`` gives one, in
    which case no tokenizer is written). Returns the path. Streams: one tensor in memory."""
    import gguf

    from specdecode.models.loading import default_gguf_path

    if isinstance(shape, str):
        require(shape in SHAPES, f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    require(mix in MIXES, f"unknown type mix {mix!r}; known: {', '.join(MIXES)}")
    if vocab is not None:
        shape = replace(shape, vocab=vocab)
    path = Path(path)
    tokenizer = {} if shape.vocab else _tokenizer_fields(tokenizer_from or default_gguf_path())
    vocab = shape.vocab or len(tokenizer["tokenizer.ggml.tokens"][0])
    plan = _tensor_plan(shape, vocab, mix)

    arch = shape.arch
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"specdecode random {arch} {shape.layers}x{shape.hidden} {mix}")
    add_hyperparameters(writer, shape, 1e-6 if arch != "llama" else 1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type({"Q4_1": 3, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}[mix])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, vtype, sub) in tokenizer.items():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    _write_tensor_table(writer, plan)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, qtype in plan:
        if name == "rope_freqs.weight":
            data = llama3_rope_factors(dims[0] * 2, shape.rope_base, shape.llama3_rope)
        elif qtype == "F32" and len(dims) > 1:  # a router: logits of a few units
            data = (rng.standard_normal(dims) / np.sqrt(dims[1])).astype(np.float32)
        elif qtype == "F32":  # norms near 1 (Gemma stores 1 + w), biases near 0
            centre = 0.0 if name.endswith(".bias") else 1.0
            data = (centre + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        else:
            data = random_blocks(qtype, int(np.prod(dims[:-1])), dims[-1], rng)
        writer.write_tensor_data(data)
    writer.close()
    return path
