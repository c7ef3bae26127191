"""The small dLLM: an AR model adapted into a block-diffusion model by a LoRA delta trained with
the masked-diffusion objective (DiffuGPT/DiffuLLaMA, Gong et al. 2024; Dream, Ye et al. 2025;
BD3-LM, Arriola et al. 2025: adaptation, not pretraining).

**The delta** (:class:`DiffusionDelta`): a low-rank ``B A`` (LoRA, Hu et al. 2021) beside every
attention and MLP projection of every layer, ``B`` starting at zero so an untrained delta is the
AR model. Training runs it as forward hooks on the frozen ``transformers`` model; inference
merges ``W + scale B A`` into fp32 weights and runs the native runner on them
(:func:`merged_runner`), so the forward of ``diffusion/model.py`` needs nothing new.

**One training sequence** (:func:`diffusion_batch`) is BD3-LM's vectorised layout, laid out to
match the runner's: the clean conversation ``x`` (prompt then answer), causal, exactly the rows
the runner commits; then a noisy copy of the answer, cut into blocks of ``block_size`` from the
answer's start as decoding cuts them, each block with its own mask rate ``t`` and each of its
positions replaced by the mask token with probability ``t`` (at least one). A noisy row sees the
clean rows before its block and every row of its own block (bidirectional inside the block),
at its own position id. The loss is the cross-entropy of every masked position, predicted with
shifted logits (position ``i`` by the row at ``i - 1``: the noisy block's previous row, or for
a block's first position the last clean row before it), weighted by ``1 / t`` (the masked-
diffusion ELBO's weight for the linear schedule: MDLM, Sahoo et al. 2024; BD3-LM) and divided
by the number of block positions. ``t`` is drawn from ``[min_rate, 1]``: ``min_rate`` 0.1 is
ours (it bounds the ``1 / t`` weight, whose variance BD3-LM reduces with clipped schedules).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import require

KIND = "dllm_lora"
#: the projections that carry a delta (every attention and MLP matrix of a Llama layer)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class DiffusionDelta(nn.Module):
    """LoRA factors for the projections of a ``transformers`` Llama-family model."""

    def __init__(self, model: nn.Module, rank: int, alpha: float | None = None,
                 config: dict | None = None):
        super().__init__()
        require(rank > 0, f"the delta's rank must be positive, got {rank}")
        self.rank = rank
        #: LoRA's ``alpha / rank`` scale; alpha defaults to twice the rank
        self.scale = (alpha if alpha is not None else 2.0 * rank) / rank
        self.config = dict(config or {})
        self.names = [name for name, module in model.named_modules()
                      if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS]
        require(bool(self.names), f"{type(model).__name__} has none of the projections "
                                  f"{', '.join(PROJECTIONS)}")
        modules = dict(model.named_modules())
        gen = torch.Generator().manual_seed(0)
        self.down = nn.ParameterDict()
        self.up = nn.ParameterDict()
        for name in self.names:
            linear = modules[name]
            key = name.replace(".", "/")
            self.down[key] = nn.Parameter(torch.randn(rank, linear.in_features, generator=gen,
                                                      device="cpu") / linear.in_features ** 0.5)
            self.up[key] = nn.Parameter(torch.zeros(linear.out_features, rank, device="cpu"))

    def attach(self, model: nn.Module) -> list:
        """Forward hooks adding ``scale B A x`` to each projection's output (the handles, to
        ``remove()``)."""
        modules = dict(model.named_modules())
        handles = []
        for name in self.names:
            key = name.replace(".", "/")

            def hook(module, inputs, output, key=key):
                low = inputs[0].to(self.down[key].dtype) @ self.down[key].T
                return output + (self.scale * low @ self.up[key].T).to(output.dtype)

            handles.append(modules[name].register_forward_hook(hook))
        return handles

    @torch.no_grad()
    def merged(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of a model's fp32 ``state_dict`` with ``W + scale B A`` in every projection."""
        out = dict(tensors)
        for name in self.names:
            key, weight = name.replace(".", "/"), f"{name}.weight"
            require(weight in tensors, f"the model has no {weight}: the delta is for another one")
            out[weight] = tensors[weight].float() + self.scale * (
                self.up[key].float() @ self.down[key].float())
        return out

    def save(self, path: str | Path, fingerprint: str) -> Path:
        from specdecode.artifacts import save_artifact

        tensors = {f"{part}.{key}": p.detach().to(torch.float16).contiguous()
                   for part, table in (("down", self.down), ("up", self.up))
                   for key, p in table.items()}
        config = dict(self.config, rank=self.rank, scale=self.scale, names=self.names)
        return save_artifact(path, tensors, KIND, config, fingerprint)

    @classmethod
    def load(cls, path: str | Path, model: nn.Module, fingerprint: str) -> DiffusionDelta:
        """The delta in ``path`` (made by ``specdecode train dllm`` for this model)."""
        from specdecode.artifacts import load_artifact

        art = load_artifact(path, KIND, fingerprint)
        c = art.config
        delta = cls(model, int(c["rank"]), float(c["scale"]) * int(c["rank"]), c)
        require(delta.names == list(c["names"]),
                f"{path} adapts other projections than this model has; retrain it with "
                "`specdecode train dllm`")
        for name, tensor in art.tensors.items():
            part, key = name.split(".", 1)
            getattr(delta, part)[key].data.copy_(tensor.float())
        return delta.eval().requires_grad_(False)


