"""What every trainer's run keeps besides its network: a work folder per target, a checkpoint
that ``--resume`` continues, and a progress bar over the run's time budget; and, for the
trainers of small pieces on a frozen target (LoRA-Drop's correctors, LUD's adapters), their
common setup (:func:`frozen_target_run`) and step loop (:func:`train_steps`).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError, require


def add_run_arguments(parser, workdir_help: str = "checkpoint (default: the user cache)") -> None:
    """The arguments every frozen-target trainer shares: the target, the budget, where the
    result and the checkpoint go, resuming, the seed and the progress bar."""
    parser.add_argument("--model", default="smollm2",
                        help="target: 'smollm2' (default), a .gguf file or a checkpoint folder")
    parser.add_argument("--max-minutes", type=float, default=12.0,
                        help="wall-clock budget of this run, all phases together")
    parser.add_argument("--out", default=None,
                        help="artifact path (default: the user cache, where the method finds it)")
    parser.add_argument("--workdir", default=None, help=workdir_help)
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def training_device() -> str:
    """Where a trainer runs: a CUDA GPU when torch sees one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def use_device(device: str) -> None:
    """Tensors made without a device land on ``device`` from now on: the networks and the
    runners make their position, mask and index tensors without one, so on a GPU they must
    land beside the weights. On CUDA, float32 matrix products may use TF32 (training only).
    The CPU is torch's own default: no device mode is left in place (one costs every later
    torch call of the process a Python hook)."""
    torch.set_default_device(None if device == "cpu" else device)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def target_key(fingerprint: str) -> str:
    """A short name for a target (its runner fingerprint), for folder and file names."""
    return hashlib.sha1(fingerprint.encode()).hexdigest()[:10]


def work_dir(given: str | None, default: Path) -> Path:
    """``--workdir`` (or ``default``), created."""
    path = Path(given) if given else default
    path.mkdir(parents=True, exist_ok=True)
    return path


def descend(loss: torch.Tensor, optim: torch.optim.Optimizer, params, step: int) -> float:
    """One optimiser step on ``loss``, gradients clipped to norm 1; the loss's value. A loss of
    NaN stops the run with the fix (every trainer's step, in one place)."""
    value = loss.item()
    require(not math.isnan(value), f"training diverged at step {step} (the loss is NaN); "
                                   "lower --lr")
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optim.step()
    return value


class Checkpoint:
    """A run's checkpoint file. Without ``--resume`` an existing one is refused (a run never
    overwrites another's progress by accident); with it, :meth:`load` checks that the file is
    this run's. Saved atomically: a run killed while saving keeps the previous checkpoint."""

    def __init__(self, path: Path, resume: bool):
        require(resume or not path.is_file(),
                f"a checkpoint exists in {path.parent}; pass --resume to continue it, or delete "
                "it to start over")
        self.path = path
        self.resume = resume

    def load(self, is_this_run: Callable[[dict], bool],
             mismatch: str | Callable[[dict], str]) -> dict | None:
        """The saved state (None without ``--resume`` or a file). Where ``is_this_run(state)``
        is false (another target, other settings) the error says the checkpoint is for
        ``mismatch`` (or ``mismatch(state)``)."""
        if not (self.resume and self.path.is_file()):
            return None
        state = torch.load(self.path, weights_only=False)
        if not is_this_run(state):
            what = mismatch(state) if callable(mismatch) else mismatch
            raise SpecDecodeError(f"the checkpoint in {self.path.parent} is for {what}")
        return state

    def save(self, state: dict) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.path)


class TimeBar:
    """A progress bar over a run's seconds (``shown=False``: nothing), with the phase or the
    loss beside it."""

    def __init__(self, seconds: float, desc: str, shown: bool = True):
        self.began = time.monotonic()
        self.bar = None
        if shown:
            from tqdm import tqdm

            self.bar = tqdm(total=math.ceil(seconds), unit="s", desc=desc,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}s "
                                       "{postfix}")

    def show(self, text: str) -> None:
        if self.bar is not None:
            self.bar.n = min(self.bar.total, time.monotonic() - self.began)
            self.bar.set_postfix_str(text, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class FrozenTargetRun:
    """A trainer's frozen target and what it trains on it."""

    loaded: object
    model: torch.nn.Module
    fingerprint: str
    workdir: Path
    checkpoint: Checkpoint
    #: the trained piece (its ``settings()`` go into the checkpoint)
    module: torch.nn.Module
    optim: torch.optim.Optimizer
    #: the step, the loss log and what a resumed checkpoint must share
    state: dict
    #: the module's name in the checkpoint
    piece: str


def frozen_target_run(args, work_name: str, piece: str, make: Callable[[torch.nn.Module], object],
                      shared: dict | None = None) -> FrozenTargetRun:
    """The frozen target of ``--model``, its work folder (``--workdir``, or the user cache's
    ``WORK_NAME-work-KEY``), the checkpoint, the piece ``make(model)`` and its AdamW (``--lr``),
    both from the checkpoint with ``--resume``, which must share the target, the piece's
    settings and ``shared``."""
    from specdecode.models.hf import HFRunner
    from specdecode.models.loading import load_model
    from specdecode.artifacts import user_dir

    loaded = load_model(args.model)
    model = loaded.model.eval().requires_grad_(False)
    fingerprint = HFRunner(model).fingerprint()
    workdir = work_dir(args.workdir, user_dir() / f"{work_name}-work-{target_key(fingerprint)}")
    checkpoint = Checkpoint(workdir / "checkpoint.pt", args.resume)
    torch.manual_seed(args.seed)
    module = make(model)
    optim = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
    state = {"fingerprint": fingerprint, "settings": module.settings(), **(shared or {})}
    must_share = list(state)
    state.update(step=0, log=[])
    saved = checkpoint.load(lambda s: all(s.get(k) == state[k] for k in must_share),
                            "another target or other settings; start afresh without --resume "
                            "(or pass another --workdir)")
    if saved is not None:
        module.load_state_dict(saved[piece])
        optim.load_state_dict(saved["optim"])
        state.update(step=saved["step"], log=saved["log"])
    return FrozenTargetRun(loaded, model, fingerprint, workdir, checkpoint, module, optim, state,
                           piece)


def train_steps(module: torch.nn.Module, optim: torch.optim.Optimizer, state: dict,
                checkpoint: Checkpoint, piece: str, deadline: float,
                loss_of: Callable[[int], torch.Tensor], logged: str, show,
                max_steps: int | None = None) -> None:
    """Steps of ``loss_of(step)`` until ``deadline`` (or step ``max_steps``: tests bound runs
    by steps, which no machine's speed changes); a checkpoint (``piece``: the module's
    name in it) every two minutes and at the end. ``state`` holds the step and the log: the
    mean of the last 20 losses, as ``logged``, every 20 steps."""
    def save() -> None:
        checkpoint.save({**state, piece: module.state_dict(), "optim": optim.state_dict()})

    last_save, recent = time.monotonic(), []
    while time.monotonic() < deadline and (max_steps is None or state["step"] < max_steps):
        step = state["step"]
        value = descend(loss_of(step), optim, module.parameters(), step)
        state["step"] = step = step + 1
        recent = (recent + [value])[-20:]
        mean = sum(recent) / len(recent)
        if step % 20 == 0:
            state["log"].append({"step": step, logged: round(mean, 4)})
        show(f"step {step} {logged} {mean:.3f}")
        if time.monotonic() - last_save > 120:
            save()
            last_save = time.monotonic()
    save()
