"""``specdecode train exit-adapters``: per-layer exit adapters by self-distillation.

The target reads prompts (the Spec-Bench dev half by default, its held-out fifth excepted) and
its own greedy continuations of them; at sampled positions the hidden states of the candidate
exit layers and the final layer are kept (phase 1, cached on disk). Each adapter is then trained
to match the full model's next-token distribution through the frozen LM head, minimising
KL(p_full || q_exit) (phase 2: self-distillation, as in LayerSkip's early-exit loss but with the
model frozen and a soft target). Finally the agreement of every exit's argmax with the full
model's greedy token is measured on held-out prompts, before (plain final norm + LM head) and
after training, and stored in the artifact.

Bounded and resumable: ``--max-minutes`` stops training in time to evaluate and save;
a checkpoint is written every ``--checkpoint-every`` steps and ``--resume`` continues from it
(the features cache is reused whenever its settings match).

Defaults: layers 6,9,...,27; rank 64; 64 positions a step; AdamW, lr 2e-3 decaying linearly to
a tenth; 96 generated tokens per prompt. The LM head products run in bfloat16 (AMX makes them
several times faster on this CPU); the loss is computed in float32.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from specdecode.drafting.exit_adapters import ExitAdapters
from specdecode.drafting.exits import check_exit_layer, require_early_exit
from specdecode.errors import SpecDecodeError, require
from specdecode.training.runs import Checkpoint, target_key, work_dir

DEFAULT_LAYERS = "6,9,12,15,18,21,24,27"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
            "humanities"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (default), a .gguf file or a local Hugging Face checkpoint")
    parser.add_argument("--layers", default=DEFAULT_LAYERS, help="exit layers to train adapters for")
    parser.add_argument("--rank", type=int, default=64, help="rank of each adapter's low-rank map")
    parser.add_argument("--steps", type=int, default=3000, help="most optimiser steps")
    parser.add_argument("--max-minutes", type=float, default=25.0,
                        help="wall-clock budget for the whole run (features, training, evaluation)")
    parser.add_argument("--batch", type=int, default=64, help="positions per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--train-prompts", type=int, default=192,
                        help="prompts to read (the held-out fifth of the data is never used)")
    parser.add_argument("--eval-per-task", type=int, default=2,
                        help="held-out prompts per task for the agreement table")
    parser.add_argument("--gen-tokens", type=int, default=96,
                        help="greedy tokens generated after each prompt")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="longer prompts keep their last tokens")
    parser.add_argument("--data", default=None,
                        help="Spec-Bench-format jsonl (default: the packaged dev half)")
    parser.add_argument("--out", default=None,
                        help="artifact path (default: the user cache, where methods find it)")
    parser.add_argument("--workdir", default=None,
                        help="features cache and checkpoints (default: under the user cache)")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--seed", type=int, default=0)


# ---- data ---------------------------------------------------------------------------------

def default_data() -> Path:
    packaged = Path(__file__).resolve().parent.parent / "data" / "spec_bench_dev.jsonl"
    if packaged.is_file():
        return packaged
    shared = Path(__file__).resolve().parents[4] / "shared" / "data" / "spec_bench" / "dev.jsonl"
    require(shared.is_file(), "no training prompts found; pass --data FILE.jsonl "
                              "(Spec-Bench format: one {\"category\", \"turns\"} per line)")
    return shared


def split_prompts(path: Path, train_prompts: int, eval_per_task: int):
    """(train, eval) lists of (task, text): every fifth question is held out for evaluation."""
    train, held = [], {}
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        q = json.loads(line)
        task = "mt_bench" if q["category"] in MT_BENCH else q["category"]
        if i % 5 == 4:
            held.setdefault(task, []).append((task, q["turns"][0]))
        else:
            train.append((task, q["turns"][0]))
    random.Random(0).shuffle(train)  # mix tasks, so a short run still sees each of them
    evaluation = [p for task in sorted(held) for p in held[task][:eval_per_task]]
    return train[:train_prompts], evaluation


def encode(tokenizer, text: str, max_tokens: int) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return ids[-max_tokens:]


def generate(model, prompts: list[list[int]], new_tokens: int, pad: int,
             eos: frozenset[int]) -> list[list[int]]:
    """Each prompt followed by its greedy continuation, batched with left padding (training
    data: a rounding difference from unpadded decoding does not matter here), cut after its
    end-of-sequence token (``self_data.generate``, greedy and unbounded in time)."""
    from specdecode.training.self_data import generate as continuations

    return [p + row for p, row in zip(prompts, continuations(model, prompts, new_tokens, pad,
                                                             eos, 0.0, None))]


@torch.inference_mode()
def features(model, ids: list[int], prompt_len: int, layers: tuple[int, ...],
             prompt_positions: int, generator: random.Random) -> dict[str, torch.Tensor]:
    """Hidden states at the generated positions and some prompt positions: one row per
    position, for each exit layer and the final (normed) layer, which gives the teacher."""
    out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    # position i predicts token i + 1: generated positions start at the last prompt token
    generated = list(range(prompt_len - 1, len(ids) - 1))
    earlier = list(range(0, prompt_len - 1))
    chosen = generated + sorted(generator.sample(earlier, min(prompt_positions, len(earlier))))
    index = torch.tensor(chosen)
    feats = {f"h{layer}": out.hidden_states[layer][0, index].half() for layer in layers}
    feats["final"] = out.last_hidden_state[0, index].half()  # after the final norm
    feats["generated"] = torch.tensor([True] * len(generated) + [False] * (len(chosen) - len(generated)))
    return feats


def build_features(model, tokenizer, prompts, layers, args, path: Path, what: str,
                   deadline: float, prompt_positions: int) -> dict[str, torch.Tensor]:
    """Phase 1, cached in ``path`` (chunks appended as they are made, so it resumes)."""
    from tqdm import tqdm

    settings = {"layers": list(layers), "gen_tokens": args.gen_tokens, "seed": args.seed,
                "max_prompt_tokens": args.max_prompt_tokens, "prompts": [p for _, p in prompts],
                "prompt_positions": prompt_positions}
    cache = torch.load(path) if path.is_file() else None
    if cache is None or cache["settings"] != settings:
        cache = {"settings": settings, "chunks": []}
    from specdecode.api import eos_ids

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = frozenset(eos_ids(model, tokenizer))
    batch = 8
    done = sum(c["count"] for c in cache["chunks"])
    bar = tqdm(total=len(prompts), initial=done, desc=f"{what} features", unit="prompt")
    for start in range(done, len(prompts), batch):
        if time.monotonic() > deadline and cache["chunks"]:  # one chunk at least, however late
            break
        chunk = prompts[start:start + batch]
        encoded = [encode(tokenizer, text, args.max_prompt_tokens) for _, text in chunk]
        full = generate(model, encoded, args.gen_tokens, pad, eos)
        rng = random.Random(args.seed * 100003 + start)
        rows = [features(model, ids, len(p), layers, prompt_positions, rng)
                for ids, p in zip(full, encoded)]
        merged = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        cache["chunks"].append({"count": len(chunk), "features": merged})
        tmp = path.with_name(path.name + ".tmp")
        torch.save(cache, tmp)
        tmp.replace(path)
        bar.update(len(chunk))
    bar.close()
    chunks = [c["features"] for c in cache["chunks"]]
    require(bool(chunks), f"no {what} features were made before the time ran out; "
                          "raise --max-minutes")
    return {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}


# ---- training -----------------------------------------------------------------------------

def kl_loss(adapter, hidden: torch.Tensor, head: torch.Tensor,
            teacher_logp: torch.Tensor) -> torch.Tensor:
    """mean KL(p_full || q_exit) over rows; the head product in bfloat16, the rest in float32."""
    normed = adapter(hidden.float())
    logits = (normed.to(torch.bfloat16) @ head.T).float()  # [B, V]
    logq = torch.log_softmax(logits, -1)
    return (teacher_logp.exp() * (teacher_logp - logq)).sum(-1).mean()


@torch.no_grad()
def agreement(adapters: ExitAdapters | None, feats: dict, head: torch.Tensor, norm,
              layers) -> dict[int, float]:
    """Fraction of generated positions where each exit's argmax equals the full model's."""
    mask = feats["generated"]
    target = (feats["final"][mask].float() @ head.float().T).argmax(-1)
    result = {}
    for layer in layers:
        h = feats[f"h{layer}"][mask].float()
        normed = norm(h) if adapters is None else adapters[layer](h)
        guess = torch.cat([(part @ head.float().T).argmax(-1) for part in normed.split(256)])
        result[layer] = round(float((guess == target).float().mean()), 4)
    return result


def parse_layers(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise SpecDecodeError(f"--layers must be comma-separated layer numbers, got {text!r}") from None
    require(bool(layers), "--layers is empty; give e.g. --layers 12,15,18")
    return layers


def run(args: argparse.Namespace) -> int:
    from specdecode.models.loading import load_model

    layers = parse_layers(args.layers)
    for name in ("rank", "steps", "batch", "checkpoint_every", "gen_tokens", "train_prompts"):
        require(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive")
    require(args.max_minutes > 0, "--max-minutes must be positive")
    loaded = load_model(args.model)
    adapters, out = train(loaded.model, loaded.tokenizer, layers, args)
    before, after = adapters.config["agreement_before"], adapters.config["agreement_after"]
    print(f"\nsaved {out} ({out.stat().st_size / 1e6:.1f} MB) after {adapters.config['steps']} "
          f"steps, {adapters.config['minutes']} min")
    print("agreement of each exit's argmax with the full model on "
          f"{adapters.config['eval_positions']} held-out generated positions:")
    print("| exit layer | plain exit | with adapter |\n|---:|---:|---:|")
    for layer in layers:
        print(f"| {layer} | {before[str(layer)]:.1%} | {after[str(layer)]:.1%} |")
    return 0


def train(model, tokenizer, layers: tuple[int, ...], args) -> tuple[ExitAdapters, Path]:
    """Both phases, the evaluation and the artifact; returns the adapters and their path."""
    from specdecode.api import as_runner
    from specdecode.cache import cache_root

    began = time.monotonic()
    deadline = began + args.max_minutes * 60
    runner = as_runner(model)
    require_early_exit(runner, "an exit adapter")
    for layer in layers:
        check_exit_layer(runner, layer, "--layers:")
    fingerprint = runner.fingerprint()
    key = target_key(fingerprint)
    workdir = work_dir(args.workdir, cache_root() / "train" / f"exit-adapters-{key}")
    checkpoint = Checkpoint(workdir / "checkpoint.pt", args.resume)
    torch.manual_seed(args.seed)

    train_prompts, eval_prompts = split_prompts(Path(args.data) if args.data else default_data(),
                                                args.train_prompts, args.eval_per_task)
    # reading may use 40% of the budget at most: training needs the rest
    read_deadline = began + args.max_minutes * 60 * 0.4
    evaluation = build_features(model, tokenizer, eval_prompts, layers, args,
                                workdir / "eval-features.pt", "eval", read_deadline, 0)
    data = build_features(model, tokenizer, train_prompts, layers, args,
                          workdir / "train-features.pt", "train", read_deadline,
                          args.gen_tokens // 2)

    head = model.get_output_embeddings().weight.detach()
    norm = model.model.norm
    eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
    adapters = ExitAdapters(layers, head.shape[1], args.rank, eps, norm.weight)
    # keep time for the evaluation at the end (about as long as a few dozen steps)
    step, losses = _fit(adapters, data, head.to(torch.bfloat16), checkpoint, fingerprint, args,
                        deadline - max(20.0, 0.05 * args.max_minutes * 60))

    with torch.no_grad():  # evaluate what is stored: the artifact keeps fp16 weights
        for p in adapters.parameters():
            p.copy_(p.half().float())
    before = agreement(None, evaluation, head, norm, layers)
    after = agreement(adapters.eval(), evaluation, head, norm, layers)
    adapters.config = {
        "agreement_before": {str(k): v for k, v in before.items()},
        "agreement_after": {str(k): v for k, v in after.items()},
        "eval_positions": int(evaluation["generated"].sum()),
        "eval_prompts": len(eval_prompts), "train_positions": data["final"].shape[0],
        "steps": step, "batch": args.batch, "lr": args.lr, "gen_tokens": args.gen_tokens,
        "losses_every_50": losses[::50],
        "minutes": round((time.monotonic() - began) / 60, 1),
    }
    out = Path(args.out) if args.out else (
        cache_root() / "artifacts" / f"exit-adapters-{runner.name}-{key}.safetensors")
    return adapters, adapters.save(out, fingerprint)


def _fit(adapters: ExitAdapters, data: dict, head16: torch.Tensor, checkpoint: Checkpoint,
         fingerprint: str, args, deadline: float) -> tuple[int, list[float]]:
    """The training phase, from the checkpoint with ``--resume``: up to ``--steps`` steps (or
    ``deadline``) of ``--batch`` random positions, every exit's KL to the final layer's
    distribution, AdamW with the learning rate falling linearly to a tenth over ``--steps``;
    a checkpoint every ``--checkpoint-every`` steps and at the end. Returns (steps, losses)."""
    from tqdm import tqdm

    layers = adapters.layers
    optimizer = torch.optim.AdamW(adapters.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: max(0.1, 1.0 - 0.9 * s / args.steps))
    step, losses = 0, []
    settings = {"fingerprint": fingerprint, "layers": list(layers), "rank": args.rank}
    state = checkpoint.load(
        lambda s: all(s[k] == v for k, v in settings.items()),
        lambda s: f"other settings (layers {s['layers']}, rank {s['rank']}); delete it to start "
                  "over")
    if state is not None:
        adapters.load_state_dict(state["adapters"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, losses = state["step"], state["losses"]

    def save() -> None:
        checkpoint.save({**settings, "adapters": adapters.state_dict(),
                         "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                         "step": step, "losses": losses})

    rows = data["final"].shape[0]
    bar = tqdm(total=args.steps, initial=step, desc="training", unit="step")
    while step < args.steps and time.monotonic() < deadline:
        # the step number seeds the batch, so a resumed run draws the batches it would have
        index = torch.randint(rows, (args.batch,), generator=torch.Generator().manual_seed(
            args.seed * 1_000_003 + step))
        with torch.no_grad():
            final = data["final"][index].float()
            teacher = torch.log_softmax((final.to(torch.bfloat16) @ head16.T).float(), -1)
        loss = sum(kl_loss(adapters[layer], data[f"h{layer}"][index], head16, teacher)
                   for layer in layers) / len(layers)
        require(not math.isnan(loss.item()), f"training diverged at step {step} (the loss is "
                                              "NaN); lower --lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        step += 1
        losses.append(round(loss.item(), 4))
        bar.update(1)
        bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if step % args.checkpoint_every == 0:
            save()
    bar.close()
    save()
    return step, losses
