"""``specdecode train router``: the Arbitrage router (specdecode/lossy/arbitrage.py).

Labels come from the target's own greedy decoding of training prompts: at every step the cheap
drafter writes a step, the target reads it in one pass (the router's features,
:func:`step_features`) and then writes its own greedy step from the same context; the label is
the target's advantage, its mean log-probability of its own step minus that of the draft step.
Decoding follows the target's steps, so the contexts are those ``ar`` would reach. A ridge
regression on the standardised features is the router.

Prompts: the Spec-Bench dev half, without the first ``--holdout`` questions of each task (the
questions ``specdecode bench --per-task 10`` measures), in a fixed shuffle. Bounded and
resumable: collection stops after ``--max-minutes`` (default 8) or ``--questions`` prompts;
every prompt's examples are saved as they come (``--workdir``), and ``--resume`` goes on from
them. Fitting takes a second. Defaults: 96 generated tokens a prompt, ridge 1.0, steps of at
most 32 tokens (the method's default).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from pathlib import Path

import torch

from specdecode.errors import require

RIDGE = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="the target ('smollm2' or a .gguf)")
    parser.add_argument("--questions", type=int, default=60, help="most training prompts")
    parser.add_argument("--holdout", type=int, default=10,
                        help="first questions of each task left out (the bench's dev slice)")
    parser.add_argument("--gen-tokens", type=int, default=96, help="tokens generated a prompt")
    parser.add_argument("--max-minutes", type=float, default=8.0,
                        help="stop collecting after this long (the fit follows)")
    parser.add_argument("--max-step-tokens", type=int, default=32)
    parser.add_argument("--cheap", default="draft", choices=("draft", "int4"),
                        help="the cheap model, as arbitrage's -c cheap= (int4: the target's own "
                             "int4 copy; the target then runs fp32)")
    parser.add_argument("--draft", default="distilled",
                        help="with --cheap draft: the draft, as draft_model's -c draft=")
    parser.add_argument("--data", default=None, help="Spec-Bench-format jsonl (default: dev half)")
    parser.add_argument("--out", default=None,
                        help="artifact path (default: the user cache, where arbitrage finds it)")
    parser.add_argument("--workdir", default=None, help="collected examples (default: user cache)")
    parser.add_argument("--resume", action="store_true", help="keep the examples collected so far")


def training_prompts(data, holdout: int) -> list[tuple[int, str]]:
    from specdecode.questions import load_questions

    seen: dict[str, int] = {}
    chosen = []
    for q in load_questions(data):
        seen[q.task] = seen.get(q.task, 0) + 1
        if seen[q.task] > holdout:
            chosen.append((q.question_id, q.turns[0]))
    random.Random(0).shuffle(chosen)
    return chosen


def newline_ids(tokenizer, vocab_size: int) -> frozenset[int]:
    return frozenset(i for i in range(vocab_size) if "\n" in tokenizer.decode([i]))


@torch.inference_mode()
def collect(arbitrage, prompt_ids: list[int], gen_tokens: int, eos: frozenset[int],
            max_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [steps, F] and advantages [steps] along the target's greedy decoding."""
    from specdecode.draft import Draft
    from specdecode.lossy.arbitrage import step_features

    runner = arbitrage.runner
    arbitrage.lm.reset()
    first = int(runner.prefill(prompt_ids).logits[0].argmax())
    context, made = list(prompt_ids) + [first], 1
    feats, labels = [], []
    while made < gen_tokens and context[-1] not in eos:
        limit = min(max_step, gen_tokens - made)
        step, logps = arbitrage.draft_step(context, limit, eos)
        out = runner.forward(context[-1], Draft.chain(step))
        f = step_features(logps, out.logits, step, max_step)
        runner.commit([])
        row0 = torch.log_softmax(out.logits[0].float(), -1)
        own, own_logps = arbitrage.target_step(int(row0.argmax()), limit, eos)
        own_mean = (float(row0.max()) + sum(own_logps)) / len(own)
        feats.append(f)
        labels.append(own_mean - float(f[2]))  # f[2]: the target's mean log-prob of the draft
        context += own
        made += len(own)
    return torch.stack(feats), torch.tensor(labels)


def fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]:
    """Ridge regression on standardised features: (weight, bias, mean, std)."""
    x, y = x.double(), y.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    bias = y.mean()
    eye = torch.eye(z.shape[1], dtype=torch.float64)
    weight = torch.linalg.solve(z.T @ z + RIDGE * eye, z.T @ (y - bias))
    return weight.float(), float(bias), mean.float(), std.float()


