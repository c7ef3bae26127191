"""Quantized self-drafting: the target's own int4 copy drafts chains for the precise target
(Zhang et al., 2025, "Speculative Decoding Meets Quantization: Compatibility Evaluation and
Hierarchical Framework Design", arXiv 2505.22179 - its baseline of a quantised model drafting
for its full-precision self; the three-level hierarchy is ``hierspec``).

The target is the runner the user picked (``--weights fp32`` or ``bf16`` on the native runner,
or any ``transformers`` Llama-family model on the hf runner); the drafter is the same weights
in the native runner's int4 format, with a KV cache of its own. Where the target was read from
a GGUF file the drafter reads the same file, taking its 4-bit blocks as they are
(memory-mapped, nothing re-quantised) and sharing the target's float embedding table; a
``transformers`` target is quantised from its float weights. A target whose int4 copy cannot
be made (no native kernels, sizes that are not whole int4 groups, a native runner built from a
folder it no longer has) is refused with the reason and the fix.

The output is the target's, exactly: greedy, the int4 copy proposes its argmax and the target's
argmax decides; sampled, the int4 copy samples each token from its own processed distribution
and records it in ``Draft.probs``, and the verifier's rejection rule keeps the target's
distribution (:mod:`specdecode.drafting.session`).

Length controllers (``controller``, :mod:`specdecode.control`): ``heuristic`` (default:
transformers' +2/-1 schedule, up to ``max_speculative_tokens``; the copy agrees with the
precise model often enough that long chains pay), ``confidence`` (stop after a token whose int4
probability is below ``confidence_threshold``) and ``fixed``. SpecDec++'s stopping rule needs
a trained acceptance head, which the int4 copy has none of.

Sampled, ``drafts=k`` drafts k i.i.d. chains side by side (SpecTr's k draft sequences, Sun et
al., 2023), verified by recursive rejection (``verifier=specinfer``) or SpecTr's K-SEQ
(``verifier=spectr``; :mod:`specdecode.verify`). Measurements: docs/quantized.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdecode.control import ConfidenceStop, Controller, HeuristicLength
from specdecode.drafting.caches import NativeDraftLM
from specdecode.drafting.session import DraftSession
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import Runner
from specdecode.proposer import Feedback, Proposer
from specdecode.registry import param, register


#: target runner -> its int4 copy, made once (packing a model's weights takes seconds) and
#: dropped with the target; every drafter gets a replica of it: the same weights, its own cache
_INT4_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def int4_copy(runner: Runner):
    """The target's weights as a native int4 :class:`LlamaRunner` with its own KV cache, or a
    :class:`SpecDecodeError` saying why there can be none."""
    copy = _INT4_COPIES.get(runner)
    if copy is None:
        copy = _INT4_COPIES[runner] = _make_int4_copy(runner)
    return copy.replica()


def _make_int4_copy(runner: Runner):
    from specdecode import kernels
    from specdecode.models.hf import HFRunner
    from specdecode.models.llama import LlamaRunner
    from specdecode.models.native_shape import LlamaShape

    require(kernels.available(), "the int4 drafter needs the native kernels, which did not "
                                 "build on this machine (see `python -m specdecode.kernels`)")
    if isinstance(runner, LlamaRunner):
        require(runner.weights != "int4",
                "the target already runs in int4: its int4 copy would be itself. Pick a "
                "precise target with --weights fp32 (or bf16)")
        require(runner.shape.fits_int4, "the model's sizes are not whole int4 groups of 32; "
                                        "it has no int4 copy")
        source = runner.source
        if not source.endswith(".gguf"):
            raise SpecDecodeError(
                f"the native target was built from {source or 'tensors in memory'}, not a GGUF "
                "file, so there is nothing to read its int4 copy from; load the model from its "
                "GGUF file, or run the target on the hf runner (--runner hf)")
        # (its embedding rows are read from the file like the target's: no second table)
        return LlamaRunner.from_gguf(source, "int4", max_context=runner.max_context)
    if isinstance(runner, HFRunner):
        config = runner.model.config
        try:
            shape = LlamaShape.from_config(config)
        except SpecDecodeError as exc:
            raise SpecDecodeError(f"no int4 copy of this target: {exc}") from None
        require(shape.fits_int4, "the model's sizes are not whole int4 groups of 32; it has no "
                                 "int4 copy")
        return LlamaRunner.from_transformers(runner.model, "int4",
                                             max_context=runner.max_context)
    raise SpecDecodeError(f"no int4 copy of a {type(runner).__name__} target; use the native "
                          "runner (--runner native --weights fp32)")


@dataclass(frozen=True)
class QuantizedConfig:
    controller: str = param("heuristic", "draft length controller: heuristic | confidence | "
                                         "fixed (docs/quantized.md compares them)")
    num_speculative_tokens: int = param(6, "draft length of the fixed controller and the "
                                           "heuristic's starting length", bounds=(1, 32))
    max_speculative_tokens: int = param(16, "longest chain any controller drafts", bounds=(1, 64))
    confidence_threshold: float = param(0.5, "confidence controller: stop after a token whose "
                                             "int4 probability is below this", bounds=(0.0, 1.0))
    drafts: int = param(1, "k: i.i.d. chains drafted side by side when sampling (SpecTr's k "
                           "draft sequences), each num_speculative_tokens long (the adaptive "
                           "controllers read one chain's acceptance); greedy drafts one",
                        bounds=(1, 8))
    verifier: str = param("specinfer", "sampled acceptance rule for k > 1 chains: specinfer "
                                       "(recursive rejection) or spectr (SpecTr's K-SEQ)")

    def __post_init__(self):
        require(self.drafts >= 1, f"drafts must be >= 1, got {self.drafts}")
        require(self.verifier in VERIFIERS,
                f"unknown verifier {self.verifier!r}; known: {', '.join(VERIFIERS)}")
        require(self.controller in CONTROLLERS,
                f"unknown controller {self.controller!r}; known: {', '.join(CONTROLLERS)}")
        require(self.num_speculative_tokens >= 1,
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        require(self.max_speculative_tokens >= self.num_speculative_tokens,
                f"max_speculative_tokens ({self.max_speculative_tokens}) must be >= "
                f"num_speculative_tokens ({self.num_speculative_tokens})")
        require(0.0 <= self.confidence_threshold <= 1.0,
                f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")


#: verifier name -> the Draft's sibling rule (verify.py)
VERIFIERS = {"specinfer": "recursive", "spectr": "spectr"}

#: controller name -> factory(config)
CONTROLLERS: dict[str, Callable[[QuantizedConfig], Controller]] = {
    "confidence": lambda c: ConfidenceStop(c.confidence_threshold, c.max_speculative_tokens),
    "heuristic": lambda c: HeuristicLength(c.num_speculative_tokens, c.max_speculative_tokens),
    "fixed": lambda c: Controller(c.num_speculative_tokens, c.num_speculative_tokens),
}


def int4_session(runner: Runner) -> DraftSession:
    """The target's int4 copy in a draft cache of its own, with a drafting session."""
    from specdecode.models.llama_drafter import LlamaDrafter

    return DraftSession(NativeDraftLM(LlamaDrafter(int4_copy(runner))))


