"""A draft cache with what a drafting proposer keeps between its steps: the request's sampling,
a random generator of its own, and the last draft's nodes, so that :meth:`keep_accepted` keeps
the draft's KV rows of the accepted tokens it computed itself (nothing accepted is computed
twice).

Sampled drafting draws each token from the draft distribution processed exactly like the
target's (penalties, temperature, top-k, top-p, min-p, each node with its own context) and
records that distribution in ``Draft.probs``, so the verifier's rejection rule keeps the
target's distribution. The draws come from the session's generator, seeded from the request
seed plus ``DRAFT_SEED_OFFSET``: seeded runs repeat, and drafting never reuses the verifier's
uniforms.

Coupled drafts (:meth:`DraftSession.couple`; the ``coupled`` setting of ``draft_model``,
``dyspec`` and the head methods, and of ``auto``'s parts) do the opposite: a chain's token at
depth k, and in a tree each node's first child at depth k, is drawn with the uniform the
verifier's generator will draw k-th from now (a copy of its state; ``sample`` is an
inverse-CDF draw in token order, one uniform a token, as the verifier's walk draws one a
committed token); a tree's other siblings are drawn apart, from the session's generator, as
other guesses; and the draft goes without probabilities. The verifier's deterministic walk
then commits ``ar``'s own tokens whatever was drafted (a seeded answer is ``ar``'s), and a
drafted token is accepted where the draft's draw and the target's land on the same token: the
coupling of drafter-invariant speculative decoding (Daliri, Musco and Suresh, 2024, "Coupling
without Communication and Drafter-Invariant Speculative Decoding", arXiv 2408.07978, which
couples by Gumbel-max over shared noise; here by the inverse CDF ``ar`` already samples
with). On the peaked distributions of real models the two draws agree nearly as often as
min(1, p / q) accepts: over Qwen2.5-Coder-1.5B's own answers at T = 0.7 with its 0.5B as the
draft, 0.815 of positions against rejection sampling's 0.838, where a token drawn apart from
the verifier and sent without probabilities is accepted with p(x), 0.770
(scripts/coupling_agreement.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdecode.control import DraftSignal
from specdecode.draft import Draft
from specdecode.registry import param
from specdecode.sampling import (GREEDY, NodeDistributions, SamplingParams, filtered_probs,
                                 sample, uniform)


def coupled_param():
    """The ``coupled`` setting of the methods that draft through a :class:`DraftSession`."""
    return param(False, "T > 0: draw each drafted token (in a tree, each node's first child) "
                        "with the uniform the verifier will draw for its position and send the "
                        "draft without probabilities, so a seeded answer is ar's own (false: "
                        "rejection sampling with its probabilities)")


class CoupledDrafts:
    """``couple`` and ``samples_drafts`` for a proposer drafting through ``self.session``
    whose config has ``coupled``."""

    @property
    def samples_drafts(self) -> bool:
        """Coupled drafts carry no probabilities: any draft leaves a seeded answer ar's."""
        return not self.config.coupled

    def couple(self, generator: torch.Generator) -> None:
        if self.config.coupled:
            self.session.couple(generator)


#: added to the request seed for the draft's generator: its draws must not repeat the
#: verifier's uniforms (the same stream would correlate drafting and acceptance)
DRAFT_SEED_OFFSET = 0x5DEECE66D


