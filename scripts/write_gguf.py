"""Write a GGUF file of a real model's shape with random weights (see specdecode/bench/shapes.py).

    python scripts/write_gguf.py 7b /work/gguf/syn-7b-q4_k_m.gguf --mix Q4_K_M

Shapes: 1.7b, 3b, 7b (Llama layout), qwen2.5-7b (Qwen2 layout), qwen3-30b-a3b (Qwen3-MoE:
128 experts, 8 per token) and tiny test shapes; mixes: Q4_1, Q4_0, Q4_K_M, Q8_0. ``--layers N``
keeps the shape's first N layers (a per-layer cost in less memory and disk: the MoE's 48 layers
are 17 GB). The default model's tokenizer is copied in, so llama.cpp and specdecode load the file
as a complete model. Memory: one tensor at a time.

    python scripts/write_gguf.py qwen3-30b-a3b /work/gguf/syn-30b-a3b-12l.gguf --mix Q4_K_M --layers 12
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from specdecode.bench.shapes import MIXES, SHAPES, write_shape
from specdecode.errors import SpecDecodeError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path")
    parser.add_argument("--mix", default="Q4_1", choices=MIXES, help="GGUF type mix (default Q4_1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, help="keep the first N layers (default: all)")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    if args.layers is not None:
        if not 0 < args.layers <= shape.layers:
            parser.error(f"--layers must be 1..{shape.layers} for {args.shape}")
        shape = dataclasses.replace(shape, layers=args.layers)
    start = time.perf_counter()
    try:
        path = write_shape(args.path, shape, args.mix, args.seed)
    except SpecDecodeError as exc:
        print(f"write_gguf: error: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
