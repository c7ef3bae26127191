"""``specdecode train lora-drop``: the LoRA correctors of LoRA-Drop (specdecode/lossy/lora_drop.py).

1. data: conversations the target writes itself (:mod:`specdecode.training.self_data`, the
   cache every self-distilled trainer shares); a tenth is held out.
2. training, teacher forcing over whole conversations under the method's schedule
   (:func:`scheduled_hidden`: each droppable layer runs on the prompt and the anchors only, the
   other answer positions reuse the anchor's delta plus the corrector): the loss is KL(p_full ||
   p_dropped) against the frozen full model's next-token distribution at every answer position.
   The base weights stay frozen. AdamW, lr 1e-3 (the paper's 1e-5 is for continued
   pre-training of a 7B model over billions of tokens; minutes on a CPU need a larger step),
   one conversation a step.
3. evaluation on the held-out conversations: how often the dropped schedule's top token is the
   full model's, untrained (plain reuse) and trained; stored with the artifact.

Bounded (``--max-minutes``, all phases together) and resumable (``--resume`` continues from the
checkpoint in ``--workdir``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.artifacts import save_artifact, user_dir
from specdecode.errors import require
from specdecode.lossy.lora_drop import (CORRECTORS_KIND, Correctors, droppable_layers,
                                        full_positions, run_layer)
from specdecode.training.runs import (FrozenTargetRun, TimeBar, add_run_arguments,
                                      frozen_target_run, target_key, train_steps)
from specdecode.training.self_data import target_conversations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument("--conversations", type=int, default=64,
                        help="target-written conversations to train on")
    parser.add_argument("--batch", type=int, default=32,
                        help="conversations written at once (the cache is per batch size)")
    parser.add_argument("--data-share", type=float, default=0.3,
                        help="most of the budget spent writing conversations")
    parser.add_argument("--drop-cycle", type=int, default=4, help="as the method's drop_cycle")
    parser.add_argument("--layer-stride", type=int, default=4, help="as the method's layer_stride")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (the paper's 8)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")


def scheduled_hidden(model, correctors: Correctors, ids: list[int], prompt_len: int,
                     drop_cycle: int) -> torch.Tensor:
    """[n, H] the last layer's hidden states of ``ids`` under LoRA-Drop's schedule, all
    positions at once: what the method's decode loop computes token by token."""
    inner = model.model
    n = len(ids)
    full = torch.tensor(full_positions(prompt_len, n, drop_cycle))
    full_at = full.nonzero()[:, 0]  # positions of the full rows
    anchor_row = torch.cumsum(full.long(), 0) - 1  # each position's anchor among them
    dropped_rows = (~full).float()[None, :, None]
    hidden = inner.embed_tokens(torch.tensor([ids]))
    everywhere = torch.arange(n)
    for i, layer in enumerate(inner.layers):
        if i not in correctors.layers:
            hidden = run_layer(layer, hidden, everywhere, inner.rotary_emb)
            continue
        anchors = hidden[:, full_at]
        delta = run_layer(layer, anchors, full_at, inner.rotary_emb) - anchors
        correction = correctors.correction(i, layer.input_layernorm(hidden)) * dropped_rows
        hidden = hidden + delta[:, anchor_row] + correction
    return hidden[0]