@dataclass(frozen=True)
class DiffusionBatch:
    """Model inputs for :func:`masked_diffusion_loss` (see the module docstring)."""

    input_ids: torch.Tensor  # [N, T]
    position_ids: torch.Tensor  # [N, T]
    attention: torch.Tensor  # [N, 1, T, T] additive: 0 where a row sees a key, -inf elsewhere
    rows: torch.Tensor  # [M] flat (sequence * T + row) of the row predicting each target
    targets: torch.Tensor  # [M] the clean token of each masked position
    weights: torch.Tensor  # [M] 1 / t of its block, over the batch's block positions


def _noisy_answer(answer: Sequence[int], block_size: int, mask_id: int, min_rate: float,
                  rng: random.Random) -> tuple[list[int], list[float]]:
    """The answer with each block masked at its own rate: (tokens, each position's rate, 0 where
    kept)."""
    noisy, rates = [], []
    for start in range(0, len(answer), block_size):
        block = list(answer[start:start + block_size])
        rate = rng.uniform(min_rate, 1.0)
        masked = [rng.random() < rate for _ in block]
        if not any(masked):
            masked[rng.randrange(len(block))] = True
        noisy += [mask_id if m else t for m, t in zip(masked, block)]
        rates += [rate if m else 0.0 for m in masked]
    return noisy, rates


def diffusion_batch(conversations: Sequence[tuple[Sequence[int], int]], block_size: int,
                    mask_id: int, rng: random.Random, min_rate: float = 0.1) -> DiffusionBatch:
    """One batch of (token ids, prompt length) conversations, each with a non-empty answer."""
    require(block_size > 0 and 0.0 < min_rate <= 1.0,
            f"block_size must be positive and min_rate in (0, 1]; got {block_size}, {min_rate}")
    require(all(0 < start < len(ids) for ids, start in conversations),
            "every training conversation needs a prompt and a non-empty answer")
    # laid out on the CPU whatever the default device (a few thousand small writes);
    # the loss moves the batch to the model
    with torch.device("cpu"):
        return _layout(conversations, block_size, mask_id, rng, min_rate)


