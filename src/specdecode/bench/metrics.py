"""Records -> ``summary.json``: per contender, overall and per task.

Aggregation (stated once here and in docs/bench.md):

- ``tokens_per_s`` = total new tokens / total wall time of the records in the cell (each
  record's wall time is the median of its repeats). This weights every request by its time, so
  one short answer cannot swing a task; Spec-Bench averages per-question speeds instead, which
  lets a 3-token answer count as much as a 128-token one.
- ``speedup_vs_ar`` = the cell's ``tokens_per_s`` / ``ar``'s ``tokens_per_s`` in the same cell
  (same run, same questions); ``speedup_vs_hf`` the same against the ``hf`` peer (plain
  ``transformers`` ``generate``), None when that peer did not run.
- ``overall`` pools every record of every task the same way (total tokens / total time).
- ``median_speedup_vs_ar``: the median over prompts of the per-prompt ratio, a check that the
  pooled figure is not carried by a few prompts.
- ``speedup_vs_ar_interval``: a 95% bootstrap interval of ``speedup_vs_ar`` over the prompts
  (question turns) of the cell, each drawn with its ``ar`` record: how far the pooled figure
  moves with which prompts were asked (and with each record's own timing noise); it does not
  cover drift of the machine between runs. None below ``INTERVAL_MIN_PROMPTS`` prompts.
- ``mean_accepted`` (tau): tokens committed per verify step, the prefill's token excluded - the
  engine's own accepted lengths for our methods; for peers, which do not expose per-step data,
  (new tokens - 1) / (target forwards - 1) per request, pooled.
- ``identical_fraction``: the share of records whose token ids equal ``ar``'s.
- ``draft_ms_per_token``: the proposer's time (drafting and learning from feedback) per draft
  node sent to the target, pooled; ``propose_share``: that time over the wall time. Our
  methods only (None for peers and for ``ar``, which drafts nothing).
- The prompt and what comes after it, where every record of the cell timed its prompt
  (``prefill_s``: from the request's start to the prompt's logits, so the time to the first
  token; ``llama-server``'s own prompt seconds for its peers; None otherwise):
  ``prompt_tokens_per_s`` = total prompt tokens / total prompt seconds, ``prefill_share`` =
  those seconds over the wall time, ``time_to_first_token_s`` = the median request's,
  ``decode_tokens_per_s`` = the tokens after each request's first / the wall time after its
  prompt, pooled, and ``decode_speedup_vs_ar`` that over ``ar``'s in the same cell: what a
  method does to the decoding, which every method's prompt seconds, paid alike, dilute in
  ``speedup_vs_ar``.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

from specdecode.questions import task_sort_key

FIELDS = ("tokens_per_s", "speedup_vs_ar", "speedup_vs_hf", "mean_accepted", "identical_fraction")
#: fewest prompts a cell's speedup interval is drawn from, and the resamples it takes
INTERVAL_MIN_PROMPTS = 5
RESAMPLES = 2000


def _cell(records: Sequence[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    steps = [n for r in records for n in (r["accepted_lengths"] or [])]
    if records and all(r["accepted_lengths"] is not None for r in records):
        accepted = sum(steps) / len(steps) if steps else None
    else:
        # peers: every forward after the prefill committed (tokens - 1) / (forwards - 1)
        after = sum(r["new_tokens"] - 1 for r in records)
        forwards = sum(r["target_forwards"] - 1 for r in records)
        accepted = after / forwards if forwards > 0 else None
    drafted = sum(r.get("draft_tokens") or 0 for r in records)
    proposing = sum(r.get("propose_s") or 0.0 for r in records)
    timed = records and all(r.get("propose_s") is not None for r in records)
    return _prompt_figures(records, wall) | {
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "mean_accepted": accepted,
        "draft_ms_per_token": 1000 * proposing / drafted if timed and drafted else None,
        "propose_share": proposing / wall if timed and wall > 0 else None,
        "identical_fraction": sum(r["identical_to_ar"] for r in records) / len(records),
        "new_tokens": tokens,
        "wall_s": wall,
        "target_forwards": sum(r["target_forwards"] for r in records),
        "records": len(records),
    }


def _prompt_figures(records: Sequence[dict], wall: float) -> dict:
    """The prompt's figures of a cell (see the module docstring); None where a record did not
    time its prompt."""
    prompted = bool(records) and all(r.get("prefill_s") is not None for r in records)
    prefill = sum(r["prefill_s"] for r in records) if prompted else 0.0
    after = wall - prefill
    prompt_tokens = sum(r.get("prompt_tokens") or 0 for r in records)
    return {
        "prompt_tokens_per_s": prompt_tokens / prefill if prompted and prefill > 0 else None,
        "prefill_share": prefill / wall if prompted and wall > 0 else None,
        "time_to_first_token_s": (statistics.median(r["prefill_s"] for r in records)
                                  if prompted else None),
        "decode_tokens_per_s": (sum(max(0, r["new_tokens"] - 1) for r in records) / after
                                if prompted and after > 0 else None),
    }


def _key(r: dict) -> tuple:
    return (r["question_id"], r["turn"])


def summarize(records: Sequence[dict]) -> dict:
    """``{"tasks": [...], "methods": {name: {"kind", "overall": {...}, "tasks": {task: {...}}}}}``"""
    names = list(dict.fromkeys(r["method"] for r in records))
    tasks = sorted({r["task"] for r in records}, key=task_sort_key)
    by_method = {n: [r for r in records if r["method"] == n] for n in names}
    ar_speed = {_key(r): r["new_tokens"] / r["wall_s"] for r in by_method.get("ar", [])
                if r["wall_s"] > 0}
    ar_record = {_key(r): (r["new_tokens"], r["wall_s"]) for r in by_method.get("ar", [])
                 if r["wall_s"] > 0}
    methods: dict[str, dict] = {}
    for name in names:
        rows = by_method[name]
        cells = {"overall": _cell(rows)}
        for task in tasks:
            task_rows = [r for r in rows if r["task"] == task]
            if task_rows:
                cells[task] = _cell(task_rows)
        for scope, cell in cells.items():
            scoped = rows if scope == "overall" else [r for r in rows if r["task"] == scope]
            ratios = [(r["new_tokens"] / r["wall_s"]) / ar_speed[_key(r)]
                      for r in scoped if _key(r) in ar_speed and r["wall_s"] > 0
                      and ar_speed[_key(r)] > 0]
            cell["median_speedup_vs_ar"] = statistics.median(ratios) if ratios else None
            cell["speedup_vs_ar_interval"] = speedup_interval(
                [(r["new_tokens"], r["wall_s"], *ar_record[_key(r)]) for r in scoped
                 if _key(r) in ar_record and r["wall_s"] > 0])
        methods[name] = {"kind": rows[0]["kind"], "cells": cells}
    for name, entry in methods.items():
        for scope, cell in entry["cells"].items():
            for ref, key, field in (("ar", "speedup_vs_ar", "tokens_per_s"),
                                    ("hf", "speedup_vs_hf", "tokens_per_s"),
                                    ("ar", "decode_speedup_vs_ar", "decode_tokens_per_s")):
                base = methods.get(ref, {}).get("cells", {}).get(scope)
                cell[key] = (cell[field] / base[field]
                             if base and cell[field] is not None and base[field] else None)
    return {
        "tasks": tasks,
        "methods": {
            name: {"kind": e["kind"], "overall": _rounded(e["cells"]["overall"]),
                   "tasks": {t: _rounded(c) for t, c in e["cells"].items() if t != "overall"}}
            for name, e in methods.items()
        },
    }


def speedup_interval(pairs: Sequence[tuple[int, float, int, float]],
                     level: float = 0.95) -> tuple[float, float] | None:
    """The ``level`` bootstrap interval (percentiles, ``RESAMPLES`` draws of a fixed seed) of
    the pooled speedup over prompts given as (tokens, wall seconds, ``ar``'s tokens, ``ar``'s
    wall seconds); None for fewer than ``INTERVAL_MIN_PROMPTS`` prompts."""
    if len(pairs) < INTERVAL_MIN_PROMPTS:
        return None
    rng = random.Random(0)
    ratios = []
    for _ in range(RESAMPLES):
        drawn = rng.choices(pairs, k=len(pairs))
        ar_speed = sum(p[2] for p in drawn) / sum(p[3] for p in drawn)
        ratios.append(sum(p[0] for p in drawn) / sum(p[1] for p in drawn) / ar_speed)
    ratios.sort()
    tail = (1.0 - level) / 2
    return ratios[int(tail * RESAMPLES)], ratios[int((1.0 - tail) * RESAMPLES) - 1]


def _rounded(cell: dict) -> dict:
    ordered = {k: cell[k] for k in FIELDS}
    ordered.update({k: v for k, v in cell.items() if k not in FIELDS})
    return {k: round(v, 4) if isinstance(v, float)
            else [round(x, 4) for x in v] if isinstance(v, tuple) else v
            for k, v in ordered.items()}


def accepted_histograms(records: Sequence[dict]) -> dict[str, dict[int, int]]:
    """method -> accepted length -> verify steps (methods that expose accepted lengths)."""
    out: dict[str, dict[int, int]] = {}
    for r in records:
        if r["accepted_lengths"] is None:
            continue
        hist = out.setdefault(r["method"], {})
        for n in r["accepted_lengths"]:
            hist[n] = hist.get(n, 0) + 1
    return {m: dict(sorted(h.items())) for m, h in out.items()}
