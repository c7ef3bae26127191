"""Is a short request held behind another client's long prompt?

Starts a real `specdecode serve --parallel 4` process (the code on PYTHONPATH, so the same script
measures two checkouts), then, on loopback:

  1. idle: a short completion (a few prompt tokens, ``--short-tokens`` new tokens) alone,
     ``--repeat`` times -> its latency without competition;
  2. stalled: a long prompt (``--long-tokens`` token ids, one new token) is sent, and once it is
     in the server (``--lead`` seconds later) the same short request goes to a free slot ->
     the short request's latency beside the long prefill, and the long request's own latency.

Both requests name the ``ar`` method, so only the scheduling differs between runs.

    PYTHONPATH=src python scripts/prefill_stall.py                       # this checkout
    PYTHONPATH=/path/to/other/src python scripts/prefill_stall.py        # another one
    python scripts/prefill_stall.py --long-tokens 2000 --repeat 1        # a quick check

Timings move with the machine's load: report ``uptime`` beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

from specdecode.server.loadtest import start_server, stop_server, wait_healthy

SHORT_PROMPT = "Say hi."


def completion(client: httpx.Client, url: str, prompt, max_tokens: int) -> float:
    """Seconds one non-streaming completion takes, client side (raises on a non-200); one
    ``client`` for every request (making one costs tens of milliseconds)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "specdecode": {"method": "ar"}}
    start = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise RuntimeError(f"status {r.status_code}: {r.text[:300]}")
    return elapsed


def long_prompt(tokens: int, vocab: int = 49152) -> list[int]:
    """Token ids of ordinary text tokens (a fixed pattern: the result does not matter)."""
    return [1000 + (i * 7919) % (vocab - 2000) for i in range(tokens)]


def measure(url: str, args) -> dict:
    with httpx.Client() as client:  # thread-safe: the long request's thread shares it
        completion(client, url, SHORT_PROMPT, args.short_tokens)  # warm-up
        idle = [completion(client, url, SHORT_PROMPT, args.short_tokens)
                for _ in range(args.repeat)]
        stalled, longs = [], []
        for _ in range(args.repeat):
            result = {}

            def send_long():
                result["long"] = completion(client, url, long_prompt(args.long_tokens), 1)

            thread = threading.Thread(target=send_long)
            thread.start()
            time.sleep(args.lead)
            stalled.append(completion(client, url, SHORT_PROMPT, args.short_tokens))
            thread.join(600)
            longs.append(result["long"])
    return {"idle_s": [round(t, 3) for t in idle],
            "beside_long_prefill_s": [round(t, 3) for t in stalled],
            "long_request_s": [round(t, 3) for t in longs],
            "median_idle_s": round(statistics.median(idle), 3),
            "median_beside_long_prefill_s": round(statistics.median(stalled), 3),
            "median_long_request_s": round(statistics.median(longs), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--long-tokens", type=int, default=7000)
    parser.add_argument("--short-tokens", type=int, default=4, help="new tokens of the short one")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lead", type=float, default=0.5,
                        help="seconds between sending the long prompt and the short one")
    parser.add_argument("--serve-args", default="--parallel 4",
                        help="extra `specdecode serve` arguments")
    args = parser.parse_args(argv)
    process = start_server(args.port, args.serve_args.split())
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, 600, process)
        print(json.dumps(measure(url, args), indent=1))
    finally:
        stop_server(process)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
