"""``specdecode train lud``: LUD's fine-tuned delta (specdecode/lossy/lud.py): the slots' input
embeddings and LoRA on the attention projections, active on the slots' rows only.

1. data: the prompts of the conversations the target writes itself (the cache every
   self-distilled trainer shares), answered again by the target greedily (what the method's
   contexts are), cached in ``--workdir`` a batch at a time; a tenth held out.
2. training, teacher forcing: each step takes one conversation and up to ``--anchors`` answer
   positions t; after each, the slots sit at positions t + 1... and attend to the tokens up to t
   and the slots before them (one forward, :func:`slot_logits`); slot j's loss is the cross
   entropy of the token at t + 2 + j. AdamW, lr 1e-3 (minutes on a CPU, not the paper's
   fine-tuning of a 7B model).
3. evaluation on the held-out conversations: per slot, how often its top token is the greedy
   text's; and, as the method emits units (threshold 0.9), the mean unit length and the share
   of unit tokens equal to the greedy text's; stored with the artifact.

Bounded (``--max-minutes``, all phases together) and resumable (``--resume`` continues from the
checkpoint in ``--workdir``).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.artifacts import save_artifact, user_dir
from specdecode.errors import require
from specdecode.lossy.lud import ADAPTERS_KIND, UnitAdapters, lexical_unit
from specdecode.training.runs import (TimeBar, add_run_arguments, frozen_target_run,
                                      target_key, train_steps)
from specdecode.training.self_data import target_conversations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, "greedy answers and checkpoint (default: the user cache)")
    parser.add_argument("--conversations", type=int, default=64,
                        help="target-written conversations whose prompts are answered greedily")
    parser.add_argument("--batch", type=int, default=32,
                        help="conversations written at once (the cache is per batch size)")
    parser.add_argument("--data-share", type=float, default=0.35,
                        help="most of the budget spent writing and answering conversations")
    parser.add_argument("--slots", type=int, default=3, help="placeholder slots trained")
    parser.add_argument("--anchors", type=int, default=48,
                        help="answer positions a conversation's step puts slots after")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")


def slot_mask(length: int, anchors: torch.Tensor, slots: int) -> torch.Tensor:
    """[1, 1, N, N] additive mask of a sequence of ``length`` tokens followed by a block of
    ``slots`` slots per anchor: the tokens causal, a block's slots see the tokens up to its
    anchor and the block's slots up to themselves."""
    size = length + len(anchors) * slots
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    block_anchor = anchors.repeat_interleave(slots)
    allowed[length:, :length] = torch.arange(length)[None] <= block_anchor[:, None]
    block = torch.arange(len(anchors)).repeat_interleave(slots)
    slot = torch.arange(slots).repeat(len(anchors))
    allowed[length:, length:] = (block[:, None] == block[None]) & (slot[None] <= slot[:, None])
    return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))[None, None]


