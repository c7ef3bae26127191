"""Exit adapters: a small trained map from an intermediate layer's hidden state into the shared,
frozen LM head, so that early exits of a model never trained for them agree with its final
prediction more often (the "tuned lens" idea of Belrose et al., 2023, used as LayerSkip-style
exits without retraining the model; LayerSkip itself, Elhoushi et al. 2024, retrains the whole
model with an early-exit loss instead).

For exit layer l with output h (before any norm):

    normed = RMSNorm_l(h + bias_l + up_l(down_l(h)))     # down: H -> r, up: r -> H
    logits = lm_head(normed)                             # the target's own head, frozen

``up`` starts at zero and ``RMSNorm_l`` at the final norm's weight, so an untrained adapter is
exactly the plain early exit (final norm + LM head). ``specdecode train exit-adapters``
(training/exit_adapters.py) trains them. Rank 64 keeps one layer's adapter at about
74k parameters for SmolLM2 (576 wide): a few hundred kilobytes for a set of layers in fp16.

An :class:`ExitAdapters` set is saved as an artifact of kind ``exit_adapters`` (see
:mod:`specdecode.artifacts`) whose config also records each layer's measured agreement
with the full model, which the proposers use to choose their exit layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from specdecode.artifacts import find_artifacts, load_artifact, save_artifact
from specdecode.errors import SpecDecodeError, require

KIND = "exit_adapters"


class ExitAdapter(nn.Module):
    def __init__(self, hidden_size: int, rank: int, eps: float, norm_weight: torch.Tensor):
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(norm_weight.detach().clone().float())
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.down = nn.Parameter(torch.randn(rank, hidden_size) / hidden_size ** 0.5)
        self.up = nn.Parameter(torch.zeros(hidden_size, rank))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.float()
        h = h + self.bias + (h @ self.down.T) @ self.up.T  # [n, H]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.norm_weight).to(hidden.dtype)


class ExitAdapters(nn.Module):
    """Adapters for a set of exit layers, plus what training measured about them."""

    def __init__(self, layers: Sequence[int], hidden_size: int, rank: int, eps: float,
                 norm_weight: torch.Tensor, config: dict | None = None):
        super().__init__()
        require(len(layers) > 0, "exit adapters need at least one layer")
        self.layers = tuple(sorted(int(x) for x in layers))
        self.hidden_size, self.rank, self.eps = hidden_size, rank, eps
        self.adapters = nn.ModuleDict(
            {str(layer): ExitAdapter(hidden_size, rank, eps, norm_weight) for layer in self.layers})
        #: everything the trainer recorded (steps, data, agreement per layer before/after)
        self.config = dict(config or {})

    def __getitem__(self, layer: int) -> ExitAdapter:
        return self.adapters[str(layer)]

    def __contains__(self, layer: int) -> bool:
        return str(layer) in self.adapters

    def agreement(self) -> dict[int, float]:
        """Measured agreement of each layer's adapted exit with the full model (empty when the
        trainer recorded none)."""
        return {int(k): float(v) for k, v in self.config.get("agreement_after", {}).items()}

    def save(self, path: str | Path, fingerprint: str) -> Path:
        tensors = {f"layer{layer}.{name}": p.detach().to(torch.float16)
                   for layer in self.layers for name, p in self[layer].named_parameters()}
        config = dict(self.config, layers=list(self.layers), hidden_size=self.hidden_size,
                      rank=self.rank, eps=self.eps)
        return save_artifact(path, tensors, KIND, config, fingerprint)

    @classmethod
    def load(cls, path: str | Path, fingerprint: str) -> ExitAdapters:
        art = load_artifact(path, KIND, fingerprint)
        c = art.config
        first = art.tensors[f"layer{c['layers'][0]}.norm_weight"]
        adapters = cls(c["layers"], c["hidden_size"], c["rank"], c["eps"], first, c)
        state = {f"adapters.{name.replace('layer', '', 1)}": t.float()
                 for name, t in art.tensors.items()}
        missing, unexpected = adapters.load_state_dict(state, strict=False)
        require(not missing and not unexpected,
                f"{path} does not match its own config (missing {missing}, unexpected "
                f"{unexpected}); re-create it with `specdecode train exit-adapters`")
        return adapters.eval().requires_grad_(False)


def resolve_adapters(spec: str, runner) -> ExitAdapters | None:
    """The adapters a proposer drafts through: ``"none"``; ``"auto"`` (the newest artifact
    trained for this target, else none); or a file path (refused if trained for another target)."""
    if spec == "none":
        return None
    fingerprint = runner.fingerprint()
    if spec == "auto":
        found = find_artifacts(KIND, fingerprint)
        return ExitAdapters.load(found[0], fingerprint) if found else None
    path = Path(spec)
    if not path.is_file():
        raise SpecDecodeError(f"adapters file {spec!r} does not exist; give 'auto', 'none' or "
                              "the path of a file made by `specdecode train exit-adapters`")
    adapters = ExitAdapters.load(path, fingerprint)
    bad = [layer for layer in adapters.layers if not 1 <= layer < runner.num_layers]
    require(not bad, f"{path} has adapters for layers {bad}, outside this model's "
                     f"1..{runner.num_layers - 1}")
    return adapters
