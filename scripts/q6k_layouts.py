"""Time a GGUF file's Q6_K matrices in their own layout against block int8, interleaved.

    PYTHONPATH=src python scripts/q6k_layouts.py                      # qwen2.5-coder-1.5b
    PYTHONPATH=src python scripts/q6k_layouts.py --model FILE.gguf --rows 1 4 16

Every matrix of the file that is Q6_K throughout and that the runner holds as such (the LM head
and each ``ffn_down``; a fused q/k/v stays block int8) is built twice from the same blocks:
``Int8BlockLinear`` of the ``Q6KWeight`` (0.83 bytes a weight, kernels/q6k_blocks.h) and of
the plain block int8 weight (1.25 bytes, kernels/q8_blocks.h). Both compute the same bits
(asserted here as well). Per row count, all matrices in turn form one timing, the two layouts
alternate ``--repeat`` times, and the medians are printed with their ratio: as a decode step
reads them one after another, from memory rather than cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.models.gguf_reader import GGUFFile
from specdecode.models.int8_blocks import Int8BlockLinear, Int8BlockWeight
from specdecode.models.loading import NAMED_MODELS


def layouts(path) -> tuple[list[Int8BlockLinear], list[Int8BlockLinear]]:
    file = GGUFFile(path)
    own, block = [], []
    for name, entry in file.entries.items():
        if entry.qtype == "Q6_K" and name.endswith(("down_proj.weight", "lm_head.weight")):
            weight = file.read_blocks(name)
            own.append(Int8BlockLinear(weight))
            block.append(Int8BlockLinear(Int8BlockWeight(weight.codes, weight.scale, None, 16)))
    return own, block


def seconds(linears: list[Int8BlockLinear], rows: int) -> float:
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    own, block = layouts(NAMED_MODELS[args.model]() if args.model in NAMED_MODELS else args.model)
    if not own:
        raise SystemExit(f"{args.model} has no matrix that is Q6_K throughout")
    x = torch.randn(3, own[0].in_features)
    assert torch.equal(own[0](x), block[0](x)), "the two layouts must give the same bits"
    megabytes = [sum(lin.nbytes for lin in group) / 1e6 for group in (own, block)]
    print(f"{len(own)} Q6_K matrices: {megabytes[0]:.0f} MB in the Q6_K layout, "
          f"{megabytes[1]:.0f} MB as block int8; {args.threads} threads; medians of {args.repeat}")
    print("| rows | block int8 ms | Q6_K layout ms | ratio |\n|---:|---:|---:|---:|")
    for rows in args.rows:
        times = {"own": [], "block": []}
        for _ in range(args.repeat):
            times["block"].append(seconds(block, rows))
            times["own"].append(seconds(own, rows))
        b, o = (statistics.median(times[k]) * 1e3 for k in ("block", "own"))
        print(f"| {rows} | {b:.2f} | {o:.2f} | {o / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
