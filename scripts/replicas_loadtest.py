"""`specdecode serve --replicas 2` against one process, on repeated similar requests.

Workload: server_warmup.py's code-edit instruction over its 24 Python functions (each request a
different function), greedy, `suffix`, from ``--concurrency`` clients at once, all within a time
limit. Each configuration is a fresh `specdecode serve` process (no saved tree), so every one
learns from the same responses in the same order of arrival:

  one process, --parallel 2 / --parallel 1     (torch's threads: every core)
  --replicas 2                                 (cores / 2 threads each, one shared memory)
  --replicas 2 --no-shared-memory              (each replica learns only its own responses)
  --replicas 2, one replica killed (SIGKILL) after --kill-after responses   (with --fault)

Reported per configuration: requests/s, p50/p95 latency, tokens/s, mean accepted length
(tokens per verify step over all requests), and whether every response's token ids equal the
first configuration's (lossless, whichever replica served it). With --fault, also the requests
lost (must be 0) and the ingress's retries (``GET /health``).

    python scripts/replicas_loadtest.py --concurrency 4 --max-tokens 96 --fault
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from server_warmup import FUNCTIONS, send
from specdecode.server.loadtest import start_server, stop_server, wait_healthy

CONFIGS = {
    "one process --parallel 2": ["--parallel", "2"],
    "one process --parallel 1": ["--parallel", "1"],
    "--replicas 2": ["--replicas", "2", "--parallel", "1"],
    "--replicas 2 --no-shared-memory": ["--replicas", "2", "--parallel", "1",
                                        "--no-shared-memory"],
}
FAULT = "--replicas 2 + one replica killed"


def replica_pids() -> list[int]:
    """Processes of this machine's Serve engine replicas (Ray names them in their command)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "ServeReplica:specdecode:EngineReplica" in command:
                pids.append(int(entry.name))
    return pids


def run(label: str, serve_args: list[str], args, kill_after: int | None) -> dict:
    process = start_server(args.port, serve_args)
    url = f"http://127.0.0.1:{args.port}"
    functions = FUNCTIONS[:args.requests]
    rows: list[dict | None] = [None] * len(functions)
    done = threading.Semaphore(0)
    killed: list[int] = []
    try:
        wait_healthy(url, 600, process)

        def one(i: int) -> None:
            try:
                with httpx.Client() as client:
                    rows[i] = send(client, url, "suffix", functions[i], args.max_tokens)
            except Exception as exc:  # counted as lost below
                print(f"  request {i} failed: {exc}", file=sys.stderr)
            done.release()

        def killer() -> None:
            for _ in range(kill_after):
                done.acquire()
            pids = replica_pids()
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

        thread = threading.Thread(target=killer) if kill_after is not None else None
        if thread:
            thread.start()
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, range(len(functions))))
        wall = time.perf_counter() - start
        if thread:
            thread.join()
        health = httpx.get(url + "/health", timeout=10).json()
    finally:
        stop_server(process)
    ok = [r for r in rows if r is not None]
    latencies = sorted(r["latency_s"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    steps = sum(r["tokens"] / r["mean_accepted"] for r in ok if r["mean_accepted"])

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, max(0, math.ceil(q * len(latencies)) - 1))]

    result = {"config": label, "serve_args": " ".join(serve_args), "requests": len(functions),
              "completed": len(ok), "wall_s": round(wall, 2),
              "requests_per_s": round(len(ok) / wall, 3), "p50_latency_s": round(pct(0.5), 2),
              "p95_latency_s": round(pct(0.95), 2), "tokens_per_s": round(tokens / wall, 2),
              "mean_accepted": round(tokens / steps, 3) if steps else 0.0,
              "token_ids": [r["token_ids"] if r else None for r in rows]}
    if kill_after is not None:
        result.update(killed_pid=killed, retries=health.get("retries"),
                      failures=health.get("failures"))
    print(f"  {label}: {json.dumps({k: v for k, v in result.items() if k != 'token_ids'})}",
          file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--requests", type=int, default=24,
                        help=f"the first N functions (default 24, the docs' runs; at most "
                             f"{len(FUNCTIONS)})")
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated subset of: " + "; ".join(CONFIGS))
    parser.add_argument("--fault", action="store_true",
                        help="also run --replicas 2 and SIGKILL one replica mid-run")
    parser.add_argument("--kill-after", type=int, default=6,
                        help="responses completed before the kill (with --fault)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    results = [run(label, CONFIGS[label], args, None) for label in args.configs.split(",")]
    if args.fault:
        results.append(run(FAULT, CONFIGS["--replicas 2"], args, args.kill_after))
    reference = results[0]["token_ids"]
    for r in results:
        r["identical"] = r.pop("token_ids") == reference
    if args.json:
        print(json.dumps(results))
    else:
        print(f"\n{args.requests} code-edit requests, {args.concurrency} concurrent clients, "
              f"max_tokens {args.max_tokens}, greedy, suffix\n")
        print("| configuration | completed | wall | requests/s | p50 latency | p95 latency | "
              "tokens/s | mean accepted length | identical |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in results:
            print(f"| {r['config']} | {r['completed']}/{r['requests']} | {r['wall_s']:.1f} s | "
                  f"{r['requests_per_s']:.2f} | {r['p50_latency_s']:.2f} s | "
                  f"{r['p95_latency_s']:.2f} s | {r['tokens_per_s']:.1f} | "
                  f"{r['mean_accepted']:.2f} | {'yes' if r['identical'] else 'NO'} |")
        for r in results:
            if "retries" in r:
                print(f"\n{r['config']}: pid {r['killed_pid']} killed after {args.kill_after} "
                      f"responses; {r['requests'] - r['completed']} requests lost, "
                      f"{r['retries']} retried by the ingress, {r['failures']} failed")
    return 0 if all(r["identical"] and r["completed"] == r["requests"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
