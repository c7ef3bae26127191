"""``specdecode train dllm``: adapt the target into a block-diffusion model (docs/diffusion.md).

A LoRA delta over every attention and MLP projection (``diffusion/dllm.py``) is trained with the
masked-diffusion objective of BD3-LM (Arriola et al. 2025) on target-written conversations
(``training/self_data.py``: the target writes its own user turns and answers them; no benchmark
question is read), the model itself frozen in fp32 (the GGUF dequantised by ``transformers``).
The result is an artifact of kind ``dllm_lora`` that ``generate --diffusion POLICY --dllm PATH``
merges into fp32 weights for the native runner.

Bounded and resumable: ``--minutes`` bounds the whole run (data, training, evaluation); a
checkpoint is written every ``--checkpoint-every`` steps and ``--resume`` continues it. A CUDA
GPU is used when torch sees one, the CPU otherwise.

Defaults: rank 8 (alpha 16: 4.9 MB in fp16 on SmolLM2-135M, the shipped delta's; rank 3 is
1.9 MB), blocks of 8 (BD3-LM trains blocks of 4 to 16), 4 conversations a step, AdamW at lr
2e-3 (ours: a short run), 64 conversations of up to 64 + 160 tokens (the data ``train heads``
and ``train draft`` write, shared through the user cache), plus those of ``--data`` shards
(``specdecode train data``).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdecode.diffusion.dllm import DiffusionDelta, diffusion_batch, masked_diffusion_loss
from specdecode.errors import require
from specdecode.training.runs import (Checkpoint, TimeBar, target_key, training_device,
                                      use_device, work_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="the target ('smollm2' or a .gguf)")
    parser.add_argument("--rank", type=int, default=8, help="the LoRA delta's rank")
    parser.add_argument("--block-size", type=int, default=8, help="positions per diffusion block")
    parser.add_argument("--batch", type=int, default=4, help="conversations per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=100_000, help="most optimiser steps")
    parser.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget")
    parser.add_argument("--conversations", type=int, default=64,
                        help="target-written conversations (a tenth held out for the loss)")
    parser.add_argument("--data", action="append", default=[], metavar="SHARD",
                        help="a shard of `train data` (repeatable): its conversations join "
                             "the cached ones, for training only")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=160)
    parser.add_argument("--mask-id", type=int, default=None,
                        help="the mask token id (default as `generate --diffusion`)")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--workdir", default=None, help="checkpoint folder (default: user cache)")
    parser.add_argument("--out", default=None, help="the artifact (default: the user cache)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")


def _step_batch(data: Sequence, settings: dict, step: int):
    """Step ``step``'s batch: drawn from a generator seeded by the step, so a resumed run draws
    what the uninterrupted one would have."""
    rng = random.Random(settings["seed"] * 1_000_003 + step)
    chosen = [data[rng.randrange(len(data))] for _ in range(settings["batch"])]
    return diffusion_batch(chosen, settings["block_size"], settings["mask_id"], rng)


def train(model, delta: DiffusionDelta, data: Sequence, settings: dict, checkpoint: Checkpoint,
          steps: int, checkpoint_every: int, out_of_time: Callable[[], bool] = lambda: False,
          show: Callable[[str], None] = lambda text: None) -> dict:
    """Train ``delta`` (attached to ``model``) to ``steps`` optimiser steps, or until
    ``out_of_time()``, resuming from ``checkpoint``; the run's state (step, tokens seen,
    losses) at the end, also saved there."""
    opt = torch.optim.AdamW(delta.parameters(), lr=settings["lr"], weight_decay=0.0)
    state = checkpoint.load(lambda s: s["settings"] == settings,
                            lambda s: f"other settings ({s['settings']})")
    if state is not None:
        delta.load_state_dict(state["delta"])
        opt.load_state_dict(state["optimizer"])
    state = state or {"settings": settings, "step": 0, "tokens": 0, "losses": []}
    while state["step"] < steps and not out_of_time():
        batch = _step_batch(data, settings, state["step"])
        loss = masked_diffusion_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] += 1
        # rows read: padding rows sit at position 0, like only each sequence's first real row
        state["tokens"] += int((batch.position_ids > 0).sum()) + len(batch.position_ids)
        state["losses"].append(float(loss.detach()))
        recent = state["losses"][-20:]
        show(f"step {state['step']} loss {sum(recent) / len(recent):.3f}")
        if state["step"] % checkpoint_every == 0 or state["step"] == steps or out_of_time():
            checkpoint.save(dict(state, delta=delta.state_dict(), optimizer=opt.state_dict()))
    return state


@torch.no_grad()
def held_out_loss(model, data: Sequence, settings: dict) -> float:
    """The masked-diffusion loss on ``data`` at fixed masks (the same for every call)."""
    rng = random.Random(12345)
    losses = [float(masked_diffusion_loss(model, diffusion_batch(
        [item], settings["block_size"], settings["mask_id"], rng))) for item in data]
    return sum(losses) / max(1, len(losses))


def shard_conversations(paths: Sequence[str]) -> list:
    """The conversations of ``train data`` shards (any settings), each once."""
    from specdecode.training.target_data import read_shard

    unique = {}
    for path in paths:
        require(Path(path).is_file(), f"no shard at {path}; write one with `specdecode train "
                                      "data --out FILE`")
        for ids, start in read_shard(Path(path)).values():
            if start < len(ids):
                unique[tuple(ids)] = (ids, start)
    return list(unique.values())


def run(args: argparse.Namespace) -> int:
    from specdecode.diffusion.model import default_mask_id
    from specdecode.models.hf import HFRunner
    from specdecode.models.loading import load_model
    from specdecode.artifacts import user_dir
    from specdecode.training.self_data import target_conversations

    require(args.minutes > 0 and args.checkpoint_every > 0, "--minutes and --checkpoint-every "
                                                           "must be positive")
    began = time.monotonic()
    budget = args.minutes * 60
    bar = TimeBar(budget, "train dllm", shown=not args.no_progress)
    loaded = load_model(args.model)
    model = loaded.model.float().eval().requires_grad_(False)
    fingerprint = HFRunner(model).fingerprint()
    device = training_device()
    model.to(device)  # before the data: the target writes it on the GPU too
    use_device(device)
    vocab = model.get_input_embeddings().weight.shape[0]
    mask = args.mask_id if args.mask_id is not None else default_mask_id(loaded.tokenizer, vocab)
    conversations = target_conversations(
        model, loaded.tokenizer, fingerprint, args.conversations, prompt_tokens=args.prompt_tokens,
        answer_tokens=args.answer_tokens, batch=32, seed=args.seed, seconds=0.4 * budget,
        show=bar.show)
    conversations = [(ids, start) for ids, start in conversations if start < len(ids)]
    held = max(2, len(conversations) // 10)
    evaluation, data = conversations[:held], conversations[held:] + shard_conversations(args.data)
    settings = {"fingerprint": fingerprint, "rank": args.rank, "block_size": args.block_size,
                "batch": args.batch, "lr": args.lr, "mask_id": mask, "seed": args.seed,
                "conversations": held + len(data)}
    delta = DiffusionDelta(model, args.rank, config={"mask_id": mask,
                                                     "block_size": args.block_size}).to(device)
    folder = work_dir(args.workdir, user_dir() / f"dllm-work-{target_key(fingerprint)}")
    before = held_out_loss(model, evaluation, settings)
    delta.attach(model)
    state = train(model, delta, data, settings, Checkpoint(folder / "checkpoint.pt", args.resume),
                  args.steps, args.checkpoint_every,
                  lambda: time.monotonic() - began > 0.92 * budget, bar.show)
    after = held_out_loss(model, evaluation, settings)
    bar.close()
    recent = state["losses"][-20:]
    delta.config.update(steps=state["step"], tokens_seen=state["tokens"],
                        held_out_loss_before=round(before, 4), held_out_loss_after=round(after, 4),
                        final_train_loss=round(sum(recent) / max(1, len(recent)), 4))
    out = Path(args.out) if args.out else user_dir() / f"dllm-{target_key(fingerprint)}.safetensors"
    use_device("cpu")
    path = delta.cpu().save(out, fingerprint)
    print(f"dllm delta: {state['step']} steps, {state['tokens']} tokens seen on {device}, "
          f"{time.monotonic() - began:.0f} s; held-out masked-diffusion loss {before:.3f} -> "
          f"{after:.3f}; {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0