def _fit_router(examples: dict, newlines, router_class):
    """Fit on four of every five prompts and measure R^2 on the fifth, then refit on all:
    (router, held-out predictions, held-out labels, held-out R^2, steps)."""
    names = sorted(examples)
    held = set(names[::5])  # every fifth prompt measures the fit
    x_fit = torch.cat([examples[n][0] for n in names if n not in held])
    y_fit = torch.cat([examples[n][1] for n in names if n not in held])
    x_held = torch.cat([examples[n][0] for n in held])
    y_held = torch.cat([examples[n][1] for n in held])
    router = router_class(*fit(x_fit, y_fit), newlines)
    predicted = torch.tensor([router.advantage(f) for f in x_held])
    r2 = 1 - float(((predicted - y_held) ** 2).mean() / y_held.var().clamp_min(1e-9))
    router = router_class(*fit(torch.cat([x_fit, x_held]), torch.cat([y_fit, y_held])), newlines)
    return router, predicted, y_held, r2, int(len(y_fit) + len(y_held))


def run(args: argparse.Namespace) -> int:
    from specdecode.api import eos_ids
    from specdecode.lossy.arbitrage import (FEATURES, ROUTER_KIND, Arbitrage, ArbitrageConfig,
                                            Router)
    from specdecode.models.loading import load_model, make_runner
    from specdecode.artifacts import save_artifact, user_dir
    from specdecode.training.exit_adapters import encode

    require(args.questions > 0 and args.gen_tokens > 1 and args.max_minutes > 0,
            "--questions and --max-minutes must be positive and --gen-tokens above 1")
    loaded = load_model(args.model)
    # the int4 copy drafts for the precise target; the distilled draft for the default runner
    runner = make_runner(loaded, weights="fp32" if args.cheap == "int4" else "auto")
    tokenizer = loaded.tokenizer
    eos = frozenset(eos_ids(loaded, tokenizer))
    fingerprint = runner.fingerprint()
    cheap = args.draft if args.cheap == "draft" else "int4"
    key = hashlib.sha1(f"{fingerprint}:{args.gen_tokens}:{args.max_step_tokens}:{cheap}"
                       .encode()).hexdigest()[:12]
    workdir = Path(args.workdir) if args.workdir else user_dir() / "router-work"
    workdir.mkdir(parents=True, exist_ok=True)
    examples_path = workdir / f"examples-{key}.pt"
    examples = torch.load(examples_path) if args.resume and examples_path.is_file() else {}

    width = len(FEATURES)
    newlines = newline_ids(tokenizer, runner.vocab_size)
    blank = Router(torch.zeros(width), 0.0, torch.zeros(width), torch.ones(width), newlines)
    config = ArbitrageConfig(cheap=args.cheap, draft=args.draft,
                             max_step_tokens=args.max_step_tokens)
    arbitrage = Arbitrage(config, runner, router=blank)
    started = time.time()
    for qid, text in training_prompts(args.data, args.holdout)[:args.questions]:
        if str(qid) in examples:
            continue
        if time.time() - started > 60 * args.max_minutes:
            print(f"stopped after {args.max_minutes} minutes (--resume goes on)")
            break
        examples[str(qid)] = collect(arbitrage, encode(tokenizer, text, 512), args.gen_tokens,
                                     eos, args.max_step_tokens)
        torch.save(examples, examples_path)
        print(f"{len(examples)} prompts, {sum(len(y) for _, y in examples.values())} steps")
    require(len(examples) >= 4, "too few prompts collected to fit a router; raise --max-minutes")

    router, predicted, y_held, r2, steps = _fit_router(examples, newlines, Router)
    threshold = ArbitrageConfig.threshold
    summary = {"prompts": len(examples), "steps": steps,
               "held_out_r2": round(r2, 4), "features": list(FEATURES),
               "gen_tokens": args.gen_tokens, "max_step_tokens": args.max_step_tokens,
               "cheap": args.cheap, "draft": args.draft, "ridge": RIDGE,
               "oracle_target_share_at_default": round(float((y_held > threshold).float().mean()), 4),
               "router_target_share_at_default": round(float((predicted > threshold).float().mean()), 4)}
    out = Path(args.out) if args.out else user_dir() / f"arbitrage-router-{key}.safetensors"
    save_artifact(out, router.tensors(), ROUTER_KIND, summary, fingerprint)
    print(f"wrote {out}: {summary}")
    return 0
