"""Reading a GGUF file directly with the ``gguf`` package (llama.cpp's file format).

Returns a ``transformers`` config built from the file's metadata (Llama, Qwen2, Qwen3 or Gemma 3
text) and its tensors under Hugging Face parameter names, so the native runner builds from a
GGUF file exactly as from a checkpoint. Tensors in a 4-bit block format stay 4-bit
(:class:`Q4Weight`: codes 0..15 with a scale and a minimum per 32 weights, the int4 format):

    Q4_0  w = d * (q - 8) per block of 32: scale d, minimum -8 d, exactly
    Q4_1  w = d * q + m per block of 32: exactly
    Q4_K  super-blocks of 256 (ggml-quants.c, ``block_q4_K``): float16 d and dmin, and per
          sub-block of 32 a 6-bit scale sc and 6-bit minimum m packed in 12 bytes, w = (d sc) q
          - (dmin m). Each sub-block is a Q4_1 block with scale d sc and minimum -(dmin m). Those
          products (11 x 6 significant bits) are exact in float32 but not always in float16, the
          precision int4 keeps: they are rounded to the nearest float16 here, which moves a
          scale or minimum by at most 2^-11 of itself, so a weight q s + m by at most
          2^-11 (15 s + |m|), against 4-bit steps of s. ``q4k_blocks`` counts the products
          that were not exact.

Every other type (float, Q8_0, Q5_0, Q5_K, Q6_K, ...) is dequantised to float32 by ``gguf``
itself, exactly as ``transformers`` does; the int4 runner re-quantises those matrices in the
Q4_1 scheme (5, 6 and 8-bit weights lose their extra bits), the other formats take them as
they are.

llama.cpp stores Llama's query and key projections with their rows permuted for its interleaved
rotary embedding; the inverse permutation (the one ``transformers`` applies) restores the
Hugging Face layout. It stores Gemma's norm weights as 1 + w; 1 is subtracted, as
``transformers`` does, so the tensors mean what a Hugging Face checkpoint's do.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import SpecDecodeError, require
from specdecode.models.architectures import GGUF_ARCHITECTURES

_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
#: GGUF types kept as 4-bit blocks
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
#: transformers config class per architecture
_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
            "gemma3_text": "Gemma3TextConfig"}


def hf_name(gguf_name: str, layer_names: dict = _LAYER_NAMES) -> str | None:
    if gguf_name in _NAMES:
        return _NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}.{match.group(3)}"
    return None


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q/k projection (rows = heads * D)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def q4_blocks(raw: np.ndarray, qtype: str):
    """(codes [rows, cols] uint8, d [rows, blocks], m [rows, blocks]) of Q4_0/Q4_1 data."""
    header = 4 if qtype == "Q4_1" else 2
    blocks = raw.reshape(raw.shape[0], -1, header + 16)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    packed = blocks[..., header:]
    # a block's first 16 weights are the low nibbles, the next 16 the high nibbles
    codes = np.concatenate([packed & 0x0F, packed >> 4], -1).reshape(raw.shape[0], -1)
    if qtype == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    else:
        m = -8 * d
    return torch.from_numpy(codes), d, m


def _half(raw: np.ndarray) -> np.ndarray:
    """float16 stored in the last axis's 2 bytes, as float32 [...]."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def q4k_blocks(raw: np.ndarray):
    """(codes [rows, cols] uint8, scale [rows, cols / 32], minimum [rows, cols / 32], inexact)
    of Q4_K data: each sub-block of 32 as a Q4_1 block, scale d * sc and minimum -(dmin * m)
    rounded to float16 (``inexact``: how many of them that rounding moved)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 144)  # 2 + 2 bytes of d and dmin, 12 of scales, 128 of codes
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [rows, super-blocks]
    s = blocks[..., 4:16].astype(np.uint8)
    # ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    # (minimums); 4-7 in the nibbles of bytes 8-11 with their top 2 bits in bytes 0-7's top bits
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    exact_scale = d[..., None] * sc.astype(np.float32)  # float32, as ggml dequantises
    exact_min = -(dmin[..., None] * m.astype(np.float32))
    scale = exact_scale.astype(np.float16).astype(np.float32)
    minimum = exact_min.astype(np.float16).astype(np.float32)
    inexact = int((scale != exact_scale).sum() + (minimum != exact_min).sum())
    # 64 weights per 32 bytes: sub-block 2j in the low nibbles of bytes 32j.., 2j + 1 in the high
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    codes = np.concatenate([qs & 15, qs >> 4], 3).reshape(rows, -1)
    return (torch.from_numpy(codes), torch.from_numpy(scale.reshape(rows, -1)),
            torch.from_numpy(minimum.reshape(rows, -1)), inexact)


def read_gguf(path, blocks_only: bool = False):
    """(transformers config, {Hugging Face name: float32 tensor or Q4Weight}) of a GGUF file of
    a supported architecture; ``blocks_only``: only the tensors kept as 4-bit blocks."""
    import gguf
    import transformers

    from specdecode.models.quant import Q4Weight

    path = Path(path)
    require(path.is_file(), f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise SpecDecodeError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                              f"{exc}") from None

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture", "?")
    spec = GGUF_ARCHITECTURES.get(arch)
    require(spec is not None,
            f"{path.name} holds a '{arch}' model; the native runner supports "
            f"{', '.join(GGUF_ARCHITECTURES)} GGUF files: use the hf runner (--runner hf)")
    layer_names = {**_LAYER_NAMES, **spec.gguf_layer_names}
    tensors = {}
    unknown = []
    vocab = 0
    for t in reader.tensors:
        name = hf_name(t.name, layer_names)
        if name is None:
            unknown.append(t.name)
            continue
        qtype = t.tensor_type.name
        expected = [int(x) for x in reversed(t.shape.tolist())]  # GGUF lists dims innermost first
        if name == "model.embed_tokens.weight":
            vocab = expected[0]
        if blocks_only and qtype not in Q4_TYPES:
            continue
        try:
            if qtype == "Q4_K":
                tensors[name] = Q4Weight(*q4k_blocks(np.asarray(t.data))[:3])
            elif qtype in Q4_TYPES:
                tensors[name] = Q4Weight(*q4_blocks(np.asarray(t.data), qtype))
            else:
                data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
                tensors[name] = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(expected)
                if spec.gguf_norm_plus_one and name.endswith("norm.weight"):
                    tensors[name] -= 1
        except (ValueError, NotImplementedError) as exc:
            raise SpecDecodeError(f"cannot read tensor {t.name} ({qtype}) of {path}: {exc}") from None
        size = list((tensors[name].codes if qtype in Q4_TYPES else tensors[name]).shape)
        require(size == expected, f"{path}: tensor {t.name} has {size} values, header says "
                f"{expected}: the file is truncated or corrupt")
    require(not unknown, f"{path.name} has tensors the native runner does not know "
            f"({', '.join(unknown[:4])}); use the hf runner (--runner hf)")

    heads = int(field(f"{arch}.attention.head_count"))
    kv_heads = int(field(f"{arch}.attention.head_count_kv", heads))
    hidden = int(field(f"{arch}.embedding_length"))
    rope = {}
    scaling = field(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        rope = {"rope_type": scaling, "factor": float(field(f"{arch}.rope.scaling.factor", 1.0))}
    # the same fields transformers' GGUF loader reads (integrations/ggml.py); the rest are the
    # config class's defaults, as there (Gemma 3: query_pre_attn_scalar 256, local rope base
    # 10000, every sixth layer global)
    window = field(f"{arch}.attention.sliding_window")
    extra = {} if window is None else {"sliding_window": int(window)}
    config = getattr(transformers, _CONFIGS[spec.model_type])(
        **extra,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(field(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope or None,
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
    )
    for i in range(config.num_hidden_layers if spec.gguf_permuted_qk else 0):
        for proj, n in (("q", heads), ("k", kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            if name in tensors:
                w = tensors[name]
                tensors[name] = (Q4Weight(*(unpermute_rows(x, n) for x in (w.codes, w.scale, w.minimum)))
                                 if isinstance(w, Q4Weight) else unpermute_rows(w, n))
    return config, tensors
