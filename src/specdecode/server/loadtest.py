"""A bounded load test of a running server: every response complete and correct, none lost.

1. Reference: each prompt once, alone, greedy (the single-request output).
2. Load: ``requests`` greedy requests (prompt ``i % len(prompts)``, every other one streamed)
   from ``concurrency`` client threads at once, all within ``time_limit`` seconds.
3. Check: exactly one response per request, each finished (``[DONE]`` for streams), each
   response id unique, each text equal to its prompt's reference (so no two requests were
   mixed up); report requests/s, p50/p95 latency and tokens/s.

    python scripts/loadtest.py --requests 64 --concurrency 8      # starts `specdecode serve`
    python scripts/loadtest.py --url http://127.0.0.1:8000         # or use a running server
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

#: varied prompts: chat, code, lists, translation, so references differ and mix-ups show
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "List five countries in South America and their capitals.",
    "Explain in two sentences what a hash table is.",
    "Translate to French: The weather is nice today and I am going to the park.",
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Give three tips for writing clear commit messages.",
]


@dataclass
class Outcome:
    index: int
    prompt: int
    stream: bool
    text: str = ""
    response_id: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None


@dataclass
class LoadReport:
    requests: int
    concurrency: int
    wall_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    #: responses complete and equal to their prompt's single-request output
    correct: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def percentile(self, q: float) -> float:
        values = sorted(o.latency_s for o in self.outcomes if o.error is None)
        if not values:
            return 0.0
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]

    def as_dict(self) -> dict:
        tokens = sum(o.completion_tokens for o in self.outcomes)
        return {
            "requests": self.requests, "concurrency": self.concurrency,
            "completed": sum(o.error is None for o in self.outcomes),
            "correct": self.correct,
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.requests / self.wall_s, 3) if self.wall_s else 0.0,
            "p50_latency_s": round(self.percentile(0.5), 3),
            "p95_latency_s": round(self.percentile(0.95), 3),
            "completion_tokens": tokens,
            "tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s else 0.0,
            "problems": self.problems[:20],
        }


def _body(model: str, prompt: str, max_tokens: int, stream: bool, method: str | None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if method:
        body["specdecode"] = {"method": method}
    return body


def request_once(client: httpx.Client, url: str, body: dict, timeout: float) -> Outcome:
    """One chat request (streamed or not); fills text, id, finish reason and tokens."""
    out = Outcome(-1, -1, body["stream"])
    start = time.perf_counter()
    try:
        if not body["stream"]:
            r = client.post(url, json=body, timeout=timeout)
            data = r.json()
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {data}")
            out.text = data["choices"][0]["message"]["content"]
            out.finish_reason = data["choices"][0]["finish_reason"]
            out.response_id = data["id"]
            out.completion_tokens = data["usage"]["completion_tokens"]
        else:
            body = dict(body, stream_options={"include_usage": True})
            done = False
            with client.stream("POST", url, json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"stream error: {chunk['error']}")
                    out.response_id = chunk["id"]
                    for choice in chunk["choices"]:
                        out.text += choice["delta"].get("content") or ""
                        out.finish_reason = choice["finish_reason"] or out.finish_reason
                    if chunk.get("usage"):
                        out.completion_tokens = chunk["usage"]["completion_tokens"]
            if not done:
                raise RuntimeError("the stream ended without [DONE]")
    except Exception as exc:  # recorded, then reported as a problem
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - start
    return out


def run_load(base_url: str, model: str, prompts: list[str], requests: int, concurrency: int,
             max_tokens: int, time_limit: float, method: str | None = None) -> LoadReport:
    """Each prompt alone first (the reference answers), then ``requests`` requests from
    ``concurrency`` clients at once, every other one streamed; each answer is checked against
    its prompt's reference."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    deadline = time.monotonic() + time_limit
    references = []
    with httpx.Client() as client:
        for prompt in prompts:
            ref = request_once(client, url, _body(model, prompt, max_tokens, False, method),
                               max(1.0, deadline - time.monotonic()))
            if ref.error:
                raise RuntimeError(f"reference request failed: {ref.error}")
            references.append(ref)
    start = time.perf_counter()
    outcomes = _concurrent_requests(url, model, prompts, requests, concurrency, max_tokens,
                                    deadline, method)
    report = LoadReport(requests, concurrency, time.perf_counter() - start, outcomes)
    _check(report, references)
    return report


