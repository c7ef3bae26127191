"""LoRA-Drop: temporal layer reuse with LoRA correctors ("LoRA-Drop: temporal LoRA decoding",
January 2026; code github.com/hosseinbv/LoRA-Drop, a Qwen2 implementation on LLaMA-Factory).

Lossy by design: on most tokens a fixed set of layers is not computed; what they would have
added to the residual stream is taken from the last token that ran them, plus a small trained
correction.

The schedule (the paper's code, ``modeling_qwen2_lora_drop.py``):

- *droppable* layers: every layer ``i > 0`` with ``i % layer_stride != 0`` (22 of SmolLM2's
  30 with the default stride 4); the others always run;
- every ``drop_cycle``-th token (default 4) is an *anchor*: the whole model runs, and each
  droppable layer's residual delta (its output minus its input) is kept. The prompt's last
  token is the first anchor;
- on the other tokens a droppable layer adds ``anchor delta + LoRA(input)`` to its input
  instead of running attention and MLP, and writes no KV row (the paper's KV saving: later
  tokens attend, in that layer, to the prompt and the anchors only).

The LoRA correctors (rank 8, alpha 16, the paper's) are trained by ``specdecode train
lora-drop`` (training/lora_drop.py) to match the full model's next-token distribution under
this schedule, on target-written text; the base weights stay frozen.

Differences from the paper's code: there a dropped layer returns the anchor's whole output
(its residual stream included) plus ``LoRA(raw input)``, so the current token reaches the layers
after a dropped run only through the correctors; here the anchor's residual *delta* is reused
and the current token's own stream passes through. A corrector reads the layer's input after
the layer's own input RMSNorm (the raw residual stream of a small model has outlier dimensions
that make an unnormed corrector hard to train in minutes on a CPU). The paper trains by
continued pre-training over all positions (every layer also runs on the dropped tokens there,
so training sees KV rows that inference never writes); here training follows inference exactly
(:func:`specdecode.training.lora_drop.scheduled_hidden`).

Runs on the native runner (:class:`NativePasses`: its layers in stretches through
``LayerLoop.run_layers``, the int4 stack for each stretch of kept layers) and on the hf runner
(:class:`HFPasses`: the transformers layers one by one, what the corrector's training runs
through with autograd). Both compute the same passes (tests/test_lora_drop.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from specdecode.engine import GenerationStats
from specdecode.errors import require
from specdecode.lossy.base import LossyMethod, adapters_param, trained_artifact
from specdecode.models.base import Runner
from specdecode.registry import param, register
from specdecode.sampling import SamplingParams

#: artifact kind written by ``specdecode train lora-drop``
CORRECTORS_KIND = "lora_drop_correctors"


def droppable_layers(num_layers: int, layer_stride: int) -> tuple[int, ...]:
    """The layers skipped on non-anchor tokens: ``i > 0`` and ``i % layer_stride != 0``."""
    return tuple(i for i in range(1, num_layers) if i % layer_stride != 0)


def full_positions(prompt_len: int, length: int, drop_cycle: int) -> list[bool]:
    """For each of ``length`` positions, whether the whole model runs there: the prompt's, and
    every ``drop_cycle``-th after the prompt's last (the first anchor)."""
    return [j < prompt_len or (j - prompt_len + 1) % drop_cycle == 0 for j in range(length)]


class Correctors(nn.Module):
    """One LoRA corrector per droppable layer: ``up(down(norm(x))) * alpha / rank``, ``up``
    starting at zero (an untrained corrector is plain reuse of the anchor's delta)."""

    def __init__(self, layers: Sequence[int], hidden_size: int, rank: int = 8,
                 alpha: float = 16.0, config: dict | None = None):
        super().__init__()
        self.layers = tuple(layers)
        self.hidden_size, self.rank, self.alpha = hidden_size, rank, alpha
        self.down = nn.ParameterDict({str(i): nn.Parameter(torch.randn(rank, hidden_size)
                                                           / hidden_size ** 0.5)
                                      for i in self.layers})
        self.up = nn.ParameterDict({str(i): nn.Parameter(torch.zeros(hidden_size, rank))
                                    for i in self.layers})
        #: what the trainer recorded (steps, data, loss)
        self.config = dict(config or {})

    def correction(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] the corrector's addition for ``layer`` from its normed input."""
        key = str(layer)
        return (normed @ self.down[key].T) @ self.up[key].T * (self.alpha / self.rank)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{kind}.{i}": getattr(self, kind)[str(i)].detach().half()
                for kind in ("down", "up") for i in self.layers}

    def settings(self) -> dict:
        return dict(self.config, layers=list(self.layers), hidden_size=self.hidden_size,
                    rank=self.rank, alpha=self.alpha)

    @classmethod
    def from_artifact(cls, tensors: dict[str, torch.Tensor], config: dict) -> Correctors:
        made = cls(config["layers"], config["hidden_size"], config["rank"], config["alpha"], config)
        made.load_state_dict({name: t.float() for name, t in tensors.items()})
        return made.eval().requires_grad_(False)


