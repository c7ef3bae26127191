"""HierSpec: a three-level hierarchy - a cheap proposer drafts a tree, the target's int4 copy
verifies the tree and turns it into a chain, the precise target verifies the chain (Zhang et
al., 2025, "Speculative Decoding Meets Quantization: Compatibility Evaluation and Hierarchical
Framework Design", arXiv 2505.22179; reference code AI9Stars/SpecMQuant).

The paper's finding: a large draft tree costs a quantised-weight target much more to verify
than one token, so the expensive model should verify a *chain*, and a cheaper intermediate
model should absorb the tree. Here the levels are:

1. the inner proposer (``proposer``, default ``suffix``; any model-free method) drafts a tree
   of up to ``tree_nodes`` nodes from the committed context;
2. the int4 copy (:func:`specdecode.proposers.quantized.int4_copy`, its own KV cache) reads the
   whole tree in one forward and verifies it with the ordinary verifier
   (:func:`specdecode.verify.verify`) as if it were the target: greedy, its argmax decides;
   sampled, it samples each token from its own processed distribution q. The accepted path and
   its bonus/recovered token start the chain;
3. where the chain is still shorter than the controller allows, the int4 copy extends it token
   by token (``quantized``'s drafting), until the length controller stops it.

The precise target then verifies the chain. Every chain token was drawn from the int4 copy's
distribution given the tokens before it (step 2 is ancestral sampling from q along the tree,
step 3 draws from q directly), and that q is recorded in ``Draft.probs``, so speculative
sampling keeps the target's distribution exactly; greedy, the output is the target's ``ar``.

Unlike the paper, the cheap proposer drafts once per target step: a model-free proposer learns
from the contexts it is handed, so it must only see committed tokens (the paper's EAGLE head
drafts again after each intermediate verify). The inner proposer sees the precise target's
feedback as its own. Measurements: docs/quantized.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode import registry
from specdecode.control import Budget, Controller, DraftSignal
from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.models.base import NOTHING, Runner
from specdecode.proposer import Feedback, Proposer
from specdecode.proposers.quantized import CONTROLLERS, QuantizedConfig, int4_session
from specdecode.registry import param, register
from specdecode.sampling import NodeDistributions
from specdecode.verify import verify


@dataclass(frozen=True)
class HierSpecConfig(QuantizedConfig):
    proposer: str = param("suffix", "the cheap tree proposer of level 1 (a model-free method: "
                                    "suffix, ngram, recycling, lookahead...)")
    tree_nodes: int = param(24, "most nodes of the cheap tree the int4 copy verifies in one "
                                "forward (the paper's 70B script: 30)", bounds=(1, 128))

    def __post_init__(self):
        super().__post_init__()
        require(self.tree_nodes >= 1, f"tree_nodes must be >= 1, got {self.tree_nodes}")


@register("hierspec", HierSpecConfig,
          paper="HierSpec (Zhang et al., 2025, arXiv 2505.22179)",
          summary="a cheap proposer's tree, verified by the target's int4 copy into a chain that "
                  "the fp32/bf16 target verifies (--weights fp32)")
class HierSpecProposer(Proposer):
    def __init__(self, config: HierSpecConfig, runner: Runner):
        super().__init__(config, runner)
        require(config.proposer not in ("hierspec", "quantized", "ar"),
                f"hierspec's level-1 proposer must be a cheap model-free method, not "
                f"{config.proposer!r}")
        method = registry.get(config.proposer)
        self.inner: Proposer = method.proposer(method.make_config(), runner)
        require(self.inner.needs == NOTHING,
                f"hierspec's level-1 proposer {config.proposer!r} reads the target's features; "
                "pick a model-free one (suffix, ngram, recycling, lookahead)")
        self.session = int4_session(runner)
        # the last chain: how many of its first tokens the int4 cache holds as committed, and
        # how many more it holds as tree rows (extended token by token)
        self._committed = 0
        self._rows = 0

    def make_controller(self) -> Controller:
        return CONTROLLERS[self.config.controller](self.config)

    def set_sampling(self, sampling) -> None:
        super().set_sampling(sampling)
        self.inner.set_sampling(sampling)

    def start(self, prompt: Sequence[int]) -> None:
        self.session.start(prompt, self.sampling)
        self.inner.start(prompt)

    def propose(self, context, budget):
        limit = min(budget.max_depth, budget.max_nodes)
        self._committed = self._rows = 0
        if limit <= 0:
            return Draft.empty()
        lm, sampling = self.session.lm, self.sampling
        root, root_hidden = lm.catch_up(context)
        # level 1 -> level 2: the cheap tree, read by the int4 copy in one forward and verified
        nodes = self.config.tree_nodes
        tree = self.inner.propose(context, Budget(limit, nodes)).truncated(limit, nodes)
        logits, hidden = root[None], root_hidden[None]
        if len(tree):
            node_logits, node_hidden = lm.feed(tree.tokens, tree.parents)
            logits, hidden = torch.cat([logits, node_logits]), torch.cat([hidden, node_hidden])
        result = verify(tree, logits, sampling, context, self.session.prompt_len,
                        self.session.generator)
        lm.prune(result.accepted)
        self._committed = len(result.accepted)
        rows = [0] + [1 + i for i in result.accepted]  # the row each chain token was drawn at
        dists = NodeDistributions(logits, sampling, context, self.session.prompt_len, tree)
        chain: list[int] = []
        probs: list[torch.Tensor] = []
        stop = budget.keep_drafting
        for token, row in zip(result.tokens, rows):
            chain.append(token)
            q = None if sampling.greedy else dists.probs(row)
            if q is not None:
                probs.append(q)
            confidence = float((logits[row].softmax(-1) if q is None else q)[token])
            if len(chain) == limit or (stop is not None and not stop(
                    DraftSignal(len(chain), confidence, hidden[row]))):
                return self._draft(chain, probs)
        # level 2 alone: the int4 copy extends the chain token by token
        path = list(context) + chain
        while len(chain) < limit:
            step_logits, step_hidden = lm.feed([chain[-1]], [self._rows - 1])
            self._rows += 1
            token, q, confidence = self.session.draw(step_logits[0], path)
            chain.append(token)
            path.append(token)
            if q is not None:
                probs.append(q)
            if stop is not None and not stop(DraftSignal(len(chain), confidence, step_hidden[0])):
                break
        return self._draft(chain, probs)

    @staticmethod
    def _draft(chain: list[int], probs: list[torch.Tensor]) -> Draft:
        return Draft.chain(chain, torch.stack(probs) if probs else None)

    def observe(self, feedback: Feedback) -> None:
        self.inner.observe(feedback)
        # chain token i (i >= committed) sits on tree row i - committed: keep the accepted ones
        accepted = len(feedback.accepted)
        self.session.lm.prune(list(range(max(0, min(accepted - self._committed, self._rows)))))
        self._committed = self._rows = 0

    def finish(self, output: Sequence[int]) -> None:
        self.inner.finish(output)
