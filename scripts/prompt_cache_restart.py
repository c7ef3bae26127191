"""A long prompt across a server restart (``serve --prompt-cache-file``): a request whose system
prompt holds the first ``--chars`` characters of a standard-library module (``difflib``, as an
agent's instructions and tool definitions would be), answered by a freshly started server, then
the same request after the server was stopped and started again. Printed for each: seconds to
start, seconds for the request (greedy, 32 tokens), prompt tokens and those read from the cache,
seconds to stop (the cache is written then), the file's size and the answer's beginning.

    python scripts/prompt_cache_restart.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import tempfile
import time
from pathlib import Path

import httpx

from infill_session import serve


def ask(url: str, system: str) -> tuple[float, dict]:
    started = time.perf_counter()
    answer = httpx.post(url + "/v1/chat/completions", timeout=3600, json={
        "model": "default", "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "system", "content": "You review this module:\n" + system},
                     {"role": "user", "content": "Which function compares two sequences?"}]})
    return time.perf_counter() - started, answer.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--chars", type=int, default=24000)
    parser.add_argument("--port", type=int, default=8014)
    args = parser.parse_args()
    system = inspect.getsource(difflib)[:args.chars]
    with tempfile.TemporaryDirectory() as folder:
        cache_file = Path(folder) / "prompts.safetensors"
        for run in ("first start", "after a restart"):
            started = time.perf_counter()
            server = serve(args.model, args.port, "--max-context", "16384",
                           "--prompt-cache-file", str(cache_file))
            up = time.perf_counter() - started
            try:
                seconds, answer = ask(f"http://127.0.0.1:{args.port}", system)
            finally:
                started = time.perf_counter()
                server.terminate()
                server.wait()
            down = time.perf_counter() - started
            usage = answer["usage"]
            print(f"{run}: started in {up:.1f} s; request {seconds:.2f} s, "
                  f"{usage['prompt_tokens']} prompt tokens, "
                  f"{usage['prompt_tokens_details']['cached_tokens']} from the cache; stopped "
                  f"in {down:.1f} s; file {cache_file.stat().st_size / 1e6:.0f} MB; "
                  f"{answer['choices'][0]['message']['content'][:60]!r}", flush=True)


if __name__ == "__main__":
    main()