def slot_logits(model, adapters: UnitAdapters, ids: list[int], anchors: torch.Tensor,
                slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [A, V] of the anchors' own rows and [A, slots, V] of their slots, all in one
    forward (what the method's step computes for one anchor)."""
    inner, length = model.model, len(ids)
    x = torch.cat([inner.embed_tokens(torch.tensor(ids)),
                   adapters.slot_embeddings[:slots].repeat(len(anchors), 1)])[None]
    block_positions = (anchors[:, None] + 1 + torch.arange(slots)[None]).reshape(-1)
    positions = torch.cat([torch.arange(length), block_positions])[None]
    mask = slot_mask(length, anchors, slots)
    rotary = inner.rotary_emb(x, positions)
    with adapters.applied(model, torch.arange(x.shape[1]) >= length):
        hidden = x
        for layer in inner.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions,
                           position_embeddings=rotary)
    logits = model.lm_head(inner.norm(hidden[0, torch.cat([anchors, length + torch.arange(
        len(block_positions))])])).float()
    return logits[:len(anchors)], logits[len(anchors):].view(len(anchors), slots, -1)


def pick_anchors(conversation, count: int, rng: random.Random) -> torch.Tensor:
    """Up to ``count`` answer positions t with at least one slot target (t + 2 < length)."""
    ids, prompt_len = conversation
    candidates = list(range(prompt_len - 1, len(ids) - 2))
    return torch.tensor(sorted(rng.sample(candidates, min(count, len(candidates)))),
                        dtype=torch.long)


def slot_targets(ids: list[int], anchors: torch.Tensor, slots: int) -> torch.Tensor:
    """[A, slots] the token each slot should predict (t + 2 + j), -100 past the end."""
    index = anchors[:, None] + 2 + torch.arange(slots)[None]
    padded = torch.tensor(ids + [-100] * (slots + 2))
    return padded[index]


@torch.no_grad()
def evaluate(model, adapters, conversations, slots: int, threshold: float) -> dict:
    """Per-slot top-1 accuracy against the greedy text; mean unit length at ``threshold`` and
    the share of unit tokens equal to the text's."""
    right, seen = torch.zeros(slots), torch.zeros(slots)
    unit_tokens = unit_right = units = 0
    for ids, prompt_len in conversations:
        anchors = torch.arange(prompt_len - 1, len(ids) - 2)
        own, slot = slot_logits(model, adapters, ids, anchors, slots)
        targets = slot_targets(ids, anchors, slots)
        valid = targets >= 0
        right += ((slot.argmax(-1) == targets) & valid).sum(0).float()
        seen += valid.sum(0).float()
        probs = torch.softmax(torch.cat([own[:, None], slot], 1), -1)
        for a, t in enumerate(anchors.tolist()):
            unit = lexical_unit(probs[a], threshold)[:len(ids) - t - 1]
            units += 1
            unit_tokens += len(unit)
            unit_right += sum(u == v for u, v in zip(unit, ids[t + 1:]))
    return {"slot_top1": [round(float(r / max(s, 1)), 4) for r, s in zip(right, seen)],
            "mean_unit_tokens": round(unit_tokens / max(units, 1), 3),
            "unit_token_accuracy": round(unit_right / max(unit_tokens, 1), 4)}


def greedy_answers(model, tokenizer, conversations, workdir: Path, deadline: float, show
                   ) -> list:
    """The conversations' prompts answered greedily (as many as time allows), cached."""
    from specdecode.api import eos_ids
    from specdecode.training.exit_adapters import generate

    path = workdir / f"greedy-{len(conversations)}.pt"
    done = torch.load(path) if path.is_file() else []
    eos = frozenset(eos_ids(model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    while len(done) < len(conversations) and time.monotonic() < deadline:
        batch = conversations[len(done):len(done) + 16]
        prompts = [ids[:prompt_len] for ids, prompt_len in batch]
        answered = generate(model, prompts, max(len(i) - p for i, p in batch), pad, eos)
        done += [(ids, len(p)) for ids, p in zip(answered, prompts)]
        torch.save(done, path)
        show(f"greedy answers {len(done)}/{len(conversations)}")
    require(len(done) >= 10, "too little time to answer 10 prompts greedily; raise --max-minutes")
    return done


def _train(model, adapters, optim, train, state, checkpoint, args, deadline, show,
           max_steps: int | None = None) -> None:
    """One conversation a step until ``deadline`` (:func:`~specdecode.training.runs.train_steps`)."""
    rng = random.Random(args.seed * 7919 + state["step"])

    def loss_of(step: int) -> torch.Tensor:
        ids, prompt_len = train[step % len(train)]
        anchors = pick_anchors((ids, prompt_len), args.anchors, rng)
        _, logits = slot_logits(model, adapters, ids, anchors, args.slots)
        return F.cross_entropy(logits.flatten(0, 1), slot_targets(ids, anchors, args.slots)
                               .flatten(), ignore_index=-100)

    train_steps(adapters, optim, state, checkpoint, "adapters", deadline, loss_of, "loss", show,
                max_steps)


def run(args: argparse.Namespace) -> int:
    from specdecode.lossy.lud import LudConfig

    require(args.max_minutes > 0, f"--max-minutes must be positive, got {args.max_minutes}")
    require(args.conversations >= 10, f"--conversations must be >= 10, got {args.conversations}")
    require(args.slots >= 1 and args.anchors >= 1, "--slots and --anchors must be >= 1")
    budget = 60 * args.max_minutes
    bar = TimeBar(budget, "train lud", shown=not args.no_progress)
    setup = frozen_target_run(args, "lud", "adapters",
                              lambda model: UnitAdapters.fresh(model, args.slots, args.rank))
    loaded, model, fingerprint, adapters = setup.loaded, setup.model, setup.fingerprint, setup.module
    optim, state, checkpoint, workdir = setup.optim, setup.state, setup.checkpoint, setup.workdir
    data_deadline = bar.began + args.data_share * budget
    written = target_conversations(
        model, loaded.tokenizer, fingerprint, args.conversations, prompt_tokens=64,
        answer_tokens=160, batch=args.batch, seed=0,
        seconds=0.5 * args.data_share * budget, show=bar.show)
    conversations = greedy_answers(model, loaded.tokenizer, written, workdir,
                                   max(data_deadline, time.monotonic() + 60), bar.show)
    held = max(2, len(conversations) // 10)
    evaluation, train = conversations[:held], conversations[held:]
    _train(model, adapters.train(), optim, train, state, checkpoint, args,
           bar.began + budget - max(30.0, 0.08 * budget), bar.show)
    bar.show("evaluation")
    measured = evaluate(model, adapters.eval(), evaluation, args.slots, LudConfig.threshold)
    adapters.config = {"conversations": len(conversations), "held_out_conversations": held,
                       "steps": state["step"], "lr": args.lr, "anchors": args.anchors,
                       "loss_log": state["log"], "held_out": measured,
                       "minutes": round((time.monotonic() - bar.began) / 60, 1)}
    out = (Path(args.out) if args.out
           else user_dir() / f"lud-adapters-{target_key(fingerprint)}.safetensors")
    path = save_artifact(out, adapters.tensors(), ADAPTERS_KIND, adapters.settings(), fingerprint)
    bar.close()
    print(f"lud adapters: {state['step']} steps on {len(train)} conversations in "
          f"{adapters.config['minutes']} min; held out: {measured}")
    print(f"saved {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0
