"""Two things about the attention kernel, measured.

1. What its software prefetch gives: the kernels built as shipped against the same sources
   with it off (``-DATTN_PREFETCH=0 -DATTN_VALUE_PREFETCH=0``: each pass asks for the lines it
   is reading, i.e. nothing ahead), alternating call by call (each first in turn) in one
   process so that a shared machine's load falls on both alike:

   - ``attention`` alone over 30 layers of a bfloat16 cache (the default model's 9 query and
     3 key/value heads of 64), a chain of ``rows`` new rows after ``past`` cached positions,
     with a 400 MB buffer written before each timed call so the cache comes from memory, as
     it does in a forward (whose weights stream through the caches between two layers'
     attention);
   - the default model's whole forward (native int4 runner: one runner built on each
     variant), ``rows`` rows after ``past`` cached positions.

   Both variants give the same bits (checked).

2. How evenly its work items share the threads: one prompt block's attention (a chain of
   ``rows`` rows after ``past`` positions: later rows see more keys) on 1 thread and on
   ``--threads``; the ratio is what the threads give (2.0 at best on 2 threads).

Medians of ``--repeats`` turns.

    PYTHONPATH=src python scripts/attention_costs.py
    PYTHONPATH=src python scripts/attention_costs.py --threads 1 --repeats 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode import kernels
from specdecode.draft import Draft

OFF = ["-DATTN_PREFETCH=0", "-DATTN_VALUE_PREFETCH=0"]
PASTS = (40, 300, 800, 1600)
ROWS = (1, 4, 8)


def kernel_table(variants: dict, repeats: int) -> None:
    heads, kv_heads, d, capacity, layers = 9, 3, 64, 2048, 30
    k = torch.randn(layers, kv_heads, capacity // 16, d, 16).to(torch.bfloat16)
    v = torch.randn(layers, kv_heads, capacity, d).to(torch.bfloat16)
    flush = torch.zeros(100 * 1024 * 1024)
    print("attention alone, 30 layers, cache from memory: ms (shipped / off)")
    for past in PASTS:
        for m in ROWS:
            q = torch.randn(m, heads, d)
            slots = torch.tensor([[past + j for j in range(m)]] * m, dtype=torch.int32)
            lens = torch.arange(1, m + 1, dtype=torch.int32)
            outs = [ext.attention(q, k[0], v[0], past, slots, lens, 0, 0.0, kernels.isa())
                    for ext in variants.values()]
            assert torch.equal(outs[0], outs[1]), "the variants disagree"
            times = {name: [] for name in variants}
            for turn in range(repeats):
                for name in sorted(variants, reverse=turn % 2 == 1):  # each first in turn
                    ext = variants[name]
                    flush.add_(1.0)
                    start = time.perf_counter()
                    for layer in range(layers):
                        ext.attention(q, k[layer], v[layer], past, slots, lens, 0, 0.0, kernels.isa())
                    times[name].append(time.perf_counter() - start)
            on, off = (statistics.median(times[name]) * 1e3 for name in variants)
            print(f"  past {past:5d} rows {m}: {on:6.2f} / {off:6.2f}  ({on / off:.2f}x)", flush=True)


def forward_table(variants: dict, repeats: int) -> None:
    from specdecode.models.loading import load_model, make_runner

    loaded = load_model()
    runners = {}
    for name, ext in variants.items():
        kernels.load = lambda ext=ext: ext  # the runner's layer stack is built on this variant
        runners[name] = make_runner(loaded)
    print("whole forward (native int4, default model): ms (shipped / off)")
    for past in PASTS:
        prompt = [1000 + (i * 7919) % 40000 for i in range(past)]
        for name, runner in runners.items():
            kernels.load = lambda ext=variants[name]: ext
            runner.prefill(prompt)
        for m in ROWS:
            times = {name: [] for name in variants}
            for turn in range(repeats):
                for name in sorted(runners, reverse=turn % 2 == 1):  # each first in turn
                    runner = runners[name]
                    kernels.load = lambda ext=variants[name]: ext
                    start = time.perf_counter()
                    runner.forward(0, Draft.chain([5] * (m - 1)))
                    times[name].append(time.perf_counter() - start)
                    runner.commit([])
            on, off = (statistics.median(times[name]) * 1e3 for name in variants)
            print(f"  past {past:5d} rows {m}: {on:6.2f} / {off:6.2f}  ({on / off:.2f}x)", flush=True)


def balance_table(threads: int, repeats: int) -> None:
    heads, kv_heads, d, capacity = 9, 3, 64, 2048
    k = torch.randn(kv_heads, capacity // 16, d, 16).to(torch.bfloat16)
    v = torch.randn(kv_heads, capacity, d).to(torch.bfloat16)
    print(f"one prompt block's attention: ms on 1 / {threads} threads")
    for past, m in ((0, 128), (0, 512), (640, 128), (100, 8)):
        q = torch.randn(m, heads, d)
        slots = (past + torch.arange(m, dtype=torch.int32)).expand(m, m).contiguous()
        lens = torch.arange(1, m + 1, dtype=torch.int32)
        times = {1: [], threads: []}
        for _ in range(repeats):
            for n in times:
                torch.set_num_threads(n)
                start = time.perf_counter()
                kernels.attention(q, k, v, past, slots, lens)
                times[n].append(time.perf_counter() - start)
        one, many = (statistics.median(times[n]) * 1e3 for n in times)
        print(f"  past {past:5d} rows {m:3d}: {one:6.3f} / {many:6.3f}  ({one / many:.2f}x)", flush=True)
    torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = {"shipped": kernels.load(),
                "off": kernels.compile_extension("specdecode_cpu_kernels_no_attn_prefetch",
                                                 kernels._SOURCES, OFF)}
    if args.threads > 1:
        balance_table(args.threads, args.repeats)
    kernel_table(variants, args.repeats)
    forward_table(variants, args.repeats)


if __name__ == "__main__":
    main()
