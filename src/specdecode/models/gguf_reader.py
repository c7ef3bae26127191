"""Reading a GGUF file directly with the ``gguf`` package (llama.cpp's file format).

:class:`GGUFFile` opens a file's header (the ``gguf`` package's reader maps the file; only
the header's pages are read), builds a ``transformers`` config from its metadata (Llama,
Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3, Granite, OLMo 2, SmolLM3, Qwen2-MoE, Qwen3-MoE or
gpt-oss) and reads one tensor at a time, under its Hugging Face parameter name, so the native
runner builds from a GGUF file exactly as from a checkpoint, in the memory of one tensor beyond
what it keeps. A tensor's bytes are read with ``pread`` into a buffer of its own, not through
the map: mapped pages count as the process's resident memory once touched, and would add the
whole file to it. Tensors in a 4-bit block format stay 4-bit (:class:`Q4Weight`: codes 0..15
with a scale and a minimum per 32 weights, the int4 format):

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

IQ3_S and IQ1_S, whose codes are odd (-15..15), are Q4_1 blocks with scale 2 s and minimum
-15 s (models/iq_grid_blocks.py), those two rounded to float16 as Q4_K's products are. The 5, 6
and 8-bit types, Q2_K, Q3_K, the IQ4 types, IQ3_XXS and the IQ2 types (``INT8_BLOCK_TYPES``) are
read as blocks too, which the int4 and int8 runners keep with their own values
(models/int8_blocks.py). Every other type (float16, bfloat16, float32, IQ1_M) is dequantised to
float32 by
``gguf`` itself, exactly as ``transformers`` does; the int4 runner re-quantises those matrices
in the Q4_1 scheme, the other formats take them as they are.

llama.cpp stores Llama's query and key projections with their rows permuted for its interleaved
rotary embedding; the inverse permutation (the one ``transformers`` applies) restores the
Hugging Face layout (Llama, Granite, SmolLM3). It stores Gemma's norm weights as 1 + w; 1 is
subtracted, as ``transformers`` does, so the tensors mean what a Hugging Face checkpoint's do.
Phi-3's fused attn_qkv and ffn_up (gate and up) are read as transformers' qkv_proj and
gate_up_proj. Llama 3.1+ files hold their llama3 rope scaling only as ``rope_freqs.weight``,
a factor per rotary frequency (read under that name: the runner divides the frequencies by
it); Phi-3's ``rope_factors_long/short.weight`` become its config's longrope factors.
gpt-oss's stacked experts and their stacked biases are read one expert at a time, its MXFP4
expert matrices as block int8 (exactly) for the int4 and int8 runners, ``attn_sinks`` as
``self_attn.sinks``. A file whose architecture or tensor types cannot be read is refused from
its header, naming them; a file with tensors the native runner has no place for is refused by
:meth:`GGUFFile.check_native` only, so the hf runner still reads it.
"""

from __future__ import annotations

import functools
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdecode import kernels
from specdecode.cache import file_version
from specdecode.errors import SpecDecodeError, require
from specdecode.models.architectures import GGUF_ARCHITECTURES
from specdecode.models.int8_blocks import decode_gguf_blocks, vnni_own_layouts
from specdecode.models.iq_grid_blocks import ODD_GRID_TYPES, odd_grid_q4
from specdecode.models.quant import Q4Weight