def _concurrent_requests(url: str, model: str, prompts: list[str], requests: int,
                         concurrency: int, max_tokens: int, deadline: float,
                         method: str | None) -> list[Outcome]:
    """``requests`` requests (prompts in turn, odd ones streamed) from ``concurrency`` client
    threads; a request not started by ``deadline`` is an error outcome."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    next_index = iter(range(requests))

    def client_thread() -> None:
        with httpx.Client() as client:
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None:
                    return
                left = deadline - time.monotonic()
                p = index % len(prompts)
                if left <= 0:
                    out = Outcome(index, p, index % 2 == 1, error="time limit reached first")
                else:
                    out = request_once(client, url,
                                       _body(model, prompts[p], max_tokens, index % 2 == 1, method),
                                       left)
                out.index, out.prompt = index, p
                with lock:
                    outcomes.append(out)

    threads = [threading.Thread(target=client_thread) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def _check(report: LoadReport, references: list[Outcome]) -> None:
    """Problems into ``report``: lost or repeated requests, duplicate ids, errors, answers
    unlike their prompt's reference; the rest counts as correct."""
    outcomes = report.outcomes
    seen = sorted(o.index for o in outcomes)
    if seen != list(range(report.requests)):
        report.problems.append(f"requests lost or repeated: got {len(seen)} outcomes for "
                               f"{report.requests} requests")
    ids = [o.response_id for o in outcomes if o.error is None]
    if len(set(ids)) != len(ids):
        report.problems.append("duplicate response ids")
    for o in sorted(outcomes, key=lambda o: o.index):
        ref = references[o.prompt]
        if o.error:
            report.problems.append(f"request {o.index}: {o.error}")
        elif o.text != ref.text or o.finish_reason != ref.finish_reason:
            report.problems.append(f"request {o.index} (prompt {o.prompt}, "
                                   f"{'stream' if o.stream else 'json'}): response differs from "
                                   f"the single-request output")
        else:
            report.correct += 1


def wait_healthy(base_url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {base_url} was not healthy after {timeout:.0f} s")


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    """``specdecode serve`` in a child process (stopped with SIGINT, so caches get saved)."""
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port),
           "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, env=dict(os.environ))


def stop_server(process: subprocess.Popen, timeout: float = 60) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--port", type=int, default=8765, help="port of the started server")
    parser.add_argument("--serve-args", default="",
                        help="extra `specdecode serve` arguments of the started server")
    parser.add_argument("--model", default="smollm2", help="model name sent in requests")
    parser.add_argument("--method", default=None, help="method per request (default: the server's)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds for everything")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    process = None
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        process = start_server(args.port, args.serve_args.split())
    try:
        wait_healthy(url, 300, process)
        report = run_load(url, args.model, PROMPTS, args.requests, args.concurrency,
                          args.max_tokens, args.time_limit, args.method)
    finally:
        if process is not None:
            stop_server(process)
    data = report.as_dict()
    if args.json:
        print(json.dumps(data))
    else:
        print(f"{data['completed']}/{data['requests']} requests completed, "
              f"{data['correct']} correct, {args.concurrency} concurrent clients, "
              f"{data['wall_s']:.1f} s")
        print(f"requests/s {data['requests_per_s']:.2f}   p50 latency {data['p50_latency_s']:.2f} s"
              f"   p95 latency {data['p95_latency_s']:.2f} s   tokens/s {data['tokens_per_s']:.1f}")
        for problem in data["problems"]:
            print("PROBLEM:", problem)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
