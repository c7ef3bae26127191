"""Reading a Llama GGUF file directly with the ``gguf`` package (llama.cpp's file format).

Returns a ``transformers`` ``LlamaConfig`` built from the file's metadata and its tensors under
Hugging Face parameter names, so the native runner builds from a GGUF file exactly as from a
checkpoint. Tensors in GGUF's 4-bit block formats stay 4-bit (:class:`Q4Weight`: the file's
codes, scales and minimums: Q4_1 is w = d * q + m per block of 32, Q4_0 is w = d * (q - 8));
every other type is dequantised to float32 by ``gguf`` itself, as ``transformers`` does.

llama.cpp stores the query and key projections with their rows permuted for its interleaved
rotary embedding; the inverse permutation (the one ``transformers`` applies) restores the
Hugging Face layout.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import SpecDecodeError, require

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
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _NAMES:
        return _NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
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


def read_gguf(path):
    """(LlamaConfig, {Hugging Face name: float32 tensor or Q4Weight}) of a Llama GGUF file."""
    import gguf
    from transformers import LlamaConfig

    from specdecode.models.llama import SUPPORTED, Q4Weight

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
    require(arch in SUPPORTED,
            f"{path.name} holds a '{arch}' model; the native runner supports "
            f"{', '.join(SUPPORTED)} GGUF files: use the hf runner (--runner hf)")
    tensors = {}
    unknown = []
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            unknown.append(t.name)
            continue
        qtype = t.tensor_type.name
        expected = [int(x) for x in reversed(t.shape.tolist())]  # GGUF lists dims innermost first
        try:
            if qtype in ("Q4_0", "Q4_1"):
                tensors[name] = Q4Weight(*q4_blocks(np.asarray(t.data), qtype))
            else:
                data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
                tensors[name] = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(expected)
        except (ValueError, NotImplementedError) as exc:
            raise SpecDecodeError(f"cannot read tensor {t.name} ({qtype}) of {path}: {exc}") from None
        size = list((tensors[name].codes if qtype in ("Q4_0", "Q4_1") else tensors[name]).shape)
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
    config = LlamaConfig(
        vocab_size=int(tensors["model.embed_tokens.weight"].shape[0]),
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
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
    )
    for i in range(config.num_hidden_layers):
        for proj, n in (("q", heads), ("k", kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            if name in tensors:
                w = tensors[name]
                tensors[name] = (Q4Weight(*(unpermute_rows(x, n) for x in (w.codes, w.scale, w.minimum)))
                                 if isinstance(w, Q4Weight) else unpermute_rows(w, n))
    return config, tensors
