"""What every trainer's run keeps besides its network: a work folder per target, a checkpoint
that ``--resume`` continues, and a progress bar over the run's time budget.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError, require


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
