"""``specdecode bench``: every method and the peers over a Spec-Bench question file, one run.

    specdecode bench --per-task 10 --max-new-tokens 128 --out bench-out

Every input is checked before the model loads (question file, methods, peers, sampling
options, the output folder). The run writes, into ``--out``: ``records.jsonl`` (one record per
contender x question x turn), ``summary.json``, ``report.md`` and the PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from specdecode.bench.contenders import (PEERS, HFGenerate, IsolatedLlamaCpp, MethodContender,
                                         llama_cpp_available, llama_cpp_unsupported)
from specdecode.bench.datasets import load_workloads
from specdecode.questions import Question, load_questions, pick_questions, sample_per_task
from specdecode.bench.diffusion import add_arguments as add_diffusion_arguments
from specdecode.bench.llama_server_peer import CONFIGS as SERVER_CONFIGS
from specdecode.bench.llama_server_peer import LlamaServerPeer
from specdecode.bench.llama_tools import TOOLS_ENV
from specdecode.models.parted import MEASURED_MODEL
from specdecode.bench.metrics import accepted_histograms, summarize
from specdecode.bench.peer_process import PeerFailed
from specdecode.bench.report import fmt, markdown, plots
from specdecode.bench.runner import BenchOptions, Target, encode_messages, jsonl_writer, run_bench
from specdecode.bench.perplexity import PPL_CONTEXT
from specdecode.bench.quality import lossy_summary
from specdecode.errors import SpecDecodeError, require

#: context tokens before each timed forward of --runners
RUNNERS_CONTEXT = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.cli_options import (add_draft_budget_argument, add_model_arguments,
                                        add_sampling_arguments)

    parser.add_argument("--methods", default=None,
                        help="comma-separated methods (default: every exact method; lossy ones "
                             "run when named, reported in a table of their own with their "
                             "agreement with ar), or "
                             "variants NAME:KEY=VALUE[:KEY=VALUE...] such as "
                             "draft_model:controller=heuristic; 'ar' is always run, as the "
                             "reference")
    parser.add_argument("--data", default=None, metavar="FILE[,...]",
                        help="question file(s) in Spec-Bench's JSON-lines format, comma-"
                             "separated, or the built-in 'spec-bench' (the default: the "
                             "packaged Spec-Bench dev half, 240 questions, 6 tasks) and "
                             "'code-edit' (an edit instruction over small Python functions), "
                             "e.g. --data spec-bench,code-edit")
    parser.add_argument("--per-task", type=int, default=None, metavar="N",
                        help="the first N questions of each task (default: all)")
    parser.add_argument("--questions", default=None, metavar="ID[,...]",
                        help="these question ids of --data, in this order, instead of "
                             "--per-task (what methods that learn across requests saw first "
                             "matters), e.g. --questions 161,401,403")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1,
                        help="time each prompt this many times; records keep the median")
    parser.add_argument("--max-minutes", type=float, metavar="M",
                        help="start no question after M minutes; the report covers those done")
    parser.add_argument("--out", default="bench-out", metavar="DIR",
                        help="output folder (created; files in it are replaced)")
    parser.add_argument("--peers", default="all",
                        help=f"comma-separated peers from {', '.join(PEERS + tuple(SERVER_CONFIGS))}; 'all' (default: "
                             "those available) or 'none'")
    parser.add_argument("-c", "--config", action="append", default=[], metavar="METHOD.KEY=VALUE",
                        help="method config field (repeatable), e.g. -c ngram.max_ngram=4")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_runner_arguments(parser)
    add_diffusion_arguments(parser)
    add_model_arguments(parser)
    # the bench measures on the model users run (`specdecode models install` it); --model
    # smollm2 is the quick run
    parser.set_defaults(model=MEASURED_MODEL)
    add_draft_budget_argument(parser)
    add_sampling_arguments(parser)


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """The modes that measure the runners rather than the methods: --runners, --perplexity,
    --project-from and their settings."""
    parser.add_argument("--runners", action="store_true",
                        help="measure the runners instead of the methods: per-forward latency "
                             "(1, 2, 4, 8, 16, 64 tokens), one row against its memory bound, greedy "
                             "ar tokens/s of the native runner in each format (--weights: auto "
                             "or a list such as int4,int8) and the hf runner where the model "
                             "fits in float32, beside transformers and llama.cpp (llama-cpp-"
                             "python and llama-bench) on the same file")
    parser.add_argument("--perplexity", action="store_true",
                        help="the native runner's perplexity on a text (each format of --weights) "
                             "as llama-perplexity computes it, beside it on the same file and text")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="context tokens: before each timed forward with --runners "
                             f"(default {RUNNERS_CONTEXT}); the window with --perplexity "
                             f"(default {PPL_CONTEXT}, llama-perplexity's -c)")
    parser.add_argument("--chunks", type=int, default=None, metavar="N",
                        help="with --perplexity: the first N windows only (llama-perplexity's "
                             "--chunks; default: all)")
    parser.add_argument("--text", default=None, metavar="FILE",
                        help="with --perplexity: the text (default: the summarization articles "
                             "of --data, the Spec-Bench dev half)")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR",
                        help="the folder of llama.cpp's llama-bench, llama-perplexity and "
                             f"llama-server (default: ${TOOLS_ENV}, then PATH; docs/bench.md "
                             "builds them)")
    parser.add_argument("--peer-draft", default="qwen2.5-coder-0.5b", metavar="MODEL",
                        help="the draft model of the llama-server-draft peer: a named model or "
                             "a .gguf file (default: qwen2.5-coder-0.5b)")
    parser.add_argument("--project-from", default=None, metavar="RUN",
                        help="a bench run (its --out folder or records.jsonl): project each "
                             "method's speedup on the row costs measured with --runners, or on "
                             "those of --row-costs")
    parser.add_argument("--row-costs", default=None, metavar="RUNNERS",
                        help="with --project-from and without --runners: a --runners run's "
                             "folder or runners.json to project on (nothing is measured)")


@dataclass
class Plan:
    """Everything checked before the model loads."""

    questions: list[Question]
    #: (name, registry Method, frozen config), ar first
    methods: list[tuple]
    #: whether --methods named them (a named method that cannot run is an error; one from
    #: the default list, e.g. a draft model not trained yet, is left out with a note)
    methods_named: bool
    #: requested peer names; None = every available one
    peers: list[str] | None
    options: BenchOptions
    out: Path
    #: llama-server for its peers (None: not found) and the draft file of llama-server-draft
    llama_server: Path | None = None
    peer_draft: Path | None = None


def parse_methods(spec: str | None, config_pairs: list[str]) -> list[tuple]:
    """(label, method, config) per contender. A contender is a method name, or a *variant*
    ``name:key=value:...`` whose fields override the method's ``-c`` ones, so several configs
    of one method run interleaved in one run (a sweep, each length controller)."""
    from specdecode import registry
    from specdecode.cli_options import parse_config

    labels = registry.names(lossy=False) if spec is None else [n.strip() for n in spec.split(",") if n.strip()]
    require(len(labels) > 0, "--methods is empty; give names such as ar,ngram "
                             "(see `specdecode methods`)")
    variants = [label.split(":") for label in labels]
    methods = [registry.get(name) for name, *_ in variants]  # unknown names fail here
    overrides: dict[str, dict] = {}
    for key, value in parse_config(config_pairs).items():
        method, dot, field = key.partition(".")
        require(dot and field, f"--config expects METHOD.KEY=VALUE, got {key}={value}")
        require(method in [m.name for m in methods],
                f"--config names method {method!r}, which is not in --methods")
        overrides.setdefault(method, {})[field] = value
    chosen = [(label, m, m.make_config({**overrides.get(m.name, {}), **parse_config(pairs)}))
              for label, m, (_, *pairs) in zip(labels, methods, variants)]
    if "ar" not in labels:
        ar = registry.get("ar")
        chosen.append(("ar", ar, ar.make_config()))
    chosen.sort(key=lambda c: c[0] != "ar")
    return list({c[0]: c for c in chosen}.values())


def parse_peers(spec: str, model: str) -> list[str] | None:
    spec = spec.strip()
    if spec == "all":
        return None
    if spec == "none":
        return []
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS + tuple(SERVER_CONFIGS)]
    require(not unknown, f"unknown peer(s) {', '.join(map(repr, unknown))}; known peers: "
                         f"{', '.join(PEERS + tuple(SERVER_CONFIGS))} (or 'all', 'none')")
    if any(n.startswith("llama.cpp") for n in names):
        require(llama_cpp_available(),
                "the llama.cpp peers need llama-cpp-python: CMAKE_ARGS=\"-DGGML_NATIVE=OFF "
                "-DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF\" pip install "
                "llama-cpp-python (see docs/bench.md)")
        require(gguf_path_for(model) is not None,
                f"the llama.cpp peers need a GGUF file; --model {model!r} is not one")
    return list(dict.fromkeys(names))


def gguf_path_for(model: str) -> Path | None:
    from specdecode.models.loading import NAMED_MODELS

    if model in NAMED_MODELS:
        return NAMED_MODELS[model]()
    return Path(model) if model.endswith(".gguf") else None


def prepare_out(out: str) -> Path:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".specdecode-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise SpecDecodeError(f"cannot write to --out {out}: {exc.strerror or exc}; choose a "
                              "folder you can write") from None
    return path


def plan(args: argparse.Namespace) -> Plan:
    from specdecode.cli_options import sampling_options
    from specdecode.sampling import SamplingParams

    require(args.questions is None or args.per_task is None,
            "--questions and --per-task both choose the questions; give one")
    loaded = load_workloads(args.data)
    questions = (sample_per_task(loaded, args.per_task) if args.questions is None
                 else pick_questions(loaded, args.questions))
    methods = parse_methods(args.methods, args.config)
    peers = parse_peers(args.peers, args.model)
    llama_server, peer_draft = server_peers(peers, args)
    sampling = SamplingParams(**sampling_options(args))
    require(args.max_new_tokens > 0, f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    require(args.repeats >= 1, f"--repeats must be at least 1, got {args.repeats}")
    require(args.max_minutes is None or args.max_minutes > 0,
            f"--max-minutes must be positive, got {args.max_minutes}")
    lossy = [label for label, method, _ in methods if method.lossy]
    require(not lossy or (sampling.greedy and not sampling.adjusts_logits),
            f"the lossy methods ({', '.join(lossy)}) decode greedily only; drop them or the "
            "sampling options")
    options = BenchOptions(max_new_tokens=args.max_new_tokens, sampling=sampling,
                           draft_budget=args.draft_budget,
                           repeats=args.repeats, seed=0 if args.seed is None else args.seed,
                           max_minutes=args.max_minutes)
    return Plan(questions, methods, args.methods is not None, peers, options,
                prepare_out(args.out), llama_server, peer_draft)


def server_peers(peers: list[str] | None, args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """llama-server's binary and the draft file its draft peer needs (None where not found:
    a named peer is then an error, an unnamed one a note)."""
    from specdecode.bench.llama_tools import find_tool

    named = [p for p in peers or () if p in SERVER_CONFIGS]
    binary = find_tool("llama-server", args.llama_cpp)
    require(binary is not None or not named,
            f"the {', '.join(named)} peer(s) need llama-server (--llama-cpp DIR, ${TOOLS_ENV} or "
            "PATH; docs/bench.md builds it)")
    require(not named or gguf_path_for(args.model) is not None,
            f"the llama-server peers need a GGUF file; --model {args.model!r} is not one")
    draft = None
    if binary is not None and (peers is None or "llama-server-draft" in named):
        try:
            draft = gguf_path_for(args.peer_draft)
        except SpecDecodeError:
            if "llama-server-draft" in named:
                raise
        require(draft is not None or "llama-server-draft" not in named,
                f"--peer-draft {args.peer_draft!r} is not a GGUF file or a named model")
    return binary, draft


def build_contenders(target: Target, plan: Plan, questions: list[Question]) -> tuple[list, list[str]]:
    """Our methods (ar first), then the peers; and notes on what was left out."""
    contenders: list = []
    notes: list[str] = []
    for name, method, config in plan.methods:
        try:
            contenders.append(MethodContender(name, method, config, target.runner,
                                              target.eos_token_ids, plan.options.draft_budget))
        except SpecDecodeError as exc:
            if plan.methods_named:
                raise
            notes.append(f"{name}: {exc}")
    wanted = plan.peers
    for peer in PEERS + tuple(SERVER_CONFIGS) if wanted is None else wanted:
        explicit = wanted is not None
        if peer in SERVER_CONFIGS:
            if plan.llama_server is None or target.gguf_path is None or (
                    peer == "llama-server-draft" and plan.peer_draft is None):
                notes.append(f"{peer}: " + ("llama-server not found" if plan.llama_server is None
                                            else "no GGUF file (or draft file)"))
                continue
            contender = LlamaServerPeer(peer, plan.llama_server, target.gguf_path,
                                        target.eos_token_ids,
                                        llama_n_ctx(target, questions, plan.options.max_new_tokens),
                                        plan.peer_draft)
        elif peer.startswith("hf"):
            if target.hf_model is None:
                require(not explicit, f"peer {peer!r} needs a transformers model")
                notes.append(f"{peer}: no transformers model behind this runner")
                continue
            contender = HFGenerate(target.hf_model, target.eos_token_ids, peer == "hf-pld")
        else:
            if not llama_cpp_available() or target.gguf_path is None:
                notes.append(f"{peer}: " + ("llama-cpp-python is not installed"
                                            if not llama_cpp_available() else "no GGUF file"))
                continue
            reason = llama_cpp_unsupported(plan.options.sampling)
            if reason:
                require(not explicit, f"peer {peer!r} cannot run these sampling options: {reason}")
                notes.append(f"{peer}: skipped, {reason}")
                continue
            try:
                contender = IsolatedLlamaCpp(target.gguf_path, target.eos_token_ids,
                                             peer == "llama.cpp-pld",
                                             llama_n_ctx(target, questions,
                                                         plan.options.max_new_tokens))
            except PeerFailed as exc:
                notes.append(f"{peer}: {exc} (loading the model)")
                continue
        reason = contender.unsupported(plan.options.sampling)
        if reason:
            require(not explicit, f"peer {peer!r} cannot run these sampling options: {reason}")
            notes.append(f"{peer}: skipped, {reason}")
            continue
        contenders.append(contender)
    return contenders, notes


def llama_n_ctx(target: Target, questions: list[Question], max_new_tokens: int) -> int:
    """A context just big enough for the longest conversation (logits_all keeps a row per
    context position, so 8192 would cost 1.6 GB of logits)."""
    need = 0
    for q in questions:
        messages = [{"role": "user", "content": t} for t in q.turns]
        need = max(need, len(encode_messages(target.tokenizer, messages))
                   + len(q.turns) * (max_new_tokens + 32))
    return min(target.runner.max_context, -(-need // 256) * 256)


def machine() -> str:
    import torch

    from specdecode.models.row_costs import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} with " \
           f"{torch.get_num_threads()} threads"


def bench(target: Target, plan: Plan, progress: bool = True, meta: dict | None = None) -> dict:
    """Run the plan on ``target``; write records.jsonl, summary.json, report.md and plots."""
    contenders, notes = build_contenders(target, plan, plan.questions)
    write, close = jsonl_writer(plan.out / "records.jsonl")
    started = time.time()
    failed: dict[str, str] = {}
    try:
        records = run_bench(target, plan.questions, contenders, plan.options, write, progress,
                            failed)
    finally:
        close()
        for c in contenders:
            if hasattr(c, "close"):
                c.close()
    # a peer that failed part-way keeps its records in records.jsonl, not in the tables
    records = [r for r in records if r["method"] not in failed]
    notes += [f"{reason}; its records are in records.jsonl, not in the tables"
              for reason in failed.values()]
    contenders = [c for c in contenders if c.name not in failed]
    answered = {r["question_id"] for r in records}
    questions = [q for q in plan.questions if q.question_id in answered]
    if len(questions) < len(plan.questions):
        notes.append(f"stopped by --max-minutes {plan.options.max_minutes:g} after "
                     f"{len(questions)} of {len(plan.questions)} questions")
    summary = summarize(records)
    lossy = [c.name for c in contenders if c.kind == "lossy"]
    if lossy:  # their own table, with their agreement with ar beside their speed
        summary["lossy"] = lossy_summary(records, summary, questions, target.tokenizer, lossy)
        summary["methods"] = {n: e for n, e in summary["methods"].items() if n not in lossy}
    s = plan.options.sampling
    info = {
        "model": target.source,
        "runner": target.runner.name,
        "machine": machine(),
        "questions": f"{len(questions)} ({', '.join(summary['tasks'])}), "
                     f"{sum(len(q.turns) for q in questions)} turns",
        "max_new_tokens": plan.options.max_new_tokens,
        "sampling": "greedy" if s.greedy else
                    f"temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}, "
                    f"min_p {s.min_p}, seeds from {plan.options.seed}",
        "repeats": plan.options.repeats,
        "contenders": ", ".join(c.name for c in contenders),
        "left out": "; ".join(notes) or "none",
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        **(meta or {}),
    }
    summary = {"meta": info, **summary}
    (plan.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    written = plots(summary, accepted_histograms(records), plan.out)
    info["plots"] = (", ".join(p.name for p in written) or "none") if isinstance(written, list) \
        else written
    (plan.out / "report.md").write_text(markdown(summary, info))
    return summary


def run(args: argparse.Namespace) -> int:
    from specdecode.cli_options import load_target
    from specdecode.models.hf import HFRunner

    checked = plan(args)
    modes = [flag for flag in ("runners", "perplexity", "diffusion") if getattr(args, flag)]
    require(len(modes) <= 1, "--runners, --perplexity and --diffusion are separate runs; give one")
    require(args.row_costs is None or (args.project_from and not modes),
            "--row-costs goes with --project-from, without --runners (which measures the costs)")
    require(args.project_from is None or not args.perplexity,
            "--project-from goes with --runners or --row-costs, not --perplexity")
    if args.project_from and args.row_costs:
        return run_projection(args, checked)
    if args.runners:
        return run_runners(args, checked)
    if args.perplexity:
        return run_perplexity(args, checked)
    if args.diffusion:
        from specdecode.bench import diffusion

        return diffusion.run(args, checked.questions, checked.out, _meta(args, time.time()))
    require(args.project_from is None, "--project-from needs row costs: add --runners (measure "
                                       "them on --model) or --row-costs RUNNERS_JSON")
    runner, tokenizer, eos = load_target(args)
    hf_model = runner.model if isinstance(runner, HFRunner) else None
    if hf_model is None and (checked.peers is None or any(p.startswith("hf") for p in checked.peers)):
        from specdecode.models.loading import load_model

        hf_model = load_model(args.model).model
    target = Target(runner, tokenizer, eos, hf_model, gguf_path_for(args.model), args.model)
    summary = bench(target, checked, progress=not args.no_progress,
                    meta={"command": "specdecode bench " + " ".join(_argv())})
    print(f"wrote {checked.out}/records.jsonl, summary.json, report.md")
    print(f"{'method':<16}{'tokens/s':>10}{'vs ar':>8}{'vs hf':>8}{'tau':>7}{'identical':>11}")
    for name, entry in summary["methods"].items():
        o = entry["overall"]
        print(f"{name:<16}{o['tokens_per_s']:>10.1f}{fmt(o['speedup_vs_ar'], '.2f', 'x'):>8}"
              f"{fmt(o['speedup_vs_hf'], '.2f', 'x'):>8}{fmt(o['mean_accepted'], '.2f'):>7}"
              f"{o['identical_fraction']:>11.0%}")
    if "lossy" in summary:
        print("\nlossy methods (output differs from ar on purpose; see report.md):")
        print(f"{'method':<16}{'tokens/s':>10}{'vs ar':>8}{'tokens':>8}{'answers':>9}"
              f"{'math':>7}{'rouge-l':>9}")
        for name, q in summary["lossy"]["methods"].items():
            print(f"{name:<16}{q['tokens_per_s']:>10.1f}{fmt(q['speedup_vs_ar'], '.2f', 'x'):>8}"
                  f"{q['token_agreement']:>8.0%}{q['answer_agreement']:>9.0%}"
                  f"{fmt(q['math_accuracy'], '.0%'):>7}{fmt(q['rouge_l_vs_ar'], '.3f'):>9}")
    return 0


def _meta(args: argparse.Namespace, started: float) -> dict:
    import torch

    return {"command": "specdecode bench " + " ".join(_argv()), "model": args.model,
            "machine": machine(), "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
            "duration_s": round(time.time() - started, 1)}


def _load_steps(args: argparse.Namespace):
    """The projection's source run, read before any model loads (a bad path fails first)."""
    from specdecode.bench.projection import load_steps

    return load_steps(args.project_from) if args.project_from else None


