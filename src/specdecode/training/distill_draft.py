"""``specdecode train draft``: distil a small draft model from the target itself.

No smaller sibling of the default model is installed, so the draft is made from the target: its
first ``--layers`` decoder layers and final norm (a strong start: the residual stream already
speaks the target's language), sharing the target's frozen embedding table, with an LM head
restricted to a frequency-ranked shortlist of ``--shortlist`` tokens (FR-Spec, Zhao et al., 2025:
the head of a 49k vocabulary would otherwise cost more than the draft's layers). It is trained
on the target's own distributions in the spirit of OSD (Liu et al., 2023, "Online Speculative
Decoding"): minimise KL(p_target || q_draft) over the shortlist at every position of text the
target reads and generates.

1. data: conversations the target writes itself (:mod:`specdecode.training.self_data`: user
   turns and answers, half greedy, half at temperature 0.7; no benchmark prompt). A tenth is held
   out to measure agreement (the greedy acceptance rate: how often
   the draft's argmax is the target's).
2. distillation: AdamW (lr 1e-3 after 10 warm-up steps, constant: runs are short) on the
   draft's layers and norm; one conversation a step, the target's distribution computed on the
   fly.
3. SpecDec++ acceptance head (Huang et al., 2024): the draft reads held-in conversations where
   15% of the answer tokens are replaced by its own greedy guesses (the paper's mixing ratio);
   the head learns, from the draft's hidden state at each answer token, whether the target's
   greedy choice there is that token; weighted BCE, rejected tokens weighted 6 (the paper's).

Bounded (``--max-minutes``, split between the phases), resumable (``--resume`` continues from
the last checkpoint in ``--workdir``), with a progress bar. The artifact (kind ``draft_model``,
tied to the target's fingerprint) holds the layers' matrices in int8 with float16 row scales
(norms in float16), the shortlist and the acceptance head: about 14 MB for 4 layers of SmolLM2.
The draft_model proposer finds it in the user cache or, for the default model, in the package.
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.artifacts import int8_rows, save_artifact, user_dir
from specdecode.control import AcceptanceHead
from specdecode.errors import require
from specdecode.training.runs import TimeBar, descend, work_dir
from specdecode.training.self_data import frequency_shortlist, target_conversations

KIND = "draft_model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="target: 'smollm2' (default), a .gguf file or a checkpoint folder")
    parser.add_argument("--layers", type=int, default=4,
                        help="draft depth: the target's first N layers (4 of SmolLM2's 30)")
    parser.add_argument("--shortlist", type=int, default=8192,
                        help="tokens the draft's LM head covers (0 = the whole vocabulary)")
    parser.add_argument("--max-minutes", type=float, default=28.0,
                        help="wall-clock budget of this run, all phases together")
    parser.add_argument("--conversations", type=int, default=320,
                        help="target-written conversations to generate (data phase)")
    parser.add_argument("--data-share", type=float, default=0.4,
                        help="largest share of the budget spent generating data")
    parser.add_argument("--head-share", type=float, default=0.08,
                        help="share of the budget for the SpecDec++ acceptance head (0 = none)")
    parser.add_argument("--batch", type=int, default=64,
                        help="conversations generated at once (batched decoding is several "
                             "times cheaper per token on CPU)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="longest user turn written")
    parser.add_argument("--answer-tokens", type=int, default=160, help="longest answer generated")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="AdamW learning rate (after 10 warm-up steps, constant: runs are short)")
    parser.add_argument("--out", default=None,
                        help="artifact path (default: the user cache, where draft_model finds it)")
    parser.add_argument("--workdir", default=None,
                        help="checkpoints and data (default: under the user cache)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---- the student ------------------------------------------------------------------------

def make_student(target, layers: int, head_ids: torch.Tensor | None):
    """A LlamaForCausalLM of the target's first ``layers`` layers (copied) and final norm,
    sharing the target's embedding table; its LM head covers ``head_ids`` (None: all)."""
    from transformers import LlamaForCausalLM

    require(target.config.model_type == "llama",
            f"the draft distiller builds Llama-layout drafts; the target is "
            f"'{target.config.model_type}'")
    require(1 <= layers < target.config.num_hidden_layers,
            f"--layers must be in 1..{target.config.num_hidden_layers - 1}, got {layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    config.tie_word_embeddings = False
    student = LlamaForCausalLM(config)
    embed = target.get_input_embeddings().weight.detach()
    student.model.embed_tokens.weight = torch.nn.Parameter(embed, requires_grad=False)
    for mine, theirs in zip(student.model.layers, target.model.layers):
        mine.load_state_dict(theirs.state_dict())
    student.model.norm.load_state_dict(target.model.norm.state_dict())
    head = embed if head_ids is None else embed[head_ids]
    student.lm_head = torch.nn.Linear(config.hidden_size, head.shape[0], bias=False)
    student.lm_head.weight = torch.nn.Parameter(head.clone(), requires_grad=False)
    return student.float()


def trainable_state(student) -> dict[str, torch.Tensor]:
    """What the artifact stores: the layers and the final norm (embeddings are the target's)."""
    return {k: v for k, v in student.state_dict().items()
            if not k.startswith(("model.embed_tokens", "lm_head"))}


def save_draft(path: Path, student, head_ids: torch.Tensor | None, fingerprint: str,
               info: dict, acceptance_head: AcceptanceHead | None = None) -> Path:
    tensors = int8_rows({f"model.{k}": v.half() for k, v in trainable_state(student).items()})
    if head_ids is not None:
        tensors["head_ids"] = head_ids
    config = {"model": student.config.to_dict(), **info}
    if acceptance_head is not None:
        tensors.update({f"acceptance_head.{k}": v for k, v in acceptance_head.state_dict().items()})
        config["acceptance_head"] = {"num_blocks": len(acceptance_head.blocks)}
    config["model"]["torch_dtype"] = "float32"
    config["model"].pop("dtype", None)
    return save_artifact(path, tensors, KIND, config, fingerprint)


# ---- distillation --------------------------------------------------------------------------

def kl_loss(student, target, ids: list[int], head_ids: torch.Tensor | None) -> torch.Tensor:
    """Mean KL(p_target || q_draft) over the shortlist at every position of ``ids``."""
    x = torch.tensor([ids])
    with torch.no_grad():
        teacher = target(input_ids=x).logits[0, :-1].float()  # [T-1, V]
        if head_ids is not None:
            teacher = teacher[:, head_ids]
        p = teacher.log_softmax(-1)
    q = student(input_ids=x).logits[0, :-1].float().log_softmax(-1)
    return F.kl_div(q, p, log_target=True, reduction="batchmean")


@torch.inference_mode()
def agreement(student, target, sequences, head_ids: torch.Tensor | None) -> float:
    """How often the draft's argmax is the target's at answer positions (the greedy
    acceptance rate of one draft token)."""
    hits = total = 0
    for ids, prompt_len in sequences:
        x = torch.tensor([ids])
        want = target(input_ids=x).logits[0, prompt_len - 1:-1].argmax(-1)
        got = student(input_ids=x).logits[0, prompt_len - 1:-1].argmax(-1)
        if head_ids is not None:
            got = head_ids[got]
        hits += int((want == got).sum())
        total += len(want)
    return hits / max(total, 1)


def acceptance_examples(student, target, ids: list[int], prompt_len: int,
                        head_ids: torch.Tensor | None, rng: random.Random):
    """(hidden states [n, H], labels [n]) at the answer tokens of ``ids`` with 15% of them
    replaced by the draft's greedy guesses; label 1 where the target's greedy token is the one
    present."""
    with torch.no_grad():
        x = torch.tensor([ids])
        guess = student(input_ids=x).logits[0].argmax(-1)
        if head_ids is not None:
            guess = head_ids[guess]
        mixed = list(ids)
        for t in range(prompt_len, len(ids)):
            if rng.random() < 0.15:
                mixed[t] = int(guess[t - 1])
        x = torch.tensor([mixed])
        want = target(input_ids=x).logits[0].argmax(-1)
        hidden = student.model(input_ids=x).last_hidden_state[0]
    positions = torch.arange(prompt_len, len(ids))
    labels = (want[positions - 1] == x[0, positions]).float()
    return hidden[positions], labels


def train_acceptance_head(student, target, sequences, head_ids, seconds: float,
                          rng: random.Random, hidden_size: int) -> tuple[AcceptanceHead, dict]:
    """Collect examples for half the time, fit the head for the other half."""
    start = time.monotonic()
    feats, labels = [], []
    for ids, prompt_len in sequences:
        if time.monotonic() - start > seconds / 2 and feats:
            break
        h, y = acceptance_examples(student, target, ids, prompt_len, head_ids, rng)
        feats.append(h)
        labels.append(y)
    h, y = torch.cat(feats), torch.cat(labels)
    head = AcceptanceHead(hidden_size)
    optim = torch.optim.AdamW(head.parameters(), lr=1e-3)
    weight = torch.where(y > 0.5, 1.0, 6.0)  # the paper's weight on rejected tokens
    steps = 0
    while time.monotonic() - start < seconds or steps < 50:
        index = torch.randint(len(y), (min(256, len(y)),))
        loss = F.binary_cross_entropy_with_logits(head(h[index]), y[index], weight[index])
        optim.zero_grad()
        loss.backward()
        optim.step()
        steps += 1
        if steps >= 2000:
            break
    with torch.no_grad():
        predicted = torch.sigmoid(head(h))
    info = {"examples": len(y), "accepted_share": round(float(y.mean()), 4), "steps": steps,
            "train_accuracy": round(float(((predicted > 0.5).float() == y).float().mean()), 4)}
    return head.eval(), info


# ---- the command ---------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    from specdecode.models.hf import HFRunner
    from specdecode.models.loading import load_model

    _check_args(args)
    budget = 60 * args.max_minutes
    deadline = time.monotonic() + budget
    loaded = load_model(args.model)
    target, tokenizer = loaded.model, loaded.tokenizer
    target.requires_grad_(False)
    fingerprint = HFRunner(target).fingerprint()
    workdir = work_dir(args.workdir, user_dir() / "draft-work")
    out = Path(args.out) if args.out else user_dir() / f"draft_model-{args.layers}L.safetensors"
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    state = _resumed_state(args, workdir / "state.pt", fingerprint, rng)
    bar = TimeBar(budget, "train draft", shown=not args.no_progress)

    # 1. data: target-written conversations (cached in the user cache, shared with `train heads`)
    sequences = target_conversations(
        target, tokenizer, fingerprint, args.conversations, prompt_tokens=args.prompt_tokens,
        answer_tokens=args.answer_tokens, batch=args.batch, seed=args.seed,
        seconds=args.data_share * budget, show=bar.show)
    held = max(2, len(sequences) // 10)
    evaluation, train = sequences[:held], sequences[held:]
    if "head_ids" not in state:
        vocab = target.get_input_embeddings().weight.shape[0]
        state["head_ids"] = (frequency_shortlist(train, args.shortlist, vocab)
                             if 0 < args.shortlist < vocab else None)
    head_ids = state["head_ids"]

    # 2. distillation (keeping time for the acceptance head, the evaluation and the save)
    student = make_student(target, args.layers, head_ids)
    _distil(student, target, train, evaluation, head_ids, state, rng, workdir / "state.pt", args,
            deadline - args.head_share * budget - 30, bar.show)
    after = agreement(student, target, evaluation, head_ids)
    state["log"].append({"steps": state["step"], "agreement": round(after, 4)})

    # 3. SpecDec++ acceptance head
    acc_head, head_info = None, {}
    if args.head_share > 0:
        bar.show("acceptance head")
        seconds = max(10.0, deadline - time.monotonic() - 15)
        acc_head, head_info = train_acceptance_head(student, target, train, head_ids, seconds,
                                                    rng, target.config.hidden_size)
    info = {"layers_from_target": list(range(args.layers)), "shortlist": args.shortlist,
            "conversations": len(sequences), "steps": state["step"],
            "agreement_before": round(state["agreement_before"], 4),
            "agreement_after": round(after, 4), "acceptance_head_training": head_info,
            "command": "specdecode train draft " + _argv(args)}
    path = save_draft(out, student, head_ids, fingerprint, info, acc_head)
    bar.close()
    print(f"draft: {args.layers} layers, {state['step']} distillation steps on "
          f"{len(train)} conversations; greedy agreement with the target on {held} held-out "
          f"conversations {state['agreement_before']:.3f} -> {after:.3f}")
    if head_info:
        print(f"acceptance head: {head_info}")
    print(f"saved {path}")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Bad arguments fail before anything loads."""
    require(args.max_minutes > 0, f"--max-minutes must be positive, got {args.max_minutes}")
    require(args.conversations >= 10, f"--conversations must be >= 10, got {args.conversations}")
    require(0 <= args.shortlist, "--shortlist must be >= 0 (0 = whole vocabulary)")


def _resumed_state(args: argparse.Namespace, path: Path, fingerprint: str,
                   rng: random.Random) -> dict:
    """The run's state: a fresh one, or with ``--resume`` the checkpoint's (checked to be for
    this target and ``--layers``; ``rng`` continues where it stopped)."""
    state = {"step": 0, "fingerprint": fingerprint, "layers": args.layers, "log": []}
    if not args.resume:
        return state
    require(path.is_file(), f"no checkpoint to resume in {path.parent}; run without --resume")
    state = torch.load(path, weights_only=False)
    require(state["fingerprint"] == fingerprint and state["layers"] == args.layers,
            f"the checkpoint in {path.parent} is for another target or --layers; start afresh "
            "without --resume (or pass another --workdir)")
    rng.setstate(state["rng"])
    return state


def _distil(student, target, train, evaluation, head_ids, state: dict, rng: random.Random,
            path: Path, args: argparse.Namespace, deadline: float, show) -> None:
    """Phase 2 until ``deadline``: one conversation a step (the order reshuffled each pass),
    the learning rate warmed up over 10 steps; a checkpoint every two minutes and at the end.
    A fresh run first measures the untrained draft's agreement."""
    params = [p for p in student.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    if "student" in state:
        student.load_state_dict(state["student"], strict=False)
        optim.load_state_dict(state["optim"])
    else:
        state["agreement_before"] = agreement(student, target, evaluation, head_ids)
    last_save = time.monotonic()
    losses: list[float] = []
    order = list(range(len(train)))
    while time.monotonic() < deadline:
        step = state["step"]
        if step % len(order) == 0:
            random.Random(args.seed + step).shuffle(order)
        ids, _ = train[order[step % len(order)]]
        for group in optim.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 10)
        loss = kl_loss(student, target, ids, head_ids)
        losses.append(descend(loss, optim, params, step))
        state["step"] = step + 1
        show(f"distil step {step + 1} KL {sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if time.monotonic() - last_save > 120:
            _checkpoint(state, student, optim, rng, path)
            last_save = time.monotonic()
    _checkpoint(state, student, optim, rng, path)


def _checkpoint(state, student, optim, rng, path: Path) -> None:
    state["student"] = {k: v for k, v in student.state_dict().items()
                        if not k.startswith(("model.embed_tokens", "lm_head"))}
    state["optim"] = optim.state_dict()
    state["rng"] = rng.getstate()
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def _argv(args: argparse.Namespace) -> str:
    skip = {"resume", "no_progress", "train", "func", "command", "what", "out", "workdir"}
    parts = []
    for key, value in sorted(vars(args).items()):
        if key not in skip and value is not None and not callable(value):
            parts.append(f"--{key.replace('_', '-')} {value}")
    return " ".join(parts)
