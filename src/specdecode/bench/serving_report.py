"""Figures and tables of ``scripts/serving_bench.py``: one cell per server x method x workload x
sampling x concurrency.

- aggregate tokens/s: completion tokens (each response's ``usage``) over the batch's wall time
  (first send to last answer);
- p50/p95 latency over completed requests, TTFT p50/p95 over completed streamed ones
  (nearest-rank percentiles, as :mod:`specdecode.server.loadtest`);
- mismatches: completed responses whose text or finish reason differs from the same request's
  answer when sent alone (the concurrency-1 cell of the same server, method, workload and
  sampling);
- problems: errors, missing or repeated responses, duplicate response ids.
"""

from __future__ import annotations

import math

from specdecode.bench.serving_client import Batch, Outcome


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def mismatches(outcomes: list[Outcome], references: dict[int, Outcome]) -> list[int]:
    """Indexes of complete responses that differ from their request's solo answer (text or
    finish reason). A request without a complete reference is not counted here: the
    reference cell reports its error."""
    found = []
    for o in outcomes:
        ref = references.get(o.index)
        if o.complete and ref is not None and ref.complete and \
                (o.text != ref.text or o.finish_reason != ref.finish_reason):
            found.append(o.index)
    return found


def problems(outcomes: list[Outcome], expected: list[int]) -> list[str]:
    """What is wrong with a batch apart from mismatches: every request answered exactly once,
    no error, each response id unique."""
    found = []
    seen = sorted(o.index for o in outcomes)
    if seen != sorted(expected):
        found.append(f"{len(seen)} outcomes for {len(expected)} requests (lost or repeated)")
    ids = [o.response_id for o in outcomes if o.error is None and o.response_id]
    if len(set(ids)) != len(ids):
        found.append(f"{len(ids) - len(set(ids))} duplicate response ids")
    found += [f"request {o.index}: {o.error}" for o in outcomes if o.error]
    return found


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def summarize(batch: Batch, references: dict[int, Outcome] | None) -> dict:
    """The figures of one batch (``references``: None for the reference batch itself)."""
    done = [o for o in batch.outcomes if o.complete]
    tokens = sum(o.completion_tokens for o in done)
    ttfts = [o.ttft_s for o in done if o.stream and o.ttft_s is not None]
    latencies = [o.latency_s for o in done]
    differ = [] if references is None else mismatches(batch.outcomes, references)
    return {
        "requests": len(batch.outcomes), "completed": len(done),
        "errors": sum(o.error is not None for o in batch.outcomes),
        "wall_s": round(batch.wall_s, 3), "completion_tokens": tokens,
        "tokens_per_s": round(tokens / batch.wall_s, 2) if batch.wall_s > 0 else 0.0,
        "p50_latency_s": _round(percentile(latencies, 0.5)),
        "p95_latency_s": _round(percentile(latencies, 0.95)),
        "ttft_p50_s": _round(percentile(ttfts, 0.5)),
        "ttft_p95_s": _round(percentile(ttfts, 0.95)),
        "mismatches": None if references is None else len(differ),
        "mismatched": differ,
        "problems": problems(batch.outcomes, [o.index for o in batch.outcomes]),
    }


def identical(a: list[Outcome], b: list[Outcome]) -> tuple[int, int]:
    """(requests whose complete answers are equal in both, requests complete in both)."""
    by_index = {o.index: o for o in b if o.complete}
    pairs = [(o, by_index[o.index]) for o in a if o.complete and o.index in by_index]
    return sum(x.text == y.text and x.finish_reason == y.finish_reason for x, y in pairs), \
        len(pairs)


