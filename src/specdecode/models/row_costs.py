"""The row-cost curve of a target: seconds of one forward by the rows it runs.

A scheduler that decodes many sequences in one forward (``Runner.run_packed``) weighs a draft
row's expected accepted tokens against what the row adds to the forward; on a CPU the linear
layers read their weights once for all rows, so the curve starts flat and turns linear once the
rows' arithmetic outweighs the weights' memory traffic (docs/native-runner.md). The curve is
measured on a scratch replica (the runner's own cache is never touched): one sequence's root
and a chain of ``rows - 1`` draft tokens a forward, after a one-token prompt. The tokens are
spread over the vocabulary, as a draft's differ: a mixture-of-experts layer reads the union of
its rows' experts, so rows of one token would cost what a single row does.

:func:`cached_row_costs` measures a curve once per model file, weight format, machine (its CPU)
and thread count and keeps it under ``~/.cache/specdecode/row-costs`` (the first request on the
1.5B model pays a few seconds for it, later processes none); a runner that is not a file (a
model built in memory) is measured once per process.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from specdecode.cache import cache_root
from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.models.base import Runner

#: row counts measured by default (a forward of the native runner holds at most 256 draft rows)
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: row counts one sequence's drafts are sized over (the server's packed forwards use DEFAULT_ROWS)
SEQUENCE_ROWS = (1, 2, 4, 8, 16, 32, 64)
#: timed forwards per row count (after one warm-up forward of the most rows); the fastest is
#: kept, as other processes only ever slow a forward down
REPEATS = 5


def measure_row_costs(runner: Runner, rows: Sequence[int] = DEFAULT_ROWS,
                      repeats: int = REPEATS) -> dict[int, float]:
    """{rows: seconds of one forward of that many rows} on a replica of ``runner``: the fastest
    of ``repeats``, and never more than a forward of more rows took (a forward that took longer
    than a bigger one was slowed by something else: see :func:`settled`)."""
    require(len(rows) > 0 and all(isinstance(n, int) and n >= 1 for n in rows),
            f"row counts must be positive integers, got {list(rows)}")
    require(repeats >= 1, f"repeats must be at least 1, got {repeats}")
    scratch = runner.replica()
    scratch.prefill([0])
    # distinct tokens, a prime stride apart
    tokens = [(i * 7919) % runner.vocab_size for i in range(1, max(rows))]

    def seconds(n: int) -> float:
        start = time.perf_counter()
        scratch.forward(0, Draft.chain(tokens[:n - 1]))
        took = time.perf_counter() - start
        scratch.commit([])
        return took

    seconds(max(rows))  # warms up the allocator and the caches; not kept
    return settled({n: min(seconds(n) for _ in range(repeats)) for n in rows})


def settled(points: dict[int, float]) -> dict[int, float]:
    """The curve made non-decreasing in rows, each point lowered to the least of the points at
    more rows (more rows never cost less: a point above a later one was slowed down)."""
    out, least = {}, float("inf")
    for n in sorted(points, reverse=True):
        least = min(least, points[n])
        out[n] = least
    return dict(sorted(out.items()))


#: how curves are measured (kept curves of another version are measured again)
CURVE_VERSION = "v3: fastest of 5, settled, distinct tokens"
#: curves measured in this process, by key (runners that are no file are measured once here)
_MEASURED: dict[str, dict[int, float]] = {}


def cached_row_costs(runner: Runner, rows: Sequence[int] = SEQUENCE_ROWS) -> dict[int, float]:
    """:func:`measure_row_costs` of ``runner`` at ``rows``, measured only where neither this
    process nor the cache folder has the curve of this file, format, CPU and thread count."""
    key = _curve_key(runner)
    known = dict(_MEASURED.get(key, {}))
    file = _cache_file(key) if runner.cost_key() is not None else None
    if not set(rows) <= known.keys() and file is not None and file.is_file():
        try:
            known.update({int(r): float(s) for r, s in json.loads(file.read_text())["seconds"].items()})
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is measured again
    missing = sorted(set(rows) - known.keys())
    if missing:
        if file is not None:
            print(f"specdecode: measuring the {runner.name} runner's forward cost by rows "
                  f"({', '.join(map(str, missing))}); once for this model, format, CPU and "
                  f"thread count", file=sys.stderr)
        known = settled({**known, **measure_row_costs(runner, missing)})
        if file is not None:
            _write(file, key, known)
    _MEASURED[key] = known
    return {r: known[r] for r in rows}


def _curve_key(runner: Runner) -> str:
    """What the curve depends on: the weights (their file, or the runner's fingerprint), the
    CPU and the threads its forwards use."""
    # a runner that is no file: its kind, format and weights' fingerprint (runners of the same
    # weights then share one curve in a process, so seeded requests repeat across decoders)
    weights = runner.cost_key() or (f"{runner.name}:{getattr(runner, 'weights', '')}:"
                                    f"{runner.fingerprint()}")
    return f"{CURVE_VERSION}|{weights}|{cpu_name()}|threads={torch.get_num_threads()}"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file(key: str) -> Path:
    return cache_root() / "row-costs" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def _write(file: Path, key: str, seconds: dict[int, float]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")  # another process may write it too
    tmp.write_text(json.dumps({"key": key, "seconds": {str(r): s for r, s in sorted(seconds.items())}},
                              indent=1))
    tmp.replace(file)
