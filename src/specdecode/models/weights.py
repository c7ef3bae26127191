"""Weights for the native runner: tensors from files, repacked for the kernels one at a time.

The runner (``models/llama.py``) builds its layers from a mapping of Hugging Face parameter
names to tensors and never knows a file format. For a GGUF file that mapping is
:class:`FileTensors`: each lookup reads one tensor from the file (``GGUFFile.read``: a ``pread``
into a buffer of its own, not the map, so the file's pages never count as the process's
memory), and the runner repacks it into its layer and drops it. Nothing holds a float copy of
the model: resident memory is the packed weights, the KV cache and one tensor in flight; the
token embedding stays in the file, its rows read when looked up (``models/embedding.py``).

:func:`_linear_for` makes one layer of the matrices that share an input (q/k/v, gate/up),
keeping the file's own values wherever a kernel can: GGUF's Q4_0, Q4_1 and Q4_K blocks stay
4-bit blocks for int4 (``gguf_reader``); the other block types (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K)
run as block int8 (``models/int8_blocks``) with their own scales. Where the best kernels are
AVX-512 VNNI without AMX, Q4_K and Q5_K matrices run in their own layouts
(``int8_blocks.Q4KWeight``, ``Q5KWeight``: 0.58 and 0.70 bytes a weight, the file's numbers
exactly, scales and minimums folded in integers). A
group of several (a Q4_K_M file's q/k/v with v in Q6_K) is a ``SplitLinear``: its 4-bit parts
int4 (or in Q4_K's layout), its block parts block int8, one after another. A Q6_K, Q5_K, Q4_K,
Q3_K or Q2_K q carries the query scale as its own input scale (``Int8BlockWeight.scaled``),
fused with a k of its kind, which the kernel applies to q's columns alone. Float
matrices are quantised (int4: Q4_1's scheme, int8: Q8_0's), a few thousand rows at a time. The
int8 format takes 4-bit blocks as block int8 too, exactly.

:func:`resident_bytes` says what the runner will hold of a file in a weight format, before
anything is read, so that a file which cannot fit is refused naming the sizes
(:func:`check_fits`).
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from specdecode import kernels
from specdecode.errors import SpecDecodeError
from specdecode.models.gguf_reader import (INT8_BLOCK_TYPES, Q4_TYPES, GGUFFile, Q4Blocks,
                                           reads_as_int8_blocks)
from specdecode.models.int8_blocks import (OWN_LAYOUT_BYTES, IQ4XSWeight, Int8BlockLinear,
                                           Int8BlockWeight, Q4KWeight, fuses_scaled,
                                           held_bytes_per_weight, quantize_int8_blocks,
                                           vnni_own_layouts)
from specdecode.models.quant import (Int4Linear, Q4Weight, SplitLinear, check_format, make_linear,
                                     quantize_int4)

#: memory kept free beyond the weights and the KV cache (Python, torch, the tokenizer, one
#: tensor in flight)
MARGIN_BYTES = 512 * 2 ** 20
#: rows re-quantised or dequantised at a time: float32 temporaries of a few MB, which the
#: allocator reuses (past 32 MB each would be mapped, faulted in and unmapped every time)
_CHUNK_ROWS = 512
#: bytes per weight the runner holds, per format: int4's 16 four-bit codes with float16 scale
#: and minimum per 32 weights; int8's code with a float16 scale per 32 (Q8_0's scheme); bf16
#: and fp32 keep their decode layer plus the prefill layer ATen's GEMM reads
#: (llama.PREFILL_WEIGHTS)
BYTES_PER_WEIGHT = {"int4": 0.625, "int8": 1.0625, "bf16": 2 + 2, "fp32": 4 + 4}
#: at most what block int8 holds of a file's block types (a code, a float32 scale and minimum
#: per 16 weights: a fused layer of Q6_K or Q3_K beside a type with minimums); a matrix of one
#: type alone holds its layout's bytes (``int8_blocks.HELD_BYTES``)
BLOCK_INT8_BYTES = 1.5
#: the parts of fused layers: q/k/v (named group ``qkv``) and gate/up
_FUSED_PARTS = re.compile(r"\.(?:(?P<qkv>[qkv]_proj)|gate_proj|up_proj)\.weight$")
#: where a checkpoint's LM head lies (its own, or the embedding table it is tied to)
HEAD_NAMES = frozenset({"lm_head.weight", "model.embed_tokens.weight"})


class FileTensors(Mapping):
    """A GGUF file's tensors under Hugging Face names, read from the file at each lookup.
    ``blocks``: 4-bit block types come as :class:`Q4Blocks` (their bytes, for int4), else
    every tensor is dequantised to float32 as ``transformers`` dequantises it."""

    def __init__(self, file: GGUFFile, blocks: bool, requantise: bool = False):
        """``requantise``: the layers' tensors are read as blocks and dequantised here
        (:func:`as_float`: three times faster than the file reader's dequantisation, within
        float rounding of its numbers; for a draft, whose numbers never change the output),
        for a runner to quantise them again; the LM head (``HEAD_NAMES``) is then read as
        blocks, for the runner to dequantise only the rows it keeps (Qwen2.5's Q8_0 head of
        151,936 rows is 0.55 GB as float32)."""
        self.file = file
        self.blocks = blocks
        self.requantise = requantise

    def __getitem__(self, name: str):
        if name not in self.file.entries:
            raise KeyError(name)
        if self.blocks or self.requantise and name in HEAD_NAMES:
            return self.file.read_blocks(name)
        if self.requantise:
            return as_float(self.file.read_blocks(name))
        return self.file.read(name, blocks=False)

    def __contains__(self, name) -> bool:  # (Mapping's would read the tensor)
        return name in self.file.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.file.entries)

    def __len__(self) -> int:
        return len(self.file.entries)


def as_float(value) -> torch.Tensor:
    """A float32 tensor, or a 4-bit GGUF tensor dequantised (file blocks ``_CHUNK_ROWS`` rows
    at a time: a tied LM head of float weights is the model's largest matrix)."""
    if isinstance(value, Int8BlockWeight):
        return value.dequantize()
    if isinstance(value, Q4Blocks):
        rows = value.scale.shape[0]
        out = torch.empty(rows, value.scale.shape[1] * 32)
        for start in range(0, rows, _CHUNK_ROWS):
            out[start:start + _CHUNK_ROWS] = value.rows(slice(start, start + _CHUNK_ROWS)).dequantize()
        return out
    return (value.dequantize() if isinstance(value, Q4Weight) else value).float()


def as_q4(value) -> Q4Weight:
    """4-bit blocks of a weight: a Q4Weight as it is, a float matrix re-quantised in Q4_1's
    scheme (``quant.quantize_int4``) ``_CHUNK_ROWS`` rows at a time, codes as uint8."""
    if isinstance(value, Q4Weight):
        return value
    if isinstance(value, Q4Blocks):
        return value.codes()
    parts = []
    for rows in value.split(_CHUNK_ROWS):
        codes, scale, minimum = quantize_int4(rows)
        parts.append(Q4Weight(codes.to(torch.uint8), scale, minimum))
    return parts[0] if len(parts) == 1 else Q4Weight.cat(parts)


def as_int8_blocks(value) -> Int8BlockWeight:
    """Block int8 of a weight: a file's block int8 as it is, 4-bit blocks widened exactly (their
    codes, float16 scales and minimums), a float matrix quantised in Q8_0's scheme."""
    if isinstance(value, Int8BlockWeight):
        return value
    if isinstance(value, (Q4Blocks, Q4Weight)):
        q4 = value.codes() if isinstance(value, Q4Blocks) else value
        return Int8BlockWeight(q4.codes.to(torch.int8), q4.scale.float(), q4.minimum.float(), 32)
    return Int8BlockWeight.cat([quantize_int8_blocks(rows) for rows in value.float().split(_CHUNK_ROWS)])


def pack_blocks(blocks: Q4Blocks, out: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.pack_q4``'s layout of a file's 4-bit blocks, moved byte for byte (the kernels'
    ``repack.h``): the kernel pairs input 4j + i with input 16 + 4j + i in one byte, as Q4_0 and
    Q4_1 do, so packing is a transpose of tiles of 16 rows (no code is unpacked). Rows padded
    with zeros to whole tiles, scales and minimums as float16, as ``pack_q4`` does: the same
    bytes. ``out``: where to write them (uint8 [tiles, groups, 320], e.g. a fused layer's
    slice)."""
    rows, groups = blocks.scale.shape
    tiles = -(-rows // kernels.TILE)
    out = torch.empty(tiles, groups, 320, dtype=torch.uint8) if out is None else out
    kernels.load().pack_q4_blocks(torch.from_numpy(np.ascontiguousarray(blocks.nibbles)),
                                  blocks.scale.contiguous(), blocks.minimum.contiguous(), out)
    return out


def _pack_into(part, out: torch.Tensor) -> None:
    if isinstance(part, Q4Blocks):
        pack_blocks(part, out)
    else:
        q4 = as_q4(part)
        out.copy_(kernels.pack_q4(q4.codes, q4.scale, q4.minimum))


def _linear_for(parts: Sequence, weights: str):
    """One layer for matrices sharing an input (each float32, Q4Weight, Q4Blocks or a file's
    block int8), in ``weights``. int4: each part packed on its own and the tiles concatenated
    (the bytes of packing the concatenation, as every part but the last fills whole tiles of 16
    rows); 4-bit parts beside block int8 ones (a Q4_K_M file's Q4_K q/k and Q6_K v), or block
    parts of kinds that keep their own layouts beside others, a ``SplitLinear`` of each run's
    layer, where fused they would all be block int8."""
    check_format(weights)
    blocks = [isinstance(p, Int8BlockWeight) for p in parts]
    runs = _runs(parts)
    if weights == "int4" and any(blocks) and len(runs) > 1:
        return SplitLinear([_linear_for(run, weights) for run in runs])
    if weights == "int8" or (weights == "int4" and any(blocks)):
        return Int8BlockLinear(Int8BlockWeight.cat([as_int8_blocks(p) for p in parts]))
    if weights == "int4":
        rows = [p.scale.shape[0] if isinstance(p, (Q4Weight, Q4Blocks)) else p.shape[0] for p in parts]
        if any(n % kernels.TILE for n in rows[:-1]):
            q4 = Q4Weight.cat([as_q4(p) for p in parts])
            return Int4Linear(q4.codes, q4.scale, q4.minimum)
        first = parts[0]
        groups = (first.scale.shape[1] if isinstance(first, (Q4Weight, Q4Blocks))
                  else first.shape[1] // 32)
        tiles = [-(-n // kernels.TILE) for n in rows]
        packed = torch.empty(sum(tiles), groups, 320, dtype=torch.uint8)
        start = 0
        for part, n in zip(parts, tiles):  # each part into its own tiles: no concatenated copy
            _pack_into(part, packed[start:start + n])
            start += n
        return Int4Linear.from_packed(packed, sum(rows))
    return make_linear(torch.cat([as_float(p) for p in parts]), weights)


def _run_key(p) -> tuple[bool, type | None, float]:
    """What a part shares with the parts it runs with in one layer: block int8 or not, Q4_K's,
    Q5_K's and (where its layout is held) IQ4_XS's own kinds (beside another type they would be
    block int8) and the input scale (a query scale stands apart: ``Int8BlockWeight.scaled``)."""
    own = (type(p) if isinstance(p, Q4KWeight)
           or isinstance(p, IQ4XSWeight) and vnni_own_layouts() else None)
    return isinstance(p, Int8BlockWeight), own, getattr(p, "input_scale", 1.0)


def _takes_scaled_q(run: list, p) -> bool:
    """Whether ``p``, an unscaled k, joins ``run``, a scaled q alone of its kind, as
    ``Int8BlockWeight.cat`` fuses them (``int8_blocks.fuses_scaled``)."""
    return len(run) == 1 and fuses_scaled(run[0], p)


def _runs(parts: Sequence) -> list[list]:
    """``parts`` in runs of consecutive parts of one ``_run_key``, a scaled q taking its k."""
    runs, keys = [], []
    for p in parts:
        key = _run_key(p)
        if runs and (keys[-1] == key or _takes_scaled_q(runs[-1], p)):
            runs[-1].append(p)
            keys[-1] = key
        else:
            runs.append([p])
            keys.append(key)
    return runs


def _fused_group(name: str) -> str:
    """The layer a matrix is fused into: ``...qkv`` for q/k/v, ``...gate_up`` for gate/up,
    else its own name."""
    return _FUSED_PARTS.sub(lambda m: ".qkv" if m.group("qkv") else ".gate_up", name)


def resident_bytes(file: GGUFFile, weights: str) -> int:
    """Bytes the native runner holds of ``file``'s weights in format ``weights``: its layers
    (``BYTES_PER_WEIGHT``; for the block types int4 and int8 keep as block int8, their layout's
    bytes where a fused layer's block parts are of one type, else at most ``BLOCK_INT8_BYTES``)
    and norms; the token embedding is read from the file by row (``models/embedding.py``):
    nothing of it is held, unless it is the (tied) LM head too."""
    check_format(weights)
    types: dict[str, set[str]] = {}
    for name, entry in file.entries.items():
        types.setdefault(_fused_group(name), set()).add(entry.qtype)

    own_layouts = vnni_own_layouts()

    def layer(name: str, entry) -> int:
        kept_as_blocks = (weights in ("int4", "int8") and reads_as_int8_blocks(entry.qtype)
                          or entry.qtype in Q4_TYPES and weights == "int8")
        if not kept_as_blocks:
            return int(entry.numel * BYTES_PER_WEIGHT[weights])
        fused = types[_fused_group(name)]
        if weights == "int4":  # its int4, float and own-layout parts stand apart (_linear_for)
            if own_layouts and entry.qtype in OWN_LAYOUT_BYTES:
                return int(entry.numel * held_bytes_per_weight(entry.qtype))
            fused = fused & set(INT8_BLOCK_TYPES) - set(OWN_LAYOUT_BYTES if own_layouts else ())
        alone = len(fused) == 1
        return int(entry.numel * (held_bytes_per_weight(entry.qtype) if alone else BLOCK_INT8_BYTES))

    total = 0
    for name, entry in file.entries.items():
        if name == "model.embed_tokens.weight":
            if "lm_head.weight" not in file.entries:
                total += layer(name, entry)
        elif len(entry.shape) == 1:
            total += entry.numel * 4
        elif name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
            # a MoE router or Qwen2-MoE's shared-expert gate: float32, in whole tiles of rows
            total += -(-entry.shape[0] // kernels.TILE) * kernels.TILE * entry.shape[1] * 4
        else:
            total += layer(name, entry)
    return total


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Give the heap's free pages back to the kernel (glibc's ``malloc_trim``; nothing under
    another C library). Repacking a layer frees temporaries of 1-32 MB, which glibc serves from
    its heap (they fall below its self-raising mmap threshold) between the layers that stay;
    it returns such holes only when asked, and by the last layer of Qwen2.5-Coder-1.5B about
    100 MB of them were resident, the load's peak."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def available_memory() -> int:
    """Bytes the kernel says a new allocation can take without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def check_fits(what: str, parts: dict[str, int], available: int | None = None,
               hint: str = "") -> None:
    """Refuse (naming every size) when ``parts`` (label -> bytes) plus ``MARGIN_BYTES`` exceed
    the available memory (``available``: default :func:`available_memory`)."""
    available = available_memory() if available is None else available
    need = sum(parts.values()) + MARGIN_BYTES
    if need > available:
        items = ", ".join(f"{label} {gb(size)}" for label, size in parts.items())
        raise SpecDecodeError(
            f"{what} needs about {gb(need)} ({items}, margin {gb(MARGIN_BYTES)}) but only "
            f"{gb(available)} of memory is available{'; ' + hint if hint else ''}")


