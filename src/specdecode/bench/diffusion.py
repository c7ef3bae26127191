"""``specdecode bench --diffusion POLICIES``: the diffusion policies (docs/diffusion.md) beside
the AR model's ``ar`` and ``suffix``, in one run on the same questions' first turns.

For each contender: denoising steps a token (for ``ar`` and ``suffix``, target forwards a token,
the prefill's included: it writes the first token), tokens/s, agreement with ``one_per_step`` (the reference policy, always
run first) and with ``ar`` (position by position, as ``agreement.token_agreement``), and
maths accuracy (GSM8K's final number) on the maths questions among them. The dLLM is the
delta of ``--dllm`` merged into fp32 weights; ``ar`` and ``suffix`` run on the same weights
without it, so the comparison is of decoders, not of formats. Writes ``diffusion.json``,
``diffusion.md``, ``diffusion-records.jsonl`` and ``diffusion.png`` (speed against quality).

'all' is every policy but ``cfg`` (it needs a grammar). A contender may be a variant
``policy:key=value:...`` such as ``threshold:threshold=0.7``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.agreement import token_agreement
from specdecode.questions import Question
from specdecode.bench.quality import math_correct
from specdecode.errors import require

#: the AR model's methods measured beside the policies
AR_METHODS = ("ar", "suffix")
#: policies 'all' leaves out, and why
NOT_IN_ALL = {"cfg": "needs a grammar"}
REFERENCE = "one_per_step"


@dataclass
class Measured:
    """One contender over the questions: its outputs, steps and time."""

    outputs: list[list[int]] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0


def add_arguments(parser) -> None:
    """The ``bench --diffusion`` flags."""
    parser.add_argument("--diffusion", default=None, metavar="POLICIES",
                        help="measure diffusion policies instead of the methods: comma-separated "
                             "(variants POLICY:KEY=VALUE) or 'all', beside the AR model's ar "
                             "and suffix on the questions' first turns: steps a token, tokens/s, "
                             "agreement with one_per_step and ar, maths accuracy (docs/diffusion.md)")
    parser.add_argument("--dllm", default="auto", metavar="PATH",
                        help="with --diffusion: the dLLM delta ('auto', default: the newest "
                             "trained for the model; 'none': the AR model as it is; or a file)")
    parser.add_argument("--block-size", type=int, default=None, metavar="N",
                        help="with --diffusion: positions a block (default: the dLLM's, else 32)")


def parse_policies(spec: str) -> list[tuple[str, object, object]]:
    """(label, PolicyInfo, frozen config) per contender, ``one_per_step`` first; unknown
    policies and fields fail here, before any model loads."""
    from specdecode.cli_options import parse_config
    from specdecode.diffusion.registry import get_policy, policy_names

    labels = ([n for n in policy_names() if n not in NOT_IN_ALL] if spec.strip() == "all" else
              [n.strip() for n in spec.split(",") if n.strip()])
    require(bool(labels), "--diffusion is empty; give policies such as threshold,freedave or "
                          "'all' (see `specdecode methods`)")
    chosen = []
    for label in dict.fromkeys([REFERENCE] + labels):
        name, *pairs = label.split(":")
        info = get_policy(name)
        chosen.append((label, info, info.make_config(parse_config(pairs))))
    return chosen


def measure_ar(runner, tokenizer, eos: Sequence[int], method: str,
               prompts: Sequence[list[int]], max_new_tokens: int) -> Measured:
    from specdecode.api import Decoder

    decoder = Decoder(runner, tokenizer, method, eos)
    measured = Measured()
    for prompt in prompts:
        result = decoder.generate(prompt, max_new_tokens)
        measured.outputs.append(result.token_ids)
        measured.steps += result.stats.target_forwards  # the prefill writes the first token
        measured.seconds += result.stats.total_s
    return measured


def measure_policy(model, info, config, prompts: Sequence[list[int]], max_new_tokens: int,
                   eos: Sequence[int], block_size: int) -> Measured:
    from specdecode.diffusion.decode import diffuse

    measured = Measured()
    for prompt in prompts:
        result = diffuse(model, info.policy(config), prompt, max_new_tokens, eos, block_size)
        measured.outputs.append(result.tokens)
        measured.steps += result.steps
        measured.seconds += result.seconds
    return measured


def row(measured: Measured, reference: Measured, ar: Measured, questions: Sequence[Question],
        decode: Callable[[list[int]], str]) -> dict:
    """One table row: steps a token, tokens/s, agreements, maths right of maths asked."""
    tokens = sum(map(len, measured.outputs))
    count = max(1, len(measured.outputs))
    maths = [(out, q) for out, q in zip(measured.outputs, questions)
             if q.task == "math_reasoning" and q.reference]
    return {"steps_per_token": measured.steps / max(1, tokens),
            "tokens_per_s": tokens / measured.seconds if measured.seconds > 0 else 0.0,
            "agrees_one_per_step": sum(map(token_agreement, measured.outputs,
                                           reference.outputs)) / count,
            "agrees_ar": sum(map(token_agreement, measured.outputs, ar.outputs)) / count,
            "math_right": sum(math_correct(decode(out), q.reference[0]) for out, q in maths),
            "math_questions": len(maths), "tokens": tokens, "seconds": round(measured.seconds, 3)}


def run_contenders(model, ar_runner, tokenizer, eos: Sequence[int], policies: list,
                   questions: Sequence[Question], max_new_tokens: int, block_size: int,
                   show: Callable[[str], None] = lambda text: None) -> dict[str, Measured]:
    """``ar`` and ``suffix`` on ``ar_runner``, then every policy on the diffusion ``model``,
    over the questions' first turns."""
    from specdecode.api import encode_prompt

    prompts = [encode_prompt(tokenizer, q.turns[0]) for q in questions]
    measured: dict[str, Measured] = {}
    for method in AR_METHODS:
        measured[method] = measure_ar(ar_runner, tokenizer, eos, method, prompts, max_new_tokens)
        show(f"{method}: {measured[method].seconds:.0f} s")
    for label, info, config in policies:
        measured[label] = measure_policy(model, info, config, prompts, max_new_tokens, eos,
                                         block_size)
        show(f"{label}: {measured[label].seconds:.0f} s")
    return measured


