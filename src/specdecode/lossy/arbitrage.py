"""Arbitrage: step-level routing between a cheap drafter and the target by a learned estimate
of the target's advantage (Maheswaran, Tiwari, Hu et al., 2025, "Arbitrage: Efficient Reasoning
via Advantage-Aware Speculation", arXiv 2512.05033; code github.com/SqueezeAILab/Arbitrage).

Lossy by design: a draft step is kept whenever the router expects the target to do no better,
even where the target would have written something else.

Generation goes by *steps* (a line: up to a newline token, end-of-sequence or
``max_step_tokens``). Each step:

1. the cheap drafter writes the step greedily: the distilled draft model of ``draft_model``
   (int4 on the native runner; ``cheap=draft``, the default) or the target's own int4 copy
   from the same weights (``cheap=int4``, the copy ``quantized`` drafts with; the target then
   runs precise, ``--weights fp32``: the paper's pairing of a small and a large model of one
   family, here one model at two precisions);
2. the target reads it in ONE pass (what accepting it costs anyway: its KV rows are needed to
   go on), giving the target's log-probabilities of the drafted tokens;
3. the router (:class:`Router`, a linear model over :func:`step_features`) estimates the
   target's advantage: the target's mean log-probability of its own greedy step minus that of
   the draft step, both under the target (the target's likelihood stands in for the paper's
   process reward model, which this project does not have);
4. advantage <= ``threshold``: the step is kept, with the target's next token after it for
   free (the pass computed it); above: the target rewrites the step itself, token by token,
   starting from the token the pass already gave.

Differences from the paper: the reward is the target's own log-likelihood, not a PRM; the
router reads the target's pass over the draft step besides the draft (the paper's reads the
context and draft step with a small LM, before any target pass) - here that pass is paid
anyway, since a kept step must enter the target's cache. Defaults: ``threshold`` 2.0 nats per
token, sweepable like the paper's tau (lower sends more steps to the target; the distilled
draft's steps are often far less likely under the target, so a threshold near 0 is nearly
``ar``); ``max_step_tokens`` 32. The router is an artifact of ``specdecode train router`` (packaged for
the default model, one per cheap model: its features' scale depends on the drafter) holding
its weights and the target's newline token ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.draft import Draft
from specdecode.drafting.artifacts import DraftSource, open_draft
from specdecode.engine import GenerationStats
from specdecode.errors import require
from specdecode.lossy.base import LossyMethod
from specdecode.models.base import Runner
from specdecode.registry import param, register
from specdecode.sampling import SamplingParams

#: artifact kind written by ``specdecode train router``
ROUTER_KIND = "arbitrage_router"

#: names of :func:`step_features`, in order
FEATURES = ("draft_mean_logp", "draft_min_logp", "target_mean_logp", "target_min_logp",
            "target_mean_regret", "target_max_regret", "argmax_agreement", "length")


def step_features(draft_logp: Sequence[float], target_logits: torch.Tensor,
                  step: Sequence[int], max_step_tokens: int) -> torch.Tensor:
    """[len(FEATURES)] float32 of one draft step: the drafter's log-probabilities of its tokens,
    the target's (``target_logits`` [n + 1, V]: row i after the root and the step's first i
    tokens), the target's regret (its best log-probability minus the drafted token's) and the
    share of tokens that are the target's argmax."""
    n = len(step)
    logp = torch.log_softmax(target_logits[:n].float(), -1)  # [n, V]
    drafted = logp[torch.arange(n), torch.tensor(list(step))]  # [n]
    regret = logp.max(-1).values - drafted
    agree = (logp.argmax(-1) == torch.tensor(list(step))).float()
    d = torch.tensor([float(x) for x in draft_logp])
    return torch.stack([d.mean(), d.min(), drafted.mean(), drafted.min(), regret.mean(),
                        regret.max(), agree.mean(), torch.tensor(n / max_step_tokens)]).float()


@dataclass
class Router:
    """A linear estimate of the target's advantage from standardised step features."""

    weight: torch.Tensor  # [F]
    bias: float
    mean: torch.Tensor  # [F]
    std: torch.Tensor  # [F]
    #: target token ids whose text holds a newline (a step ends after one)
    newline_ids: frozenset[int]

    def advantage(self, features: torch.Tensor) -> float:
        return float(((features - self.mean) / self.std) @ self.weight + self.bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "bias": torch.tensor([self.bias]), "mean": self.mean,
                "std": self.std, "newline_ids": torch.tensor(sorted(self.newline_ids))}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Router:
        return cls(t["weight"].float(), float(t["bias"][0]), t["mean"].float(), t["std"].float(),
                   frozenset(t["newline_ids"].long().tolist()))


def load_router(spec: str, runner: Runner, cheap: str = "draft") -> Router:
    """``'trained'`` (the newest router trained for this target with this ``cheap`` model) or
    an artifact path."""
    from specdecode.artifacts import find_artifacts, load_artifact, read_metadata

    fingerprint = runner.fingerprint()
    if spec == "trained":
        found = [path for path in find_artifacts(ROUTER_KIND, fingerprint)
                 if read_metadata(path)[2].get("cheap", "draft") == cheap]
        require(bool(found), f"no Arbitrage router for this target and cheap={cheap} yet; make "
                             f"one with `specdecode train router --cheap {cheap}` (minutes on 2 "
                             "CPU cores), or pass -c router=PATH")
        spec = str(found[0])
    require(Path(spec).suffix == ".safetensors",
            f"router {spec!r} is neither 'trained' nor an artifact .safetensors file")
    return Router.from_tensors(load_artifact(spec, ROUTER_KIND, fingerprint).tensors)


