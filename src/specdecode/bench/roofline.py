"""The roofline of the native int4 runner, for ``specdecode bench --runners`` (benchmark only:
nothing here runs when generating).

Four rates, in multiply-adds per second: the machine's int8 multiply-add peak (VPDPBUSD chains
on every thread, nothing else); the ceiling of the Q4 kernel's own instruction mix (its
VPDPBUSD with the nibble unpacking and the per-group float fold, on registers: the fold shares
VPDPBUSD's ports); the rate each forward size reaches (the multiply-adds of its linear layers
over the whole forward's time); and the rate of one layer's linear layers with their weights in
cache, which separates the kernel from the memory stream and the rest of the forward. The first
two are micro-kernels of the bench's own extension (``peak_kernels.cpp``: ``int8_peak_macs``,
``q4_mix_peak_macs``), compiled with AVX-512 VNNI on first use. The roofline is made where the int4 kernel runs on
VNNI (isa ``avx512``): on ``amx`` its several-row forwards use tiles, which that peak does not
bound.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

from specdecode import kernels

#: VPDPBUSD rounds per thread for the peak (12 chains each: about 0.2 s)
PEAK_ITERATIONS = 30_000_000
#: rounds of the Q4 kernel's instruction mix per thread (64 VPDPBUSD each: about 0.2 s)
MIX_ITERATIONS = 5_000_000
#: timed calls of one layer's linear layers with their weights in cache (median)
CACHED_CALLS = 41
_PEAK_SOURCES = (Path(__file__).with_name("peak_kernels.cpp"),)
_VNNI_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni")


@functools.cache
def peak_kernels():
    return kernels.compile_extension("specdecode_peak_kernels", _PEAK_SOURCES, _VNNI_FLAGS)


def vnni_cpu() -> bool:
    """Whether the kernels run AVX-512 VNNI code here (the micro-kernels' instruction set)."""
    return kernels.isa() >= kernels.ISA_LEVELS.index("avx512")


def build_peak_kernels() -> None:
    """Build the micro-kernels ahead of the bench where this CPU can run them (an AVX2-only
    CPU would stop on an illegal instruction as the extension loads)."""
    if vnni_cpu():
        peak_kernels()


def layer_linears(layer) -> list:
    """The linear layers one row goes through in ``layer``: q/k/v, o and the MLP's; in a
    mixture-of-experts layer the router, as many experts as a row takes (the first ones: every
    expert is the same size) and the shared expert."""
    moe = layer.moe
    if moe is None:
        return [layer.qkv, layer.o, layer.gate_up, layer.down]
    shared = [*moe.shared, moe.shared_gate] if moe.shared is not None else []
    picked = [linear for pair in moe.experts[:moe.per_token] for linear in pair]
    return [layer.qkv, layer.o, moe.router, *picked, *shared]


def row_macs(linear) -> int:
    """Multiply-adds of one row through a linear layer of the int4 runner."""
    return linear.out_features * linear.in_features


def linear_macs_per_row(runner) -> int:
    """Multiply-adds of one row through the layers' and the head's linear maps (int4 runner)."""
    linears = [runner.head] + [lin for layer in runner.layers for lin in layer_linears(layer)]
    return sum(map(row_macs, linears))


def cached_layer_gmacs(runner, size: int) -> float:
    """Multiply-adds per second of the first layer's four linear layers on ``size`` rows, called
    again and again so that their weights stay in cache."""
    import torch

    linears = layer_linears(runner.layers[0])
    inputs = [torch.randn(size, lin.in_features) for lin in linears]
    macs = size * sum(map(row_macs, linears))
    times = []
    for _ in range(CACHED_CALLS + 1):
        start = time.perf_counter()
        for lin, x in zip(linears, inputs):
            lin(x)
        times.append(time.perf_counter() - start)
    return macs / statistics.median(times[1:]) / 1e9


def measure_roofline(int4_runner, sizes) -> dict | None:
    """The roofline's rates for an int4 runner (GMAC/s), None where the CPU extension has no
    AVX-512 VNNI build (its micro-kernels are VNNI code) and for mixture-of-experts models (a
    forward's rows read different experts: no one count of multiply-adds a row)."""
    if kernels.isa() != kernels.ISA_LEVELS.index("avx512"):
        return None
    if any(layer.moe is not None for layer in int4_runner.layers):
        return None
    ext = peak_kernels()
    return {"peak_gmacs": ext.int8_peak_macs(PEAK_ITERATIONS) / 1e9,
            "q4_mix_gmacs": ext.q4_mix_peak_macs(MIX_ITERATIONS) / 1e9,
            "macs_per_row": linear_macs_per_row(int4_runner),
            "cached_layer_gmacs": {str(size): cached_layer_gmacs(int4_runner, size)
                                   for size in sizes}}


def roofline_markdown(roofline: dict, forward_ms: dict[str, float], sizes) -> list[str]:
    """The report's roofline section: ``forward_ms`` is the int4 runner's row of the latency
    table (size -> ms)."""
    peak = roofline["peak_gmacs"]
    mix, per_row = roofline["q4_mix_gmacs"], roofline["macs_per_row"]
    lines = ["", "## Roofline of native int4", "",
             f"The machine's int8 multiply-add peak (VPDPBUSD alone, every thread): "
             f"**{peak:.0f} GMAC/s**. The Q4 kernel's own instruction mix on registers "
             f"(VPDPBUSD with its nibble unpacking and per-group float fold, no memory): "
             f"**{mix:.0f} GMAC/s** ({mix / peak:.0%} of the peak), the ceiling of GGUF "
             f"Q4_1 blocks short of AMX. A row's linear layers are "
             f"{per_row / 1e6:.1f} M multiply-adds.", "",
             "| rows | forward ms | linear ms at the peak | linear ms at the Q4 ceiling "
             "| linear GMAC/s over the forward | share of the peak "
             "| one layer's linears, weights in cache: GMAC/s | share of the peak |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sizes:
        ms = forward_ms[str(size)]
        rate = size * per_row / (ms / 1000) / 1e9
        cached = roofline["cached_layer_gmacs"][str(size)]
        lines.append(f"| {size} | {ms:.1f} | {size * per_row / peak / 1e6:.1f} "
                     f"| {size * per_row / mix / 1e6:.1f} | {rate:.0f} | {rate / peak:.0%} "
                     f"| {cached:.0f} | {cached / peak:.0%} |")
    return lines
