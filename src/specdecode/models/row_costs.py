"""The row-cost curve of a target: seconds of one forward by the rows it runs.

A scheduler that decodes many sequences in one forward (``Runner.run_packed``) weighs a draft
row's expected accepted tokens against what the row adds to the forward; on a CPU the linear
layers read their weights once for all rows, so the curve starts flat and turns linear once the
rows' arithmetic outweighs the weights' memory traffic (docs/native-runner.md). The curve is
measured on a scratch replica (the runner's own cache is never touched): one sequence's root
and a chain of ``rows - 1`` draft tokens a forward, after a one-token prompt.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.models.base import Runner

#: row counts measured by default (a forward of the native runner holds at most 256 draft rows)
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: timed forwards per row count (after one warm-up forward of the most rows); the median is kept, as other processes only
#: ever slow a forward down
REPEATS = 3


def measure_row_costs(runner: Runner, rows: Sequence[int] = DEFAULT_ROWS,
                      repeats: int = REPEATS) -> dict[int, float]:
    """{rows: median seconds of one forward of that many rows} on a replica of ``runner``."""
    require(len(rows) > 0 and all(isinstance(n, int) and n >= 1 for n in rows),
            f"row counts must be positive integers, got {list(rows)}")
    require(repeats >= 1, f"repeats must be at least 1, got {repeats}")
    scratch = runner.replica()
    scratch.prefill([0])

    def seconds(n: int) -> float:
        start = time.perf_counter()
        scratch.forward(0, Draft.chain([0] * (n - 1)))
        took = time.perf_counter() - start
        scratch.commit([])
        return took

    seconds(max(rows))  # warms up the allocator and the caches; not kept
    return {n: statistics.median(seconds(n) for _ in range(repeats)) for n in rows}