def answer_logits(model, hidden: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[answer rows, V] logits of the rows that predict the answer's tokens."""
    return model.lm_head(model.model.norm(hidden[prompt_len - 1:-1])).float()


def step_loss(model, correctors: Correctors, conversation, drop_cycle: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(full || dropped) over one conversation's answer positions, and whether each
    position's top token agrees with the full model's."""
    ids, prompt_len = conversation
    with torch.no_grad():
        teacher = model(input_ids=torch.tensor([ids])).logits[0, prompt_len - 1:-1].float()
    student = answer_logits(model, scheduled_hidden(model, correctors, ids, prompt_len,
                                                    drop_cycle), prompt_len)
    loss = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                    reduction="batchmean")
    return loss, student.argmax(-1) == teacher.argmax(-1)


@torch.no_grad()
def agreement(model, correctors: Correctors, conversations, drop_cycle: int) -> float:
    """Share of held-out answer positions where the schedule's top token is the full model's."""
    agree = torch.cat([step_loss(model, correctors, c, drop_cycle)[1] for c in conversations])
    return float(agree.float().mean())


def _train(model, correctors, optim, train, state, checkpoint, args, deadline, show,
           max_steps: int | None = None) -> None:
    """One conversation a step until ``deadline`` (:func:`~specdecode.training.runs.train_steps`)."""
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))

    def loss_of(step: int) -> torch.Tensor:
        return step_loss(model, correctors, train[int(order[step % len(train)])],
                         args.drop_cycle)[0]

    train_steps(correctors, optim, state, checkpoint, "correctors", deadline, loss_of, "kl", show,
                max_steps)


def _setup(args: argparse.Namespace) -> FrozenTargetRun:
    def make(model) -> Correctors:
        layers = droppable_layers(model.config.num_hidden_layers, args.layer_stride)
        return Correctors(layers, model.config.hidden_size, args.rank)

    return frozen_target_run(args, "lora-drop", "correctors", make,
                             {"drop_cycle": args.drop_cycle})


def run(args: argparse.Namespace) -> int:
    require(args.max_minutes > 0, f"--max-minutes must be positive, got {args.max_minutes}")
    require(args.conversations >= 10, f"--conversations must be >= 10, got {args.conversations}")
    require(args.drop_cycle >= 2 and args.layer_stride >= 2,
            "--drop-cycle and --layer-stride must be >= 2 (below, nothing is dropped)")
    budget = 60 * args.max_minutes
    bar = TimeBar(budget, "train lora-drop", shown=not args.no_progress)
    setup = _setup(args)
    loaded, model, fingerprint, correctors = setup.loaded, setup.model, setup.fingerprint, setup.module
    optim, state, checkpoint = setup.optim, setup.state, setup.checkpoint
    conversations = target_conversations(
        model, loaded.tokenizer, fingerprint, args.conversations, prompt_tokens=64,
        answer_tokens=160, batch=args.batch, seed=0, seconds=args.data_share * budget,
        show=bar.show)
    held = max(2, len(conversations) // 10)
    evaluation, train = conversations[:held], conversations[held:]
    bar.show("evaluation (plain reuse)")
    before = agreement(model, Correctors(correctors.layers, correctors.hidden_size,
                                         correctors.rank), evaluation, args.drop_cycle)
    evaluate_seconds = max(20.0, 0.08 * budget)
    _train(model, correctors.train(), optim, train, state, checkpoint, args,
           bar.began + budget - evaluate_seconds, bar.show)
    bar.show("evaluation")
    after = agreement(model, correctors.eval(), evaluation, args.drop_cycle)
    correctors.config = {"conversations": len(conversations), "held_out": held,
                         "steps": state["step"], "lr": args.lr, "drop_cycle": args.drop_cycle,
                         "layer_stride": args.layer_stride, "kl_log": state["log"],
                         "held_out_top1_plain_reuse": round(before, 4),
                         "held_out_top1_trained": round(after, 4),
                         "minutes": round((time.monotonic() - bar.began) / 60, 1)}
    out = (Path(args.out) if args.out
           else user_dir() / f"lora-drop-correctors-{target_key(fingerprint)}.safetensors")
    path = save_artifact(out, correctors.tensors(), CORRECTORS_KIND, correctors.settings(),
                         fingerprint)
    bar.close()
    print(f"lora-drop correctors: {state['step']} steps on {len(train)} conversations in "
          f"{correctors.config['minutes']} min; held-out top-1 agreement with the full model "
          f"{before:.1%} (plain reuse) -> {after:.1%} (trained)")
    print(f"saved {path} ({path.stat().st_size / 1e3:.0f} KB)")
    return 0