def run_runners(args: argparse.Namespace, checked: Plan) -> int:
    import torch

    from specdecode.bench import runner_set
    from specdecode.bench.projection import native_costs, projection_markdown
    from specdecode.bench.runners import measure_runners, runners_markdown

    context = RUNNERS_CONTEXT if args.context is None else args.context
    require(context > 0, f"--context must be positive, got {context}")
    runner_set.parse_formats(args.weights)
    steps = _load_steps(args)
    started = time.time()
    say = (lambda _: None) if args.no_progress else print
    built = runner_set.build(args.model, args.weights, gguf_path_for(args.model), say=say)
    result = measure_runners(built.runners, built.tokenizer, built.eos, checked.questions,
                             context, checked.options.max_new_tokens, built.gguf_path,
                             built.hf_model, args.llama_cpp, torch.get_num_threads(), say)
    meta = {**_meta(args, started), "left out": "; ".join(built.notes) or "none"}
    report = runners_markdown(result, meta)
    if steps is not None:
        report += "\n" + projection_markdown(steps[0], native_costs(result["forward_ms"]),
                                             steps[1], "this run")
    (checked.out / "runners.json").write_text(json.dumps({"meta": meta, **result}, indent=2) + "\n")
    (checked.out / "runners.md").write_text(report)
    print(report)
    return 0


