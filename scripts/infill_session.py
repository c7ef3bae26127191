"""An editor plugin's session through llama.cpp's ``/infill``, as llama.vim asks: a ring of
chunks of other files (three 64-line chunks of other standard-library modules) sent first as a
warm-up (``n_predict`` 0), then the cursor down ``--lines`` code lines of ``textwrap.py`` one at
a time, each request with up to 256 lines before the cursor as ``input_prefix`` and 64 after it
as ``input_suffix`` (``--prefix-lines``, ``--suffix-lines``), the ring as ``input_extra``,
``n_indent`` the cursor line's indentation and ``n_predict`` 128 (llama.vim's defaults), greedy,
or with ``--sampling llama.vim`` as llama.vim samples (top-k 40, top-p 0.9 and llama.cpp's
infill sampler) seeded by the cursor's line, so that the methods' middles can be compared in
either case. Each method runs the
whole session on a server of its own (started here, so that no method reads rows another one
cached). Printed: per method, seconds a request (median), prompt tokens read and reused, tokens
written, and how many middles are the first method's.

    python scripts/infill_session.py --model qwen2.5-coder-1.5b --methods ar,suffix
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import subprocess
import sys
import time

import httpx

RING = ("shlex", "fnmatch", "ipaddress")
CHUNK_LINES, PREFIX_LINES, SUFFIX_LINES = 64, 256, 64


def lines_of(module: str) -> list[str]:
    return inspect.getsource(importlib.import_module(module)).splitlines(keepends=True)


#: each --sampling's fields (llama.vim's own: its samplers after top-k 40 and top-p 0.9)
SAMPLING = {"greedy": {"samplers": ["temperature"], "temperature": 0.0},
            "llama.vim": {"samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.9}}


def session(url: str, method: str, start: int, count: int, before: int = PREFIX_LINES,
            after: int = SUFFIX_LINES, sampling: str = "greedy") -> list[dict]:
    ring = [{"filename": f"{name}.py", "text": "".join(lines_of(name)[100:100 + CHUNK_LINES])}
            for name in RING]
    asked = {**SAMPLING[sampling], "specdecode": {"method": method}}
    with httpx.Client(timeout=600) as client:
        client.post(url + "/infill", json={"input_extra": ring, "n_predict": 0, **asked})
        lines, out, i = lines_of("textwrap"), [], start
        while len(out) < count:
            line = lines[i]
            if line.strip() and not line.lstrip().startswith("#"):
                body = {"input_prefix": "".join(lines[max(0, i - before):i]),
                        "input_suffix": "".join(lines[i + 1:i + 1 + after]),
                        "input_extra": ring, "prompt": "", "n_predict": 128,
                        "n_indent": len(line) - len(line.lstrip()), "seed": i, **asked}
                started = time.perf_counter()
                got = client.post(url + "/infill", json=body).json()
                got["seconds"] = time.perf_counter() - started
                out.append(got)
            i += 1
    return out


def serve(model: str, port: int, *options: str) -> subprocess.Popen:
    """``specdecode serve`` of ``model`` on ``port`` (with ``options``), once it answers."""
    server = subprocess.Popen([sys.executable, "-m", "specdecode", "serve", "--model", model,
                               "--port", str(port), *options], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--methods", default="ar,suffix")
    parser.add_argument("--lines", type=int, default=8)
    parser.add_argument("--start", type=int, default=300, help="textwrap.py's line to begin at")
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--prefix-lines", type=int, default=PREFIX_LINES,
                        help="lines before the cursor (llama.vim's n_prefix)")
    parser.add_argument("--suffix-lines", type=int, default=SUFFIX_LINES,
                        help="lines after the cursor (llama.vim's n_suffix)")
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy")
    args = parser.parse_args()
    first = None
    print(f"Python {sys.version.split()[0]}'s textwrap.py from line {args.start + 1}")
    for method in args.methods.split(","):
        server = serve(args.model, args.port)
        try:
            rows = session(f"http://127.0.0.1:{args.port}", method, args.start, args.lines,
                           args.prefix_lines, args.suffix_lines, args.sampling)
        finally:
            server.terminate()
            server.wait()
        contents = [r["content"] for r in rows]
        first = first or contents
        median = statistics.median

        def middle(key: str, of=rows) -> float:
            return median(r["timings"][key] if key in r["timings"] else r[key] for r in of)

        print(f"{method}: {median(r['seconds'] for r in rows):.2f} s a request, prompt "
              f"{median(r['tokens_evaluated'] for r in rows):.0f} tokens of which "
              f"{middle('cache_n'):.0f} reused, {middle('prompt_ms') / 1000:.2f} s; "
              f"{middle('predicted_n'):.0f} tokens written at "
              f"{middle('predicted_per_second'):.1f} a second; the first method's middle "
              f"{sum(a == b for a, b in zip(contents, first))}/{len(rows)}", flush=True)


if __name__ == "__main__":
    main()