class DraftSession:
    """``lm``: a draft cache (drafting/caches.py, heads/drafter.py)."""

    def __init__(self, lm):
        self.lm = lm
        self.sampling: SamplingParams = GREEDY
        self.generator = torch.Generator()
        self.prompt_len = 0
        #: whether this request's context has been read into the draft cache yet
        self.caught_up = False
        # the last draft: node tokens, parents, and each node's tree row (None: not fed)
        self.nodes: tuple[list[int], list[int], list[int | None]] = ([], [], [])
        #: how likely the best child of a node the drafter reads is to be the target's token,
        #: a running mean over the nodes read (drafting/tree.py values unread nodes by it)
        self.child_confidence = 1.0
        #: the verifier's generator where drafts are coupled to its uniforms (:meth:`couple`)
        self.verifier: torch.Generator | None = None
        #: the current draft's coupled uniforms: a copy of the verifier's generator and those
        #: drawn from it so far (depth 1 first); None where the draft is not coupled
        self._uniforms: tuple[torch.Generator, list[float]] | None = None

    def couple(self, generator: torch.Generator) -> None:
        """Draw this request's sampled drafts with the uniforms ``generator`` (the verifier's)
        draws next, and send them without probabilities (see the module docstring)."""
        self.verifier = generator

    def begin_draft(self) -> None:
        """A draft begins: where it is coupled (sampled, after :meth:`couple`), a copy of the
        verifier's generator as it stands, whose draws are the verifier's next uniforms."""
        self._uniforms = None
        if self.verifier is not None and not self.sampling.greedy:
            copy = torch.Generator()
            copy.set_state(self.verifier.get_state())  # the verifier's own stream is untouched
            self._uniforms = (copy, [])

    @property
    def coupled(self) -> bool:
        """Whether the current draft is coupled (and so goes without probabilities)."""
        return self._uniforms is not None

    def coupled_uniform(self, depth: int) -> float | None:
        """The uniform the verifier will draw for the token at ``depth`` (1: the root's child)
        of the current draft, or None where it is not coupled."""
        if self._uniforms is None:
            return None
        copy, drawn = self._uniforms
        while len(drawn) < depth:
            drawn.append(uniform(copy))
        return drawn[depth - 1]

    def start(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        """A request begins: its sampling options, and the generator seeded from its seed."""
        self.sampling = sampling
        self.prompt_len = len(prompt)
        self.caught_up = False
        # learned anew: a seeded request's tree shapes, which its draws follow, must not
        # depend on the requests before it
        self.child_confidence = 1.0
        if sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed((sampling.seed + DRAFT_SEED_OFFSET) % 2**63)

    def draft_seconds(self, context: Sequence[int]) -> tuple[float, float]:
        """As :meth:`specdecode.proposer.Proposer.draft_seconds`, for this draft cache. Until
        a seeded sampled request first catches up, its catch-up is priced as if the cache held
        nothing: what an earlier request left there (a shared system prompt, a server's slot
        history) must not size its drafts, which its random draws follow. After it, the cache
        holds what this request read, whatever it held before."""
        return self.lm.draft_seconds(context, cold=self.sampling.repeats and not self.caught_up)

    def catch_up(self, context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft cache's :meth:`~specdecode.drafting.caches.DraftCache.catch_up`."""
        self.caught_up = True
        return self.lm.catch_up(context)

    def node(self, logits: torch.Tensor, context: Sequence[int]) -> NodeDistributions:
        """The processed distributions of a node with shortlist logits [V'] whose committed
        context plus path is ``context``."""
        full = self.lm.full_logits(logits[None])
        return NodeDistributions(full, self.sampling, context, self.prompt_len, Draft.empty())

    def draw(self, logits: torch.Tensor, context: Sequence[int],
             u: float | None = None) -> tuple[int, torch.Tensor | None, float]:
        """One draft token from shortlist logits [V'] at a node whose committed context plus
        path is ``context``: (token, the distribution it was drawn from or None when greedy,
        the draft's probability of it). Sampled at the uniform ``u`` where given (a coupled
        draft's), else with the session's generator."""
        head_ids = getattr(self.lm, "head_ids", None)
        if self.sampling.greedy and not self.sampling.adjusts_logits and head_ids is not None:
            # the shortlist's argmax and probability: the vocabulary's other tokens have
            # probability 0 (no [V] logits, softmax and argmax per drafted token)
            probs = logits.float().softmax(-1)
            best = int(probs.argmax())
            return int(head_ids[best]), None, float(probs[best])
        shortlisted = None if self.sampling.greedy else self.shortlist_probs(logits)
        if shortlisted is not None:
            # shortlists ascend by id, so the one uniform picks the token the vocabulary's draw would
            small, q = shortlisted
            index = sample(small, self.generator, u)
            return int(head_ids[index]), q, float(small[index])
        node = self.node(logits, context)
        if self.sampling.greedy:
            token = node.argmax(0)
            return token, None, float(node.logits[0].softmax(-1)[token])
        q = node.probs(0)
        token = sample(q, self.generator, u)
        return token, q, float(q[token])

    def shortlist_probs(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """At T > 0 without penalties, for a drafter with a shortlist: the sampling distribution
        of shortlist logits [V'] over the shortlist and over the vocabulary [V]. The
        vocabulary's other tokens have probability 0, so temperature, top-k, top-p and min-p
        give the same distribution on the shortlist alone, at a sixth of the work. None where
        the vocabulary's processing is needed (penalties, a logit bias and the infill cut read
        token ids; no shortlist)."""
        head_ids = getattr(self.lm, "head_ids", None)
        if head_ids is None or self.sampling.reads_token_ids:
            return None
        small = filtered_probs(logits.float(), self.sampling)
        full = torch.zeros(self.lm.vocab_size, dtype=small.dtype).index_copy_(0, head_ids, small)
        return small, full

    def chain(self, context: Sequence[int], length: int,
              keep_drafting: Callable[[DraftSignal], bool] | None = None) -> Draft:
        """Up to ``length`` tokens after ``context``, each drawn from the draft's processed
        distribution at its own path, a draft forward a token; stops early where
        ``keep_drafting`` says so. :attr:`nodes` records the chain, so that
        :meth:`keep_accepted` keeps the draft's KV rows of its accepted tokens. Coupled
        (:meth:`couple`), a sampled chain is drawn with the verifier's next uniforms and has
        no probabilities."""
        lm = self.lm
        if length <= 0:
            self.nodes = ([], [], [])
            return Draft.empty()
        self.begin_draft()
        logits, hidden = self.catch_up(context)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        path = list(context)
        for depth in range(1, length + 1):
            token, q, confidence = self.draw(logits, path, self.coupled_uniform(depth))
            tokens.append(token)
            path.append(token)
            if q is not None and not self.coupled:
                probs.append(q)
            if depth == length or (keep_drafting is not None and not keep_drafting(
                    DraftSignal(depth, confidence, hidden))):
                break
            logits, hidden = lm.feed([token], [depth - 2])
            logits, hidden = logits[0], hidden[0]
        n = len(tokens)
        # every node but the last was fed to the draft: node i sits on tree row i
        self.nodes = (tokens, list(range(-1, n - 1)), list(range(n - 1)) + [None])
        return Draft.chain(tokens, torch.stack(probs) if probs else None)

    def chains(self, context: Sequence[int], length: int, k: int, rule: str,
               keep_drafting: Callable[[DraftSignal], bool] | None = None) -> Draft:
        """``k`` i.i.d. chains of up to ``length`` tokens, drafted in lockstep (one forward of
        k rows per depth), kept apart as SpecTr's k sequences: node ``d * k + j`` is chain j's
        token at depth d + 1. Stops early where ``keep_drafting`` says so for the most
        confident chain. ``rule``: the Draft's sibling rule."""
        lm = self.lm
        if length <= 0:
            self.nodes = ([], [], [])
            return Draft.empty()
        logits, hidden = self.catch_up(context)
        rows, hiddens = [logits] * k, [hidden] * k
        paths = [list(context) for _ in range(k)]
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[torch.Tensor] = []
        for depth in range(1, length + 1):
            confidence = 0.0
            for j in range(k):
                token, q, prob = self.draw(rows[j], paths[j])
                tokens.append(token)
                parents.append(-1 if depth == 1 else len(tokens) - 1 - k)
                probs.append(q)
                paths[j].append(token)
                confidence = max(confidence, prob)
            if depth == length or (keep_drafting is not None and not keep_drafting(
                    DraftSignal(depth, confidence, hiddens[0]))):
                break
            step, step_hidden = lm.feed(tokens[-k:], parents[-k:])
            rows, hiddens = list(step), list(step_hidden)
        fed = len(tokens) - k
        self.nodes = (tokens, parents, list(range(fed)) + [None] * k)
        return Draft(tuple(tokens), tuple(parents), torch.stack(probs), sibling_rule=rule)

    def keep_accepted(self, accepted: Sequence[int], draft: Draft) -> None:
        """Keep the draft's KV rows of the accepted tokens it computed itself. Matched by token
        along the path, so a draft the engine truncated still lines up."""
        tokens, parents, rows = self.nodes
        children: dict[int, dict[int, int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, {}).setdefault(tokens[i], i)
        node, path_rows = -1, []
        for index in accepted:
            node = children.get(node, {}).get(draft.tokens[index], -2)
            if node < 0 or rows[node] is None:
                break
            path_rows.append(rows[node])
        self.lm.prune(path_rows)
        self.nodes = ([], [], [])