def run_projection(args: argparse.Namespace, checked: Plan) -> int:
    from specdecode.bench.projection import load_costs, projection_markdown

    steps, steps_from = _load_steps(args)
    costs, costs_from = load_costs(args.row_costs)
    report = projection_markdown(steps, costs, steps_from, costs_from)
    (checked.out / "projection.md").write_text(report)
    print(report)
    return 0


def run_perplexity(args: argparse.Namespace, checked: Plan) -> int:
    import torch

    from specdecode.bench import runner_set
    from specdecode.bench.llama_tools import find_tool, llama_perplexity
    from specdecode.bench.peer_process import PeerFailed
    from specdecode.bench.perplexity import articles, perplexity, tokenize, windows

    context = PPL_CONTEXT if args.context is None else args.context
    runner_set.parse_formats(args.weights)
    if args.text is not None:
        require(Path(args.text).is_file(), f"--text {args.text} does not exist")
        text = Path(args.text).read_text(encoding="utf-8")
    else:
        text = articles(load_questions(args.data))
    started = time.time()
    say = (lambda _: None) if args.no_progress else print
    built = runner_set.build(args.model, args.weights, gguf_path_for(args.model), with_hf=False,
                             say=say)
    tokens = tokenize(built.tokenizer, text, built.bos)
    windows(tokens, context, args.chunks)  # too short a text fails before any forward
    text_file = checked.out / "perplexity-text.txt"
    text_file.write_text(text, encoding="utf-8")
    results: dict[str, dict] = {}
    for name, runner in built.runners.items():
        results[name] = perplexity(runner, tokens, context, built.bos, args.chunks, say)
        say(f"{name}: perplexity {results[name]['perplexity']:.4f}")
    failed: dict[str, str] = {}
    tool = find_tool("llama-perplexity", args.llama_cpp) if built.gguf_path else None
    if tool is not None:
        try:
            results["llama-perplexity"] = llama_perplexity(
                tool, built.gguf_path, text_file, context, torch.get_num_threads(), args.chunks)
        except PeerFailed as exc:
            failed["llama-perplexity"] = str(exc)
    elif built.gguf_path is not None:
        built.notes.append(f"llama-perplexity: not found (--llama-cpp DIR, ${TOOLS_ENV} or "
                           "PATH; docs/bench.md builds it)")
    meta = {**_meta(args, started),
            "text": args.text or "the summarization articles of "
                                 + (args.data or "the Spec-Bench dev half"),
            "text tokens": len(tokens), "context": context,
            "left out": "; ".join(built.notes + list(failed.values())) or "none"}
    (checked.out / "perplexity.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    report = perplexity_markdown(results, meta)
    (checked.out / "perplexity.md").write_text(report)
    print(report)
    return 0


def perplexity_markdown(results: dict[str, dict], meta: dict) -> str:
    reference = results.get("llama-perplexity", {}).get("perplexity")
    lines = ["# specdecode bench --perplexity", ""] + [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| runner | perplexity | windows | vs llama-perplexity |",
              "|---|---:|---:|---:|"]
    for name, r in results.items():
        ratio = f"{r['perplexity'] / reference:.4f}" if reference else "-"
        lines.append(f"| {name} | {r['perplexity']:.4f} | "
                     f"{fmt(r.get('windows', r.get('chunks')), 'd')} | {ratio} |")
    if "command" in results.get("llama-perplexity", {}):
        lines += ["", f"llama-perplexity: `{results['llama-perplexity']['command']}`"]
    return "\n".join(lines) + "\n"


def _argv() -> list[str]:
    import sys

    argv = sys.argv[1:]
    return argv[1:] if argv and argv[0] == "bench" else argv