#: llama.cpp's llama3 rope scaling (Llama 3.1-3.3): a factor per rotary frequency, which the
#: frequency is divided by. transformers has no tensor for it (its config holds the scaling's
#: parameters): the runner reads it under this name
ROPE_FACTORS = "rope_freqs.weight"
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": ROPE_FACTORS,
}
#: Phi-3's longrope factors, which its transformers config holds (rope_scaling's long_factor
#: and short_factor): read into the config, not kept as tensors
_LONGROPE_FACTORS = {"rope_factors_long.weight": "long_factor",
                     "rope_factors_short.weight": "short_factor"}
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
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
#: a MoE layer's experts stacked in one tensor [experts, out, in] (llama.cpp's converter
#: merges them): read as each expert's matrix under its Hugging Face name
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERT = re.compile(r"blk\.(\d+)\.experts\.(\d+)\.(\w+)\.(weight|bias)")
#: layer vectors whose Hugging Face name has no ``.weight`` (gpt-oss's attention sinks)
_BARE_NAMES = {"attn_sinks": "self_attn.sinks"}
#: rows of a 4-bit tensor unpacked at a time (:meth:`GGUFFile.read_blocks`)
_READ_ROWS = 512
#: GGUF types kept as 4-bit blocks (IQ3_S and IQ1_S: models/iq_grid_blocks.py's odd grids)
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K", *ODD_GRID_TYPES)
#: GGUF types the int4 and int8 runners keep as block int8, with the file's own values
INT8_BLOCK_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "MXFP4", "Q3_K", "IQ4_NL", "IQ4_XS",
                    "Q2_K", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S")


def _readable_types() -> tuple[str, ...]:
    """GGUF types a tensor may have: float32 and float16, and those the ``gguf`` package
    dequantises (every llama.cpp quantisation: K-quants, I-quants, ...)."""
    import gguf.quants

    return ("F32", "F16", *(t.name for t in gguf.quants._type_traits))


#: transformers config class per architecture
_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
            "gemma2": "Gemma2Config",
            "gemma3_text": "Gemma3TextConfig", "qwen2_moe": "Qwen2MoeConfig",
            "qwen3_moe": "Qwen3MoeConfig",
            "phi3": "Phi3Config", "granite": "GraniteConfig", "olmo2": "Olmo2Config",
            "smollm3": "SmolLM3Config", "gpt_oss": "GptOssConfig"}
#: Granite's multipliers: config attribute -> GGUF key (after ``{arch}.``)
_GRANITE_KEYS = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                 "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}


