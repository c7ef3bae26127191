"""llama.cpp's own tools as peers: ``llama-bench`` (forward cost) and ``llama-perplexity``.

They are built from the llama.cpp sources vendored in the llama-cpp-python sdist (commands in
docs/bench.md) and found, in this order, in ``--llama-cpp DIR`` (the folder holding them, or a
build folder with ``bin/``), in the folder named by ``SPECDECODE_LLAMA_CPP``, then on ``PATH``.
Each runs as a process of its own through ``peer_process.run_tool``: a crash or an illegal
instruction becomes a failed peer in the report, never a failed run.

``llama-bench -p 1,2,4,8,16,64 -n G -d C -t T -r R -o json`` times, after ``C`` tokens already in
the cache (``-d``), one ``llama_decode`` of 1, 2, 4, 8, 16 and 64 new tokens (``pp``) and ``G``
single-token decodes (``tg``): the same shapes as our per-forward latency. Its ``pp`` batches
ask for the last row's logits only, where a verify pass needs every row's (the LM head on 63
more rows at 64: a few percent of a 7B model's work, a fifth of SmolLM2-135M's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
from pathlib import Path

from specdecode.bench.peer_process import PeerFailed, run_tool

#: the environment variable naming the folder of llama.cpp's binaries (``--llama-cpp`` wins)
TOOLS_ENV = "SPECDECODE_LLAMA_CPP"
#: repetitions of each llama-bench test (it reports each; we keep the median)
BENCH_REPETITIONS = 5


def find_tool(name: str, directory: str | None = None) -> Path | None:
    """The binary ``name`` in ``directory``, ``$SPECDECODE_LLAMA_CPP`` or ``PATH``; None if
    absent."""
    for folder in (directory, os.environ.get(TOOLS_ENV)):
        if folder:
            for candidate in (Path(folder) / name, Path(folder) / "bin" / name,
                              Path(folder) / "build" / "bin" / name):
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def llama_bench_argv(tool: Path, gguf: Path, sizes, context: int, threads: int,
                     gen_tokens: int, repetitions: int = BENCH_REPETITIONS) -> list[str]:
    return [str(tool), "-m", str(gguf), "-p", ",".join(map(str, sizes)), "-n", str(gen_tokens),
            "-d", str(context), "-t", str(threads), "-r", str(repetitions), "-o", "json"]


def parse_llama_bench(text: str, sizes) -> dict:
    """``{"forward_ms": {size: ms}, "decode_tokens_per_s": x}`` from ``llama-bench -o json``
    (each test's median sample: one ``pp`` forward of ``size`` tokens, ``tg`` tokens one at a
    time)."""
    try:
        tests = json.loads(text[text.index("["):])
    except ValueError:
        raise PeerFailed("llama-bench", f"its output is not JSON: {text[:200]!r}") from None
    forward, decode = {}, None
    for test in tests:
        median_s = statistics.median(test["samples_ns"]) / 1e9
        if test["n_prompt"] > 0 and test["n_gen"] == 0:
            forward[int(test["n_prompt"])] = median_s * 1000
        elif test["n_gen"] > 0 and test["n_prompt"] == 0:
            decode = test["n_gen"] / median_s
    missing = [s for s in sizes if s not in forward]
    if missing:
        raise PeerFailed("llama-bench", f"no pp result for {missing}")
    return {"forward_ms": {s: forward[s] for s in sizes}, "decode_tokens_per_s": decode}


def llama_bench(tool: Path, gguf: Path, sizes, context: int, threads: int,
                gen_tokens: int = 32) -> dict:
    argv = llama_bench_argv(tool, gguf, sizes, context, threads, gen_tokens)
    result = parse_llama_bench(run_tool("llama-bench", argv), sizes)
    return {**result, "command": " ".join(argv)}


_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


def llama_perplexity(tool: Path, gguf: Path, text_file: Path, context: int, threads: int,
                     chunks: int | None = None) -> dict:
    """``llama-perplexity -m FILE -f TEXT -c CONTEXT``: its final estimate and chunk count.
    ``-b CONTEXT`` gives it one window per batch, as we compute them (its default packs
    several windows into one batch as separate sequences: the same windows, the same rule)."""
    argv = [str(tool), "-m", str(gguf), "-f", str(text_file), "-c", str(context),
            "-t", str(threads), "-b", str(context)]
    if chunks is not None:
        argv += ["--chunks", str(chunks)]
    log = run_tool("llama-perplexity", argv, with_stderr=True)  # it logs to both
    return {**parse_llama_perplexity(log), "command": " ".join(argv)}


def parse_llama_perplexity(log: str) -> dict:
    found = _PPL.search(log)
    if found is None:
        raise PeerFailed("llama-perplexity", "no 'Final estimate' in its output: "
                                             f"{log.strip().splitlines()[-1:] or ['(empty)']}")
    chunks = _CHUNKS.search(log)
    return {"perplexity": float(found.group(1)), "plus_minus": float(found.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None}
