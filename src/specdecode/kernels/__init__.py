"""Compiled CPU kernels of the native runner: build, load, and pick the instruction set.

``cpu_kernels.cpp`` (with ``generic.h``, ``q4_avx2.h``, ``q8_blocks.h``, ``small_codes.h`` and
``amx.h``) holds every operation of a decode or verify forward that adds numbers up: the
linear layers of each weight format (fp32, bf16, block int8 and the 4-bit GGUF Q4_1 scheme
times int8 activations with AVX-512 VNNI, AVX2, or AMX tiles for several int4 rows), RMSNorm,
SwiGLU, rotary embedding with the cache write, tree attention (optionally over a sliding
window, optionally with its scores soft-capped), GeGLU and logit soft-capping. Each
output element is computed by one thread in an order of additions fixed by the model's sizes
alone, so a row's result never depends on the rows beside it, on any x86-64 CPU; the
instruction set only changes the speed (the variants give the same bits). ``repack.h`` decodes a
GGUF file's blocks and moves them into those layouts when a model loads (``pack_q6k``,
``pack_five_bit``, ``pack_codebook``, ``pack_q3k``, ``pack_q2k``, ``pack_q4k``, ``pack_q5k``,
``pack_iq4xs``, ``weights.pack_blocks``, ``int8_blocks.decode_gguf_blocks``).

The extension is compiled once by ``scripts/setup.sh`` (``python -m specdecode.kernels``), or
on first use, with torch's ``cpp_extension`` and the machine's g++, into
``~/.cache/specdecode/kernels/<hash of the sources (paths and contents) and torch version>``.

``SPECDECODE_KERNEL_ISA`` (amx | avx512 | avx2 | generic) caps the instruction set, as
``ATEN_CPU_CAPABILITY`` does for ATen: a diagnostic for testing other CPUs' code paths on this
one, never needed in use.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError, require

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "cpu_kernels.cpp", _HERE / "generic.h", _HERE / "q4_avx2.h",
            _HERE / "q8_blocks.h", _HERE / "small_codes.h", _HERE / "amx.h", _HERE / "attention.h",
            _HERE / "repack.h")
#: instruction-set levels, lowest first (the extension's isa_level() numbering); ``amx`` is
#: avx512 with the int4 linears of several rows on AMX tiles (Sapphire Rapids and later, where
#: the OS grants the tile state)
ISA_LEVELS = ("generic", "avx2", "avx512", "amx")
# -fopenmp: at::parallel_for is a template compiled into this extension, and runs its loop on
# one thread unless _OPENMP is defined here; the extension then uses the libgomp that torch
# has already loaded (the same soname), so torch.set_num_threads governs both
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c++17", "-fopenmp"]
#: output columns per packed tile
TILE = 16


def build_dir(sources=_SOURCES) -> Path:
    digest = hashlib.sha256()
    for source in sources:
        # the path too: the build files name the sources by absolute path, so two checkouts
        # sharing one folder would rebuild it in turn (and wait on each other's build lock)
        digest.update(str(source.resolve()).encode() + b"\0" + source.read_bytes())
    digest.update(" ".join(_FLAGS + [torch.__version__, sys.version]).encode())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "specdecode" / "kernels" / digest.hexdigest()[:16]


@functools.cache
def build_id() -> str:
    """The runner's kernels build (its folder's name, a hash of the sources) as this process
    loads it: what measurements on these kernels are keyed by. Taken once, with the build."""
    return build_dir().name


@functools.cache
def load():
    """The compiled extension, built on first use; a SpecDecodeError naming the fix where the
    machine cannot build it."""
    build_id()
    return compile_extension("specdecode_cpu_kernels", _SOURCES)


def compile_extension(name: str, sources, extra_flags=()):
    """Build (once per source hash) and import the extension ``name`` whose first source is the
    C++ file and the rest its headers; a SpecDecodeError naming the fix where it cannot."""
    from torch.utils.cpp_extension import load as load_extension

    if not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "AMD64"):
        raise SpecDecodeError(
            "the native runner's kernels are written for x86-64 Linux; use --runner hf here")
    folder = build_dir(sources)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return load_extension(name=name, sources=[str(sources[0])],
                              extra_cflags=_FLAGS + list(extra_flags), extra_ldflags=["-fopenmp"],
                              build_directory=str(folder), verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "?")
        raise SpecDecodeError(
            f"could not build the native runner's CPU kernels ({reason}): install g++ "
            "and the Python headers (python3-dev) and run `python -m specdecode.kernels`, or "
            "use --runner hf") from None


@functools.cache
def isa() -> int:
    """The instruction-set level the kernels run: the CPU's best, capped by
    ``SPECDECODE_KERNEL_ISA``."""
    best = load().isa_level()
    cap = os.environ.get("SPECDECODE_KERNEL_ISA", ISA_LEVELS[-1])
    if cap not in ISA_LEVELS:
        raise SpecDecodeError(f"SPECDECODE_KERNEL_ISA={cap!r}; known: {', '.join(ISA_LEVELS)}")
    return min(best, ISA_LEVELS.index(cap))


def available() -> bool:
    try:
        load()
    except SpecDecodeError:
        return False
    return True


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, ...] with N padded by zero rows to a multiple of TILE, as [N / TILE, TILE, ...]."""
    extra = -t.shape[0] % TILE
    if extra:
        t = torch.cat([t, t.new_zeros(extra, *t.shape[1:])])
    return t.view(t.shape[0] // TILE, TILE, *t.shape[1:])


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] (any dtype) -> [N / 16, K, 16]: each tile's 16 columns side by side per input."""
    return _tiles(weight).transpose(1, 2).contiguous()


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 blocks (w = scale * codes + minimum per 32 inputs; codes [N, K] in 0..15,
    scale and minimum [N, K / 32], rounded to float16 as the file stores them) -> uint8
    [N / 16, K / 32, 320]: per tile and group, byte 4c + i of slice j holds input 4j + i of
    column c (low nibble) and input 16 + 4j + i (high nibble), then 16 scales, 16 minimums."""
    n, k = codes.shape
    c = _tiles(codes.to(torch.uint8)).view(-1, TILE, k // 32, 2, 4, 4)  # [T, c, g, half, j, i]
    c = c.permute(0, 2, 3, 4, 1, 5)  # [T, g, half, j, c, i]
    nibbles = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, k // 32, 256)

    def halves(t):
        return _tiles(t.to(torch.float16)).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([nibbles, halves(scale), halves(minimum)], -1).contiguous()


def pack_q8_blocks(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                   group: int, half: bool = False) -> torch.Tensor:
    """Block int8 weights (w = scale * codes (+ minimum) per ``group`` = 16 or 32 inputs; codes
    int8 [N, K], scale and minimum float32 [N, K / group]) -> uint8 [N / 16, K' / group, B]: per
    tile and group, byte 4c + i of slice j (64 bytes) holds code + 128 of input 4j + i of
    column c, then 16 scales, then (with minimums) 16 minimums, float32 or (``half``: every
    one of them a float16 number) float16; B = 16 group + 64 (+ 64), or + 32 (+ 32) in float16.
    K' is K padded with zero codes to a multiple of 32 (the activations' group)."""
    n, k = codes.shape
    codes = codes.contiguous()
    extra = -k % 32
    if extra:
        codes = torch.nn.functional.pad(codes, (0, extra))
        scale, minimum = (None if t is None else torch.nn.functional.pad(t, (0, extra // group))
                          for t in (scale, minimum))
    groups = codes.shape[1] // group
    dtype = torch.float16 if half else torch.float32
    numbers = [t.to(dtype) for t in (scale, minimum) if t is not None]
    width = TILE * group + TILE * numbers[0].element_size() * len(numbers)
    packed = torch.empty(-(-n // TILE), groups, width, dtype=torch.uint8)
    # tiles at a time: about 4 MB of codes, so a wide matrix's temporaries stay small too (a
    # model's last layer packs while every other layer is held: they are the load's peak)
    step = max(1, (1 << 22) // (TILE * codes.shape[1]))
    for first in range(0, packed.shape[0], step):
        rows = slice(first * TILE, (first + step) * TILE)
        c = _tiles(codes[rows].view(torch.uint8) ^ 0x80)  # [T, c, K]: code + 128
        c = c.view(-1, TILE, groups, group // 4, 4).permute(0, 2, 3, 1, 4)  # [T, g, j, c, i]
        parts = [c.reshape(-1, groups, TILE * group)]
        parts += [_tiles(t[rows]).transpose(1, 2).contiguous().view(torch.uint8) for t in numbers]
        torch.cat(parts, -1, out=packed[first:first + step])
    return packed


def pack_q6k(codes: torch.Tensor, sub_scale: torch.Tensor, super_scale: torch.Tensor) -> torch.Tensor:
    """GGUF Q6_K weights (w = d * sc * code; codes int8 [N, K] in -32..31, sc int8 [N, K / 16],
    d float16 [N, K / 256]) -> uint8 [N / 16, K / 256, 3392]: per tile and super-block,
    16 groups of 16 inputs, each four 64-byte slices of u = code + 32 in VPDPBUSD's order (byte
    4c + i of slice j: input 4j + i of column c) stored as the nibbles of slices 0 and 1, of 2 and
    3, then their top two bits (slice j's at bits 2j); then the groups' sc, the columns' d, and
    zero padding (kernels/small_codes.h)."""
    n, k = codes.shape
    require(k % 256 == 0 and tuple(sub_scale.shape) == (n, k // 16)
            and tuple(super_scale.shape) == (n, k // 256),
            f"Q6_K weights: codes [N, a multiple of 256] with sc [N, K / 16] and d [N, K / 256], "
            f"got {tuple(codes.shape)}, {tuple(sub_scale.shape)}, {tuple(super_scale.shape)}")
    return load().pack_q6k(codes.to(torch.int8).contiguous(), sub_scale.to(torch.int8).contiguous(),
                           super_scale.to(torch.float16).contiguous())


def pack_q3k(codes: torch.Tensor, sub_scale: torch.Tensor, super_scale: torch.Tensor) -> torch.Tensor:
    """Weights of Q6_K's form whose codes are -8..7 (GGUF Q3_K: -4..3, sc = its 6-bit scale -
    32) -> uint8 [N / 16, K / 256, 2368]: ``pack_q6k``'s layout holding u = code + 8 in the
    nibbles alone, without the groups' top bits (the ``q3k`` layout, kernels/small_codes.h)."""
    require(int(codes.min()) >= -8 and int(codes.max()) <= 7, "Q3_K codes are -8..7")
    # pack_q6k holds code + 32: codes 24 less are u = code + 8, top bits zero
    packed = pack_q6k(codes.to(torch.int8) - 24, sub_scale, super_scale)
    tiles, supers = packed.shape[:2]
    groups = packed[..., :3072].view(tiles, supers, 16, 192)[..., :128].reshape(tiles, supers, 2048)
    return torch.cat([groups, packed[..., 3072:]], -1).contiguous()