def summarize(measured: dict[str, Measured], questions: Sequence[Question],
              decode: Callable[[list[int]], str]) -> dict[str, dict]:
    return {label: row(m, measured[REFERENCE], measured["ar"], questions, decode)
            for label, m in measured.items()}


def markdown(rows: dict[str, dict], meta: dict) -> str:
    lines = ["# specdecode bench --diffusion", ""] + [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| contender | steps/token | tokens/s | agrees with one_per_step | agrees with "
              "ar | maths |", "|---|---:|---:|---:|---:|---:|"]
    for label, r in rows.items():
        maths = f"{r['math_right']}/{r['math_questions']}" if r["math_questions"] else "-"
        lines.append(f"| {label} | {r['steps_per_token']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['agrees_one_per_step']:.0%} | {r['agrees_ar']:.0%} | {maths} |")
    lines += ["", f"steps/token: denoising steps a token for the policies; target forwards a "
                  f"token for {' and '.join(AR_METHODS)} (the AR model; the prefill, which "
                  "writes the first token, included)."]
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, dict], out: Path) -> Path | str:
    """Speed against quality: tokens/s against agreement with one_per_step, and against maths
    accuracy where there are maths questions."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("agrees_one_per_step", "agreement with one_per_step")]
    if any(r["math_questions"] for r in rows.values()):
        panels.append(("math_accuracy", "maths accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for i, (label, r) in enumerate(rows.items()):
            value = (r["math_right"] / r["math_questions"] if key == "math_accuracy"
                     else r[key])
            ax.scatter(r["tokens_per_s"], value, marker="s" if label in AR_METHODS else "o")
            # staggered, so the labels of points that coincide stay readable
            ax.annotate(label, (r["tokens_per_s"], value), fontsize="x-small",
                        xytext=(4, 4 + 8 * (i % 4)), textcoords="offset points")
        ax.set_xlabel("tokens/s")
        ax.set_ylabel(title)
        ax.set_ylim(-0.05, 1.08)
    fig.tight_layout()
    path = out / "diffusion.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(out: Path, rows: dict[str, dict], measured: dict[str, Measured],
          questions: Sequence[Question], meta: dict) -> str:
    """The run's files in ``out``; the markdown report."""
    with (out / "diffusion-records.jsonl").open("w") as records:
        for label, m in measured.items():
            for q, tokens in zip(questions, m.outputs):
                records.write(json.dumps({"contender": label, "question_id": q.question_id,
                                          "task": q.task, "token_ids": tokens}) + "\n")
    drawn = plot(rows, out)
    meta = {**meta, "plot": drawn.name if isinstance(drawn, Path) else drawn}
    (out / "diffusion.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    report = markdown(rows, meta)
    (out / "diffusion.md").write_text(report)
    return report


def load_contenders(args):
    """(diffusion model, AR runner, tokenizer, eos ids, block size, what the dLLM is) for
    ``--model``, ``--dllm``, ``--weights`` and ``--block-size``."""
    from specdecode.api import eos_ids
    from specdecode.diffusion.decode import DEFAULT_BLOCK_SIZE
    from specdecode.diffusion.dllm import dllm_runner, find_dllm
    from specdecode.diffusion.model import default_mask_id
    from specdecode.diffusion.model import DiffusionModel
    from specdecode.models.loading import load_model, make_runner

    loaded = load_model(args.model)
    path = find_dllm(loaded, args.dllm)
    weights = "fp32" if path is not None and args.weights == "auto" else args.weights
    ar_runner = make_runner(loaded, "native", weights, args.max_context)
    if path is None:
        runner, config = ar_runner, {}
        mask = default_mask_id(loaded.tokenizer, runner.vocab_size)
    else:
        runner, delta = dllm_runner(loaded, path, weights)
        config, mask = delta.config, int(delta.config["mask_id"])
    block = args.block_size or config.get("block_size") or DEFAULT_BLOCK_SIZE
    what = (f"{path} (steps {config.get('steps')}), {weights} weights" if path is not None else
            f"none: the AR model as it is ({ar_runner.name})")
    return (DiffusionModel(runner, mask), ar_runner, loaded.tokenizer,
            eos_ids(loaded, loaded.tokenizer), block, what)


def run(args, questions: Sequence[Question], out: Path, meta: dict) -> int:
    """The ``bench --diffusion`` mode."""
    policies = parse_policies(args.diffusion)
    require(args.methods is None, "--diffusion runs the policies beside ar and suffix; drop "
                                  "--methods")
    require(args.temperature == 0, "diffusion decoding is greedy here; drop --temperature")
    require(args.block_size is None or args.block_size > 0,
            f"--block-size must be positive, got {args.block_size}")
    started = time.time()
    model, ar_runner, tokenizer, eos, block, what = load_contenders(args)
    show = (lambda _: None) if args.no_progress else print
    measured = run_contenders(model, ar_runner, tokenizer, eos, policies, questions,
                              args.max_new_tokens, block, show)
    rows = summarize(measured, questions,
                     lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    meta = {**meta, "dllm": what, "block size": block,
            "questions": f"{len(questions)} first turns", "max_new_tokens": args.max_new_tokens,
            "duration_s": round(time.time() - started, 1)}
    print(write(out, rows, measured, questions, meta))
    return 0
