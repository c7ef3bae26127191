"""``specdecode train heads --kind hydra|clover|eagle|deer``: draft heads by self-distillation.

1. data: the conversations the target writes itself (:mod:`specdecode.training.self_data`, the
   same cache as ``train draft``: made once, read by every trainer). A tenth is held out.
2. features: the target reads each conversation once; its final hidden states (what its LM head
   reads) are cached in float16 in ``--workdir``. They come from the runner the heads will draft
   for (``--runner``, the default one: native int4 for SmolLM2), so training sees the features
   drafting will read; a prompt is one prefill there, several times cheaper than transformers'
   float32 forward.
3. the FR-Spec shortlist (Zhao et al., 2025): the ``--shortlist`` most frequent tokens of the
   training conversations; its coverage of the held-out answers is measured and stored.
4. training, teacher forcing over whole conversations: at every position t and depth k the
   network's feature scores token t + k + 2 over the shortlist, and the loss is KL(p_target ||
   q_head) against the target's own distribution there (Hydra++'s teacher loss; soft labels
   teach more per position than the sampled token). EAGLE adds its feature regression
   (smooth L1, weight 1, the distillation weighted 0.1 as in the paper) and is unrolled over its
   own predictions for depths past the first. deer (the block drafter) reads a low and a
   middle layer's outputs besides the final hidden states, and learns from ``--anchors`` random
   answer positions a step, each the root of an all-masked block whose row k is scored against
   the target's distribution at the k-th position after it (DEER's first stage). AdamW, lr
   1e-3 after 20 warm-up steps, decaying linearly to a tenth over the budget; one conversation
   a step. ``--shard`` reads a shard of ``specdecode train data`` instead of the cache.
5. evaluation on the held-out conversations: per depth, how often the head's top token is the
   target's greedy token (teacher forcing: the acceptance of a chain's node given its parent
   was accepted); stored with the artifact.

Bounded (``--max-minutes``, all phases together) and resumable (``--resume`` continues from the
checkpoint in ``--workdir``). The artifact (kind ``<kind>_heads``, tied to the target's
fingerprint) stores matrices in int8 with float16 row scales.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.errors import require
from specdecode.models.base import Needs
from specdecode.heads.artifact import artifact_kind, save_heads
from specdecode.heads.networks import (NETWORKS, default_feature_layers, make_network,
                                       parameter_count, target_features)
from specdecode.training.artifacts import float_rows, int8_rows, user_dir
from specdecode.training.runs import Checkpoint, TimeBar, descend, target_key, work_dir
from specdecode.training.self_data import (frequency_shortlist, shortlist_coverage,
                                           target_conversations)

#: training depth per kind: Hydra's heads, the unrolled steps of Clover and EAGLE
DEPTHS = {"hydra": 4, "clover": 4, "eagle": 3, "deer": 8}
#: EAGLE's loss: feature regression plus distillation weighted 0.1 (the paper's weights)
EAGLE_DISTILL_WEIGHT = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", required=True, choices=sorted(NETWORKS),
                        help="the network: hydra, clover, eagle or deer (the block drafter)")
    parser.add_argument("--model", default="smollm2",
                        help="target: 'smollm2' (default), a .gguf file or a checkpoint folder")
    parser.add_argument("--max-minutes", type=float, default=12.0,
                        help="wall-clock budget of this run, all phases together")
    parser.add_argument("--conversations", type=int, default=320,
                        help="target-written conversations to train on (shared with `train draft`)")
    parser.add_argument("--batch", type=int, default=64,
                        help="conversations written at once (the cache is per batch size)")
    parser.add_argument("--data-share", type=float, default=0.5,
                        help="largest share of the budget spent writing conversations not cached yet")
    parser.add_argument("--shortlist", type=int, default=8192,
                        help="tokens the heads score (FR-Spec; 0 = the whole vocabulary)")
    parser.add_argument("--depth", type=int, default=None,
                        help="depths trained (default: hydra 4 heads, clover 4, eagle 3, deer "
                             "its block of 8)")
    parser.add_argument("--layers", type=int, default=1,
                        help="deer: decoder layers of the drafter (1 or 2 in DFlash's range)")
    parser.add_argument("--anchors", type=int, default=24,
                        help="deer: blocks trained per conversation a step (random answer "
                             "positions)")
    parser.add_argument("--shard", default=None,
                        help="a JSON-lines shard of `specdecode train data` to train on instead "
                             "of the self_data cache (--conversations of it)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate")
    parser.add_argument("--out", default=None,
                        help="artifact path (default: the user cache, where the method finds it)")
    parser.add_argument("--workdir", default=None,
                        help="features and checkpoint (default: under the user cache)")
    parser.add_argument("--runner", default="auto", choices=["auto", "native", "hf"],
                        help="the runner whose final hidden states the heads learn from: the one "
                             "they will draft for (auto: the default runner)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@torch.inference_mode()
def read_features(runner, sequences, path: Path, deadline: float,
                  layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """The runner's final hidden states (normed: what its LM head reads) of every conversation
    [T, H] float16, after those of ``layers`` where a network reads them too
    (:func:`~specdecode.heads.networks.target_features`), cached in ``path`` (extended when
    more conversations come)."""
    cached: list[torch.Tensor] = torch.load(path) if path.is_file() else []
    known = len(cached)
    needs = Needs(final_hidden=True, layers=layers)
    for ids, _ in sequences[known:]:
        if time.monotonic() > deadline and cached:
            break
        cached.append(target_features(runner.prefill(ids, needs), layers).half())
    if len(cached) == known:
        return cached
    tmp = path.with_name(path.name + ".tmp")
    torch.save(cached, tmp)
    tmp.replace(path)
    return cached


def depth_losses(kind: str, outputs: dict, features: torch.Tensor, head: torch.Tensor,
                 anchors: torch.Tensor | None = None):
    """{depth: loss} for one conversation; outputs[k] row t (or ``anchors[t]``, where the
    network read only those positions) scores token t + k + 2, whose target distribution is
    the LM head's at position t + k + 1."""
    losses = {}
    for k, out in outputs.items():
        rows = torch.arange(len(out)) if anchors is None else anchors[:len(out)]
        # the final hidden states: the last part of a multi-layer network's features
        truth = features[rows + k + 1, -out.shape[-1]:]
        with torch.no_grad():
            teacher = (truth @ head.T).log_softmax(-1)
        student = (out @ head.T).log_softmax(-1)
        loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        if kind == "eagle":
            loss = F.smooth_l1_loss(out, truth) + EAGLE_DISTILL_WEIGHT * loss
        losses[k] = loss
    return losses


