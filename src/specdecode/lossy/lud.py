"""LUD, Lexical Unit Decoding (Sun, Zhang, Lin et al., 2024, "Decoding at the Speed of Thought:
Harnessing Parallel Decoding of Lexical Units for LLMs", arXiv 2405.15208; code
github.com/tjunlp-lab/Lexical-Unit-Decoding-LUD-, a placeholder README only).

Lossy by design: tokens after the next are emitted from the model's predictions *without*
reading the tokens before them, whenever those predictions are confident.

Each step feeds the tokens emitted last (the prompt, first) followed by ``placeholders`` slots
(learned input embeddings, one per slot) in one forward. The last token's row gives the next
token as plain decoding would; slot j's row predicts the token j + 1 after it. The step emits a
*lexical unit*: the next token, then each following slot's token while every prediction so far,
the next token's included, has probability at least ``threshold``; otherwise the next token
alone. The slots' KV rows are dropped after the step; the unit's tokens are fed (and cached) at
the start of the next.

The model is fine-tuned lightly: LoRA (rank 8, alpha 16) on the attention projections (q, k, v,
o) of every layer, plus the slots' embeddings, trained by ``specdecode train lud``
(training/lud.py) on the target's own greedy outputs to predict the tokens at the slots.
Differences from the paper: the LoRA acts on the slots' rows only, so every ordinary row (and
its KV) is the unmodified target's and the next token is always plain decoding's (the paper
fine-tunes the whole model on data re-arranged around lexical units, which also shifts ordinary
predictions); no repetition control. Defaults: 3 slots (units of up to 4 tokens), threshold 0.9
(the paper's confidence threshold alpha; its value there is not verified, PAPERS.md).

Runs on the native runner (the layers through ``LayerLoop.run_layers``' Python loop with
each q/k/v and output projection wrapped by :class:`SlotLora`, the int4 kernels underneath) and
on the hf runner (the LoRA applied to the transformers modules by forward hooks during the
method's own passes only; the LoRA trains there through autograd). Both compute the same steps
(tests/test_lud.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from specdecode.engine import GenerationStats
from specdecode.errors import require
from specdecode.lossy.base import LossyMethod, adapters_param, trained_artifact
from specdecode.models.base import Runner
from specdecode.registry import param, register
from specdecode.sampling import SamplingParams

#: artifact kind written by ``specdecode train lud``
ADAPTERS_KIND = "lud_adapters"
#: the attention projections of a transformers Llama layer that carry a LoRA
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class UnitAdapters(nn.Module):
    """The slots' input embeddings and one LoRA per attention projection of every layer
    (``up`` starting at zero: untrained, a slot row is the plain model's over that embedding)."""

    def __init__(self, projections: dict[str, tuple[int, int]], slot_init: torch.Tensor,
                 slots: int, rank: int = 8, alpha: float = 16.0, config: dict | None = None):
        """``projections``: {key: (in, out) features} of each projection with a LoRA;
        ``slot_init`` [H]: every slot's first embedding."""
        super().__init__()
        self.slots, self.rank, self.alpha = slots, rank, alpha
        self.slot_embeddings = nn.Parameter(slot_init.float().repeat(slots, 1))
        self.down, self.up = nn.ParameterDict(), nn.ParameterDict()
        for key, (inputs, outputs) in projections.items():
            self.down[key] = nn.Parameter(torch.randn(rank, inputs) / inputs ** 0.5)
            self.up[key] = nn.Parameter(torch.zeros(outputs, rank))
        #: what the trainer recorded (steps, data, accuracy per slot)
        self.config = dict(config or {})

    @classmethod
    def fresh(cls, model, slots: int, rank: int = 8, alpha: float = 16.0) -> UnitAdapters:
        """Untrained adapters for a transformers model; every slot starts as the mean token
        embedding (a neutral input of the right scale)."""
        embed = model.get_input_embeddings().weight.detach()
        return cls({key: (linear.in_features, linear.out_features)
                    for key, linear in cls.targets(model)}, embed.mean(0), slots, rank, alpha)

    @staticmethod
    def targets(model) -> list[tuple[str, nn.Linear]]:
        """(key, module) of every projection that carries a LoRA."""
        return [(f"{i}_{p}", getattr(layer.self_attn, p))
                for i, layer in enumerate(model.model.layers) for p in PROJECTIONS]

    @contextmanager
    def applied(self, model, rows: torch.Tensor):
        """Within the block, every projection adds its LoRA on the rows where ``rows`` [n] is
        true (the slots) and nowhere else."""
        mask = rows.float()[None, :, None]
        scale = self.alpha / self.rank

        def hook_for(key):
            def hook(module, inputs, output):
                return output + (inputs[0] @ self.down[key].T) @ self.up[key].T * scale * mask
            return hook

        handles = [linear.register_forward_hook(hook_for(key))
                   for key, linear in self.targets(model)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().half() for name, p in self.named_parameters()}

    def settings(self) -> dict:
        return dict(self.config, slots=self.slots, rank=self.rank, alpha=self.alpha)

    @classmethod
    def from_artifact(cls, tensors: dict[str, torch.Tensor], config: dict) -> UnitAdapters:
        keys = [name.removeprefix("down.") for name in tensors if name.startswith("down.")]
        projections = {key: (tensors[f"down.{key}"].shape[1], tensors[f"up.{key}"].shape[0])
                       for key in keys}
        made = cls(projections, tensors["slot_embeddings"][0], config["slots"], config["rank"],
                   config["alpha"], config)
        made.load_state_dict({name: t.float() for name, t in tensors.items()})
        return made.eval().requires_grad_(False)

    def native(self, runner) -> list[tuple[tuple, tuple]]:
        """Per layer of the native runner, the LoRA of its fused q/k/v projection and of its
        output projection as (down, up) with the scale in ``up``: q, k and v share their input,
        so their downs stack and their ups go block-diagonal; q's up carries the attention
        scale the runner folds into q's weights."""
        scale = self.alpha / self.rank
        shape = runner.shape
        q_scale = 1.0 if shape.arch.qk_norm else shape.query_scale
        layers = []
        for i in range(runner.num_layers):
            keys = [f"{i}_{p}" for p in ("q_proj", "k_proj", "v_proj")]
            down = torch.cat([self.down[key] for key in keys])
            up = torch.block_diag(*[self.up[key] for key in keys]) * scale
            up[:shape.num_heads * shape.head_dim] *= q_scale
            o = f"{i}_o_proj"
            layers.append(((down, up), (self.down[o], self.up[o] * scale)))
        return layers


class SlotLora:
    """A native linear layer whose last ``rows`` rows also get a LoRA, ``(x @ down.T) @ up.T``."""

    def __init__(self, linear, lora: tuple[torch.Tensor, torch.Tensor], rows: int):
        self.linear, (self.down, self.up), self.rows = linear, lora, rows

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = self.linear(x, residual)
        if self.rows:
            out[-self.rows:] += (x[-self.rows:] @ self.down.T) @ self.up.T
        return out


def load_adapters(spec: str, runner: Runner) -> UnitAdapters:
    """``'auto'`` (the newest artifact for this target) or an artifact path."""
    art = trained_artifact(spec, runner, ADAPTERS_KIND, "train lud")
    return UnitAdapters.from_artifact(art.tensors, art.config)


def lexical_unit(probs: torch.Tensor, threshold: float) -> list[int]:
    """The unit emitted from ``probs`` [1 + slots, V] (the next token's, then each slot's): the
    next token, then the slots' tokens while every prediction so far reaches ``threshold``."""
    confidence, tokens = probs.max(-1)
    unit = [int(tokens[0])]
    for j in range(1, len(tokens)):
        if float(confidence[:j + 1].min()) < threshold:
            break
        unit.append(int(tokens[j]))
    return unit


@dataclass(frozen=True)
class LudConfig:
    adapters: str = adapters_param("the fine-tuned delta", "train lud")
    placeholders: int = param(3, "slots appended each step (units of up to placeholders + 1 "
                                 "tokens); at most the number the adapters were trained with",
                              bounds=(0, 16))
    threshold: float = param(0.9, "a slot's token joins the unit when it and every prediction "
                                  "before it have at least this probability (the paper's alpha)",
                             bounds=(0.0, 1.0))

    def __post_init__(self):
        require(self.placeholders >= 0, f"placeholders must be >= 0, got {self.placeholders}")
        require(0 <= self.threshold <= 1, f"threshold must be in [0, 1], got {self.threshold}")


@register("lud", LudConfig,
          paper="LUD, Lexical Unit Decoding (Sun, Zhang, Lin et al., 2024; arXiv 2405.15208)",
          summary="LOSSY: placeholder slots after the last token predict the following tokens; "
                  "a confident multi-token unit is emitted in one forward", lossy=True)
class Lud(LossyMethod):
    def __init__(self, config: LudConfig, runner: Runner, adapters: UnitAdapters | None = None):
        """``adapters``: use these instead of the config's."""
        from specdecode.models.hf import HFRunner
        from specdecode.models.llama import LlamaRunner

        require(isinstance(runner, (HFRunner, LlamaRunner)),
                f"lud adds its LoRA inside the model's layers; the {runner.name} runner does not "
                "give them: use the native runner or --runner hf")
        super().__init__(config, runner)
        self.adapters = adapters or load_adapters(config.adapters, runner)
        require(config.placeholders <= self.adapters.slots,
                f"placeholders={config.placeholders} but the adapters were trained for "
                f"{self.adapters.slots} slots; lower it or train with `specdecode train lud "
                "--slots N`")
        self.native = isinstance(runner, LlamaRunner)
        #: the native runner's fused LoRAs, per layer
        self.native_loras = self.adapters.native(runner) if self.native else None

    def step(self, fed: Sequence[int], start: int, slots: int, cache) -> torch.Tensor:
        """Feed ``fed`` at positions ``start``... (after what ``cache`` holds) then ``slots``
        slots; probabilities [1 + slots, V] of the last fed token's row and the slots'. The
        slots leave the cache. ``cache``: a ``DynamicCache`` on the hf runner, the runner's
        own on the native one."""
        step = self._native_step if self.native else self._hf_step
        return torch.softmax(step(list(fed), start, slots, cache).float(), -1)

    def _hf_step(self, fed: list[int], start: int, slots: int, cache) -> torch.Tensor:
        model = self.runner.model
        embeds = torch.cat([model.get_input_embeddings()(torch.tensor(fed)),
                            self.adapters.slot_embeddings[:slots]])[None]
        positions = torch.arange(start, start + len(embeds[0]))
        rows = torch.arange(len(embeds[0])) >= len(fed)
        with self.adapters.applied(model, rows):
            logits = model(inputs_embeds=embeds, position_ids=positions[None],
                           past_key_values=cache, use_cache=True,
                           cache_position=positions).logits[0, len(fed) - 1:]
        cache.crop(start + len(fed))
        return logits

    def _native_step(self, fed: list[int], start: int, slots: int, cache) -> torch.Tensor:
        """The prompt goes through the runner's prefill, as ``ar``'s does (its slots then run in
        a forward of their own); a unit and the slots after it run in one forward, the slots'
        rows through the LoRA-wrapped layers. Only the fed rows stay in the cache."""
        from specdecode.models.kv_cache import AttentionPlan

        runner, loop = self.runner, self.runner.layer_loop
        own = None
        if start == 0:
            own = runner.prefill(fed).logits
            fed = []
        x = torch.cat([loop.embed(fed), self.adapters.slot_embeddings[:slots]])
        if len(x):
            cache.check_room(len(x), "a unit and its slots")
            loras = self.native_loras

            def with_lora(i, layer):
                qkv, o = loras[i]
                return replace(layer, qkv=SlotLora(layer.qkv, qkv, slots),
                               o=SlotLora(layer.o, o, slots))

            hidden = loop.run_layers(x, AttentionPlan.chain(cache.length, len(x)), 0,
                                     runner.num_layers, with_lora if slots else None)
            cache.append(len(fed))
            rows = loop.logits(hidden[max(len(fed) - 1, 0):])
            own = rows if own is None else torch.cat([own, rows])
        return own

    @torch.inference_mode()
    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               eos: frozenset[int], stats: GenerationStats) -> Iterator[list[int]]:
        if self.native:
            cache = self.runner.cache
        else:
            from transformers import DynamicCache

            cache = DynamicCache()
        fed, start, made = list(prompt_ids), 0, 0
        while made < max_new_tokens:
            slots = min(self.config.placeholders, max_new_tokens - made - 1)
            unit = lexical_unit(self.step(fed, start, slots, cache), self.config.threshold)
            stats.target_forwards += 1
            stats.accepted_lengths.append(len(unit))
            yield unit
            if eos.intersection(unit):
                break
            start += len(fed)
            fed = unit
            made += len(unit)
