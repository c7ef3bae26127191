"""What speculation would give on another model: a projection from one run's acceptance and
another file's measured row costs.

A verify step of method m commits tau_m tokens (its mean accepted length), sends r_m rows to
the target (the root plus its mean draft size) and spends d_m on drafting (the proposer's time
per step: propose and observe). Its tokens per second on a target whose forward of r rows
costs c(r) is tau_m / (d_m + c(r_m)); plain decoding (``ar``) makes tau = 1 with r = 1, so

    projected speedup_m = [tau_m / (d_m + c(r_m))] / [1 / (d_ar + c(1))]

What it assumes (docs/bench.md says it too):
- acceptance (tau, draft sizes) carries over from the run's model to the projected one, as if
  both models agreed with their drafts equally often;
- drafting costs what it cost in the run: true of model-free proposers (ngram, suffix,
  lookahead, recycling's lookups), too little for drafters that run part of the target or a
  network sized by it (early_exit, draft heads, draft models), whose drafts grow with it;
- c(r) is linear between the measured sizes (1, 2, 4, 8, 16, 64 rows; beyond 64, the last
  segment's slope), and c at the mean draft size stands for the mean of c over the steps (exact
  where c is linear across the sizes a method sends);
- prefill, sampling and verification time are left out for every method alike.

Sources: ``records.jsonl`` of a ``specdecode bench`` run (or its folder) for tau, r and d per
method; a ``runners.json`` of ``specdecode bench --runners`` (or its ``forward_ms``) for c.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from specdecode.errors import SpecDecodeError, require


def method_steps(records: Iterable[dict]) -> dict[str, dict]:
    """Per method of a bench run: ``tau`` (tokens per verify step), ``rows`` (target rows per
    step: 1 + draft nodes), ``draft_ms`` (proposer time per step), ``steps``,
    ``measured_speedup`` (its pooled tokens/s over ar's in that run, prefill included) and
    ``measured_decode_speedup`` (the same after the prefill, which the projection leaves out;
    None for runs recorded without ``prefill_s``). Peers (no per-step data) are skipped."""
    cells: dict[str, dict] = {}
    for r in records:
        if r.get("kind", "method") != "method" or r.get("accepted_lengths") is None:
            continue
        cell = cells.setdefault(r["method"], {"steps": 0, "tokens": 0, "drafted": 0,
                                              "propose_s": 0.0, "new_tokens": 0, "wall_s": 0.0,
                                              "prefill_s": 0.0, "prefilled": True})
        cell["steps"] += len(r["accepted_lengths"])
        cell["tokens"] += sum(r["accepted_lengths"])
        cell["drafted"] += r.get("draft_tokens") or 0
        cell["propose_s"] += r.get("propose_s") or 0.0
        cell["new_tokens"] += r["new_tokens"]
        cell["wall_s"] += r["wall_s"]
        # runs recorded before prefill_s was: no decode-only speed
        cell["prefilled"] &= r.get("prefill_s") is not None
        cell["prefill_s"] += r.get("prefill_s") or 0.0
    require("ar" in cells, "the run has no 'ar' records: the projection needs ar as its "
                           "reference (every `specdecode bench` run has them)")
    ar = cells["ar"]
    out = {}
    for name, c in cells.items():
        if c["steps"] == 0:
            continue
        decode = None
        if c["prefilled"] and ar["prefilled"]:
            # the tokens after the prefill's first one, over the time after the prefill
            decode = (c["tokens"] / (c["wall_s"] - c["prefill_s"])) / \
                     (ar["tokens"] / (ar["wall_s"] - ar["prefill_s"]))
        out[name] = {"tau": c["tokens"] / c["steps"], "rows": 1 + c["drafted"] / c["steps"],
                     "draft_ms": 1000 * c["propose_s"] / c["steps"], "steps": c["steps"],
                     "measured_speedup": (c["new_tokens"] / c["wall_s"])
                     / (ar["new_tokens"] / ar["wall_s"]),
                     "measured_decode_speedup": decode}
    return out


def row_cost(costs: Mapping[int, float], rows: float) -> float:
    """c(rows), ms: linear between the measured sizes, the last segment's slope beyond them."""
    sizes = sorted(costs)
    require(len(sizes) >= 2 and sizes[0] == 1,
            f"row costs need 1 row and at least one more size, got {sizes}")
    if rows <= sizes[0]:
        return costs[sizes[0]]
    low, high = next(((a, b) for a, b in zip(sizes, sizes[1:]) if rows <= b),
                     (sizes[-2], sizes[-1]))
    return costs[low] + (costs[high] - costs[low]) / (high - low) * (rows - low)


def project(steps: Mapping[str, dict], costs: Mapping[int, float]) -> dict[str, float]:
    """method -> projected speedup over ``ar`` on a target with forward costs ``costs``
    (rows -> ms)."""
    ar = steps["ar"]
    ar_step = ar["draft_ms"] + row_cost(costs, 1)
    return {name: (s["tau"] / (s["draft_ms"] + row_cost(costs, s["rows"]))) * ar_step
            for name, s in steps.items()}


def load_steps(source: str | Path) -> tuple[dict[str, dict], str]:
    """(method_steps, what was read) from a bench folder or its ``records.jsonl``."""
    path = Path(source)
    if path.is_dir():
        path = path / "records.jsonl"
    require(path.is_file(), f"--project-from {source}: no records.jsonl there; give the --out "
                            "folder of a `specdecode bench` run (or its records.jsonl)")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SpecDecodeError(f"{path}, line {number}: not valid JSON "
                                          f"({exc.msg})") from None
    return method_steps(records), str(path)


def load_costs(source: str | Path) -> tuple[dict[str, dict[int, float]], str]:
    """(runner -> {rows: ms}, what was read) from a ``--runners`` folder or its runners.json;
    the native runners' rows only (the projection is of our runner)."""
    path = Path(source)
    if path.is_dir():
        path = path / "runners.json"
    require(path.is_file(), f"--row-costs {source}: no runners.json there; give the --out "
                            "folder of a `specdecode bench --runners` run (or its runners.json)")
    try:
        forward = json.loads(path.read_text())["forward_ms"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise SpecDecodeError(f"{path} is not a runners.json of `specdecode bench --runners` "
                              "(no forward_ms)") from None
    return native_costs(forward), str(path)


def native_costs(forward_ms: Mapping[str, Mapping]) -> dict[str, dict[int, float]]:
    return {name: {int(k): float(v) for k, v in row.items()}
            for name, row in forward_ms.items() if name.startswith("native")}


def projection_markdown(steps: Mapping[str, dict], costs: Mapping[str, Mapping[int, float]],
                        steps_from: str, costs_from: str) -> str:
    """The projection table: each method's measured figures beside its projected speedup on
    every runner in ``costs``."""
    require(costs, f"{costs_from} has no native runner rows to project on")
    projected = {runner: project(steps, c) for runner, c in costs.items()}
    lines = ["## Projection: each method's speedup over ar with these row costs", "",
             f"Acceptance, rows and draft time per step from {steps_from}; forward costs c(rows) "
             f"from {costs_from}. Projected speedup = [tau / (draft + c(rows))] / "
             "[1 / (ar's draft + c(1))]. A projection, not a measurement: it assumes the "
             "acceptance carries over and drafting costs what it cost in that run (too little "
             "for drafters that run the target's layers or a network sized by it: early_exit, "
             "heads, draft models); see docs/bench.md.", "",
             "| method | tau | rows / step | draft ms / step | measured speedup (that run) | "
             "measured, after the prefill | "
             + " | ".join(f"projected, {runner}" for runner in costs) + " |",
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(costs)]
    for name, s in steps.items():
        cells = [f"{projected[runner][name]:.2f}x" for runner in costs]
        decode = s["measured_decode_speedup"]
        lines.append(f"| {name} | {s['tau']:.2f} | {s['rows']:.2f} | {s['draft_ms']:.3f} | "
                     f"{s['measured_speedup']:.2f}x | "
                     f"{'-' if decode is None else f'{decode:.2f}x'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
