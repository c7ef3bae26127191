"""Serving many users at once: our server beside llama.cpp's ``llama-server``, through the
official ``openai`` client, on loopback (``scripts/serving_bench.py``; docs/server.md, "Serving
many users").

For each server (``specdecode serve`` with ``ar``, with the default method; ``llama-server``),
workload (:mod:`.serving_workloads`: Spec-Bench dev first turns, code edits, agents) and sampling
(greedy; temperature 0.7 seeded) the same ``--requests`` requests are sent at each concurrency,
1 first: the one-client answers are the references every loaded answer must equal. Each
concurrency gets a **fresh server process** with ``--parallel`` equal to it: the default
method's suffix memory must not have seen the answers before the batch it is timed on, and
llama-server's slots must number the clients. A warm-up request goes first, untimed.

At ``--disconnect-clients`` (default: the largest concurrency), greedy, first workload, the
clients that hang up mid-stream are tested (:func:`disconnect_test`). Every batch, every server
start and the whole run have time limits; servers are stopped on the way out, error or not.

Written into ``--out``: ``serving.json`` (meta and one entry per cell), ``serving.md`` (the
table), ``responses.jsonl`` (every answer, to look into mismatches) and ``logs/`` (each server's
output). Exit status 1 when one of our servers answered wrongly (a mismatch, an error, a lost or
repeated response); llama-server's mismatches are reported, not failed on: its batches are not
batch-invariant.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specdecode.bench.serving_client import Outcome, run_batch
from specdecode.bench.serving_report import (identical, markdown, mismatches,
                                             summarize, targets)
from specdecode.bench.serving_servers import (LLAMA_SERVER, OURS, ServerProcess, ServerSpec,
                                              command, free_port, llama_server_binary,
                                              sequence_outcomes, version, wait_idle)
from specdecode.bench.serving_workloads import (SAMPLINGS, WORKLOADS, Request, Sampling,
                                                build_workload, sampling_of)
from specdecode.errors import SpecDecodeError, require
from specdecode.models.parted import MEASURED_MODEL

#: chunks after which a hanging-up client closes its stream (the first carries only the role)
HANG_UP_AFTER = 3
#: positions a slot holds beyond the longest prompt and max_tokens (template differences)
CONTEXT_MARGIN = 64
WARM_UP = Request(-1, "warm-up", "warm-up", "Say hello.")
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
             "amx_int8", "amx_bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="serving-out", metavar="DIR",
                        help="output folder (created; serving.json, serving.md, "
                             "responses.jsonl and logs/ in it are replaced)")
    parser.add_argument("--servers", default="ar,default,llama-server",
                        help="comma-separated: our server with a method ('ar', 'default' = the "
                             "registry's default method, or any method name) and/or "
                             "'llama-server'")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, from {', '.join(WORKLOADS)}")
    parser.add_argument("--samplings", default=",".join(SAMPLINGS),
                        help="comma-separated: 'greedy' (temperature 0) and/or 'seeded' "
                             "(temperature 0.7, request i seeded --seed + i)")
    parser.add_argument("--concurrency", default="1,4,16,64",
                        help="comma-separated client counts (1 is always run first: the "
                             "reference answers)")
    parser.add_argument("--requests", type=int, default=64,
                        help="requests of each workload, the same at every concurrency (at "
                             "least the largest concurrency, so that every client is busy)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="first seed of the seeded sampling")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads of each server (OMP_NUM_THREADS for ours, -t/-tb for "
                             "llama-server)")
    parser.add_argument("--model", default=MEASURED_MODEL,
                        help=f"our server's --model (default {MEASURED_MODEL}, the model we "
                             "measure on; 'smollm2' for a quick run); llama-server gets its "
                             "GGUF file")
    parser.add_argument("--data", default=None, metavar="FILE",
                        help="Spec-Bench question file (default: the packaged dev half)")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR",
                        help="the folder of llama.cpp's llama-server (default: "
                             "$SPECDECODE_LLAMA_CPP, then PATH)")
    parser.add_argument("--serve-args", default="",
                        help="extra `specdecode serve` arguments (appended)")
    parser.add_argument("--llama-server-args", default="",
                        help="extra llama-server arguments (appended)")
    parser.add_argument("--disconnect-clients", type=int, default=None, metavar="N",
                        help="concurrency of the hang-up test (default: the largest; 0: none)")
    parser.add_argument("--batch-time-limit", type=float, default=900.0,
                        help="seconds one batch of requests may take")
    parser.add_argument("--time-limit", type=float, default=4 * 3600.0,
                        help="seconds for the whole run; later cells are skipped")


def parse_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SpecDecodeError(f"--concurrency takes comma-separated integers, got {text!r}") \
            from None
    require(counts and counts[0] >= 1, f"--concurrency values must be >= 1, got {text!r}")
    return sorted(set(counts) | {1})


def parse_servers(text: str, serve_args: str, llama_args: str) -> list[ServerSpec]:
    from specdecode import registry

    specs = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        if name == LLAMA_SERVER:
            specs.append(ServerSpec(LLAMA_SERVER, None, tuple(llama_args.split())))
            continue
        method = registry.DEFAULT_METHOD if name == "default" else name
        registry.get(method)  # an unknown method fails here, naming the known ones
        specs.append(ServerSpec(OURS, method, tuple(serve_args.split())))
    require(specs, "--servers names no server")
    require(len({s.label for s in specs}) == len(specs), f"--servers repeats a server: {text!r}")
    return specs


def parse_names(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    require(names and all(n in known for n in names),
            f"{flag} takes names from {', '.join(known)}, got {text!r}")
    return list(dict.fromkeys(names))


def slot_context(tokenizer, workloads: dict[str, list[Request]], max_tokens: int,
                 model_context: int) -> int:
    """Positions each slot needs: the longest chat-templated prompt, max_tokens and a margin,
    rounded up to 256 (llama-server gets ``--parallel`` times this)."""
    longest = max(len(tokenizer.apply_chat_template(r.messages(), tools=list(r.tools) or None,
                                                    add_generation_prompt=True))
                  for requests in workloads.values() for r in requests)
    need = -(-(longest + max_tokens + CONTEXT_MARGIN) // 256) * 256
    require(need <= model_context,
            f"the longest prompt ({longest} tokens) and --max-tokens {max_tokens} need "
            f"{need} positions, more than the model's {model_context}")
    return need


def machine() -> dict:
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(),
            "isa": " ".join(f for f in ISA_FLAGS if f in flags)
                   or "none of " + ", ".join(ISA_FLAGS)}


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def correct(outcomes: list[Outcome], references: dict[int, Outcome]) -> int:
    """Complete answers equal to their complete solo answers."""
    comparable = [o for o in outcomes
                  if o.complete and o.index in references and references[o.index].complete]
    return len(comparable) - len(mismatches(comparable, references))


def disconnect_test(url: str, kind: str, model: str, requests: list[Request],
                    references: dict[int, Outcome], max_tokens: int, clients: int,
                    time_limit: float) -> dict:
    """``clients`` greedy requests at once, half the streamed ones hanging up after
    ``HANG_UP_AFTER`` chunks; then: nothing left busy on the server, and the hung-up requests,
    sent again whole, answered as alone."""
    greedy = Sampling("greedy", 0.0)
    batch_requests = requests[:clients]
    hang = {r.index: HANG_UP_AFTER for r in batch_requests if r.index % 4 == 1}
    first = run_batch(url, model, batch_requests, greedy, max_tokens, clients, time_limit, hang)
    others = [o for o in first.outcomes if o.index not in hang]
    busy_after = wait_idle(url, kind)
    outcomes = sequence_outcomes(url) if kind == OURS else {}
    again = [r for r in batch_requests if r.index in hang]
    resent = run_batch(url, model, again, greedy, max_tokens, clients, time_limit) if again \
        else None
    resent_outcomes = resent.outcomes if resent else []
    return {"hung_up": sum(o.disconnected for o in first.outcomes), "others": len(others),
            "others_correct": correct(others, references), "busy_after": busy_after,
            "resent": len(again), "resent_correct": correct(resent_outcomes, references),
            "busy_at_end": wait_idle(url, kind),
            "server_outcomes": ", ".join(f"{k} {v:.0f}" for k, v in sorted(outcomes.items())),
            "errors": [f"request {o.index}: {o.error}" for o in first.outcomes + resent_outcomes
                       if o.error]}


def server_side_count(url: str, answered: int) -> list[str]:
    """Our server's own count of finished sequences (``specdecode_sequences_total``, stop and
    length) must equal the answers the clients got (the warm-up included): none generated
    twice, none lost between the scheduler and the client."""
    deadline = time.monotonic() + 5  # a scheduler may count a sequence just after answering
    while True:
        counts = sequence_outcomes(url)
        finished = counts.get("stop", 0) + counts.get("length", 0)
        if finished == answered or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not counts:
        return ["could not read the server's specdecode_sequences_total"]
    if finished != answered:
        return [f"the server finished {finished:.0f} sequences for {answered} answers "
                f"({counts})"]
    return []


class Sweep:
    """The run: every cell in order, each written to responses.jsonl as it ends."""

    def __init__(self, args: argparse.Namespace, specs: list[ServerSpec],
                 workloads: dict[str, list[Request]], samplings: list[Sampling],
                 levels: list[int], context: int, gguf: Path | None, llama: Path | None):
        self.args, self.specs, self.workloads = args, specs, workloads
        self.samplings, self.levels, self.context = samplings, levels, context
        self.gguf, self.llama = gguf, llama
        self.out = Path(args.out)
        self.deadline = time.monotonic() + args.time_limit
        self.disconnect_at = max(levels) if args.disconnect_clients is None \
            else args.disconnect_clients
        self.cells: list[dict] = []
        #: (server label, workload, sampling) -> its one-client outcomes
        self.solo: dict[tuple, list[Outcome]] = {}

    def say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def run(self) -> list[dict]:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        with open(self.out / "responses.jsonl", "w", encoding="utf-8") as records:
            for spec in self.specs:
                for workload, requests in self.workloads.items():
                    for sampling in self.samplings:
                        self.series(spec, workload, requests, sampling, records)
        return self.cells

    def series(self, spec: ServerSpec, workload: str, requests: list[Request],
               sampling: Sampling, records) -> None:
        references: dict[int, Outcome] | None = None
        for clients in self.levels:
            cell = {"server": spec.label, "workload": workload, "sampling": sampling.name,
                    "concurrency": clients}
            self.cells.append(cell)
            if time.monotonic() > self.deadline:
                cell["skipped"] = "the run's --time-limit was reached"
                continue
            if clients > 1 and references is None:
                cell["skipped"] = "no reference answers (the one-client batch failed)"
                continue
            test = (clients == self.disconnect_at and sampling.name == "greedy"
                    and workload == next(iter(self.workloads)))
            try:
                outcomes = self.cell(cell, spec, requests, sampling, clients, references, test)
            except (SpecDecodeError, RuntimeError, OSError, ValueError, KeyError,
                    httpx.HTTPError) as exc:  # a server that fails fails its cell, not the run
                cell["skipped"] = f"failed: {exc}"
                self.say(f"  {spec.label} {workload} {sampling.name} x{clients}: {exc}")
                continue
            except BaseException:  # stopped (SIGTERM, Ctrl-C): the report says where
                cell["skipped"] = "the run was interrupted here"
                raise
            for o in outcomes:
                records.write(json.dumps({k: cell[k] for k in ("server", "workload", "sampling",
                                                               "concurrency")}
                                         | o.as_dict()) + "\n")
            records.flush()
            if clients == 1:
                references = {o.index: o for o in outcomes}
                self.solo[(spec.label, workload, sampling.name)] = outcomes

    def cell(self, cell: dict, spec: ServerSpec, requests: list[Request], sampling: Sampling,
             clients: int, references: dict[int, Outcome] | None, test: bool) -> list[Outcome]:
        args = self.args
        port = free_port()
        argv = command(spec, port, clients, self.context, args.threads, args.model, self.gguf,
                       self.llama)
        name = f"{spec.label.replace(' ', '-')}-{cell['workload']}-{sampling.name}-{clients}"
        with ServerProcess(argv, port, args.threads, self.out / "logs" / f"{name}.log") as server:
            model = server.model_name()
            run_batch(server.url, model, [WARM_UP], Sampling("greedy", 0.0), 8, 1, 300)
            limit = min(args.batch_time_limit, max(1.0, self.deadline - time.monotonic()))
            batch = run_batch(server.url, model, requests, sampling, args.max_tokens, clients,
                              limit)
            cell.update(summarize(batch, references if clients > 1 else None))
            cell["peak_rss_mb"] = server.peak_rss_mb()
            if spec.kind == OURS:
                cell["problems"] += server_side_count(server.url, cell["completed"] + 1)
            if test:
                cell["disconnect"] = disconnect_test(
                    server.url, spec.kind, model, requests,
                    {o.index: o for o in batch.outcomes} if references is None else references,
                    args.max_tokens, clients, limit)
        self.say(f"  {spec.label} {cell['workload']} {sampling.name} x{clients}: "
                 f"{cell['tokens_per_s']:.1f} tok/s, p50 {cell['p50_latency_s']} s, "
                 f"mismatches {cell['mismatches']}, errors {cell['errors']}")
        return batch.outcomes


def exactness_notes(sweep: Sweep, default_label: str, ar_label: str) -> list[str]:
    """The default method's greedy solo answers against ar's: lossless means all equal."""
    notes = []
    for workload in sweep.workloads:
        a = sweep.solo.get((default_label, workload, "greedy"))
        b = sweep.solo.get((ar_label, workload, "greedy"))
        if a and b:
            same, both = identical(a, b)
            notes.append(f"{workload}, greedy, one client: {default_label} equals {ar_label} on "
                         f"{same}/{both} requests")
    return notes


def failed(cells: list[dict]) -> list[str]:
    """Why our servers' answers are wrong (llama-server's mismatches are not failures)."""
    out = []
    for c in cells:
        if c["server"].startswith(OURS) and c.get("skipped", "").startswith("failed"):
            out.append(f"{c['server']} {c['workload']} {c['sampling']} x{c['concurrency']}: "
                       f"{c['skipped']}")
        if c["server"].startswith(OURS) and "skipped" not in c:
            where = f"{c['server']} {c['workload']} {c['sampling']} x{c['concurrency']}"
            if c["mismatches"]:
                out.append(f"{where}: {c['mismatches']} answers differ from their solo answers")
            out += [f"{where}: {p}" for p in c["problems"]]
            d = c.get("disconnect")
            if d and (d["others_correct"] != d["others"] or d["resent_correct"] != d["resent"]
                      or d["busy_after"] != 0 or d["errors"]):
                out.append(f"{where}: the hang-up test failed: {d}")
    return out


def check_counts(args: argparse.Namespace, levels: list[int]) -> None:
    """The numeric flags, each error naming the flag."""
    require(args.max_tokens > 0, f"--max-tokens must be positive, got {args.max_tokens}")
    require(args.threads > 0, f"--threads must be positive, got {args.threads}")
    require(args.requests >= max(levels),
            f"--requests {args.requests} is fewer than the largest concurrency {max(levels)}: "
            "some clients would have nothing to send")
    require(args.disconnect_clients in (None, 0) or args.disconnect_clients in levels,
            f"--disconnect-clients {args.disconnect_clients} is not one of --concurrency "
            f"{args.concurrency} (0: no hang-up test)")


def run(args: argparse.Namespace) -> int:
    from specdecode import registry
    from specdecode.bench.cli import gguf_path_for, prepare_out
    from specdecode.questions import load_questions
    from specdecode.models.loading import load_model

    started = time.time()
    specs = parse_servers(args.servers, args.serve_args, args.llama_server_args)
    levels = parse_counts(args.concurrency)
    samplings = [sampling_of(n, args.seed) for n in parse_names(args.samplings, SAMPLINGS,
                                                                "--samplings")]
    names = parse_names(args.workloads, WORKLOADS, "--workloads")
    check_counts(args, levels)
    questions = load_questions(args.data) if "spec-bench" in names else None
    workloads = {n: build_workload(n, args.requests, questions) for n in names}
    gguf = gguf_path_for(args.model)
    llama = None
    if any(s.kind == LLAMA_SERVER for s in specs):
        require(gguf is not None, f"llama-server needs a GGUF file; --model {args.model!r} is "
                                  "not one")
        llama = llama_server_binary(args.llama_cpp)
    out = prepare_out(args.out)
    loaded = load_model(args.model)  # the header and tokenizer: to size the slots
    context = slot_context(loaded.tokenizer, workloads, args.max_tokens,
                           int(getattr(loaded.config, "max_position_embeddings", 2048)))

    default_label = f"{OURS} {registry.DEFAULT_METHOD}"
    ar_label = f"{OURS} ar"
    meta = {
        "command": "python scripts/serving_bench.py " + " ".join(args.argv),
        **machine(), "threads per server": args.threads,
        "load average before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "model": f"{args.model} ({gguf})" if gguf else args.model,
        "servers": "; ".join(f"{s.label}: {version(s.kind, llama)}" for s in specs)
                   + (f"; specdecode commit {git_commit()}" if git_commit() else ""),
        "requests": f"{args.requests} per workload ({', '.join(names)}), the same at every "
                    "concurrency, every other one streamed",
        "max_tokens": args.max_tokens,
        "samplings": ", ".join(f"{s.name}" + (f" (T={s.temperature}, seeds {s.seed}+i, top-p 1, "
                                              "top-k and min-p off)" if s.seed is not None
                                              else " (temperature 0)") for s in samplings),
        "slot context": f"{context} positions (ours: --max-context; llama-server: -c "
                        f"{context} x --parallel)",
        "date": time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(started)),
    }
    sweep = Sweep(args, specs, workloads, samplings, levels, context, gguf, llama)
    print(f"serving benchmark: {len(specs)} servers x {len(workloads)} workloads x "
          f"{len(samplings)} samplings x concurrency {levels}, into {out}", file=sys.stderr)
    try:
        sweep.run()
    finally:  # an interrupted run still leaves the cells it measured
        write_reports(out, meta, sweep, started, default_label, ar_label)
    wrong = failed(sweep.cells)
    for line in wrong:
        print("WRONG:", line, file=sys.stderr)
    return 1 if wrong else 0


def write_reports(out: Path, meta: dict, sweep: Sweep, started: float, default_label: str,
                  ar_label: str) -> None:
    cells = sweep.cells
    meta["load average after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta["duration_s"] = round(time.time() - started, 1)
    notes = exactness_notes(sweep, default_label, ar_label)
    goals = targets(cells, default_label, ar_label, LLAMA_SERVER)
    (out / "serving.json").write_text(json.dumps(
        {"meta": meta, "exactness": notes, "targets": goals, "cells": cells}, indent=2) + "\n")
    report = markdown(meta, cells, notes + goals)
    (out / "serving.md").write_text(report)
    print(report)


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    # `timeout` and kill send SIGTERM: leave through the finally blocks (servers stopped,
    # reports written) rather than die where we stand
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args)
    except SpecDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