def _check_minimums_factors(qtype: str, group: int, codes: torch.Tensor, sub_scale: torch.Tensor,
                            sub_min: torch.Tensor, super_scale: torch.Tensor,
                            super_min: torch.Tensor) -> None:
    """Refuse the factors of GGUF Q2_K, Q4_K or Q5_K weights (``group``: the inputs of a sub-block)
    that do not fit its layout, naming the shapes or ranges wanted."""
    n, k = codes.shape
    require(k % 256 == 0 and tuple(sub_scale.shape) == tuple(sub_min.shape) == (n, k // group)
            and tuple(super_scale.shape) == tuple(super_min.shape) == (n, k // 256),
            f"{qtype} weights: codes [N, a multiple of 256] with sc and m [N, K / {group}] and d "
            f"and dmin [N, K / 256], got {tuple(codes.shape)}, {tuple(sub_scale.shape)}, "
            f"{tuple(sub_min.shape)}, {tuple(super_scale.shape)}, {tuple(super_min.shape)}")
    top_code, top_factor = {"Q2_K": (3, 15), "Q4_K": (15, 63), "Q5_K": (31, 63)}[qtype]
    require(all(0 <= int(t.min()) and int(t.max()) <= top
                for t, top in ((codes, top_code), (sub_scale, top_factor), (sub_min, top_factor))),
            f"{qtype} codes are 0..{top_code}, its sc and m 0..{top_factor}")


def pack_q2k(codes: torch.Tensor, sub_scale: torch.Tensor, sub_min: torch.Tensor,
             super_scale: torch.Tensor, super_min: torch.Tensor) -> torch.Tensor:
    """GGUF Q2_K weights (w = d * sc * code - dmin * m; codes [N, K] in 0..3, sc and m [N, K /
    16] in 0..15, d and dmin float16 [N, K / 256]) -> uint8 [N / 16, K / 256, 1344]: per tile
    and super-block, 16 groups of 16 inputs, each 64 bytes whose byte 4c + i holds input 4j + i
    of column c at bits 2j; then the groups' sc | m << 4 (group major), the columns' d, their
    dmin (the ``q2k`` layout, kernels/small_codes.h). Rows padded with zeros to whole tiles."""
    _check_minimums_factors("Q2_K", 16, codes, sub_scale, sub_min, super_scale, super_min)
    supers = codes.shape[1] // 256

    def codes_and_factors(rows: slice) -> list[torch.Tensor]:
        c = _tiles(codes[rows].to(torch.uint8))  # [T, c, K]
        c = c.view(-1, TILE, supers, 16, 4, 4).permute(0, 2, 3, 1, 5, 4)  # [T, s, g, c, i, j]
        c = c[..., 0] | c[..., 1] << 2 | c[..., 2] << 4 | c[..., 3] << 6
        sc_m = _tiles((sub_scale[rows] | sub_min[rows] << 4).to(torch.uint8))  # [T, c, K / 16]
        sc_m = sc_m.view(-1, TILE, supers, 16).permute(0, 2, 3, 1)  # [T, s, g, c]
        return [c.reshape(-1, supers, 1024), sc_m.reshape(-1, supers, 256)]

    return _pack_super_blocks(codes.shape, 1344, codes_and_factors, super_scale, super_min)


def _pack_super_blocks(shape, block_bytes: int, codes_and_factors, super_scale: torch.Tensor,
                       super_min: torch.Tensor) -> torch.Tensor:
    """uint8 [N / 16, K / 256, ``block_bytes``] of weights [N, K] (``shape``) in a few tiles at
    a time: ``codes_and_factors(rows)``'s bytes [tiles, K / 256, ...] of those rows, then the
    columns' d and dmin (float16) per super-block."""
    n, k = shape
    packed = torch.empty(-(-n // TILE), k // 256, block_bytes, dtype=torch.uint8)
    step = max(1, (1 << 22) // (TILE * k))  # tiles at a time, as pack_q8_blocks
    for first in range(0, packed.shape[0], step):
        rows = slice(first * TILE, (first + step) * TILE)
        parts = codes_and_factors(rows)
        parts += [_tiles(t[rows].to(torch.float16)).transpose(1, 2).contiguous().view(torch.uint8)
                  for t in (super_scale, super_min)]
        torch.cat(parts, -1, out=packed[first:first + step])
    return packed


def pack_q4k(codes: torch.Tensor, sub_scale: torch.Tensor, sub_min: torch.Tensor,
             super_scale: torch.Tensor, super_min: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_K weights (w = d * sc * code - dmin * m; codes [N, K] in 0..15, sc and m [N, K /
    32] in 0..63, d and dmin float16 [N, K / 256]) -> uint8 [N / 16, K / 256, 2368]: per tile
    and super-block, 8 groups of 32 inputs in the codebook layouts' nibbles (256 bytes each),
    then the groups' sc (group major), their m in pairs of groups (column c's m of groups 2p and
    2p + 1 at bytes 2c and 2c + 1 of pair p), the columns' d, their dmin (the ``q4k`` layout,
    kernels/small_codes.h). Rows padded with zeros to whole tiles."""
    return _pack_sub_mins32("Q4_K", codes, sub_scale, sub_min, super_scale, super_min)


def pack_q5k(codes: torch.Tensor, sub_scale: torch.Tensor, sub_min: torch.Tensor,
             super_scale: torch.Tensor, super_min: torch.Tensor) -> torch.Tensor:
    """GGUF Q5_K weights (``pack_q4k``'s, codes 0..31) -> uint8 [N / 16, K / 256, 2880]: each
    group's nibbles followed by its codes' fifth bits (64 bytes, slice j's at bit j), as the
    five-bit layout holds them (the ``q5k`` layout, kernels/small_codes.h)."""
    return _pack_sub_mins32("Q5_K", codes, sub_scale, sub_min, super_scale, super_min)


def _pack_sub_mins32(qtype: str, codes: torch.Tensor, sub_scale: torch.Tensor,
                     sub_min: torch.Tensor, super_scale: torch.Tensor,
                     super_min: torch.Tensor) -> torch.Tensor:
    """``pack_q4k`` and ``pack_q5k``: the five-bit layout's codes, with the sub-block factors
    and super-block scales of Q4_K's and Q5_K's layouts."""
    _check_minimums_factors(qtype, 32, codes, sub_scale, sub_min, super_scale, super_min)
    supers = codes.shape[1] // 256
    group_bytes = 256 if qtype == "Q4_K" else 320  # (Q5_K: its fifth bits too)

    def codes_and_factors(rows: slice) -> list[torch.Tensor]:
        # the five-bit layout holds codes 0..31 with minimums as they are: its nibbles, then
        # their fifth bits (zero for Q4_K)
        part = codes[rows]
        zeros = torch.zeros(part.shape[0], supers * 8, dtype=torch.float16)
        groups = pack_five_bit(part, zeros, zeros)[..., :group_bytes]  # [T, K / 32, bytes]
        sc = _tiles(sub_scale[rows].to(torch.uint8)).view(-1, TILE, supers, 8)  # [T, c, s, g]
        m = _tiles(sub_min[rows].to(torch.uint8)).view(-1, TILE, supers, 4, 2)  # [T, c, s, p, i]
        return [groups.reshape(-1, supers, 8 * group_bytes),
                sc.permute(0, 2, 3, 1).reshape(-1, supers, 128),  # [T, s, g, c]
                m.permute(0, 2, 3, 1, 4).reshape(-1, supers, 128)]  # [T, s, p, c, i]

    return _pack_super_blocks(codes.shape, 8 * group_bytes + 320, codes_and_factors, super_scale,
                              super_min)


def pack_iq4xs(indices: torch.Tensor, sub_scale: torch.Tensor,
               super_scale: torch.Tensor) -> torch.Tensor:
    """GGUF IQ4_XS weights (w = d * sc * kvalues_iq4nl[index]; indices [N, K] in 0..15, sc int8
    [N, K / 32] in -32..31, d float16 [N, K / 256]) -> uint8 [N / 16, K / 256, 2240]: per tile
    and super-block, 8 groups of 32 inputs, the codebook layouts' nibbles of the indices (256
    bytes each), the groups' sc (group major), the columns' d, 32 bytes of zeros (the ``iq4xs``
    layout, kernels/small_codes.h). Rows padded with zeros to whole tiles."""
    n, k = indices.shape
    require(k % 256 == 0 and tuple(sub_scale.shape) == (n, k // 32)
            and tuple(super_scale.shape) == (n, k // 256),
            f"IQ4_XS weights: indices [N, a multiple of 256] with sc [N, K / 32] and d [N, K / "
            f"256], got {tuple(indices.shape)}, {tuple(sub_scale.shape)}, "
            f"{tuple(super_scale.shape)}")
    require(-32 <= int(sub_scale.min()) and int(sub_scale.max()) <= 31, "IQ4_XS's sc are -32..31")
    supers = k // 256

    def codes_and_factors(rows: slice) -> list[torch.Tensor]:
        part = indices[rows]
        scales = torch.zeros(part.shape[0], supers * 8, dtype=torch.float16)
        groups = pack_codebook(part, scales)[..., :256]  # (the indices' nibbles, its scales cut)
        sc = _tiles(sub_scale[rows].to(torch.int8).view(torch.uint8)).view(-1, TILE, supers, 8)
        return [groups.reshape(-1, supers, 2048), sc.permute(0, 2, 3, 1).reshape(-1, supers, 128)]

    # (the zeros after d take dmin's place in the super-block layouts' tail)
    return _pack_super_blocks((n, k), 2240, codes_and_factors, super_scale,
                              torch.zeros_like(super_scale))


def pack_five_bit(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                  half: bool = True) -> torch.Tensor:
    """Block int8 weights in groups of 32 whose codes fit in 5 bits (-16..15 without minimums,
    0..31 with: GGUF Q5_0, Q5_1, MXFP4; Q5_K with ``half`` False) -> uint8 [N / 16, K / 32,
    320 + 32 (64) x (1 or 2)]: per tile and group, eight 64-byte slices of u = code + 16 (+ 0
    with minimums) in VPDPBUSD's order stored as the nibbles of slices 2i and 2i + 1, then their
    fifth bits (slice j's at bit j), then the 16 scales and minimums as float16 (``half``; as
    float32 where they are not float16 numbers: the ``five_bit32`` layout)
    (kernels/small_codes.h)."""
    n, k = codes.shape
    require(k % 32 == 0 and tuple(scale.shape) == (n, k // 32),
            f"five-bit weights: codes [N, a multiple of 32] with scales [N, K / 32], got "
            f"{tuple(codes.shape)}, {tuple(scale.shape)}")
    dtype = torch.float16 if half else torch.float32
    return load().pack_five_bit(codes.to(torch.int8).contiguous(), scale.to(dtype).contiguous(),
                                None if minimum is None else minimum.to(dtype).contiguous())


def pack_codebook(indices: torch.Tensor, scale: torch.Tensor, half: bool = True) -> torch.Tensor:
    """Weights whose codes are a codebook's sixteen values (GGUF IQ4's, or a grid I-quant's:
    models/iq_grid_blocks.py), given as their indices (0..15, int [N, K]) with scales [N, K /
    32] (float16 where ``half``, IQ4_NL's; else float32, IQ4_XS's d * (ls - 32)) -> uint8 [N /
    16, K / 32, 256 + 32 (64)]: the five-bit layout's nibbles of the indices, no top bits, then
    the scales (the ``codebook`` and ``codebook32`` layouts, kernels/small_codes.h, which take the
    codebook with each call). With float32 scales [N, K / 16] (IQ2_XS's, IQ2_S's): uint8 [N /
    16, K / 16, 128 + 64], the ``codebook16`` layout."""
    require(int(indices.min()) >= 0 and int(indices.max()) <= 15,
            "codebook weights are indices 0..15 into sixteen codes")
    if scale.shape[1] * 16 == indices.shape[1]:
        return _pack_codebook16(indices, scale.float())
    # the five-bit layout holds code + 16 without minimums: the index, with zero top bits
    packed = pack_five_bit(indices.to(torch.int8) - 16, scale, None, half)
    return torch.cat([packed[..., :256], packed[..., 320:]], -1).contiguous()


def _pack_codebook16(indices: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The ``codebook16`` layout: per tile of 16 columns (rows padded with zeros) and group of
    16 inputs, two 64-byte lines of nibbles, slice 2l (inputs 8l..8l + 3) low and slice 2l + 1
    high, byte 4c + i holding column c's input i of its slice, as the five-bit layout holds
    them; then the 16 columns' float32 scales."""
    n, k = indices.shape
    tiles, groups = -(-n // 16), k // 16
    padded = torch.zeros(tiles * 16, k, dtype=torch.uint8)
    padded[:n] = indices
    scales = torch.zeros(tiles * 16, groups)
    scales[:n] = scale
    # tile, column, group, line, slice of the line, input of the slice
    nibbles = padded.view(tiles, 16, groups, 2, 2, 4)
    lines = nibbles[..., 0, :] | nibbles[..., 1, :] << 4
    codes = lines.permute(0, 2, 3, 1, 4).reshape(tiles, groups, 128)
    scale_bytes = scales.view(tiles, 16, groups).permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([codes, scale_bytes], -1).contiguous()


#: small_codes_linear's layout codes (small_codes.h's Layout), by Int8BlockLinear.layout's names
SMALL_CODES_LAYOUTS = {"q6k": 0, "five_bit": 1, "five_bit32": 2, "codebook": 3, "codebook32": 4,
                       "q3k": 5, "q2k": 6, "codebook16": 7, "q4k": 8, "q5k": 9, "iq4xs": 10}


def small_codes_linear(x, packed, layout: str, minimum, n, residual=None, input_scale=1.0,
                       codebook=None, scaled_columns=-1):
    """``codebook`` (the codebook layouts and ``iq4xs`` alone): int8 [16], the codes their
    indices name;
    ``scaled_columns``: the leading columns ``input_scale`` is of (-1: all)."""
    return load().small_codes_linear(x, packed, SMALL_CODES_LAYOUTS[layout], minimum, residual, n,
                                     isa(), input_scale, codebook, scaled_columns)


def q8_linear(x, packed, group, minimum, half, n, residual=None):
    return load().q8_linear(x, packed, group, minimum, half, residual, n, isa())


def dense_linear(x, packed, n, scale=None, residual=None):
    return load().dense_linear(x, packed, scale, residual, n, isa())


def q4_linear(x, packed, n, residual=None):
    return load().q4_linear(x, packed, residual, n, isa())


def rms_norm(x, weight, eps):
    return load().rms_norm(x, weight, eps, isa())


def swiglu(gate_up):
    return load().swiglu(gate_up, isa())


def geglu(gate_up):
    return load().geglu(gate_up, isa())


def oss_glu(gate_up):
    """gpt-oss's experts' activation of [n, 2 I] (gate then up): (clamp(up, -7, 7) + 1) *
    g * sigmoid(1.702 g), g = min(gate, 7)."""
    return load().oss_glu(gate_up, isa())


def softcap(x, cap):
    return load().softcap(x, cap, isa())


def draw_tokens(logits, temperatures, uniforms, top_p):
    """A token from each row of ``logits`` [n, V]: the first largest where its temperature is 0,
    else a draw from its softmax at that temperature within the top-``top_p`` nucleus, by the
    row's ``uniforms`` [n, tries] in turn (-1 where none lands in the nucleus)."""
    return load().draw_tokens(logits, temperatures, uniforms, top_p, isa())


def top_probs(logits, limit):
    """The ``limit`` most probable tokens of each row's softmax of ``logits`` [n, V], most
    probable first (ties: the lower index): (probabilities [n, limit], indices [n, limit])."""
    return load().top_probs(logits, limit, isa())


def rope_store(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slots):
    return load().rope_store(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slots, isa())


def attention(q, k_cache, v_cache, past, slots, lens, window=0, softcap=0.0, sinks=None):
    """``window`` > 0: each row sees only its last ``window`` positions (sliding-window layers);
    ``softcap`` > 0: scores are softcap * tanh(score / softcap) before the softmax (Gemma 2);
    ``sinks`` [H] float32: each head's attention sink, a logit that joins the softmax's
    denominator and carries no value (gpt-oss)."""
    return load().attention(q, k_cache, v_cache, past, slots, lens, window, softcap, isa(), sinks)



#: ``PackedLinear``'s kinds (cpu_kernels.cpp): the kernel a packed weight goes through
INT4_KIND, BLOCK_INT8_KIND, DENSE_KIND, SMALL_CODES_KIND = 0, 1, 2, 3


def packed_linear(packed, kind, n, group=32, minimum=False, half=False, input_scale=1.0,
                  codebook=None, scaled_columns=-1):
    """A linear layer's packed weight as the extension's ``PackedLinear`` (what a
    ``LayerStack`` calls): the kernel of ``kind`` with the arguments the layer objects of
    models/quant.py give it."""
    return load().PackedLinear(packed, kind, n, group, minimum, half, input_scale, codebook,
                               scaled_columns)


def split_linear(parts):
    """Linear layers sharing an input (``PackedLinear``s, each in its own format) as one
    ``PackedLinear`` whose output is theirs side by side (models/quant.py's SplitLinear)."""
    return load().PackedLinear(list(parts))


#: the gate activations ``moe_experts`` takes (cpu_kernels.cpp's ``GateMode``), by the name
#: models/moe.py gives them
GATE_MODES = {"silu": 0, "gelu_pytorch_tanh": 1, "gpt_oss": 2}


def moe_experts(gate_up, down, activation: str, gate_up_bias=(), down_bias=()):
    """A mixture-of-experts layer's experts as one kernel call (cpu_kernels.cpp's
    ``MoEExperts``): per expert its gate/up and down ``packed_linear``s, and (gpt-oss) their
    float32 biases; ``activation``: one of ``GATE_MODES``; ``forward(h, picks, weights, isa)``
    gives each row of ``h`` [n, H] the sum of its picks' [n, k] expert outputs times their
    weights [n, k], added in the order of the picks."""
    return load().MoEExperts(gate_up, down, GATE_MODES[activation], list(gate_up_bias),
                             list(down_bias))


def layer_stack(attn_norms, qkv, o, mlp_norms, gate_up, down, windows, heads, kv_heads,
                head_dim, hidden, eps, qkv_biases=()):
    """Decoder layers as one kernel call (cpu_kernels.cpp's ``LayerStack``): per layer its
    norms' weights and its linear layers (``packed_linear``s), sliding window (0: none) and, for
    Qwen2, the fused q/k/v's bias (``qkv_biases``, one a layer, or none at all);
    ``forward(x, first, last, plan, cos, sin, isa)`` runs layers first .. last - 1 over the rows
    where a ``packed_plan`` puts them."""
    return load().LayerStack(attn_norms, qkv, o, mlp_norms, gate_up, down, windows, heads,
                             kv_heads, head_dim, hidden, eps, list(qkv_biases))


def eagle_head(stack, fuse, fc, part_norm, hidden_norm, out_norm, embed, eps):
    """EAGLE's head a kernel call at a time (cpu_kernels.cpp's ``EagleHead``): its decoder layer
    (a one-layer ``layer_stack``), ``fuse`` and, for EAGLE-3, ``fc`` (``packed_linear``s; None
    for EAGLE-1, whose norms' weights are then empty), the norms' weights and the target's input
    embeddings [V, H]; ``ingest(features, tokens, k_cache, v_cache, past, cos_table,
    sin_table, isa)`` (a chain after ``past`` cached slots) and ``expand(states, tokens,
    ancestors, k_cache, v_cache, cached, start, cos_table, sin_table, isa)`` (tree rows, as
    ``AttentionPlan.tree_rows``) return (the layer's output, its rows as the shortlist scores
    them)."""
    return load().EagleHead(stack, fuse, fc, part_norm, hidden_norm, out_norm, embed, eps)


def deer_drafter(stack, fuse, context_kv, anchor_in, root_in, part_norms, context_norm, out_norm,
                 mask, embed, heads, block, eps):
    """DEER's block drafter a kernel call a step (cpu_kernels.cpp's ``DeerDrafter``): its
    decoder layers (a ``layer_stack``), the fusing map, each layer's context k/v map, the
    anchor's and the root's maps or None (``packed_linear``s), the norms' weights (the parts'
    side by side), the mask row [H] or rows [block, H], the target's input embeddings [V, H],
    the attention heads and the block's length; ``ingest(features, root, positions, k_cache,
    v_cache, past, cos_table, sin_table, isa)`` writes the context's keys and values and returns
    the block's rows after the root, normed."""
    return load().DeerDrafter(stack, fuse, context_kv, anchor_in, root_in, part_norms,
                              context_norm, out_norm, mask, embed, heads, block, eps)


def hydra_heads(fuse, fuse_bias, res, res_bias, embed):
    """Hydra's heads as one kernel call a draft step (cpu_kernels.cpp's ``HydraHeads``): per
    head its fused projection and residual map (``packed_linear``s) and their biases (or None),
    and the target's input embeddings [V, H]; ``forward(feature, paths, isa)`` scores each
    path (the root's next token first) with the head of its depth."""
    return load().HydraHeads(fuse, fuse_bias, res, res_bias, embed)


def packed_plan(k_caches, v_caches, pasts, slots, keys, lens):
    """Where the rows of one forward of several sequences go (cpu_kernels.cpp's ``PackedPlan``):
    sequence s has the caches ``k_caches[s]`` and ``v_caches[s]`` (every layer's) and the call's
    next ``len(slots[s])`` rows; its row i writes slot ``slots[s][i]`` and sees the slots before
    ``pasts[s]``, then ``keys[s][i, :lens[s][i]]``. Checked once; its ``rope_store(layer, qkv,
    cos, sin, heads, kv_heads, isa)`` and ``attention(layer, q, window, softcap, isa, sinks=None)`` run
    every sequence's rows on its own cache of that layer."""
    return load().PackedPlan(k_caches, v_caches, pasts, slots, keys, lens)

