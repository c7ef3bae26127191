"""Time a GGUF file's 2 to 6-bit matrices in their own layout against block int8, interleaved.

    PYTHONPATH=src python scripts/small_codes_layouts.py                   # qwen2.5-coder-1.5b
    PYTHONPATH=src python scripts/small_codes_layouts.py --model qwen2.5-coder-0.5b --rows 1 4 16
    PYTHONPATH=src python scripts/small_codes_layouts.py --model q5km.gguf    # a Q5_K_M file
    PYTHONPATH=src python scripts/small_codes_layouts.py --model q3km.gguf --types Q3_K \\
        --against q6k

Every weight matrix of the file in Q6_K, Q5_0, Q5_1, MXFP4, Q5_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS,
IQ3_XXS or an IQ2 type (the token embedding aside: it is read by row) is built twice from the
same blocks: ``Int8BlockLinear``, which holds it in the file's own bytes (kernels/small_codes.h:
0.83 bytes a weight for Q6_K, 0.33 for Q2_K, 0.69-0.75 for the five-bit types, 0.63-0.75 for
IQ3_XXS's and the IQ2 types' codebook indices; on a CPU without AMX, 0.58 for Q3_K, 0.875 for
Q5_K with its float32 scales (0.70 in its own layout where the best kernels are AVX-512 VNNI)
and 0.56-0.63 for the IQ4 types' indices), and block int8 (kernels/q8_blocks.h: 1.25, 1.5,
1.06-1.13, 1.25, 1.06-1.13). The five-bit and codebook types compute the same bits in both
(asserted here as well); Q6_K, Q3_K, Q2_K and Q5_K's own layout fold their sub-block scales
(Q2_K, Q5_K: and minimums) in integers, against block int8's float fold per 16 or 32 inputs.
``--against int4`` times the same weights re-quantised to the int4 runner's Q4_1 instead (what
the runner does with a type it has no exact form for: ``make_linear(weight.dequantize(),
"int4")``); ``--against q6k`` times Q3_K matrices in Q6_K's
layout (the same numbers in 0.83 bytes a weight, what a CPU with AMX holds). Per row count, all
matrices in turn form one timing, as a decode step reads them one after another from memory;
the two layouts alternate ``--repeat`` times and the medians are printed with their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode import kernels
from specdecode.models.gguf_reader import GGUFFile
from specdecode.models.int8_blocks import Int8BlockLinear, Q6KWeight
from specdecode.models.loading import NAMED_MODELS
from specdecode.models.quant import make_linear

TYPES = ("Q6_K", "Q5_0", "Q5_1", "MXFP4", "Q5_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS",
         "IQ2_XXS", "IQ2_XS", "IQ2_S")


class BlockInt8:
    """The same weight as block int8, in q8_blocks.h's layout."""

    def __init__(self, weight, like: Int8BlockLinear):
        self.args = (weight.group, weight.minimum is not None, like.half, like.out_features)
        self.packed = kernels.pack_q8_blocks(weight.codes, weight.scale, weight.minimum,
                                             weight.group, like.half)
        self.in_features = like.in_features

    def __call__(self, x):
        group, minimum, half, n = self.args
        return kernels.q8_linear(x, self.packed, group, minimum, half, n)


def requantised(weight, like: Int8BlockLinear):
    """The same weight re-quantised to int4 (Q4_1 per 32 inputs)."""
    return make_linear(weight.dequantize(), "int4")


class Q6KLayout:
    """A Q3_K matrix in Q6_K's layout (0.83 bytes a weight: what a CPU with AMX holds)."""

    def __init__(self, weight, like: Int8BlockLinear):
        if not isinstance(weight, Q6KWeight):
            raise SystemExit("--against q6k times Q3_K matrices (--types Q3_K)")
        self.packed = kernels.pack_q6k(weight.codes, weight.sub_scale, weight.super_scale)
        self.in_features, self.n, self.input_scale = (like.in_features, like.out_features,
                                                      like.input_scale)

    def __call__(self, x):
        return kernels.small_codes_linear(x, self.packed, "q6k", False, self.n, None,
                                          self.input_scale)


AGAINST = {"block": ("block int8", BlockInt8), "int4": ("int4 re-quantised", requantised),
           "q6k": ("Q6_K's layout", Q6KLayout)}


def layouts(path, kinds=TYPES, against=BlockInt8) -> tuple[list, list, dict]:
    file = GGUFFile(path)
    own, other, types = [], [], {}
    for name, entry in file.entries.items():
        if entry.qtype in kinds and len(entry.shape) == 2 and "embed_tokens" not in name:
            weight = file.read_blocks(name)
            own.append(Int8BlockLinear(weight))
            other.append(against(weight, own[-1]))
            types[entry.qtype] = types.get(entry.qtype, 0) + 1
    return own, other, types


def seconds(linears: list, rows: int) -> float:
    inputs = {lin.in_features: torch.randn(rows, lin.in_features) for lin in linears}
    start = time.perf_counter()
    for lin in linears:
        lin(inputs[lin.in_features])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a named model or GGUF file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--types", nargs="+", default=TYPES, choices=TYPES,
                        help="the block types whose matrices are timed (default: all)")
    parser.add_argument("--against", choices=tuple(AGAINST), default="block",
                        help="block int8 (exact), int4 (re-quantised to Q4_1) or, for Q3_K, "
                             "Q6_K's layout (exact)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    other_name, other = AGAINST[args.against]
    own, block, types = layouts(NAMED_MODELS[args.model]() if args.model in NAMED_MODELS
                                else args.model, args.types, other)
    if not own:
        raise SystemExit(f"{args.model} has no matrix in {', '.join(TYPES)}")
    for a, b in zip(own, block):
        x = torch.randn(3, a.in_features)
        assert (args.against != "block" or a.layout in ("q6k", "q3k", "q2k", "q5k")
                or torch.equal(a(x), b(x))), "five-bit and codebook codes: block int8's bits"
    megabytes = [sum(lin.nbytes for lin in own) / 1e6,
                 sum(lin.packed.numel() for lin in block) / 1e6]
    print(f"{len(own)} matrices ({', '.join(f'{n} {t}' for t, n in types.items())}): "
          f"{megabytes[0]:.0f} MB in the file's own bytes, {megabytes[1]:.0f} MB as "
          f"{other_name}; {args.threads} threads; medians of {args.repeat}")
    print(f"| rows | {other_name} ms | own bytes ms | ratio |\n|---:|---:|---:|---:|")
    for rows in args.rows:
        times = {"own": [], "block": []}
        for _ in range(args.repeat):
            times["block"].append(seconds(block, rows))
            times["own"].append(seconds(own, rows))
        b, o = (statistics.median(times[k]) * 1e3 for k in ("block", "own"))
        print(f"| {rows} | {b:.2f} | {o:.2f} | {o / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
