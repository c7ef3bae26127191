"""Verification: which draft tokens the target accepts, and the one token it adds.

Words used everywhere (metrics, docs): after one target forward over a draft,

- **accepted** tokens are draft tokens on one root-to-leaf path that the rule keeps;
- a **bonus** token is sampled from the target after the last accepted node when the walk
  reaches a leaf (every draft token on the path accepted);
- a **recovered** token is sampled from the (residual) target distribution where the walk stops
  at a node whose drafted children were all rejected.

Each step therefore commits ``len(accepted) + 1`` tokens. The rule is chosen by what the draft
carries; the verifier knows nothing of how the draft was made:

- greedy (temperature 0): descend into the child equal to the target's argmax, chain or tree;
- sampled, deterministic draft (``probs is None``): sample from the target at each node and
  descend into the child holding the sampled token; stop where none does. This is plain
  ancestral sampling, so a seeded run gives the same tokens as ``ar`` whatever was drafted;
- sampled, draft with proposer probabilities: recursive rejection sampling over the siblings of
  each node (SpecInfer, Miao et al. 2023; RSD, Jeon et al. 2024). Sibling i was drawn from
  ``q_i = probs[i]``; accept it with probability min(1, p_i(x_i) / q_i(x_i)), else move to
  ``p_{i+1} = norm(max(0, p_i - q_i))``. With one child per node this is speculative sampling
  (Leviathan et al. 2023; Chen et al. 2023). With i.i.d. siblings (SpecInfer) every q_i is the
  same q; with siblings drawn without replacement (RSD) q_i excludes the earlier siblings - the
  proposer records whichever it used, and the same rule is exact for both.
- sampled, i.i.d. siblings marked ``sibling_rule="spectr"``: SpecTr's k-sequential selection
  K-SEQ (Sun et al., NeurIPS 2023, "SpecTr: Fast Speculative Decoding via Optimal Transport",
  Algorithm 2), a (1 - 1/e)-optimal transport plan for k i.i.d. drafts from q. With
  ``beta(g) = sum_x min(q(x), p(x) / g)``, candidate i is accepted with probability
  min(1, p(x_i) / (g q(x_i))), the first accepted wins; if none is, the token is drawn from
  ``p_res ∝ p - min(q, p / g) (1 - (1 - beta)^k) / beta``. ``g`` in [1, k] is the smallest
  value keeping ``p_res >= 0`` (bisection; g = k always does). k = 1, g = 1 is speculative
  sampling. The candidates at a level are the children of *every* node holding the accepted
  prefix (SpecTr's sequences consistent with it: given that prefix, their next tokens are
  i.i.d. draws from q), so k separate i.i.d. chains are verified as SpecTr verifies k sequences.

Exactness of the last rule needs exactly this of the proposer: given everything drafted before
it (its ancestors and its earlier siblings), node i's token was drawn from ``probs[i]``. So i.i.d.
siblings must be kept as separate nodes even when two draw the same token (merging them skips a
residual update), and a without-replacement sibling records q renormalised over the tokens its
earlier siblings did not take. The tests sample every rule against exactly enumerated target
distributions, and show that wrong rules (accepting with p(x), skipping the residual update,
recording i.i.d. q for without-replacement siblings, Medusa's typical acceptance) fail them.

A constraint (grammar, banned outputs) masks every node's target distribution with that node's
own path's allowed tokens before any rule runs (:class:`~specdecode.sampling.NodeDistributions`),
so each rule is exact for the constrained distribution plain decoding samples from.

Random numbers: the deterministic walk draws one uniform per committed token, as ``ar`` does,
whatever was drafted. The rejection rule draws one for each sibling whose test is uncertain
(0 < p(x) < q(x)) and one for the bonus/recovered token; so a draft whose tokens the target
never produces, and whose q lies off the target's support, leaves the tokens of ``ar`` unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdecode.constraints import Constraint
from specdecode.draft import Draft
from specdecode.sampling import NodeDistributions, SamplingParams, sample, uniform


@dataclass(frozen=True)
class VerifyResult:
    #: accepted draft node indices, root to leaf
    accepted: tuple[int, ...]
    #: committed tokens: the accepted draft tokens then the bonus or recovered token
    tokens: tuple[int, ...]
    #: the target's processed distributions the tokens came from (log-probabilities are read
    #: from its rows: row 0, then 1 + each accepted node)
    target: NodeDistributions | None = field(default=None, compare=False, repr=False)

    @property
    def rows(self) -> list[int]:
        """The logits row each committed token was chosen at."""
        return [0] + [1 + i for i in self.accepted]


def verify(draft: Draft, logits: torch.Tensor, params: SamplingParams, context: Sequence[int],
           prompt_len: int, generator: torch.Generator,
           constraint: Constraint | None = None) -> VerifyResult:
    """Verify ``draft`` against target ``logits`` [1 + n, V] (row 0 = after the root).

    ``context`` is the committed tokens, ending with the root; the first ``prompt_len`` are the
    prompt (penalties treat prompt and output differently). ``constraint`` masks each node's
    distribution with its own path's allowed tokens.
    """
    target = NodeDistributions(logits, params, context, prompt_len, draft, constraint)
    if params.greedy:
        result = _walk(draft, target.argmax)
    elif draft.probs is None or len(draft) == 0:
        result = _walk(draft, lambda row: sample(target.probs(row), generator))
    else:
        if draft.probs.shape[-1] != logits.shape[-1]:
            raise ValueError(f"draft probs cover {draft.probs.shape[-1]} tokens but the target's "
                             f"vocabulary has {logits.shape[-1]}; give q over the target's "
                             "vocabulary")
        if draft.sibling_rule == "spectr":
            result = _k_sequential(draft, target, generator)
        else:
            result = _recursive_rejection(draft, target, generator)
    return VerifyResult(result.accepted, result.tokens, target)


def _walk(draft: Draft, choose) -> VerifyResult:
    """Descend from the root into the child holding ``choose(row)`` until none does."""
    accepted: list[int] = []
    tokens: list[int] = []
    node = -1
    while True:
        token = choose(node + 1)
        tokens.append(token)
        child = next((c for c in draft.children(node) if draft.tokens[c] == token), None)
        if child is None:
            return VerifyResult(tuple(accepted), tuple(tokens))
        accepted.append(child)
        node = child


def accepts(p_x: float, q_x: float, generator: torch.Generator) -> bool:
    """Speculative sampling's test: accept x ~ q with probability min(1, p(x) / q(x)). A uniform
    is drawn only when the outcome is uncertain, so a draft token the target never produces
    (p(x) = 0) costs no random number."""
    if p_x >= q_x:
        return True
    if p_x <= 0:
        return False
    return uniform(generator) * q_x < p_x


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to sample from after rejecting a draw from q: norm(max(0, p - q))."""
    rest = (p - q).clamp_min(0)
    total = rest.sum()
    # p == q up to rounding: nothing is left, and a rejection had probability ~0
    return rest / total if total > 0 else p


