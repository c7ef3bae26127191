"""What the AMX tiles give the int4 kernel: VNNI against AMX on the same machine, in turns.

For each row count (default 1, 2, 4, 8, 16, 32, 64): one int4 linear layer of the default
model's sizes (gate/up 576 -> 3072, down 1536 -> 576) and of a 2048 x 8192 layer (random
Q4_1 weights), the whole default-model forward (native int4 runner, ``--context`` tokens
cached, a chain of ``rows`` new tokens), and torch's bfloat16 linear of the 2048 x 8192 layer
for reference (oneDNN, AMX where it has it). The instruction sets take turns in short bursts
(``--rounds`` of them, each the median of ``--calls`` calls) so that a shared machine's load
falls on both alike; the table (printed after every round) has the median of the bursts so far
and the load average. Needs a CPU with AMX for the AMX column (``SPECDECODE_KERNEL_ISA`` picks the
variant for the forward; the linears get the level directly).

    PYTHONPATH=src python scripts/amx_rows.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specdecode import kernels
from specdecode.models.quant import quantize_int4

VARIANTS = ("avx512", "amx")
SHAPES = {"gate/up 576->3072": (3072, 576), "down 1536->576": (576, 1536),
          "2048->8192": (8192, 2048)}


def median_ms(call, calls: int) -> float:
    call()  # untimed: caches, the tile permission, a first page fault
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def set_variant(name: str) -> int:
    os.environ["SPECDECODE_KERNEL_ISA"] = name
    kernels.isa.cache_clear()
    return kernels.isa()


def linear_calls(rows: list[int], gen: torch.Generator):
    """{(shape, variant or torch-bf16, rows): a call}"""
    ext, calls = kernels.load(), {}
    for shape, (n, k) in SHAPES.items():
        codes, scale, minimum = quantize_int4(torch.randn(n, k, generator=gen))
        packed = kernels.pack_q4(codes, scale, minimum)
        weight16 = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            for variant in VARIANTS:
                level = kernels.ISA_LEVELS.index(variant)
                calls[shape, variant, m] = (lambda x=x, p=packed, n=n, lv=level:
                                            ext.q4_linear(x, p, None, n, lv))
            if shape == "2048->8192":
                x16 = x.to(torch.bfloat16)
                calls[shape, "torch bf16", m] = lambda x16=x16, w=weight16: torch.nn.functional.linear(x16, w)
    return calls


def forward_calls(rows: list[int], context: int):
    from specdecode.draft import Draft
    from specdecode.models.loading import load_model, make_runner

    runner = make_runner(load_model(), "native", "int4")
    tokens = list(range(1000, 1000 + context + max(rows)))
    runner.prefill(tokens[:context])

    def forward(m):
        runner.forward(tokens[context], Draft.chain(tokens[context + 1:context + m]) if m > 1 else Draft.empty())
        runner.commit([])  # keep only the root: the context grows by one token a forward

    return {("forward", variant, m): (lambda m=m: forward(m)) for variant in VARIANTS for m in rows}


def measure(calls: dict, rounds: int, per_burst: int, rows: list[int]) -> dict:
    """The median over ``rounds`` bursts of each call's median time; variants alternate. The
    table so far is printed after every round (a shared machine can make a round slow)."""
    times: dict = {key: [] for key in calls}
    for done in range(1, rounds + 1):
        for key, call in calls.items():
            set_variant(key[1] if key[1] in VARIANTS else "amx")
            times[key].append(median_ms(call, per_burst))
        result = {key: statistics.median(ts) for key, ts in times.items()}
        print(f"after {done} of {rounds} bursts, load average {os.getloadavg()[0]:.2f}:\n"
              f"{table(result, rows)}", flush=True)
    return result


def table(result: dict, rows: list[int]) -> str:
    lines = ["| layer | variant | " + " | ".join(f"{m} rows ms" for m in rows) + " | 16 rows / 1 row |",
             "|---|---|" + "---:|" * (len(rows) + 1)]
    for shape in list(SHAPES) + ["forward"]:
        for variant in VARIANTS + ("torch bf16",):
            if (shape, variant, rows[0]) not in result:
                continue
            ms = [result[shape, variant, m] for m in rows]
            ratio = (f"{result[shape, variant, 16] / result[shape, variant, 1]:.2f}x"
                     if 16 in rows and 1 in rows else "")
            lines.append(f"| {shape} | {variant} | " + " | ".join(f"{t:.3f}" for t in ms) + f" | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=5, help="bursts per call (median)")
    parser.add_argument("--calls", type=int, default=11, help="timed calls per burst (median)")
    parser.add_argument("--context", type=int, default=256, help="cached tokens before a forward")
    parser.add_argument("--no-forward", action="store_true", help="the linear layers only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.load().isa_level() < kernels.ISA_LEVELS.index("amx"):
        raise SystemExit("this CPU (or its OS) has no AMX tiles (amx_int8 in /proc/cpuinfo): "
                         "nothing to compare")
    calls = linear_calls(args.rows, torch.Generator().manual_seed(0))
    if not args.no_forward:
        calls.update(forward_calls(args.rows, args.context))
    print(f"threads {args.threads}, {args.rounds} bursts of {args.calls} calls (medians); "
          f"load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    measure(calls, args.rounds, args.calls, args.rows)


if __name__ == "__main__":
    main()
