"""Draft-model speculative decoding: a separate small causal LM with the target's vocabulary
drafts a chain token by token from its own KV cache; the target verifies it in one forward
(Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al., 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"; the assisted
generation of ``transformers``).

Lossless in both modes. Greedy: the draft proposes its argmax. Sampled: the draft *samples* each
token from its own distribution processed exactly like the target's (penalties, temperature,
top-k, top-p, min-p, each node with its own context) and records that distribution in
``Draft.probs``, so the verifier's rejection rule keeps the target's distribution. The draft draws
from its own generator, seeded from the request seed (offset, so its draws are independent of
the verifier's): seeded runs repeat. ``coupled`` draws each token with the verifier's own next
uniform instead and sends the chain without probabilities (drafter-invariant speculative
decoding, Daliri et al., 2024; drafting/session.py): a seeded answer is then ``ar``'s own, and
a token is accepted where the two draws agree.

The draft's cache is kept aligned with the target: at each step the committed tokens it has not
seen (the accepted tokens it did not compute itself, and the bonus/recovered token) are fed in
one forward; the KV rows of drafted tokens that were accepted are kept, the rest dropped.

The draft runs on the native runner (``draft_runner=native``, int4 where its sizes allow:
``draft_weights=auto``), whose one-token forward costs a fraction of ``transformers``'; its
static cache is extended and rewound, and reads trees (``dyspec``) a few nodes a call.
``draft_runner=hf`` runs it through ``transformers`` (any causal LM).

Length controllers (``controller``; see :mod:`specdecode.control`): ``fixed`` (always
``num_speculative_tokens``), ``heuristic`` (transformers' +2/-1 schedule), ``confidence`` (stop
after a token whose draft probability is below ``confidence_threshold``; transformers' default
0.4) and ``specdecpp`` (SpecDec++, Huang et al., 2024: a trained acceptance head stops drafting
once P(some drafted token is rejected) > ``stop_threshold``; paper: 0.3, bounds 2..20).

The draft (``draft``): ``distilled`` (default) loads the artifact ``specdecode train draft``
wrote for this target (a few of the target's own layers, distilled; it shares the target's
embedding table and drafts over a frequency-ranked shortlist of the vocabulary, as in FR-Spec,
Zhao et al., 2025, so its LM head costs a fraction of the target's); or a path to such an
artifact; or a local Hugging Face checkpoint folder of any causal LM with the same vocabulary;
or, as llama.cpp's ``-md``, a GGUF file (a ``.gguf`` path, or a named model such as
``qwen2.5-coder-0.5b``, the draft of ``qwen2.5-coder-1.5b``), read by the native runner itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdecode.control import ConfidenceStop, Controller, HeuristicLength, SpecDecPlusPlus
from specdecode.drafting.artifacts import DraftSource, open_draft
from specdecode.drafting.session import CoupledDrafts, DraftSession, coupled_param
from specdecode.errors import require
from specdecode.models.base import Runner
from specdecode.proposer import Feedback, Proposer
from specdecode.registry import param, register

@dataclass(frozen=True)
class DraftModelConfig(DraftSource):
    num_speculative_tokens: int = param(5, "draft length of the fixed controller and the "
                                           "heuristic's starting length (transformers' heuristic "
                                           "schedule starts at 5)", bounds=(1, 32))
    controller: str = param("fixed", "draft length controller: fixed | heuristic | confidence | "
                                     "specdecpp")
    max_speculative_tokens: int = param(12, "longest draft the adaptive controllers allow "
                                            "(SpecDec++ uses 20 for 7B drafts; 12 bounds the "
                                            "wasted draft steps on CPU)", bounds=(1, 64))
    confidence_threshold: float = param(0.4, "confidence controller: stop after a token with "
                                             "draft probability below this (transformers' "
                                             "assistant_confidence_threshold default)",
                                        bounds=(0.0, 1.0))
    stop_threshold: float = param(0.3, "specdecpp controller: stop when the predicted P(some "
                                       "drafted token is rejected) exceeds this (paper: 0.3)",
                                  bounds=(0.0, 1.0))
    coupled: bool = coupled_param()

    def __post_init__(self):
        super().__post_init__()
        require(self.num_speculative_tokens >= 1,
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens} (a draft "
                "length of 0 drafts nothing: use method 'ar' for plain decoding)")
        require(self.max_speculative_tokens >= self.num_speculative_tokens,
                f"max_speculative_tokens ({self.max_speculative_tokens}) must be >= "
                f"num_speculative_tokens ({self.num_speculative_tokens})")
        require(self.controller in CONTROLLERS,
                f"unknown controller {self.controller!r}; known: {', '.join(CONTROLLERS)}")
        require(0.0 <= self.confidence_threshold <= 1.0,
                f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")
        require(0.0 < self.stop_threshold < 1.0,
                f"stop_threshold must be in (0, 1), got {self.stop_threshold}")


def _fixed(proposer: DraftModelProposer) -> Controller:
    n = proposer.config.num_speculative_tokens
    return Controller(n, n)


def _heuristic(proposer: DraftModelProposer) -> Controller:
    c = proposer.config
    return HeuristicLength(c.num_speculative_tokens, c.max_speculative_tokens)


def _confidence(proposer: DraftModelProposer) -> Controller:
    c = proposer.config
    return ConfidenceStop(c.confidence_threshold, c.max_speculative_tokens)


def _specdecpp(proposer: DraftModelProposer) -> Controller:
    c = proposer.config
    require(proposer.acceptance_head is not None,
            f"the specdecpp controller needs an acceptance head, and the draft "
            f"{proposer.draft_source} has none; train one with `specdecode train draft` (it "
            "trains the head after the draft), or pick another controller")
    return SpecDecPlusPlus(proposer.acceptance_head, c.stop_threshold, 2,
                           c.max_speculative_tokens)


#: controller name -> factory(proposer)
CONTROLLERS: dict[str, Callable[[DraftModelProposer], Controller]] = {
    "fixed": _fixed, "heuristic": _heuristic, "confidence": _confidence, "specdecpp": _specdecpp,
}


# ---- the proposer --------------------------------------------------------------------------


@register("draft_model", DraftModelConfig,
          paper="Speculative decoding (Leviathan et al., 2023; Chen et al., 2023); SpecDec++ "
                "(Huang et al., 2024); OSD-style distilled draft (Liu et al., 2023)",
          summary="a small draft LM samples a chain from its own KV cache; length controllers "
                  "fixed / heuristic / confidence / specdecpp")
class DraftModelProposer(CoupledDrafts, Proposer):
    def __init__(self, config: DraftModelConfig, runner: Runner,
                 draft_model: torch.nn.Module | None = None):
        """``draft_model``: a causal LM module to draft with instead of ``config.draft``."""
        super().__init__(config, runner)
        lm, loaded = open_draft(config, runner, draft_model)
        self.session = DraftSession(lm)
        self.acceptance_head = loaded.acceptance_head
        self.draft_source = loaded.source

    @property
    def lm(self):
        """The draft cache."""
        return self.session.lm

    def make_controller(self) -> Controller:
        return CONTROLLERS[self.config.controller](self)

    def start(self, prompt: Sequence[int]) -> None:
        self.session.start(prompt, self.sampling)

    def propose(self, context, budget):
        return self.session.chain(context, min(budget.max_depth, budget.max_nodes),
                                  budget.keep_drafting)

    def draft_seconds(self, context):
        return self.session.draft_seconds(context)

    def observe(self, feedback: Feedback) -> None:
        self.session.keep_accepted(feedback.accepted, feedback.draft)