def _fmt(x, spec: str = ".2f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def cell_key(cell: dict) -> tuple:
    return cell["server"], cell["workload"], cell["sampling"]


def markdown(meta: dict, cells: list[dict], checks: list[str]) -> str:
    """The report: the run's facts, the table (one row per cell), disconnect tests, targets."""
    lines = ["# Serving benchmark: many clients at once through the openai client", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "tok/s: completion tokens of all responses over the batch's wall time; vs 1: "
              "over the same server's tok/s with one client; latency and time to first token "
              "(TTFT, streamed requests) in seconds; mismatches: responses that differ from the "
              "same request sent alone; RSS: the server's peak resident memory.", "",
              "| server | workload | sampling | clients | tok/s | vs 1 | p50 | p95 | TTFT p50 | "
              "mismatches | errors | peak RSS |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    solo = {cell_key(c): c["tokens_per_s"] for c in cells
            if c.get("concurrency") == 1 and "tokens_per_s" in c}
    for c in cells:
        if "tokens_per_s" not in c:
            why = c.get("skipped", "not run")
            lines.append(f"| {c['server']} | {c['workload']} | {c['sampling']} | "
                         f"{c['concurrency']} | skipped: {why} |" + " - |" * 7)
            continue
        base = solo.get(cell_key(c))
        ratio = c["tokens_per_s"] / base if base else None
        mism = "reference" if c["mismatches"] is None else \
            f"{c['mismatches']}/{c['completed']}"
        rss = _fmt(c.get("peak_rss_mb"), ".0f", " MiB")
        lines.append(f"| {c['server']} | {c['workload']} | {c['sampling']} | {c['concurrency']} "
                     f"| {c['tokens_per_s']:.1f} | {_fmt(ratio, '.2f', 'x')} | "
                     f"{_fmt(c['p50_latency_s'])} | {_fmt(c['p95_latency_s'])} | "
                     f"{_fmt(c['ttft_p50_s'])} | {mism} | {c['errors']} | {rss} |")
    tests = [c for c in cells if c.get("disconnect")]
    if tests:
        lines += ["", "## Clients that hang up mid-stream", "",
                  "Half the streamed requests close their stream after a few chunks; the others "
                  "run to the end and must equal their solo answers; then the hung-up requests "
                  "are sent again, whole, and must too. Busy after: sequences still running or "
                  "queued once the clients are gone (0: nothing stuck).", "",
                  "| server | workload | clients | hung up | others correct | busy after | "
                  "resent correct | server-side outcomes |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        for c in tests:
            d = c["disconnect"]
            lines.append(f"| {c['server']} | {c['workload']} | {c['concurrency']} | "
                         f"{d['hung_up']} | {d['others_correct']}/{d['others']} | "
                         f"{_fmt(d['busy_after'], 'd')} | {d['resent_correct']}/{d['resent']} | "
                         f"{d.get('server_outcomes') or '-'} |")
    if checks:
        lines += ["", "## Exactness and targets", ""] + [f"- {a}" for a in checks]
    problems_ = [f"{c['server']} {c['workload']} {c['sampling']} x{c['concurrency']}: {p}"
                 for c in cells for p in c.get("problems", [])]
    if problems_:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in problems_[:50]]
    return "\n".join(lines) + "\n"


def targets(cells: list[dict], default_label: str, ar_label: str, llama_label: str) -> list[str]:
    """The serving targets, each checked where the run has the cells to check it: at 16 clients
    at least 4x one client's tok/s; the default method never below ar; ahead of
    llama-server."""
    by = {(c["server"], c["workload"], c["sampling"], c["concurrency"]): c for c in cells
          if "tokens_per_s" in c}
    out = []
    for (server, workload, sampling, clients), c in sorted(by.items()):
        if server == llama_label:
            continue
        solo = by.get((server, workload, sampling, 1))
        where = f"{workload}, {sampling}, {clients} client{'s' * (clients != 1)}"
        if clients == 16 and solo and solo["tokens_per_s"]:
            ratio = c["tokens_per_s"] / solo["tokens_per_s"]
            out.append(f"{server}, {workload}, {sampling}: 16 clients give {ratio:.2f}x one "
                       f"client ({'met' if ratio >= 4 else 'NOT met'}: at least 4x)")
        if server == default_label:
            ar = by.get((ar_label, workload, sampling, clients))
            if ar:
                ok = c["tokens_per_s"] >= ar["tokens_per_s"]
                out.append(f"{where}: {default_label} "
                           f"{c['tokens_per_s']:.1f} vs {ar_label} {ar['tokens_per_s']:.1f} tok/s "
                           f"({'met' if ok else 'NOT met'}: never below ar)")
        llama = by.get((llama_label, workload, sampling, clients))
        if llama:
            ok = c["tokens_per_s"] > llama["tokens_per_s"]
            out.append(f"{where}: {server} "
                       f"{c['tokens_per_s']:.1f} vs llama-server {llama['tokens_per_s']:.1f} "
                       f"tok/s ({'met' if ok else 'NOT met'}: ahead of llama-server)")
    return out