#: what ``cheap`` may name
CHEAP_MODELS = ("draft", "int4")


@dataclass(frozen=True)
class ArbitrageConfig(DraftSource):
    # startup only: the int4 copy is a second model in memory, the router a file the server
    # reads; the operator picks both
    cheap: str = param("draft", "the cheap model: 'draft' (the draft model named by draft, "
                                "draft_runner and draft_weights) or 'int4' (the target's own "
                                "int4 copy, as quantized drafts with: run the target precise, "
                                "--weights fp32)", startup_only=True)
    router: str = param("trained", "the router: 'trained' (the artifact `specdecode train "
                                   "router` made for this target and cheap model) or an "
                                   "artifact path", startup_only=True)
    threshold: float = param(2.0, "the target rewrites a step when the router's advantage "
                                  "estimate exceeds this (nats per token; the paper's tau; "
                                  "docs/lossy.md sweeps it)", bounds=(-100.0, 100.0))
    max_step_tokens: int = param(32, "longest step: a step ends at a newline, end-of-sequence "
                                     "or this many tokens", bounds=(1, 128))

    def __post_init__(self):
        super().__post_init__()
        require(self.cheap in CHEAP_MODELS,
                f"unknown cheap {self.cheap!r}; known: {', '.join(CHEAP_MODELS)}")
        require(self.max_step_tokens >= 1,
                f"max_step_tokens must be >= 1, got {self.max_step_tokens}")


@register("arbitrage", ArbitrageConfig,
          paper="Arbitrage (Maheswaran, Tiwari, Hu et al., 2025; arXiv 2512.05033)",
          summary="LOSSY: a cheap draft writes each step (a line); a trained router keeps it "
                  "unless it expects the target to do better, then the target rewrites it",
          lossy=True)
class Arbitrage(LossyMethod):
    def __init__(self, config: ArbitrageConfig, runner: Runner, router: Router | None = None,
                 draft_model: torch.nn.Module | None = None):
        """``router``/``draft_model``: use these instead of the config's artifacts."""
        super().__init__(config, runner)
        self.router = router or load_router(config.router, runner, config.cheap)
        if config.cheap == "int4":
            from specdecode.drafting.caches import NativeDraftLM
            from specdecode.models.llama_drafter import LlamaDrafter
            from specdecode.proposers.quantized import int4_copy

            self.lm = NativeDraftLM(LlamaDrafter(int4_copy(runner)))
        else:
            self.lm, _ = open_draft(config, runner, draft_model)

    def draft_step(self, context: Sequence[int], limit: int, eos: frozenset[int]
                   ) -> tuple[list[int], list[float]]:
        """The drafter's greedy step after ``context`` (at most ``limit`` tokens) and its
        log-probability of each token."""
        logits, _ = self.lm.catch_up(context)
        step, logps = [], []
        for i in range(limit):
            logp = torch.log_softmax(self.lm.full_logits(logits[None])[0].float(), -1)
            token = int(logp.argmax())
            step.append(token)
            logps.append(float(logp[token]))
            if self.ends_step(token, eos) or i + 1 == limit:
                break
            logits, _ = self.lm.feed([token], [i - 1])
            logits = logits[0]
        return step, logps

    def ends_step(self, token: int, eos: frozenset[int]) -> bool:
        return token in self.router.newline_ids or token in eos

    def target_step(self, first: int, limit: int, eos: frozenset[int]
                    ) -> tuple[list[int], list[float]]:
        """The target's greedy step from ``first`` (already chosen; not in the cache), and the
        target's log-probability of each token after the first."""
        step, logps = [first], []
        while len(step) < limit and not self.ends_step(step[-1], eos):
            out = self.runner.forward(step[-1], Draft.empty())
            self.runner.commit([])
            logp = torch.log_softmax(out.logits[0].float(), -1)
            step.append(int(logp.argmax()))
            logps.append(float(logp[step[-1]]))
        return step, logps

    @torch.inference_mode()
    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               eos: frozenset[int], stats: GenerationStats) -> Iterator[list[int]]:
        c, runner = self.config, self.runner
        self.lm.reset()
        first = int(runner.prefill(list(prompt_ids)).logits[0].argmax())
        stats.target_forwards += 1
        context = list(prompt_ids) + [first]
        made = 1
        yield [first]
        while made < max_new_tokens and first not in eos:
            limit = min(c.max_step_tokens, max_new_tokens - made)
            step, logps = self.draft_step(context, limit, eos)
            out = runner.forward(context[-1], Draft.chain(step))
            stats.target_forwards += 1
            stats.draft_tokens += len(step)
            advantage = self.router.advantage(step_features(logps, out.logits, step,
                                                            c.max_step_tokens))
            if advantage <= c.threshold:  # keep the draft step, and the target's next token
                runner.commit(list(range(len(step))))
                self.lm.prune(list(range(len(step) - 1)))
                chunk = step + ([] if step[-1] in eos else [int(out.logits[len(step)].argmax())])
                stats.accepted_lengths.append(len(chunk))
            else:  # the target rewrites the step
                runner.commit([])
                chunk, _ = self.target_step(int(out.logits[0].argmax()), limit, eos)
                stats.target_forwards += len(chunk) - 1
                stats.accepted_lengths.extend([1] * len(chunk))
            context += chunk
            made += len(chunk)
            first = chunk[-1]
            yield chunk
