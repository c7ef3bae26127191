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

Runs on the hf runner: the LoRA trains through the transformers model's autograd and is applied
to its modules by forward hooks during the method's own passes only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdecode.engine import GenerationStats
from specdecode.errors import require
from specdecode.lossy.base import LossyMethod
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

    def __init__(self, model, slots: int, rank: int = 8, alpha: float = 16.0,
                 config: dict | None = None):
        super().__init__()
        self.slots, self.rank, self.alpha = slots, rank, alpha
        embed = model.get_input_embeddings().weight.detach()
        # every slot starts as the mean token embedding: a neutral input of the right scale
        self.slot_embeddings = nn.Parameter(embed.mean(0).repeat(slots, 1).float())
        self.down, self.up = nn.ParameterDict(), nn.ParameterDict()
        for name, linear in self.targets(model):
            self.down[name] = nn.Parameter(torch.randn(rank, linear.in_features)
                                           / linear.in_features ** 0.5)
            self.up[name] = nn.Parameter(torch.zeros(linear.out_features, rank))
        #: what the trainer recorded (steps, data, accuracy per slot)
        self.config = dict(config or {})

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
    def from_artifact(cls, model, tensors: dict[str, torch.Tensor], config: dict) -> UnitAdapters:
        made = cls(model, config["slots"], config["rank"], config["alpha"], config)
        made.load_state_dict({name: t.float() for name, t in tensors.items()})
        return made.eval().requires_grad_(False)


def load_adapters(spec: str, runner: Runner) -> UnitAdapters:
    """``'auto'`` (the newest artifact for this target) or an artifact path."""
    from specdecode.training.artifacts import load_artifact, newest_artifact

    fingerprint = runner.fingerprint()
    if spec == "auto":
        spec = str(newest_artifact(ADAPTERS_KIND, fingerprint,
                                   "no LUD adapters for this target yet; make them with "
                                   "`specdecode train lud` (minutes on 2 CPU cores)"))
    require(Path(spec).suffix == ".safetensors" and Path(spec).is_file(),
            f"adapters {spec!r} is neither 'auto' nor an existing .safetensors file (make "
            "one with `specdecode train lud`)")
    art = load_artifact(spec, ADAPTERS_KIND, fingerprint)
    return UnitAdapters.from_artifact(runner.model, art.tensors, art.config)


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
    adapters: str = param("auto", "the fine-tuned delta: 'auto' (the artifact `specdecode "
                                     "train lud` made for this target) or an artifact path")
    placeholders: int = param(3, "slots appended each step (units of up to placeholders + 1 "
                                 "tokens); at most the number the adapters were trained with")
    threshold: float = param(0.9, "a slot's token joins the unit when it and every prediction "
                                  "before it have at least this probability (the paper's alpha)")

    def __post_init__(self):
        require(self.placeholders >= 0, f"placeholders must be >= 0, got {self.placeholders}")
        require(0 <= self.threshold <= 1, f"threshold must be in [0, 1], got {self.threshold}")


@register("lud", LudConfig,
          paper="LUD, Lexical Unit Decoding (Sun, Zhang, Lin et al., 2024; arXiv 2405.15208)",
          summary="LOSSY: placeholder slots after the last token predict the following tokens; "
                  "a confident multi-token unit is emitted in one forward (hf runner)", lossy=True)
class Lud(LossyMethod):
    def __init__(self, config: LudConfig, runner: Runner, adapters: UnitAdapters | None = None):
        """``adapters``: use these instead of the config's."""
        from specdecode.models.hf import HFRunner

        require(isinstance(runner, HFRunner),
                "lud applies its LoRA to the transformers model; use the hf runner (--runner hf)")
        super().__init__(config, runner)
        self.model = runner.model
        self.adapters = adapters or load_adapters(config.adapters, runner)
        require(config.placeholders <= self.adapters.slots,
                f"placeholders={config.placeholders} but the adapters were trained for "
                f"{self.adapters.slots} slots; lower it or train with `specdecode train lud "
                "--slots N`")

    def step(self, fed: Sequence[int], start: int, slots: int, cache) -> torch.Tensor:
        """Feed ``fed`` at positions ``start``... then ``slots`` slots; probabilities
        [1 + slots, V] of the last fed token's row and the slots'. The slots leave the cache."""
        embeds = torch.cat([self.model.get_input_embeddings()(torch.tensor(list(fed))),
                            self.adapters.slot_embeddings[:slots]])[None]
        positions = torch.arange(start, start + len(embeds[0]))
        rows = torch.arange(len(embeds[0])) >= len(fed)
        with self.adapters.applied(self.model, rows):
            logits = self.model(inputs_embeds=embeds, position_ids=positions[None],
                                past_key_values=cache, use_cache=True,
                                cache_position=positions).logits[0, len(fed) - 1:]
        cache.crop(start + len(fed))
        return torch.softmax(logits.float(), -1)

    @torch.inference_mode()
    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               eos: frozenset[int], stats: GenerationStats) -> Iterator[list[int]]:
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
