"""DEL: a context-aware dynamic exit layer for self-speculative decoding (Zarch et al., COLM 2025,
arXiv 2504.05598). Named ``del`` in the registry; ``del`` is a Python keyword, hence this file's
name.

Early-exit drafting (see ``early_exit``) with the exit layer and the draft length chosen anew
every round:

1. *Shadow tokens.* The verify pass already computes every layer's hidden state for the
   committed rows, so the proposer asks for those of the candidate exit layers; the exit head of each
   layer l turns them into the token l would have drafted there. Row i's shadow token is accepted
   exactly when it equals the committed token after row i (the context up to row i is the
   target's own), so each round gives every candidate layer a few acceptance trials for free.
2. *Context-aware acceptance.* Per layer, decayed counts of accepted / tried shadow tokens
   (``decay`` per update: recent context counts more) give the acceptance rate alpha_l, starting
   from a prior (the adapters' measured agreement, else 0.5) worth ``prior_weight`` trials.
   Shadow tokens of all layers cost one LM head call per round; while ``del`` is not speculating
   they are computed every ``idle_shadow_every`` rounds only, and each such check that leaves
   plain decoding best doubles the interval up to ``idle_shadow_max``, carried from one
   request to the next until a draft resets it (CPU adaptations: on
   SmolLM2 that call costs about a sixth of a forward; on Qwen2.5-Coder-1.5B, whose untrained
   exits never paid, a check every 4 rounds cost 5% of its time).
3. *Token per layer.* Each round picks the layer l and draft length d maximising expected
   tokens per layer computed, TPL(l, d) = (1 - alpha_l^(d+1)) / (1 - alpha_l) / cost(l, d),
   where the paper's cost is d * l + L (L = all layers). On a CPU two terms it ignores matter:
   the LM head (``head_cost`` layers per application) and the verify pass growing with the
   draft (``verify_token_cost`` of a full pass per draft token); both default to values measured
   on SmolLM2-135M here. d = 0 (plain decoding) competes too, so a context where no exit agrees
   costs one forward per token plus the occasional shadow-token head call.
4. *Dynamic draft exiting.* Drafting stops after the first token whose probability under the
   exit head is below ``confidence_threshold``.

Defaults: candidate layers auto (the trained adapters' layers, else eight spread over the upper
three quarters of the model), at most 8 draft tokens, decay 0.9, prior weight 4, idle shadow
interval 4 doubling up to 64, confidence threshold 0.4 (provisional, not yet tuned: the
paper's threshold, decay and window are not in its abstract or README, the only parts of it
read here). Drafts are
deterministic, so sampled verification stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.draft import Draft
from specdecode.drafting.exit_adapters import resolve_adapters
from specdecode.drafting.exits import (HEAD_COST, VERIFY_TOKEN_COST, check_exit_layer,
                                       require_early_exit, tokens_per_layer)
from specdecode.errors import require
from specdecode.models.base import Needs
from specdecode.proposer import Feedback, Proposer
from specdecode.registry import param, register

@dataclass(frozen=True)
class DelConfig:
    candidate_layers: str = param("auto", "comma-separated exit layers to track and choose from, "
                                          "or auto (the adapters' layers, else 8 spread layers)")
    max_speculative_tokens: int = param(8, "longest draft considered by the TPL choice",
                                        bounds=(1, 32))
    confidence_threshold: float = param(0.4, "stop drafting after a token whose exit-head "
                                             "probability is below this (0 = never)",
                                        bounds=(0.0, 1.0))
    decay: float = param(0.9, "weight of the previous updates in each layer's acceptance counts",
                         bounds=(0.0, 1.0))
    idle_shadow_every: int = param(4, "while not speculating, compute shadow tokens every this "
                                      "many rounds at first (each costs an LM head call; the "
                                      "paper: 1)",
                                   bounds=(1, 1024))
    idle_shadow_max: int = param(64, "the longest interval between those checks: each check that "
                                     "leaves plain decoding best doubles it up to this (1024 "
                                     "rounds at most)", bounds=(1, 1024))
    prior_weight: float = param(4.0, "trials the prior acceptance rate is worth", bounds=(0.0, 1e6))
    head_cost: float = param(HEAD_COST, "cost of one LM head application, in layers (0 in the "
                                        "paper; measured on SmolLM2 / CPU)", bounds=(0.0, 1000.0))
    verify_token_cost: float = param(VERIFY_TOKEN_COST, "extra verify cost per draft token, as a "
                                                        "fraction of a one-token forward (0 in "
                                                        "the paper)", bounds=(0.0, 100.0))
    adapters: str = param("auto", "'auto' (a trained exit-adapter artifact for this target, if "
                                  "found), 'none' (final norm + LM head), or an artifact path")

    def __post_init__(self):
        require(self.max_speculative_tokens >= 1,
                f"max_speculative_tokens must be >= 1, got {self.max_speculative_tokens}; "
                "use method 'ar' for no speculation")
        require(0.0 <= self.confidence_threshold < 1.0,
                f"confidence_threshold must be in [0, 1), got {self.confidence_threshold}")
        require(0.0 <= self.decay <= 1.0, f"decay must be in [0, 1], got {self.decay}")
        require(self.prior_weight > 0, f"prior_weight must be > 0, got {self.prior_weight}")
        require(1 <= self.idle_shadow_every <= self.idle_shadow_max,
                f"idle_shadow_every must be >= 1 and at most idle_shadow_max, got "
                f"{self.idle_shadow_every} and {self.idle_shadow_max}")
        require(self.head_cost >= 0 and self.verify_token_cost >= 0,
                "head_cost and verify_token_cost must be >= 0")
        if self.candidate_layers != "auto":
            try:
                layers = [int(x) for x in self.candidate_layers.split(",") if x.strip()]
            except ValueError:
                layers = []
            require(bool(layers), f"candidate_layers must be 'auto' or comma-separated layer "
                                  f"numbers such as '8,12,16', got {self.candidate_layers!r}")


@register("del", DelConfig,
          paper="DEL: Context-Aware Dynamic Exit Layer for Self-Speculative Decoding (Zarch et al., 2025)",
          summary="early-exit drafting; exit layer and length chosen each round by tokens per "
                  "layer from shadow-token acceptance")
class DynamicExitProposer(Proposer):
    samples_drafts = False  # greedy chains from the exit's logits

    def __init__(self, config: DelConfig, runner):
        super().__init__(config, runner)
        self.exits = require_early_exit(runner, "method 'del'")
        self.adapters = resolve_adapters(config.adapters, runner)
        n = runner.num_layers
        if config.candidate_layers != "auto":
            layers = sorted({int(x) for x in config.candidate_layers.split(",") if x.strip()})
        elif self.adapters is not None:
            layers = list(self.adapters.layers)
        else:  # eight layers from a quarter of the way down to the last but one
            first = max(1, n // 4)
            layers = sorted({round(first + i * (n - 1 - first) / 7) for i in range(8)})
        for layer in layers:
            check_exit_layer(runner, layer, "candidate layer")
        self.layers = tuple(layers)
        self.needs = Needs(layers=self.layers)
        self.heads = {layer: self.adapters[layer] if self.adapters is not None
                      and layer in self.adapters else None for layer in self.layers}
        measured = self.adapters.agreement() if self.adapters is not None else {}
        self.prior = {layer: measured.get(layer, 0.5) for layer in self.layers}
        #: decayed shadow-token counts per layer (reset per request: acceptance is contextual)
        self.hits = dict.fromkeys(self.layers, 0.0)
        self.trials = dict.fromkeys(self.layers, 0.0)
        #: (layer, depth) chosen in each round of the current request, for reports
        self.choices: list[tuple[int, int]] = []
        self.idle_rounds = 0
        #: rounds between shadow-token checks while not speculating (backs off, see observe)
        self.idle_interval = config.idle_shadow_every

    def alpha(self, layer: int) -> float:
        w = self.config.prior_weight
        return (self.hits[layer] + w * self.prior[layer]) / (self.trials[layer] + w)

    def choose(self, max_depth: int) -> tuple[int, int]:
        """(exit layer, draft length) with the highest TPL; depth 0 = do not speculate."""
        c, n = self.config, self.runner.num_layers
        # the shadow tokens' head call: every round when speculating, 1 in idle_interval if not
        best = (self.layers[0], 0)
        best_tpl = tokens_per_layer(0.0, 0, 0, n, c.head_cost,
                                    round_cost=c.head_cost / self.idle_interval)
        for layer in self.layers:
            a = self.alpha(layer)
            for depth in range(1, max_depth + 1):
                tpl = tokens_per_layer(a, layer, depth, n, c.head_cost, c.verify_token_cost,
                                       c.head_cost)
                if tpl > best_tpl:
                    best, best_tpl = (layer, depth), tpl
        return best

    def start(self, prompt):
        # the interval between idle checks carries over: exits that never paid on the last
        # request's text rarely pay on the next one's (restarting at idle_shadow_every, five
        # checks a 128-token answer cost del about 1% on Qwen2.5-Coder-1.5B); a draft resets it
        self.hits = dict.fromkeys(self.layers, 0.0)
        self.trials = dict.fromkeys(self.layers, 0.0)
        self.choices = []
        self.idle_rounds = 0

    def propose(self, context, budget):
        layer, depth = self.choose(min(self.config.max_speculative_tokens, budget.max_depth))
        self.choices.append((layer, depth))
        tokens: list[int] = []
        token = context[-1]
        with self.exits.chain(layer) as chain:
            for _ in range(depth):
                hidden = chain.extend([token])  # [1, H]
                probs = torch.softmax(self.exits.logits(hidden, self.heads[layer])[0], -1)
                confidence, best = probs.max(-1)
                token = int(best)
                tokens.append(token)
                if float(confidence) < self.config.confidence_threshold:
                    break
        return Draft.chain(tokens)

    def observe(self, feedback: Feedback) -> None:
        if feedback.prefill:  # learns from verify steps only
            return
        captured = feedback.target.layers
        idle = not len(feedback.draft)
        if not idle:
            self.idle_rounds, self.idle_interval = 0, self.config.idle_shadow_every
        else:
            self.idle_rounds += 1
        if not captured or (idle and self.idle_rounds < self.idle_interval):
            return
        rows = feedback.committed_rows  # rows whose next token is committed
        target = torch.tensor(feedback.tokens[: len(rows)])
        # every layer's rows through the head in one call: it costs what one row does
        normed = torch.cat([self.exits.norm(captured[layer][rows], self.heads[layer])
                            for layer in self.layers])  # [layers * r, H]
        shadows = self.exits.head(normed).argmax(-1).view(len(self.layers), len(rows))
        hits = (shadows == target).sum(-1).tolist()
        d = self.config.decay
        for layer, hit in zip(self.layers, hits):
            self.hits[layer] = d * self.hits[layer] + hit
            self.trials[layer] = d * self.trials[layer] + len(rows)
        if idle:  # a check that still leaves plain decoding best: look again twice as late
            self.idle_rounds = 0
            if self.choose(self.config.max_speculative_tokens)[1] == 0:
                self.idle_interval = min(2 * self.idle_interval, self.config.idle_shadow_max)