@register("quantized", QuantizedConfig,
          paper="Speculative Decoding Meets Quantization (Zhang et al., 2025, arXiv 2505.22179)",
          summary="the target's own int4 copy drafts chains for the fp32/bf16 target "
                  "(--weights fp32); output exactly the precise model's")
class QuantizedProposer(Proposer):
    def __init__(self, config: QuantizedConfig, runner: Runner):
        super().__init__(config, runner)
        self.session = int4_session(runner)

    def draft_seconds(self, context: Sequence[int]) -> tuple[float, float]:
        return self.session.draft_seconds(context)

    def make_controller(self) -> Controller:
        c = self.config
        if c.drafts > 1:
            return Controller(c.num_speculative_tokens, c.drafts * c.num_speculative_tokens)
        return CONTROLLERS[c.controller](c)

    def start(self, prompt: Sequence[int]) -> None:
        self.session.start(prompt, self.sampling)

    def propose(self, context, budget):
        k = 1 if self.sampling.greedy else self.config.drafts
        if k == 1:
            return self.session.chain(context, min(budget.max_depth, budget.max_nodes),
                                      budget.keep_drafting)
        return self.session.chains(context, min(budget.max_depth, budget.max_nodes // k), k,
                                   VERIFIERS[self.config.verifier], budget.keep_drafting)

    def observe(self, feedback: Feedback) -> None:
        self.session.keep_accepted(feedback.accepted, feedback.draft)
