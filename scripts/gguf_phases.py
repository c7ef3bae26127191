"""Wall and CPU seconds, page faults and peak memory of each phase of generating from a GGUF
file (header and tokenizer, weights repacked, prefill, first token, the rest), as
`specdecode generate` does with `ar`. CPU seconds are the better guide on a loaded machine.

    python scripts/gguf_phases.py /work/gguf/syn-7b-q4_k_m.gguf 16
"""

from __future__ import annotations

import resource
import sys
import time


class Phases:
    def __init__(self):
        self.start = (time.perf_counter(), time.process_time())
        self.marks: list[tuple[str, float, float, int, float]] = []

    def mark(self, name: str) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.marks.append((name, time.perf_counter() - self.start[0],
                           time.process_time() - self.start[1], usage.ru_minflt,
                           usage.ru_maxrss / 1e6))  # kB -> GB

    def print(self) -> None:
        wall = cpu = faults = 0.0
        for name, w, c, f, rss in self.marks:
            print(f"{name:32s} wall {w - wall:7.1f} s  cpu {c - cpu:7.1f} s  "
                  f"page faults {(f - faults) * 4096 / 1e9:6.1f} GB  peak RSS {rss:5.2f} GB")
            wall, cpu, faults = w, c, f


def main() -> int:
    phases = Phases()
    from specdecode.api import Decoder, eos_ids
    from specdecode.models.loading import load_model, make_runner

    phases.mark("imports")
    loaded = load_model(sys.argv[1])
    phases.mark("header and tokenizer")
    runner = make_runner(loaded)
    phases.mark("weights repacked")
    decoder = Decoder(runner, loaded.tokenizer, "ar", eos_ids(loaded, loaded.tokenizer))
    prompt = "Hello, how are"
    runner.prefill(decoder.encode(prompt))
    phases.mark("warm-up prefill")
    first = True
    for _ in decoder.start(prompt, int(sys.argv[2]) if len(sys.argv) > 2 else 16):
        if first:
            phases.mark("prefill and first token")
            first = False
    phases.mark("the other tokens")
    phases.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