def layer_sizes(runner: Runner) -> tuple[int, int]:
    """(layers, hidden size) of the runner's model; refused on a runner without per-layer
    access."""
    from specdecode.models.hf import HFRunner
    from specdecode.models.llama import LlamaRunner

    if isinstance(runner, LlamaRunner):
        return runner.num_layers, runner.shape.hidden_size
    require(isinstance(runner, HFRunner),
            f"lora_drop runs the model's layers one by one; the {runner.name} runner does not "
            "give them: use the native runner or --runner hf")
    return runner.model.config.num_hidden_layers, runner.model.config.hidden_size


def load_correctors(spec: str, runner: Runner, layers: Sequence[int], hidden_size: int
                    ) -> Correctors:
    """``'none'`` (untrained: plain reuse), ``'auto'`` (the newest artifact for this target)
    or an artifact path; refused where its layers are not ``layers``."""
    if spec == "none":
        return Correctors(layers, hidden_size).eval().requires_grad_(False)
    art = trained_artifact(spec, runner, CORRECTORS_KIND, "train lora-drop",
                           "or pass -c adapters=none (plain reuse, no correction)")
    correctors = Correctors.from_artifact(art.tensors, art.config)
    require(correctors.layers == tuple(layers),
            f"{spec} corrects layers {list(correctors.layers)}, but this layer_stride drops "
            f"{list(layers)}; train correctors for it (`specdecode train lora-drop "
            "--layer-stride N`) or use the stride they were trained for")
    return correctors


def causal_mask(rows: int, dtype: torch.dtype) -> torch.Tensor | None:
    """[1, 1, rows, rows] additive causal mask over rows that are the whole sequence so far
    (None for one row: it sees every key its layer holds)."""
    if rows == 1:
        return None
    blocked = torch.ones(rows, rows, dtype=torch.bool).triu(1)
    return torch.zeros(rows, rows, dtype=dtype).masked_fill(blocked, float("-inf"))[None, None]


def run_layer(layer, hidden: torch.Tensor, positions: torch.Tensor, rotary, cache=None
              ) -> torch.Tensor:
    """One transformers decoder layer over ``hidden`` [1, n, H] at ``positions`` [n], causal
    among the rows (and after ``cache``'s rows of that layer)."""
    position_ids = positions[None]
    return layer(hidden, attention_mask=causal_mask(hidden.shape[1], hidden.dtype),
                 position_ids=position_ids, past_key_values=cache, use_cache=cache is not None,
                 cache_position=positions, position_embeddings=rotary(hidden, position_ids))


@dataclass(frozen=True)
class LoraDropConfig:
    adapters: str = adapters_param("the LoRA correctors", "train lora-drop",
                                   ", or 'none' (reuse the anchor's delta uncorrected)")
    drop_cycle: int = param(4, "every drop_cycle-th token runs the whole model (an anchor); the "
                               "others skip the droppable layers (the paper's drop_cycle)",
                            bounds=(1, 64))
    layer_stride: int = param(4, "layers i > 0 with i % layer_stride != 0 are droppable (the "
                                 "paper's code: every layer but the first and each fourth)",
                              bounds=(1, 1024))

    def __post_init__(self):
        require(self.drop_cycle >= 1, f"drop_cycle must be >= 1, got {self.drop_cycle}")
        require(self.layer_stride >= 1, f"layer_stride must be >= 1, got {self.layer_stride}")


@register("lora_drop", LoraDropConfig,
          paper="LoRA-Drop: temporal LoRA decoding (2026; github.com/hosseinbv/LoRA-Drop)",
          summary="LOSSY: 3 tokens in 4 skip every layer but the first and each fourth, reusing "
                  "the last full token's layer deltas plus trained LoRA corrections",
          lossy=True)
