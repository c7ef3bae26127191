"""Self-speculative decoding with an early exit: the target's own first ``exit_layer`` layers
draft a greedy chain, the full model verifies it (LayerSkip, Elhoushi et al., 2024,
arXiv 2404.16710; Draft & Verify, Zhang et al., 2023, skips layers to the same end).

The draft pass shares the target's KV cache: for layers below the exit, the committed tokens'
entries are exactly what a draft pass would compute, so drafting costs ``exit_layer`` layers per
token and no second cache. The draft tokens' rows are cropped before verification, which stays
the normal full forward (LayerSkip also reuses them in verification; on this runner that saves
little, since the last draft token would still need its own pass through the early layers).

The default model was never trained for early exit (the raw LM head on SmolLM2's middle layers
rarely agrees with the final prediction, docs/self-speculation.md), so the exit goes through a
trained adapter when one is found for the target (``specdecode train exit-adapters``).

Defaults: ``num_speculative_tokens`` 2 (faster than 4 on the kernel runner, docs/bench.md);
``exit_layer`` 0 = auto (the adapter layer with the
highest expected tokens per layer computed, from its measured agreement; half the model without
adapters); ``adapters`` auto. Drafts are deterministic (no probabilities), so sampled
verification stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.draft import Draft
from specdecode.drafting.exit_adapters import resolve_adapters
from specdecode.drafting.exits import best_fixed_layer, check_exit_layer, require_early_exit
from specdecode.errors import require
from specdecode.proposer import Proposer
from specdecode.registry import param, register


@dataclass(frozen=True)
class EarlyExitConfig:
    exit_layer: int = param(0, "layer whose output drafts (1 .. layers-1); 0 = auto: the adapter "
                               "layer with the best expected tokens per layer, else half the model",
                            bounds=(0, 1024))
    num_speculative_tokens: int = param(2, "draft length (short: an early exit of a model never "
                                           "trained for it rarely keeps agreeing for long; 2 "
                                           "measured fastest, docs/bench.md)", bounds=(1, 32))
    adapters: str = param("auto", "'auto' (a trained exit-adapter artifact for this target, if "
                                  "found), 'none' (final norm + LM head), or an artifact path")

    def __post_init__(self):
        require(self.num_speculative_tokens >= 1,
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}; "
                "use method 'ar' for no speculation")
        require(self.exit_layer >= 0, f"exit_layer must be >= 1 (or 0 for auto), "
                                      f"got {self.exit_layer}")


@register("early_exit", EarlyExitConfig,
          paper="LayerSkip: Early Exit Inference and Self-Speculative Decoding (Elhoushi et al., 2024)",
          summary="the target's first layers draft a chain (shared KV cache, trained exit adapters)")
class EarlyExitProposer(Proposer):
    samples_drafts = False  # greedy chains from the exit's logits

    def __init__(self, config: EarlyExitConfig, runner):
        super().__init__(config, runner)
        self.exits = require_early_exit(runner, "method 'early_exit'")
        self.adapters = resolve_adapters(config.adapters, runner)
        if config.exit_layer:
            self.exit_layer = config.exit_layer
        elif self.adapters is not None and self.adapters.agreement():
            self.exit_layer = best_fixed_layer(self.adapters.agreement(), runner.num_layers,
                                               config.num_speculative_tokens)
        else:
            self.exit_layer = max(1, runner.num_layers // 2)
        check_exit_layer(runner, self.exit_layer)
        if self.adapters is not None and config.adapters != "auto":
            require(self.exit_layer in self.adapters,
                    f"the adapters in {config.adapters} cover layers {list(self.adapters.layers)}, "
                    f"not exit_layer {self.exit_layer}; pick one of those or adapters=none")
        has_head = self.adapters is not None and self.exit_layer in self.adapters
        self.head = self.adapters[self.exit_layer] if has_head else None

    def propose(self, context, budget):
        tokens: list[int] = []
        token = context[-1]
        with self.exits.chain(self.exit_layer) as chain:
            for _ in range(min(self.config.num_speculative_tokens, budget.max_depth)):
                hidden = chain.extend([token])  # [1, H]
                token = int(self.exits.logits(hidden, self.head)[0].argmax())
                tokens.append(token)
        return Draft.chain(tokens)
