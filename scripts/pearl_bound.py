"""What PEARL (Liu et al., 2024, arXiv 2408.11850: draft and target run concurrently) could gain on
this machine with the default model's int4 copy drafting for its fp32 self.

PEARL gives the drafter and the target a core each and overlaps them: a round costs
max(gamma * d1, t1) instead of sequential drafting's gamma * d2 + t2 (d: one int4 draft token,
t: one fp32 verify pass of gamma + 1 rows; 1 or 2: the cores each gets). On 2 cores both
models lose a core, and both are bound by memory bandwidth that the cores share. This script
measures, on the same file:

- d and t on 1 and 2 threads, each model alone;
- d1 and t1 while the other model runs at the same time in another process on the other core
  (processes, so the two really run at once; the shared memory bandwidth shows here);

and prints each gamma's round cost both ways. Token counts per round are the same in both
schemes (PEARL's pre-/post-verify changes which tokens are drafted when, not the acceptance),
so the ratio of round costs is the speedup PEARL could give over sequential drafting.

    PYTHONPATH=src python scripts/pearl_bound.py --context 256 --reps 30
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

CHAIN = list(range(1000, 1016))


def runner(weights: str, context: int):
    from specdecode.models.loading import load_model, make_runner

    r = make_runner(load_model(), "native", weights)
    r.prefill(list(range(500, 500 + context)))
    return r


def timed(r, rows: int, reps: int) -> float:
    """Median seconds of one forward over a chain of ``rows - 1`` draft tokens (rows in all),
    nothing committed."""
    from specdecode.draft import Draft

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r.forward(CHAIN[0], Draft.chain(CHAIN[1:rows]))
        times.append(time.perf_counter() - t0)
        r.commit([])
    return statistics.median(times)


def _busy(weights: str, context: int, threads: int, ready, stop) -> None:
    """The other model, forwarding one row after another until told to stop."""
    torch.set_num_threads(threads)
    r = runner(weights, context)
    ready.set()
    while not stop.is_set():
        timed(r, 1, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--gammas", default="2,4,6,8,12")
    args = parser.parse_args()
    gammas = [int(g) for g in args.gammas.split(",")]
    rows = sorted({1} | {g + 1 for g in gammas})
    out: dict = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for weights in ("fp32", "int4"):
            r = runner(weights, args.context)
            out[f"{weights}_{threads}t_alone"] = {n: timed(r, n, args.reps) for n in rows}
    ctx = mp.get_context("spawn")
    torch.set_num_threads(1)
    for weights, other in (("fp32", "int4"), ("int4", "fp32")):
        ready, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_busy, args=(other, args.context, 1, ready, stop))
        proc.start()
        r = runner(weights, args.context)
        ready.wait()
        out[f"{weights}_1t_beside_{other}"] = {n: timed(r, n, args.reps) for n in rows}
        stop.set()
        proc.join()
    rounds = {}
    for g in gammas:
        sequential = g * out["int4_2t_alone"][1] + out["fp32_2t_alone"][g + 1]
        pearl = max(g * out["int4_1t_beside_fp32"][1], out["fp32_1t_beside_int4"][g + 1])
        rounds[g] = {"sequential_ms": round(1e3 * sequential, 2), "pearl_ms": round(1e3 * pearl, 2),
                     "pearl_speedup": round(sequential / pearl, 3)}
    print(json.dumps({"ms": {k: {n: round(1e3 * v, 2) for n, v in d.items()} for k, d in out.items()},
                      "round_cost": rounds}, indent=1))


if __name__ == "__main__":
    main()