@torch.no_grad()
def evaluate(net, sequences, features, head_ids, full_head: torch.Tensor, depth: int) -> list[float]:
    """Per depth: the share of held-out answer positions where the head's top shortlist token
    is the target's greedy token (teacher forcing)."""
    hits, total = [0] * depth, [0] * depth
    short = full_head if head_ids is None else full_head[head_ids]
    for (ids, prompt_len), feats in zip(sequences, features):
        feats = feats.float()
        net.reset()
        outputs = net.train_outputs(feats, torch.tensor(ids), depth)
        for k, out in outputs.items():
            rows = torch.arange(len(out))
            keep = rows + k + 1 >= prompt_len - 1  # the target's answer positions
            want = (feats[k + 1: k + 1 + len(out), -out.shape[-1]:][keep] @ full_head.T).argmax(-1)
            got = (out[keep] @ short.T).argmax(-1)
            if head_ids is not None:
                got = head_ids[got]
            hits[k] += int((got == want).sum())
            total[k] += int(keep.sum())
    return [round(h / max(t, 1), 4) for h, t in zip(hits, total)]


@dataclass
class _Data:
    """Phases 1-3: the conversations split into training and held-out ones, their features,
    and the LM head the heads score with (its shortlist rows)."""

    train: list
    evaluation: list
    train_features: list[torch.Tensor]
    eval_features: list[torch.Tensor]
    #: which runner the features come from ("native-int4", ...)
    reader: str
    #: the input embeddings, the whole LM head (float32), the shortlist (None: every token)
    embed: torch.Tensor
    full_head: torch.Tensor
    head_ids: torch.Tensor | None
    coverage: float

    @property
    def head(self) -> torch.Tensor:
        return self.full_head if self.head_ids is None else self.full_head[self.head_ids]


