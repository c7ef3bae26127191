"""Whole forwards of a GGUF file as a CPU with AMX holds it against this CPU's, in one process.

    PYTHONPATH=src python scripts/held_layouts_ab.py --model iq4xs.gguf
    PYTHONPATH=src python scripts/held_layouts_ab.py --model q3km.gguf --rows 1 16 --turns 15
    PYTHONPATH=src python scripts/held_layouts_ab.py --model iq4xs.gguf --against codebook32

Without AMX the int4 runner holds Q4_K, Q5_K, Q3_K, IQ4_NL and IQ4_XS matrices in their own
small layouts (kernels/small_codes.h: 0.58, 0.70 (AVX2: 0.875), 0.58, 0.56 and 0.63 bytes a
weight); with AMX it keeps them as int4's Q4_1 blocks, block int8 and in Q6_K's layout (0.625,
1.25, 0.83, 1.06, 1.13), whose tile kernels take many rows. Two runners of ``--model`` are
built here, one each way (``int8_blocks._without_amx`` set for its build), both on this CPU's
kernels; after ``--past`` cached positions they take turns on forwards of each row count (each
first in every other turn; their logits asserted equal where the layouts compute the same
numbers: not where the file has Q4_K or Q5_K matrices, whose own layouts fold per 256 inputs
where the others fold per 32), then on a prompt of ``--prompt`` tokens. Printed: the medians
and the ratio, this CPU's layouts over the AMX CPU's. ``--against codebook32``: the other
runner holds the file as this CPU does but its IQ4_XS matrices as an AVX2 CPU does (indices with
their float32 scales d * sc, activations per 32 inputs) instead of the iq4xs layout (its
integer sub-block scales folded per 256 inputs).
"""

from __future__ import annotations

import argparse

import torch

from kernels_ab import alternate, forward_times, medians, tokens  # (a script beside this one)
from specdecode.models import gguf_reader, int8_blocks
from specdecode.models.gguf_reader import GGUFFile
from specdecode.models.loading import load_model, make_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a named model or GGUF file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", choices=("amx", "codebook32"), default="amx",
                        help="the other runner's holding (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    # (Q4_K's, Q5_K's and IQ4_XS's own layouts fold per 256 inputs, their other layouts per 32)
    other_numbers = any(e.qtype in ("Q4_K", "Q5_K", "IQ4_XS")
                        for e in GGUFFile(loaded.gguf_path).entries.values())
    context = max(args.past + max(args.rows), args.prompt) + 16
    runners = {args.against: held_other_way(loaded, args.against, context),
               "this": make_runner(loaded, "native", "int4", context)}
    print(f"{args.model}: ms, held as {args.against} / as this CPU holds it ({args.threads} "
          f"threads)")
    for runner in runners.values():
        runner.prefill(tokens(args.past))
    for rows in args.rows:
        took = medians(forward_times(runners, rows, args.turns, equal=not other_numbers))
        other = took[args.against]
        print(f"{rows} rows after {args.past}: {other * 1e3:.1f} / {took['this'] * 1e3:.1f} "
              f"({took['this'] / other:.2f}x)", flush=True)
    took = medians(alternate({name: lambda name=name: runners[name].replica().prefill(
        tokens(args.prompt)) for name in runners}, max(3, args.turns // 3)))
    other = took[args.against]
    print(f"{args.prompt}-token prompt: {other * 1e3:.0f} / {took['this'] * 1e3:.0f} "
          f"({took['this'] / other:.2f}x)")


def held_other_way(loaded, against: str, context: int):
    """A runner of ``loaded`` as an AMX CPU holds it, or with its IQ4_XS matrices as block int8
    weights (``codebook32`` on this CPU)."""
    if against == "amx":
        held = int8_blocks._without_amx
        int8_blocks._without_amx = lambda: False
        try:
            return make_runner(loaded, "native", "int4", context)
        finally:
            int8_blocks._without_amx = held
    decode = gguf_reader.decode_gguf_blocks

    def as_blocks(raw, qtype):
        weight = decode(raw, qtype)
        if isinstance(weight, int8_blocks.IQ4XSWeight):
            return int8_blocks.Int8BlockWeight(weight.codes, weight.scale, None, weight.group)
        return weight

    gguf_reader.decode_gguf_blocks = as_blocks
    try:
        return make_runner(loaded, "native", "int4", context)
    finally:
        gguf_reader.decode_gguf_blocks = decode


if __name__ == "__main__":
    main()