class LoraDrop(LossyMethod):
    def __init__(self, config: LoraDropConfig, runner: Runner, correctors: Correctors | None = None):
        """``correctors``: use these instead of the config's ``adapters``."""
        super().__init__(config, runner)
        num_layers, hidden_size = layer_sizes(runner)
        self.dropped = droppable_layers(num_layers, config.layer_stride)
        self.correctors = correctors or load_correctors(config.adapters, runner, self.dropped,
                                                        hidden_size)

    def passes(self) -> HFPasses | NativePasses:
        """One request's forwards (its cache and anchors) on this method's runner."""
        from specdecode.models.llama import LlamaRunner

        kind = NativePasses if isinstance(self.runner, LlamaRunner) else HFPasses
        return kind(self.runner, self.correctors, self.dropped)

    @torch.inference_mode()
    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               eos: frozenset[int], stats: GenerationStats) -> Iterator[list[int]]:
        passes = self.passes()
        token = int(passes.feed(prompt_ids, full=True).argmax())
        stats.target_forwards += 1
        stats.accepted_lengths.append(1)
        yield [token]
        for made in range(1, max_new_tokens):
            if token in eos:
                break
            full = made % self.config.drop_cycle == 0
            token = int(passes.feed([token], full).argmax())
            # a drop step is a cheap pass: its token counts for the last full pass
            if full:
                stats.target_forwards += 1
                stats.accepted_lengths.append(1)
            else:
                stats.draft_tokens += 1
                stats.accepted_lengths[-1] += 1
            yield [token]


class HFPasses:
    """LoRA-Drop's forwards on the hf runner: the transformers layers called one by one, the
    droppable ones skipped on a drop step (a ``DynamicCache`` layer then gets no row)."""

    def __init__(self, runner: Runner, correctors: Correctors, dropped: Sequence[int]):
        from transformers import DynamicCache

        self.model, self.correctors, self.dropped = runner.model, correctors, set(dropped)
        self.cache = DynamicCache()
        #: each droppable layer's residual delta at the last anchor [1, 1, H]
        self.anchors: dict[int, torch.Tensor] = {}
        self.position = 0

    def feed(self, token_ids: Sequence[int], full: bool) -> torch.Tensor:
        """Feed ``token_ids`` after the ones fed before (a full step records each droppable
        layer's delta at the last row; a drop step reuses it). Logits [V] of the last row."""
        inner = self.model.model
        hidden = inner.embed_tokens(torch.tensor([list(token_ids)]))
        positions = torch.arange(self.position, self.position + len(token_ids))
        self.position += len(token_ids)
        for i, layer in enumerate(inner.layers):
            if not full and i in self.dropped:
                normed = layer.input_layernorm(hidden)
                hidden = hidden + self.anchors[i] + self.correctors.correction(i, normed)
                continue
            out = run_layer(layer, hidden, positions, inner.rotary_emb, self.cache)
            if full and i in self.dropped:
                self.anchors[i] = (out - hidden)[:, -1:]
            hidden = out
        return self.model.lm_head(inner.norm(hidden[:, -1]))[0].float()


class NativePasses:
    """LoRA-Drop's forwards on the native runner (any weight format; the int4 stack runs each
    stretch of kept layers in one call). A droppable layer's KV rows, the prompt's and the
    anchors' only, lie packed at the front of its cache slots: its rows run with a plan of
    their own (the token's position, the next of its own slots), so they see in that layer
    exactly what the hf runner's shorter cache layer holds. A prompt goes through the runner's
    prompt layers up to its last token, which runs as an anchor."""

    def __init__(self, runner: Runner, correctors: Correctors, dropped: Sequence[int]):
        self.loop, self.correctors = runner.layer_loop, correctors
        dropped = set(dropped)
        #: (first, last, droppable) stretches of layers
        self.stretches: list[tuple[int, int, bool]] = []
        for i in range(runner.num_layers):
            if self.stretches and self.stretches[-1][2] == (i in dropped):
                first, _, kind = self.stretches[-1]
                self.stretches[-1] = (first, i + 1, kind)
            else:
                self.stretches.append((i, i + 1, i in dropped))
        self.anchors: dict[int, torch.Tensor] = {}
        #: rows the droppable layers hold (the prompt's and the anchors')
        self.kept = 0
        runner.cache.reset()

    def feed(self, token_ids: Sequence[int], full: bool) -> torch.Tensor:
        """As :meth:`HFPasses.feed`."""
        from specdecode.models.kv_cache import AttentionPlan

        loop, cache = self.loop, self.loop.cache
        if len(token_ids) > 1:
            loop.append(token_ids[:-1], bulk_rows=2)
            self.kept = cache.length
        cache.check_room(1, "one token")
        every = AttentionPlan.chain(cache.length, 1)
        own = replace(AttentionPlan.chain(self.kept, 1), positions=every.positions)
        x = loop.embed(token_ids[-1:])
        for first, last, droppable in self.stretches:
            if not droppable:
                x = loop.run_layers(x, every, first, last)
                continue
            for i in range(first, last):
                if full:
                    out = loop.run_layers(x, own, i, i + 1)
                    self.anchors[i] = out - x
                    x = out
                else:
                    correction = self.correctors.correction(i, loop.attention_norm(i, x))
                    x = x + self.anchors[i] + correction
        cache.append(1)
        self.kept += full
        return loop.logits(x)[0]
