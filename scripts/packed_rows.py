"""Time one packed forward of S sequences x (1 root + k draft rows) beside S solo forwards.

    PYTHONPATH=src python scripts/packed_rows.py                    # S 1 4 16 64, k 0 3 7
    PYTHONPATH=src python scripts/packed_rows.py --sequences 1 8 --drafts 3 --repeat 9

Each sequence is a replica of the default model's native runner (SmolLM2-135M, int4, the
cache cut to --max-context positions so that 64 replicas fit in about 1 GB), prefilled with a
prompt of its own length (between 64 and 191 tokens), so the sequences attend to caches of
different lengths. One measurement: every sequence verifies its root and a chain of k draft
tokens, either all in one ``run_packed`` or in S ``forward`` calls one after another; each
sequence then commits its root alone. Each cell is the median of --repeat measurements, in ms.
Then the row-cost curve of one forward by rows (``models/row_costs.py``). The run stops itself
after --budget-s seconds, printing what it has measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specdecode.draft import Draft
from specdecode.models.base import VerifyCall
from specdecode.models.loading import load_model, make_runner
from specdecode.models.row_costs import measure_row_costs


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 3, 7],
                        help="draft tokens per sequence (a chain)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--budget-s", type=float, default=300.0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    deadline = time.monotonic() + args.budget_s

    base = make_runner(load_model(), max_context=args.max_context)
    replicas = [base.replica() for _ in range(max(args.sequences))]
    for i, runner in enumerate(replicas):
        runner.prefill([(7 * i + j) % 1000 + 100 for j in range(64 + (37 * i) % 128)])
    print(f"{base.source}: {base.weights}, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'S':>3} {'k':>2} {'rows':>5} {'packed ms':>10} {'solo ms':>9} {'solo/packed':>11} "
          f"{'packed ms/seq':>13}")
    for s in args.sequences:
        for k in args.drafts:
            if time.monotonic() > deadline:
                print(f"stopped: the {args.budget_s:.0f} s budget is spent")
                return
            work = [(r, VerifyCall(5, Draft.chain([9] * k))) for r in replicas[:s]]

            def commit():
                for runner, _ in work:
                    runner.commit([])

            def packed():
                base.run_packed(work)

            def solo():
                for runner, call in work:
                    call.run(runner)

            times = {"packed": [], "solo": []}
            for _ in range(args.repeat + 1):  # the first round warms up and is not kept
                for name, run in (("packed", packed), ("solo", solo)):
                    times[name].append(timed(run))
                    commit()
            p, a = (statistics.median(times[n][1:]) * 1e3 for n in ("packed", "solo"))
            print(f"{s:>3} {k:>2} {s * (k + 1):>5} {p:>10.2f} {a:>9.2f} {a / p:>11.2f} {p / s:>13.2f}",
                  flush=True)
    costs = measure_row_costs(base)
    print("row-cost curve (one forward, one sequence): " +
          ", ".join(f"{n}: {t * 1e3:.2f} ms" for n, t in costs.items()))
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
