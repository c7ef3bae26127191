"""Does the server's shared suffix tree pay off on repeated, similar requests?

Workload: the same code-edit instruction ("add type hints and a docstring") over different
Python functions, sent one at a time (greedy), as an agent or an IDE would. Each phase runs a
real `specdecode serve` process (one slot, so timings are per request):

  A. fresh server, `suffix`: the TRAIN functions in order -> the warm-up curve (first requests
     vs the last ones), then `ar` over the EVAL functions (the baseline; ar leaves the tree
     alone); shut down, saving the tree (--suffix-cache).
  B. restarted WITH the saved tree: `suffix` over the EVAL functions.
  C. restarted WITHOUT it: `suffix` over the EVAL functions (a cold tree).

Reported per phase: tokens/s (completion tokens / request latency, client side) and mean
accepted length; the EVAL outputs of B and C must equal ar's token ids (lossless).

    python scripts/server_warmup.py --train 16 --eval 8 --max-tokens 128     # the README run
    python scripts/server_warmup.py --train 3 --eval 2 --max-tokens 32       # a quick check
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdecode.bench.code_edit import FUNCTIONS, INSTRUCTION
from specdecode.server.loadtest import start_server, stop_server, wait_healthy


def send(client: httpx.Client, url: str, method: str, code: str, max_tokens: int) -> dict:
    body = {"model": f"smollm2+{method}", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": INSTRUCTION.format(code=code)}],
            "specdecode": {"return_token_ids": True}}
    start = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=body, timeout=600)
    latency = time.perf_counter() - start
    r.raise_for_status()
    data = r.json()
    usage = data["usage"]
    return {"method": method, "token_ids": data["choices"][0]["token_ids"],
            "tokens": usage["completion_tokens"], "latency_s": latency,
            "tokens_per_s": usage["completion_tokens"] / latency,
            "mean_accepted": usage["mean_accepted_length"]}


def summary(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["latency_s"] for r in rows)
    steps = sum(r["tokens"] / r["mean_accepted"] for r in rows if r["mean_accepted"])
    return {"requests": len(rows), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "mean_accepted": round(tokens / steps, 3) if steps else 0.0}


def phase(port: int, serve_args: list[str], work: list[tuple[str, list[str]]],
          max_tokens: int) -> dict[str, list[dict]]:
    """Start a server, send each (method, functions) batch in order, stop it (saving)."""
    process = start_server(port, ["--parallel", "1", *serve_args])
    url = f"http://127.0.0.1:{port}"
    out: dict[str, list[dict]] = {}
    try:
        wait_healthy(url, 600, process)
        with httpx.Client() as client:
            for label, (method, functions) in work:
                out[label] = [send(client, url, method, f, max_tokens) for f in functions]
                for i, row in enumerate(out[label]):
                    print(f"  {label:>12} {i:2d}: {row['tokens']:4d} tokens "
                          f"{row['tokens_per_s']:6.2f} tok/s  tau {row['mean_accepted']:.2f}",
                          file=sys.stderr, flush=True)
    finally:
        stop_server(process)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=16, help="functions that warm the tree")
    parser.add_argument("--eval", type=int, default=8, help="held-out functions measured")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--head", type=int, default=3,
                        help="requests counted as 'first' and as 'last' of the warm-up curve")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--cache", type=Path, default=None,
                        help="suffix cache file (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.train + args.eval > len(FUNCTIONS):
        parser.error(f"--train + --eval must be at most {len(FUNCTIONS)}")
    train = FUNCTIONS[:args.train]
    held_out = FUNCTIONS[args.train:args.train + args.eval]
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or Path(tmp) / "suffix.json"
        cache.unlink(missing_ok=True)
        print("A: fresh server, warm-up over TRAIN, ar over EVAL", file=sys.stderr)
        a = phase(args.port, ["--suffix-cache", str(cache)],
                  [("warm-up", ("suffix", train)), ("ar", ("ar", held_out))], args.max_tokens)
        print("B: restarted with the saved tree", file=sys.stderr)
        b = phase(args.port, ["--suffix-cache", str(cache)],
                  [("with cache", ("suffix", held_out))], args.max_tokens)
        print("C: restarted without it", file=sys.stderr)
        c = phase(args.port, [], [("no cache", ("suffix", held_out))], args.max_tokens)

    curve = a["warm-up"]
    result = {
        "workload": f"code edit x {args.train} train + {args.eval} eval functions, "
                    f"max_tokens {args.max_tokens}, greedy, one request at a time",
        "warm-up first": summary(curve[:args.head]),
        "warm-up last": summary(curve[-args.head:]),
        "eval ar": summary(a["ar"]),
        "eval suffix, restarted without cache": summary(c["no cache"]),
        "eval suffix, restarted with cache": summary(b["with cache"]),
        "eval first request, without cache": summary(c["no cache"][:1]),
        "eval first request, with cache": summary(b["with cache"][:1]),
        "identical to ar": all(x["token_ids"] == y["token_ids"] == z["token_ids"] for x, y, z
                               in zip(a["ar"], b["with cache"], c["no cache"])),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\n{result['workload']}\n")
    print("| requests | tokens/s | mean accepted length |")
    print("|---|---:|---:|")
    for key, row in result.items():
        if isinstance(row, dict):
            print(f"| {key} ({row['requests']}) | {row['tokens_per_s']:.2f} | "
                  f"{row['mean_accepted']:.2f} |")
    print(f"\noutputs identical to ar: {'yes' if result['identical to ar'] else 'NO'}")
    return 0 if result["identical to ar"] else 1


if __name__ == "__main__":
    sys.exit(main())