def _layout(conversations, block_size: int, mask_id: int, rng: random.Random,
            min_rate: float) -> DiffusionBatch:
    width = max(len(ids) + len(ids) - start for ids, start in conversations)
    count = len(conversations)
    input_ids = torch.zeros(count, width, dtype=torch.long)
    position_ids = torch.zeros(count, width, dtype=torch.long)
    sees = torch.eye(width, dtype=torch.bool).repeat(count, 1, 1)  # padding rows see themselves
    rows, targets, weights = [], [], []
    for n, (ids, start) in enumerate(conversations):
        length, answer = len(ids), list(ids[start:])
        noisy, rates = _noisy_answer(answer, block_size, mask_id, min_rate, rng)
        input_ids[n, :length + len(noisy)] = torch.tensor(list(ids) + noisy)
        position_ids[n, :length] = torch.arange(length)
        position_ids[n, length:length + len(noisy)] = torch.arange(start, length)
        sees[n, :length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
        for j, rate in enumerate(rates):
            block = j - j % block_size
            row = length + j
            sees[n, row, :start + block] = True  # the clean rows before its block
            sees[n, row, length + block:length + min(block + block_size, len(noisy))] = True
            if rate > 0:
                # shifted: the previous noisy row, or the last clean row for a block's first
                before = start + j - 1 if j == block else row - 1
                rows.append(n * width + before)
                targets.append(answer[j])
                weights.append(1.0 / rate)
    positions = sum(len(ids) - start for ids, start in conversations)
    attention = torch.zeros(count, 1, width, width).masked_fill(~sees[:, None], float("-inf"))
    return DiffusionBatch(input_ids, position_ids, attention, torch.tensor(rows),
                          torch.tensor(targets), torch.tensor(weights) / positions)


def masked_diffusion_loss(model: nn.Module, batch: DiffusionBatch) -> torch.Tensor:
    """The weighted masked-position cross-entropy of ``batch`` under ``model`` (a
    ``transformers`` causal LM, with its delta attached when training one)."""
    device = next(model.parameters()).device
    out = model.model(input_ids=batch.input_ids.to(device),
                      position_ids=batch.position_ids.to(device),
                      attention_mask=batch.attention.to(device))
    hidden = out.last_hidden_state.flatten(0, 1)[batch.rows.to(device)]  # [M, H]
    logits = model.lm_head(hidden).float()
    losses = nn.functional.cross_entropy(logits, batch.targets.to(device), reduction="none")
    return (losses * batch.weights.to(device)).sum()


def merged_runner(model: nn.Module, delta: DiffusionDelta, weights: str = "fp32", **kwargs):
    """The native runner on ``model``'s weights with ``delta`` merged in. fp32 keeps the delta
    exactly; bf16/int8 round the merged matrices (int4 re-quantises them from fp32)."""
    from specdecode.models.llama import LlamaRunner

    tensors = {k: v.detach().float() for k, v in model.state_dict().items()}
    return LlamaRunner(model.config, delta.merged(tensors), weights,
                       source=f"{type(model).__name__} + dLLM delta", **kwargs)


def dllm_runner(loaded, path: str | Path, weights: str = "fp32", **kwargs):
    """(native runner with the delta in ``path`` merged, the delta) for a loaded model; the
    delta must have been trained for this model (its fingerprint is checked)."""
    from specdecode.models.hf import HFRunner

    require(Path(path).is_file(), f"dLLM delta {path} does not exist; make one with "
                                  "`specdecode train dllm --out PATH`")
    model = loaded.model.float().eval()
    delta = DiffusionDelta.load(path, model, HFRunner(model).fingerprint())
    return merged_runner(model, delta, weights, **kwargs), delta


def find_dllm(loaded, spec: str) -> Path | None:
    """The delta ``spec`` names for a loaded model: a file; ``'auto'``, the newest trained for
    this model (the user cache, then the package's ``data/adapters``), or None where there is
    none; ``'none'``, None (the AR model as it is)."""
    from specdecode.models.hf import HFRunner
    from specdecode.artifacts import find_artifacts

    if spec == "none":
        return None
    if spec == "auto":
        found = find_artifacts(KIND, HFRunner(loaded.model.float().eval()).fingerprint())
        return found[0] if found else None
    require(Path(spec).suffix == ".safetensors" and Path(spec).is_file(),
            f"--dllm {spec!r} is neither 'auto', 'none' nor an existing .safetensors file (make "
            "one with `specdecode train dllm --out PATH`)")
    return Path(spec)