def _recursive_rejection(draft: Draft, target: NodeDistributions,
                         generator: torch.Generator) -> VerifyResult:
    accepted: list[int] = []
    node = -1
    while True:
        p = target.probs(node + 1).double()
        for child in draft.children(node):
            q = draft.probs[child].double()
            token = draft.tokens[child]
            if q[token] <= 0:
                raise ValueError(
                    f"draft node {child} holds token {token} with zero proposer probability; "
                    "probs[i] must be the distribution tokens[i] was drawn from"
                )
            if accepts(float(p[token]), float(q[token]), generator):
                accepted.append(child)
                node = child
                break
            p = residual(p, q)
        else:
            tokens = [draft.tokens[i] for i in accepted]
            tokens.append(sample(p, generator))
            return VerifyResult(tuple(accepted), tuple(tokens))


#: bisection steps for SpecTr's gamma (the interval [1, k] shrinks below 1e-6 of k)
GAMMA_STEPS = 24


def kseq_gamma(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    """SpecTr's smallest feasible gamma in [1, k] for k i.i.d. drafts from ``q`` against ``p``
    (float64 [V]), and the accepted mass per token ``min(q, p / gamma) * (1 - (1 - beta)^k) /
    beta`` it gives. Bisection only ever moves the upper end to a feasible value, so the result
    is feasible (p_res >= 0) even where feasibility is not monotone in gamma."""

    def accepted_mass(gamma: float) -> torch.Tensor:
        part = torch.minimum(q, p / gamma)
        beta = float(part.sum())
        if beta <= 0:
            return part  # q and p are disjoint: nothing can be accepted
        return part * ((1 - (1 - beta) ** k) / beta)

    def feasible(gamma: float) -> bool:
        return bool((p - accepted_mass(gamma) >= -1e-12).all())

    lo, hi = 1.0, float(k)
    if feasible(lo):
        return lo, accepted_mass(lo)
    for _ in range(GAMMA_STEPS):
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi, accepted_mass(hi)


def _k_sequential(draft: Draft, target: NodeDistributions,
                  generator: torch.Generator) -> VerifyResult:
    accepted_tokens: list[int] = []
    holders, last = [-1], -1  # the nodes holding the accepted prefix; the one whose path is kept
    while True:
        p = target.probs(last + 1).double()
        candidates = [c for node in holders for c in draft.children(node)]
        if not candidates:
            break
        q = draft.probs[candidates[0]].double()
        for c in candidates[1:]:
            if not torch.equal(draft.probs[c], draft.probs[candidates[0]]):
                raise ValueError(f"draft nodes {candidates[0]} and {c} hold the same prefix's "
                                 "next token with different q; SpecTr's rule needs i.i.d. "
                                 "siblings (use sibling_rule='recursive' for others)")
        gamma, mass = kseq_gamma(p, q, len(candidates))
        chosen = None
        for c in candidates:
            token = draft.tokens[c]
            if q[token] <= 0:
                raise ValueError(f"draft node {c} holds token {token} with zero proposer "
                                 "probability; probs[i] must be the distribution tokens[i] was "
                                 "drawn from")
            if accepts(float(p[token]) / gamma, float(q[token]), generator):
                chosen = c
                break
        if chosen is None:
            p = residual(p, mass)
            break
        token = draft.tokens[chosen]
        accepted_tokens.append(token)
        holders = [c for c in candidates if draft.tokens[c] == token]
        last = chosen
    # every holder of the accepted prefix has the same tokens at the same positions, so the
    # last accepted node's path commits the same cache rows as any other
    path = tuple(draft.path_to(last)) if last >= 0 else ()
    return VerifyResult(path, tuple(accepted_tokens) + (sample(p, generator),))