def gemma2_query_scalar(layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """Gemma 2's query_pre_attn_scalar, which a GGUF file does not hold, by llama.cpp's rule
    (from gemma_pytorch's configs): hidden / heads for the 46-layer 27B (144), the head size
    for the others (256 for 2B and 9B)."""
    return hidden // heads if layers == 46 else head_dim


def hf_name(gguf_name: str, layer_names: dict = _LAYER_NAMES) -> str | None:
    if gguf_name in _NAMES:
        return _NAMES[gguf_name]
    expert = _EXPERT.fullmatch(gguf_name)
    if expert:
        return "model.layers.{}.mlp.experts.{}.{}.{}".format(*expert.groups())
    match = _LAYER.fullmatch(gguf_name)
    if match and match.group(2) in _BARE_NAMES and match.group(3) == "weight":
        return f"model.layers.{match.group(1)}.{_BARE_NAMES[match.group(2)]}"
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
    unpacked = np.concatenate([qs & 15, qs >> 4], 3).reshape(rows, -1)
    return (torch.from_numpy(unpacked), torch.from_numpy(scale.reshape(rows, -1)),
            torch.from_numpy(minimum.reshape(rows, -1)), inexact)


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor lies in a GGUF file."""

    gguf_name: str
    #: GGUF type name (F32, Q4_1, Q4_K, Q6_K, ...)
    qtype: str
    #: [rows, columns] (or [n]), outermost first
    shape: tuple[int, ...]
    #: absolute byte offset and size of its data
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class Q4Blocks:
    """4-bit blocks as the file's bytes hold them, for repacking without unpacking the codes:
    ``nibbles`` uint8 [rows, in / 32, 16], byte k of a group holding its weight k in the low
    nibble and weight k + 16 in the high one (Q4_0's and Q4_1's own layout); ``scale`` and
    ``minimum`` float16 [rows, in / 32]: w = scale * q + minimum."""

    nibbles: np.ndarray
    scale: torch.Tensor
    minimum: torch.Tensor

    def codes(self) -> Q4Weight:
        n = torch.from_numpy(self.nibbles)
        codes = torch.cat([n & 15, n >> 4], -1).reshape(n.shape[0], -1)
        return Q4Weight(codes, self.scale.float(), self.minimum.float())

    def dequantize(self) -> torch.Tensor:
        return self.codes().dequantize()

    def rows(self, index) -> Q4Blocks:
        return Q4Blocks(self.nibbles[index], self.scale[index], self.minimum[index])

    def scaled(self, factor: float) -> Q4Blocks:
        """Scales and minimums times ``factor`` in float32, rounded to float16 (as the int4
        layer rounds a scaled :class:`Q4Weight`'s)."""
        return Q4Blocks(self.nibbles, (self.scale.float() * factor).half(),
                        (self.minimum.float() * factor).half())


def q4_nibbles(raw: np.ndarray, qtype: str) -> Q4Blocks:
    """:class:`Q4Blocks` of Q4_0, Q4_1 or Q4_K data [rows, bytes]: the same weights as
    :func:`q4_blocks` and :func:`q4k_blocks` (Q4_K's scale products rounded to float16 there
    too), the codes left in bytes (moved by the kernels' ``repack.h``); of IQ3_S or IQ1_S data
    (``ODD_GRID_TYPES``): their Q4_1 form, decoded in numpy (``iq_grid_blocks.odd_grid_q4``)."""
    if qtype in ODD_GRID_TYPES:
        nibbles, scale, minimum = odd_grid_q4(raw, qtype)
        return Q4Blocks(nibbles, torch.from_numpy(scale), torch.from_numpy(minimum))
    nibbles, scale, minimum = kernels.load().q4_nibbles(
        torch.from_numpy(np.ascontiguousarray(raw)), qtype)
    return Q4Blocks(nibbles.numpy(), scale, minimum)


#: GGUF metadata value types (gguf's GGUFValueType) -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
#: a string's length, before its bytes
_LENGTH = struct.Struct("<Q")


class _HeaderCursor:
    """GGUF header values read one after another from a buffer (little-endian)."""

    def __init__(self, buffer, pos: int = 0):
        self.buffer = buffer
        self.pos = pos

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buffer[self.pos - n:self.pos]).decode("utf-8")

    def value(self, vtype: int):
        """A metadata value of type ``vtype``; an array of strings is skipped (:class:`_Skipped`
        holds its length)."""
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        require(vtype == _ARRAY, f"unknown metadata type {vtype}")
        item, n = self.take("IQ")
        if item == _STRING:  # skipped: only their count is kept
            length, buffer, pos = _LENGTH.unpack_from, self.buffer, self.pos
            for _ in range(n):  # (a vocabulary: 150,000 of them, so no call but the one)
                pos += 8 + length(buffer, pos)[0]
            self.pos = pos
            return _Skipped(n)
        if item in _SCALARS:
            out = list(struct.unpack_from(f"<{n}{_SCALARS[item]}", self.buffer, self.pos))
            self.pos += n * struct.calcsize(_SCALARS[item])
            return out
        return [self.value(item) for _ in range(n)]


def read_header(path: Path) -> tuple[dict, list[TensorEntry]]:
    """(metadata, tensor table) of a GGUF file (version 2 or 3, little-endian), parsed from its
    first bytes: ``gguf.GGUFReader`` makes a numpy view per vocabulary entry, seconds for a
    large vocabulary, where this skips them. Arrays of strings are left out of the metadata
    (their length is kept, under the key + ".count"). Parsed once per process and version of
    the file (loading a model reads its header three times)."""
    fields, tensors = _parsed_header(*file_version(Path(path)))
    return dict(fields), list(tensors)


@functools.lru_cache(maxsize=8)
def _parsed_header(path: Path, size: int, mtime_ns: int) -> tuple[dict, list[TensorEntry]]:
    """:func:`read_header`'s parse of the file at ``path`` of that size and time."""
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        require(m[:4] == b"GGUF", "no GGUF magic number")
        cursor = _HeaderCursor(m, 4)
        version, n_tensors, n_fields = cursor.take("IQQ")
        require(version in (2, 3), f"GGUF version {version} (big-endian or unknown)")
        fields = {}
        for _ in range(n_fields):
            key = cursor.string()
            v = cursor.value(cursor.take("I"))
            if isinstance(v, _Skipped):
                fields[key + ".count"] = v.n
            else:
                fields[key] = v
        infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = cursor.take(f"{cursor.take('I')}Q")
            dims = (dims,) if isinstance(dims, int) else dims
            infos.append((name, tuple(reversed(dims)), cursor.take("I"), cursor.take("Q")))
        align = int(fields.get("general.alignment", 32))
        start = -(-cursor.pos // align) * align
    tensors = []
    for name, shape, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        tensors.append(TensorEntry(name, qtype.name, shape, start + offset,
                                   int(np.prod(shape)) // block * size))
    return fields, tensors


def _dequantized(raw: np.ndarray, e: TensorEntry) -> torch.Tensor:
    """float32 values of ``raw`` (rows of tensor ``e``), dequantised by ``gguf`` as
    ``transformers`` does, ``_READ_ROWS`` rows at a time into the result (``gguf``'s numpy
    dequantisers make several temporaries the size of their input)."""
    import gguf

    kind = gguf.GGMLQuantizationType[e.qtype]
    if len(e.shape) == 1:
        return torch.from_numpy(np.array(gguf.quants.dequantize(raw, kind), np.float32).reshape(e.shape))
    out = np.empty((len(raw), *e.shape[1:]), np.float32)
    for start in range(0, len(raw), _READ_ROWS):
        out[start:start + _READ_ROWS] = gguf.quants.dequantize(raw[start:start + _READ_ROWS], kind)
    return torch.from_numpy(out)


def reads_as_int8_blocks(qtype: str) -> bool:
    """Whether the int4 and int8 runners read a tensor of ``qtype`` as :class:`Int8BlockWeight`
    (the block int8 types, and Q4_K where this CPU holds it in its own layout:
    ``int8_blocks.vnni_own_layouts``)."""
    return qtype in INT8_BLOCK_TYPES or qtype == "Q4_K" and vnni_own_layouts()


def dequantized_rows(raw: np.ndarray, e: TensorEntry, blocks: bool) -> torch.Tensor:
    """float32 rows of matrix ``e`` from their bytes ``raw`` [rows, bytes a row], the values
    ``weights.as_float`` gives of the tensor the runner reads: with ``blocks`` (the int4 and
    int8 runners' :meth:`GGUFFile.read_blocks`) 4-bit types through :class:`Q4Blocks` (Q4_K's
    scale products rounded to float16, as int4 holds them) and the block int8 types (and Q4_K
    where it keeps its own layout) through :class:`Int8BlockWeight` (exactly), else as
    :meth:`GGUFFile.read` with ``blocks=False`` (``gguf``'s dequantisation). The same
    functions on fewer rows: every block decodes on its own, so a row has the same bits
    whichever rows are read with it. Not for llama.cpp's permuted q/k rows or Gemma's 1 + w
    norms (the token embedding is neither)."""
    try:
        if blocks and reads_as_int8_blocks(e.qtype):
            return decode_gguf_blocks(raw, e.qtype).dequantize()
        if blocks and e.qtype in Q4_TYPES:
            return q4_nibbles(raw, e.qtype).dequantize()
        return _dequantized(raw, e)
    except (ValueError, NotImplementedError, KeyError) as exc:
        raise SpecDecodeError(f"cannot read tensor {e.gguf_name} ({e.qtype}): {exc}") from None


def _experts(entry: TensorEntry) -> list[TensorEntry]:
    """``entry``, or the experts of a stacked expert tensor [experts, out, in] (gpt-oss's
    biases: [experts, out]) each as a tensor of its own (named ``blk.N.experts.J.<its Hugging
    Face name>``)."""
    match = _LAYER.fullmatch(entry.gguf_name)
    stacked_dims = 3 if match and match.group(3) == "weight" else 2
    if not match or match.group(2) not in _EXPERT_NAMES or len(entry.shape) != stacked_dims:
        return [entry]
    count, size = entry.shape[0], entry.nbytes // entry.shape[0]
    name = f"blk.{match.group(1)}.experts.{{}}.{_EXPERT_NAMES[match.group(2)]}.{match.group(3)}"
    return [TensorEntry(name.format(j), entry.qtype, entry.shape[1:], entry.offset + j * size, size)
            for j in range(count)]


class _Skipped:
    def __init__(self, n: int):
        self.n = n


class GGUFFile:
    """A GGUF file's config and tensor table; tensors read one at a time (:meth:`read`).

    ``config``: the ``transformers`` config its metadata describes; ``entries``: Hugging Face
    parameter name -> :class:`TensorEntry`; ``fields``: the metadata (key -> value) other than
    arrays of strings (the tokenizer's vocabulary and merges); ``unknown``: the GGUF names of
    tensors the native runner has no place for (:meth:`check_native` refuses them; the hf
    runner reads such a file through ``transformers``)."""

    def __init__(self, path):
        path = Path(path)
        require(path.is_file(), f"GGUF file {path} does not exist")
        self.path = path
        try:
            self.fields, tensors = read_header(path)
        except (ValueError, IndexError, KeyError, OSError, struct.error, UnicodeDecodeError) as exc:
            raise SpecDecodeError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                                  f"{exc}") from None
        arch = self.fields.get("general.architecture", "?")
        spec = GGUF_ARCHITECTURES.get(arch)
        require(spec is not None,
                f"{path.name} holds a '{arch}' model; the native runner supports "
                f"{', '.join(GGUF_ARCHITECTURES)} GGUF files: use the hf runner (--runner hf)")
        self.spec = spec
        layer_names = {**_LAYER_NAMES, **spec.gguf_layer_names}
        size = path.stat().st_size
        self.entries: dict[str, TensorEntry] = {}
        self.unknown: list[str] = []
        longrope: dict[str, TensorEntry] = {}
        readable = _readable_types()
        for entry in (part for whole in tensors for part in _experts(whole)):
            require(entry.offset + entry.nbytes <= size,
                    f"{path}: tensor {entry.gguf_name} ends at byte {entry.offset + entry.nbytes} "
                    f"but the file has {size}: the file is truncated or corrupt")
            require(entry.qtype in readable,
                    f"{path.name}: tensor {entry.gguf_name} is of GGUF type {entry.qtype}, which "
                    f"cannot be read; the readable types are {', '.join(readable)}")
            name = hf_name(entry.gguf_name, layer_names)
            if entry.gguf_name in _LONGROPE_FACTORS:
                longrope[_LONGROPE_FACTORS[entry.gguf_name]] = entry
            elif name is None:
                self.unknown.append(entry.gguf_name)
            else:
                self.entries[name] = entry
        require("model.embed_tokens.weight" in self.entries,
                f"{path.name} has no token_embd.weight: not a complete model file")
        self.config = self._config(arch, {key: self._vector(e) for key, e in longrope.items()})

    def check_native(self) -> None:
        """Refuse a file with tensors the native runner has no place for, naming them."""
        require(not self.unknown, f"{self.path.name} has tensors the native runner does not "
                f"know ({', '.join(self.unknown[:4])}); use the hf runner (--runner hf)")

    def _vector(self, e: TensorEntry) -> list[float]:
        """The values of a small one-dimensional tensor."""
        raw = np.fromfile(self.path, np.uint8, e.nbytes, offset=e.offset)
        require(raw.size == e.nbytes, f"{self.path}: tensor {e.gguf_name} is cut short: the "
                                      "file is truncated or corrupt")
        return _dequantized(raw, e).tolist()

    def field(self, key, default=None):
        value = self.fields.get(key)
        return default if value is None else value

    def _config(self, arch: str, longrope: dict[str, list[float]]):
        """The transformers config; ``longrope``: Phi-3's long and short rope factors."""
        import transformers

        field = self.field
        heads = int(field(f"{arch}.attention.head_count"))
        kv_heads = int(field(f"{arch}.attention.head_count_kv", heads))
        hidden = int(field(f"{arch}.embedding_length"))
        rope = self._rope_scaling(arch)
        # the same fields transformers' GGUF loader reads (integrations/ggml.py); the rest are
        # the config class's defaults, as there (Gemma 3: query_pre_attn_scalar 256, local rope
        # base 10000, every sixth layer global)
        window = field(f"{arch}.attention.sliding_window")
        extra = {} if window is None else {"sliding_window": int(window)}
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's
            if field(f"{arch}.{cap}") is not None:
                extra[cap] = float(field(f"{arch}.{cap}"))
        if self.spec.model_type == "gemma2":
            extra["query_pre_attn_scalar"] = gemma2_query_scalar(
                int(field(f"{arch}.block_count")), hidden, heads,
                int(field(f"{arch}.attention.key_length", hidden // heads)))
        if longrope:
            # Phi-3's config holds exactly these three (Phi3Config validates it); the attention
            # factor follows from the two context lengths, as llama.cpp's converter computed it
            rope = {"type": "longrope", **longrope}
            extra["original_max_position_embeddings"] = int(
                field(f"{arch}.rope.scaling.original_context_length"))
        rotary = field(f"{arch}.rope.dimension_count")
        head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
        if self.spec.model_type == "phi3" and rotary is not None:
            extra["partial_rotary_factor"] = int(rotary) / head_dim
        if self.spec.model_type == "granite":
            extra.update({attr: float(field(f"{arch}.{key}")) for attr, key in _GRANITE_KEYS.items()
                          if field(f"{arch}.{key}") is not None})
        if self.spec.experts_attr:
            extra.update({self.spec.experts_attr: int(field(f"{arch}.expert_count", 0)),
                          "num_experts_per_tok": int(field(f"{arch}.expert_used_count", 0)),
                          "moe_intermediate_size": int(field(f"{arch}.expert_feed_forward_length", 0)),
                          "shared_expert_intermediate_size":
                              int(field(f"{arch}.expert_shared_feed_forward_length", 0)),
                          "norm_topk_prob": bool(field(f"{arch}.expert_weights_norm",
                                                       self.spec.gguf_normalize))})
        return getattr(transformers, _CONFIGS[self.spec.model_type])(
            **extra,
            vocab_size=self.entries["model.embed_tokens.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(field(f"{arch}.feed_forward_length")),
            num_hidden_layers=int(field(f"{arch}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope or None,
            max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
            tie_word_embeddings="lm_head.weight" not in self.entries,
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_id=field("tokenizer.ggml.eos_token_id"),
        )

    def _rope_scaling(self, arch: str) -> dict:
        """The config's rope_scaling from the file's ``rope.scaling`` keys ({}: none)."""
        key = f"{arch}.rope.scaling."
        scaling = self.field(key + "type", "none")
        if scaling in ("none", None):
            return {}
        rope = {"rope_type": scaling, "factor": float(self.field(key + "factor", 1.0))}
        if scaling == "yarn":  # (gpt-oss) its original context and betas, where written
            names = {"original_max_position_embeddings": "original_context_length",
                     "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}
            rope.update({name: self.field(key + written) for name, written in names.items()
                         if self.field(key + written) is not None})
            if self.spec.model_type == "gpt_oss":
                # gpt-oss's own configs leave YaRN's correction range unrounded, which the file
                # does not record (transformers' default rounds it, as llama.cpp does)
                rope["truncate"] = False
        return rope

    def raw(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """The file's bytes of tensor ``name`` (rows ``rows`` of a matrix), uint8 [rows, bytes
        per row], read into a buffer of their own."""
        e = self.entries[name]
        n = e.shape[0] if len(e.shape) > 1 else 1
        per_row = e.nbytes // n
        start, stop, _ = rows.indices(n)
        count = (stop - start) * per_row
        data = np.fromfile(self.path, np.uint8, count, offset=e.offset + start * per_row)
        require(data.size == count, f"{self.path}: tensor {e.gguf_name} is cut short: the file "
                                    "is truncated or corrupt")
        return data.reshape(stop - start, per_row)

    def read(self, name: str, blocks: bool = True, rows: slice = slice(None)):
        """Tensor ``name``: a :class:`Q4Weight` for 4-bit block types when ``blocks``, else
        float32 (dequantised by ``gguf`` as ``transformers`` does); llama.cpp's q/k row
        permutation undone and Gemma's 1 + w norms made w. ``rows``: a slice of a matrix's rows
        (not of permuted q/k)."""
        import gguf

        e = self.entries[name]
        heads = self._permuted_heads(name)
        require(not heads or rows == slice(None), f"{name}: rows of a permuted q/k projection")
        raw = self.raw(name, rows)
        try:
            if blocks and e.qtype == "Q4_K":
                value = Q4Weight(*q4k_blocks(raw)[:3])
            elif blocks and e.qtype in ODD_GRID_TYPES:
                value = q4_nibbles(raw, e.qtype).codes()
            elif blocks and e.qtype in Q4_TYPES:
                value = Q4Weight(*q4_blocks(raw, e.qtype))
            else:
                value = _dequantized(raw, e)
                if self.spec.gguf_norm_plus_one and name.endswith("norm.weight"):
                    value -= 1
        except (ValueError, NotImplementedError, KeyError) as exc:
            raise SpecDecodeError(f"cannot read tensor {e.gguf_name} ({e.qtype}) of {self.path}: "
                                  f"{exc}") from None
        if heads:
            value = (Q4Weight(*(unpermute_rows(x, heads) for x in (value.codes, value.scale, value.minimum)))
                     if isinstance(value, Q4Weight) else unpermute_rows(value, heads))
        return value

    def read_blocks(self, name: str):
        """Tensor ``name`` for the int4 and int8 runners: :class:`Q4Blocks` for 4-bit block
        types (their bytes as they are), :class:`Int8BlockWeight` for the other block types
        (``INT8_BLOCK_TYPES``: their own values, exactly) and for Q4_K where this CPU holds it in
        its own layout (``reads_as_int8_blocks``), else float32 as :meth:`read` gives it; q/k
        rows unpermuted."""
        e = self.entries[name]
        if reads_as_int8_blocks(e.qtype):
            weight = decode_gguf_blocks(self.raw(name), e.qtype)
            heads = self._permuted_heads(name)
            if heads:
                order = unpermute_rows(torch.arange(e.shape[0]), heads)
                weight = weight.take(order)
            return weight
        if e.qtype not in Q4_TYPES:
            return self.read(name, blocks=False)
        # in chunks of rows into the result's arrays: the temporaries of unpacking stay small
        # (and are reused), not several copies of the tensor each faulted in afresh
        rows, groups = e.shape[0], e.shape[1] // 32
        nibbles = np.empty((rows, groups, 16), np.uint8)
        scale, minimum = (np.empty((rows, groups), np.float16) for _ in range(2))
        for start in range(0, rows, _READ_ROWS):
            part = q4_nibbles(self.raw(name, slice(start, start + _READ_ROWS)), e.qtype)
            stop = start + part.scale.shape[0]
            nibbles[start:stop] = part.nibbles
            scale[start:stop] = part.scale.numpy()
            minimum[start:stop] = part.minimum.numpy()
        blocks = Q4Blocks(nibbles, torch.from_numpy(scale), torch.from_numpy(minimum))
        heads = self._permuted_heads(name)
        if heads:
            order = unpermute_rows(torch.arange(e.shape[0]), heads)
            blocks = blocks.rows(order.numpy())
        return blocks

    def _permuted_heads(self, name: str) -> int:
        """Heads of a q/k projection whose rows llama.cpp permuted (0: not permuted)."""
        if not self.spec.gguf_permuted_qk or not name.endswith("_proj.weight"):
            return 0
        c = self.config
        return {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(
            name.split(".")[-2], 0)


def read_gguf(path, blocks_only: bool = False):
    """(transformers config, {Hugging Face name: float32 tensor or Q4Weight}) of a GGUF file of
    a supported architecture, every tensor in memory (small files and tests; the native runner
    reads one tensor at a time through :class:`GGUFFile`); ``blocks_only``: only the tensors
    kept as 4-bit blocks."""
    f = GGUFFile(path)
    f.check_native()
    return f.config, {name: f.read(name) for name, e in f.entries.items()
                      if not blocks_only or e.qtype in Q4_TYPES}
