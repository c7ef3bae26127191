"""Time one linear layer in each integer format of the native runner, at a few row counts.

    PYTHONPATH=src python scripts/int8_rows.py                       # 576x1536 and 2048x8192
    PYTHONPATH=src python scripts/int8_rows.py --shapes 2048x8192 --rows 1 16 --rotate-mb 1200

Formats: int4 (GGUF Q4_1 blocks, ``quant.Int4Linear``), int8-channel (int8 with one scale per
output channel in the dense fp32-fma kernel: --weights int8 until block int8 replaced it) and
int8-block (``int8_blocks.Int8BlockLinear`` of float weights: group 32, float16 scales). Each timing is
the fastest of ``--repeat`` calls (other processes only ever slow a call down), in ms, with the
weight bytes a millisecond streams. ``--rotate-mb``: cycle through copies of the layer holding
at least that many MB, so that the weights come from memory rather than cache (this machine's
last-level cache may be large). The stream bandwidth printed first is the same kind of figure
for a plain sum over a buffer of ``--stream-mb`` MB: weight bytes over it are the memory bound
of one row. Shapes are [out x in].
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from specdecode import kernels
from specdecode.models.int8_blocks import Int8BlockLinear
from specdecode.models.quant import Int4Linear


class ChannelInt8:
    """--weights int8 before block int8: int8 weights with one float32 scale per output channel,
    s = max|w| / 127, in the dense kernel (one float fma per weight and row)."""

    def __init__(self, weight: torch.Tensor):
        self.scale = (weight.abs().amax(1) / 127).clamp_min(1e-12)
        codes = (weight / self.scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.packed = kernels.pack_dense(codes)
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.dense_linear(x, self.packed, self.out_features, self.scale, residual)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * 4


FORMATS = {
    "int4": Int4Linear.quantize,
    "int8-channel": ChannelInt8,
    "int8-block": Int8BlockLinear.quantize,
}


def fastest(call, repeat: int) -> float:
    """The fastest of ``repeat`` timed calls, in seconds (after one untimed call)."""
    call()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def stream_gbs(megabytes: int, repeat: int) -> float:
    buffer = torch.ones(megabytes * 2 ** 20 // 4)
    return buffer.numel() * 4 / fastest(buffer.sum, repeat) / 1e9


def copies(layer, rotate_mb: int) -> list:
    """``layer`` and enough copies of its packed weights to hold ``rotate_mb`` MB."""
    count = max(1, -(-rotate_mb * 2 ** 20 // layer.nbytes))
    out = [layer]
    for _ in range(count - 1):
        twin = object.__new__(type(layer))
        twin.__dict__.update(layer.__dict__, packed=layer.packed.clone())
        out.append(twin)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["576x1536", "2048x8192"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--rotate-mb", type=int, default=0)
    parser.add_argument("--stream-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"threads {torch.get_num_threads()}, load average {load:.1f}, "
          f"stream {stream_gbs(args.stream_mb, 10):.1f} GB/s over {args.stream_mb} MB")
    print(f"{'shape':>10} {'format':>13} {'MB':>6} " + " ".join(f"{m:>4} rows ms  GB/s" for m in args.rows))
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        out, inp = map(int, shape.split("x"))
        weight = torch.randn(out, inp, generator=gen) * 0.02
        for name in args.formats:
            layers = copies(FORMATS[name](weight), args.rotate_mb)
            cells = []
            for m in args.rows:
                x = torch.randn(m, inp, generator=gen)
                turn = iter(range(1 << 62))
                seconds = fastest(lambda: layers[next(turn) % len(layers)](x), args.repeat)
                cells.append(f"{seconds * 1e3:13.3f} {layers[0].nbytes / seconds / 1e9:5.1f}")
            print(f"{shape:>10} {name:>13} {layers[0].nbytes / 2 ** 20:6.2f} " + " ".join(cells))
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