def run(args: argparse.Namespace) -> int:
    from specdecode.models.hf import HFRunner
    from specdecode.models.loading import load_model

    depth = _checked_depth(args)
    budget = 60 * args.max_minutes
    bar = TimeBar(budget, f"train {args.kind} heads", shown=not args.no_progress)
    deadline = bar.began + budget
    loaded = load_model(args.model)
    target = loaded.model
    target.requires_grad_(False)
    fingerprint = HFRunner(target).fingerprint()
    key = target_key(fingerprint)
    workdir = work_dir(args.workdir, user_dir() / f"heads-work-{key}")
    checkpoint = Checkpoint(workdir / f"{args.kind}-checkpoint.pt", args.resume)
    torch.manual_seed(args.seed)
    settings = network_settings(args, target.config.num_hidden_layers)
    data = _data(loaded, fingerprint, workdir, args, bar.began + 0.7 * budget,
                 args.data_share * budget, bar.show, tuple(settings.get("feature_layers", ())))

    # 4. training
    net = make_network(args.kind, data.embed.shape[1], data.embed, **settings)
    optim = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    state = {"fingerprint": fingerprint, "kind": args.kind, "settings": net.settings(),
             "step": 0, "log": []}
    saved = checkpoint.load(
        lambda s: all(s[k] == state[k] for k in ("fingerprint", "kind", "settings")),
        "another target or network; start afresh without --resume (or pass another --workdir)")
    if saved is not None:
        net.load_state_dict(saved["net"])
        optim.load_state_dict(saved["optim"])
        state.update(step=saved["step"], log=saved["log"])
    _train(net, optim, data, depth, state, checkpoint, args,
           deadline - max(30.0, 0.06 * budget), bar.show)  # time to evaluate and save

    # 5. what is stored is evaluated: int8 round trip of the weights first
    with torch.no_grad():
        stored = int8_rows({k: v.half() for k, v in net.state_dict().items()})
        net.load_state_dict(float_rows(stored))
    bar.show("evaluation")
    accuracy = evaluate(net.eval(), data.evaluation, data.eval_features, data.head_ids,
                        data.full_head, depth)
    info = {"kind": args.kind, "depth_trained": depth, "features": data.reader,
            "shortlist": args.shortlist, "shortlist_coverage": round(data.coverage, 4),
            "conversations": len(data.train) + len(data.evaluation),
            "held_out": len(data.evaluation), "steps": state["step"], "lr": args.lr,
            "loss_log": state["log"], "top1_agreement_per_depth": accuracy,
            "parameters": parameter_count(net),
            "minutes": round((time.monotonic() - bar.began) / 60, 1)}
    out = (Path(args.out) if args.out
           else user_dir() / f"{artifact_kind(args.kind)}-{key}.safetensors")
    path = save_heads(out, net, data.head_ids, fingerprint, info)
    bar.close()
    print(f"{args.kind} heads: {parameter_count(net) / 1e6:.2f}M parameters, {state['step']} "
          f"steps on {len(data.train)} conversations in {info['minutes']} min")
    print(f"shortlist: {args.shortlist} tokens cover {data.coverage:.1%} of held-out answers")
    print("top-1 agreement with the target's greedy token on held-out answers, per depth: "
          + ", ".join(f"{a:.1%}" for a in accuracy))
    print(f"saved {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def network_settings(args: argparse.Namespace, num_layers: int) -> dict:
    """The network's settings besides its width: for deer its layers, block and the target
    layers it reads (:func:`default_feature_layers`); the other kinds' defaults."""
    if args.kind != "deer":
        return {}
    return {"layers": args.layers, "block": args.depth or DEPTHS["deer"],
            "feature_layers": default_feature_layers("deer", num_layers)}


def _checked_depth(args: argparse.Namespace) -> int:
    """The depth to train, after checking the arguments (before anything loads)."""
    require(args.max_minutes > 0, f"--max-minutes must be positive, got {args.max_minutes}")
    require(args.conversations >= 10, f"--conversations must be >= 10, got {args.conversations}")
    require(args.batch >= 1, f"--batch must be >= 1, got {args.batch}")
    require(args.shortlist >= 0, "--shortlist must be >= 0 (0 = whole vocabulary)")
    depth = args.depth or DEPTHS[args.kind]
    require(depth >= 1, f"--depth must be >= 1, got {depth}")
    require(args.layers >= 1, f"--layers must be >= 1, got {args.layers}")
    require(args.shard is None or Path(args.shard).is_file(),
            f"--shard {args.shard} is not a file; write one with `specdecode train data --out "
            "FILE`")
    return depth


def _data(loaded, fingerprint: str, workdir: Path, args: argparse.Namespace,
          features_deadline: float, data_seconds: float, show,
          layers: tuple[int, ...] = ()) -> _Data:
    """Phases 1-3: conversations (the draft trainer's defaults: one cache serves both; or a
    shard of `train data`), their features (final hidden states, after those of ``layers``)
    from the runner the heads will draft for, a tenth held out, the shortlist."""
    from specdecode.models.loading import make_runner
    from specdecode.training.target_data import read_shard

    target = loaded.model
    if args.shard:
        shard = read_shard(Path(args.shard))
        sequences = [shard[i] for i in sorted(shard)][:args.conversations]
        source = f"shard{len(sequences)}"
    else:
        sequences = target_conversations(target, loaded.tokenizer, fingerprint, args.conversations,
                                         prompt_tokens=64, answer_tokens=160, batch=args.batch,
                                         seed=0, seconds=data_seconds, show=show)
        source = str(len(sequences))
    show("features")
    runner = make_runner(loaded, args.runner)
    reader = f"{runner.name}-{getattr(runner, 'weights', 'fp32')}"
    suffix = "".join(f"-L{layer}" for layer in layers)
    features = read_features(runner, sequences, workdir / f"features-{reader}-{source}{suffix}.pt",
                             features_deadline, layers)
    sequences = sequences[:len(features)]
    held = max(2, len(sequences) // 10)
    evaluation, train = sequences[:held], sequences[held:]
    full_head = target.get_output_embeddings().weight.detach().float()
    vocab = full_head.shape[0]
    head_ids = (frequency_shortlist(train, args.shortlist, vocab)
                if 0 < args.shortlist < vocab else None)
    coverage = 1.0 if head_ids is None else shortlist_coverage(head_ids, evaluation)
    return _Data(train, evaluation, features[held:], features[:held], reader,
                 target.get_input_embeddings().weight.detach(), full_head, head_ids, coverage)


def _anchors(prompt_len: int, n: int, count: int) -> torch.Tensor:
    """``count`` random anchors (ascending) among the answer's positions of a conversation of
    ``n`` tokens: a deer step scores a block of rows per anchor, so it reads a sample of them
    (every anchor of a conversation would cost a hundred times a hydra step)."""
    first = max(0, prompt_len - 2)
    choices = torch.arange(first, n - 1)
    pick = torch.randperm(len(choices))[:count]
    return choices[pick].sort().values


def _train(net, optim, data: _Data, depth: int, state: dict, checkpoint: Checkpoint,
           args: argparse.Namespace, deadline: float, show) -> None:
    """Phase 4 until ``deadline``: one conversation a step, the learning rate warmed up over
    20 steps then decaying linearly to a tenth; a checkpoint every two minutes and at the end.
    ``state`` holds the step and the loss log (every 50 steps)."""
    def save() -> None:
        checkpoint.save({**state, "net": net.state_dict(), "optim": optim.state_dict()})

    train, head = data.train, data.head
    start = time.monotonic()
    last_save, recent = start, []
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    while time.monotonic() < deadline:
        step = state["step"]
        i = int(order[step % len(train)])
        ids, feats = torch.tensor(train[i][0]), data.train_features[i].float()
        elapsed = (time.monotonic() - start) / max(deadline - start, 1.0)
        for group in optim.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20) * (1.0 - 0.9 * min(elapsed, 1.0))
        net.reset()
        if args.kind == "deer":
            anchors = _anchors(train[i][1], len(ids), args.anchors)
            outputs = net.train_outputs(feats, ids, depth, anchors)
        else:
            anchors, outputs = None, net.train_outputs(feats, ids, depth)
        losses = depth_losses(args.kind, outputs, feats, head, anchors)
        loss = sum(losses.values()) / len(losses)
        value = descend(loss, optim, net.parameters(), step)
        state["step"] = step = step + 1
        recent = (recent + [value])[-20:]
        if step % 50 == 0:
            state["log"].append({"step": step, "loss": round(sum(recent) / len(recent), 4)})
        show(f"step {step} loss {sum(recent) / len(recent):.3f}")
        if time.monotonic() - last_save > 120:
            save()
            last_save = time.monotonic()
    save()
