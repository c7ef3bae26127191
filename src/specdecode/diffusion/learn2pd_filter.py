"""Learn2PD's filter and how it is trained (Bao, Chen, Xu, Shang 2025, "Learning to Parallel
Decode Diffusion LLMs", arXiv 2509.25188).

The paper's oracle, *extremely greedy parallel* decoding, commits a position as soon as its
current prediction equals the token the generation finally puts there. The filter is a tiny
MLP that learns that oracle from a position's confidence features: trained on trajectories of
the reference decoding (``one_per_step``), each masked position at each step labelled 1 when
its argmax then equals the final token. The paper's MLP has about 2K parameters; this one,
5 features -> 32 -> 32 -> 1, has 1,281. Training takes seconds to minutes on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specdecode.diffusion.step import Policy, StepView
from specdecode.errors import SpecDecodeError

#: features per position (see :func:`features`)
FEATURES = 5


def features(view: StepView) -> torch.Tensor:
    """[B, 5] per position: argmax probability, the second's, entropy (nats), offset in the
    block and the block's progress (both in [0, 1])."""
    top = view.probs.topk(2, -1).values  # [B, 2]
    entropy = -(view.probs * view.probs.clamp_min(1e-30).log()).sum(-1)
    width = len(view.block)
    offset = torch.arange(width, dtype=torch.float32) / width
    progress = torch.full((width,), view.step / width)
    return torch.stack([top[:, 0], top[:, 1], entropy, offset, progress], -1)


def make_filter() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def load_filter(path: str | Path) -> torch.nn.Module:
    """A filter saved by :func:`train_filter`; a SpecDecodeError naming the fix otherwise."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        net = make_filter()
        net.load_state_dict(state)
    except (OSError, RuntimeError, KeyError) as exc:
        raise SpecDecodeError(f"cannot load the Learn2PD filter {path}: {exc}; train one with "
                              "`specdecode train learn2pd`") from None
    return net.eval()


class _Recorder(Policy):
    """``one_per_step`` that keeps every step's features and predictions."""

    def __init__(self):
        super().__init__(None)
        self.steps: list[tuple[torch.Tensor, list[int], list[int], int]] = []

    def start_block(self, offset: int) -> None:
        self.offset = offset

    def choose(self, view: StepView) -> dict[int, int]:
        self.steps.append((features(view), view.predicted, view.masked, self.offset))
        return view.commit([view.most_confident()])


def trajectories(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int,
                 eos_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, 5], labels [N]) of every masked position at every ``one_per_step`` step:
    1 where the position's argmax then equals its final token."""
    from specdecode.diffusion.decode import diffuse

    xs, ys = [], []
    for prompt in prompts:
        recorder = _Recorder()
        final = diffuse(model, recorder, prompt, max_new_tokens, eos_ids, block_size).tokens
        for feats, predicted, masked, offset in recorder.steps:
            for i in masked:
                if offset + i < len(final):
                    xs.append(feats[i])
                    ys.append(float(predicted[i] == final[offset + i]))
    return torch.stack(xs), torch.tensor(ys)


def train_filter(x: torch.Tensor, y: torch.Tensor, epochs: int = 300, seed: int = 0
                 ) -> torch.nn.Module:
    """Fit the filter to (features, labels) with binary cross-entropy, full batch, Adam."""
    torch.manual_seed(seed)
    net = make_filter()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = loss_fn(net(x).squeeze(-1), y)
        loss.backward()
        optimizer.step()
    return net.eval()
