"""Sampled verification keeps the target's distribution exactly, and wrong rules are caught.

Hand-built target distributions p(. | output so far) and draft distributions q over V = 5
tokens (each misses a different token, so some drafted tokens must always be rejected and some
target tokens can only come from the residual). The harness plays the engine: it draws drafts
from q itself (so they really are random, as a proposer's), hands ``verify()`` the logits
log p for every node's own context, commits what comes back, and repeats until it has
``LENGTH`` tokens. The empirical distribution of those sequences is compared with the exactly
enumerated one by Pearson's chi-square test (cells with expected count < 5 pooled). At a fixed
seed the outcome is deterministic; for a random seed a correct verifier fails with probability
``ALPHA``. Each deliberately wrong rule fails the same test with a p-value below ``WRONG``.

The last tests run the real engine on a tiny random-weight Llama with a 6-token vocabulary and
sampling options set, with a proposer drafting random trees with probabilities, and compare the
distribution of the first three new tokens with the model's own, enumerated from its logits and
processed by ``transformers``' logits processors. docs/sampling.md lists the observed statistics.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import Counter
from functools import lru_cache

import pytest
import torch
from scipy.stats import chi2
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from specdecode.proposer import Proposer
import specdecode.verify as verify_module
from specdecode.draft import Draft
from specdecode.engine import Generation
from specdecode.models.base import NOTHING, ForwardOutput, Runner
from specdecode.sampling import NodeDistributions, SamplingParams, adjust_logits, sample
from specdecode.verify import VerifyResult, verify

from tiny_models import tiny_llama

#: false-alarm probability of each test on a correct verifier
ALPHA = 1e-3
#: a wrong rule must be rejected at least this strongly
WRONG = 1e-9
V = 5
LENGTH = 3
PROMPT = (2, 2, 0)
PLAIN = SamplingParams(temperature=1.0)
OPTIONS = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.15, repetition_penalty=1.5,
                         presence_penalty=0.3, frequency_penalty=0.4,
                         logit_bias={"1": 0.6, "3": -0.4})


# ---- hand-built distributions ------------------------------------------------------------

@lru_cache(maxsize=None)
def table(kind: str, prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed pseudo-random distribution [V] for each output prefix; p and q each give zero
    probability to a different token."""
    code = sum((t + 1) * (V + 1) ** i for i, t in enumerate(prefix))
    gen = torch.Generator().manual_seed(2 * code + (kind == "q"))
    weights = torch.rand(V, generator=gen, dtype=torch.float64) ** 2
    weights[(code + 2 * (kind == "q")) % V] = 0
    return weights / weights.sum()


@lru_cache(maxsize=None)
def target_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    return table("p", prefix).log().float()


def reference_probs(logits: torch.Tensor, prompt, prefix: tuple[int, ...],
                    params: SamplingParams) -> torch.Tensor:
    """The sampling distribution [V] after ``prompt + prefix`` given the raw next-token
    ``logits``, processed independently of specdecode: transformers' processors (its
    sequence bias for ``logit_bias``), OpenAI's presence/frequency penalties written out."""
    ids = torch.tensor([list(prompt) + list(prefix)])
    logits = logits[None].clone()
    if params.logit_bias:
        bias = {(token,): value for token, value in params.logit_bias}
        logits = SequenceBiasLogitsProcessor(bias)(ids, logits)
    if params.repetition_penalty != 1.0:
        logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, logits)
    for token, count in Counter(prefix).items():
        logits[0, token] -= params.frequency_penalty * count + params.presence_penalty
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    for warper in warpers:
        logits = warper(ids, logits)
    return logits[0].softmax(-1).double()


def enumerate_sequences(next_probs, length: int, vocab: int) -> dict[tuple[int, ...], float]:
    """Exact probability of every token sequence of ``length`` under ``next_probs(prefix)``."""
    out = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in out.items():
            probs = next_probs(prefix)
            for token in range(vocab):
                if probs[token] > 0:
                    grown[prefix + (token,)] = mass * float(probs[token])
        out = grown
    return out


# ---- the statistic --------------------------------------------------------------------------

def chi_square(counts: Counter, exact: dict, n: int) -> dict:
    """Pearson's chi-square goodness of fit; cells expected < 5 times are pooled into one
    (merged with the next smallest cell while the pool is itself below 5)."""
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0)) for s in set(counts) | set(exact))
    if any(exact.get(s, 0.0) == 0 for s in counts):
        return {"stat": math.inf, "df": 0, "p": 0.0, "tv": tv}
    cells = sorted(exact, key=exact.get)
    pooled_obs = pooled_exp = 0.0
    bins = []
    for s in cells:
        if n * exact[s] < 5 or pooled_exp < 5 and pooled_exp > 0:
            pooled_obs += counts.get(s, 0)
            pooled_exp += n * exact[s]
        else:
            bins.append((counts.get(s, 0), n * exact[s]))
    if pooled_exp > 0:
        bins.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    return {"stat": stat, "df": df, "p": float(chi2.sf(stat, df)), "tv": tv}


# ---- drafts, drawn from q as a proposer would ----------------------------------------------

def draw(q: torch.Tensor, rng: random.Random) -> int:
    """Inverse-CDF draw (torch.multinomial costs ~50x more per call at this size)."""
    cdf = list(itertools.accumulate(q.tolist()))
    return bisect.bisect_right(cdf, rng.random() * cdf[-1])


def chain(out, rng, depth=3, with_probs=True) -> Draft:
    tokens, rows, prefix = [], [], out
    for _ in range(depth):
        q = table("q", prefix)
        tokens.append(draw(q, rng))
        rows.append(q)
        prefix += (tokens[-1],)
    return Draft.chain(tokens, torch.stack(rows) if with_probs else None)


def tree(out, rng, widths=(3, 2), replacement=True, with_probs=True, record_iid=False) -> Draft:
    """``widths[d]`` children under every node of depth d, i.i.d. or without replacement;
    ``record_iid`` (wrong on purpose) records the full q even for draws without replacement."""
    tokens, parents, rows = [], [], []
    frontier = [(-1, out)]
    for width in widths:
        grown = []
        for parent, prefix in frontier:
            q = table("q", prefix)
            left = q.clone()
            for _ in range(width):
                qi = q if replacement else left / left.sum()
                token = draw(qi, rng)
                tokens.append(token)
                parents.append(parent)
                rows.append(q if record_iid else qi)
                left[token] = 0
                grown.append((len(tokens) - 1, prefix + (token,)))
        frontier = grown
    return Draft(tuple(tokens), tuple(parents), torch.stack(rows) if with_probs else None)


DRAFTS = {
    "chain with probs": lambda out, rng: chain(out, rng),
    "deterministic chain": lambda out, rng: chain(out, rng, with_probs=False),
    "deterministic tree": lambda out, rng: tree(out, rng, (2, 2), replacement=False,
                                                with_probs=False),
    "iid tree (SpecInfer)": lambda out, rng: tree(out, rng, (3, 2)),
    "without-replacement tree (RSD)": lambda out, rng: tree(out, rng, (3, 2), replacement=False),
}


def sample_sequences(make_draft, n, params=PLAIN, rule=verify, seed=0) -> Counter:
    """``n`` sequences of ``LENGTH`` tokens, each decoded step by step through ``rule``."""
    gen = torch.Generator().manual_seed(seed)
    draft_rng = random.Random(seed + 1)
    counts = Counter()
    start = len(PROMPT)
    for _ in range(n):
        context = list(PROMPT)
        while len(context) < start + LENGTH:
            out = tuple(context[start:])
            draft = make_draft(out, draft_rng)
            rows = [out] + [out + tuple(draft.tokens[j] for j in draft.path_to(i))
                            for i in range(len(draft))]
            logits = torch.stack([target_logits(r) for r in rows])
            context.extend(rule(draft, logits, params, context, start, gen).tokens)
        counts[tuple(context[start:start + LENGTH])] += 1
    return counts


def check(make_draft, n, params=PLAIN, rule=verify) -> dict:
    exact = enumerate_sequences(
        lambda prefix: reference_probs(target_logits(prefix), PROMPT, prefix, params), LENGTH, V)
    return chi_square(sample_sequences(make_draft, n, params, rule), exact, n)


# ---- correct rules pass ---------------------------------------------------------------------

@pytest.mark.parametrize("name", list(DRAFTS))
def test_verifier_keeps_the_target_distribution(name):
    result = check(DRAFTS[name], 1500)
    assert result["p"] > ALPHA, result


@pytest.mark.parametrize("name", ["deterministic tree", "iid tree (SpecInfer)"])
def test_sampling_options_keep_their_distribution(name):
    """Penalties (each node with its own path), temperature, top-k, top-p and min-p: the
    verifier's output matches plain decoding processed by transformers' processors."""
    result = check(DRAFTS[name], 800, OPTIONS)
    assert result["p"] > ALPHA, result


def test_the_chi_square_pooling_is_exact_on_exact_counts():
    exact = enumerate_sequences(lambda prefix: table("p", prefix), LENGTH, V)
    counts = Counter({s: round(1e6 * pr) for s, pr in exact.items()})
    result = chi_square(counts, exact, sum(counts.values()))
    assert result["p"] > 0.999 and result["tv"] < 1e-5


# ---- wrong rules fail the same test ---------------------------------------------------------

def typical_acceptance(draft, logits, params, context, prompt_len, generator,
                       threshold=0.09, alpha=0.3):
    """Medusa's typical acceptance (Cai et al., 2024, defaults 0.09 / 0.3): accept a drafted
    child when the target gives it more than min(threshold, alpha * exp(-entropy)). Lossy."""
    nodes = NodeDistributions(logits, params, context, prompt_len, draft)
    accepted, node = [], -1
    while True:
        p = nodes.probs(node + 1)
        entropy = float(-(p * p.clamp_min(1e-30).log()).sum())
        bar = min(threshold, alpha * math.exp(-entropy))
        child = next((c for c in draft.children(node) if p[draft.tokens[c]] > bar), None)
        if child is None:
            tokens = [draft.tokens[i] for i in accepted] + [sample(p, generator)]
            return VerifyResult(tuple(accepted), tuple(tokens))
        accepted.append(child)
        node = child


def _penalised_without_path(self, row):
    """Wrong: a draft node penalised with the committed context only, not its own path."""
    return adjust_logits(self.logits[row].float(), self.params, self.seen, self.counts)


WRONG_RULES = {
    "accept with p(x), not min(1, p/q)": (
        "chain with probs", PLAIN,
        [(verify_module, "accepts", lambda p_x, q_x, gen: verify_module.uniform(gen) < p_x)]),
    "no residual update (chain)": (
        "chain with probs", PLAIN, [(verify_module, "residual", lambda p, q: p)]),
    "no residual update (iid tree)": (
        "iid tree (SpecInfer)", PLAIN, [(verify_module, "residual", lambda p, q: p)]),
    "Medusa typical acceptance": ("deterministic tree", PLAIN, "typical"),
    "penalties without the node's path": (
        "deterministic tree", OPTIONS, [(NodeDistributions, "penalised", _penalised_without_path)]),
}


@pytest.mark.parametrize("name", list(WRONG_RULES))
def test_wrong_rules_fail(monkeypatch, name):
    draft_name, params, patch = WRONG_RULES[name]
    rule = verify
    if patch == "typical":
        rule = typical_acceptance
    else:
        for owner, attr, value in patch:
            monkeypatch.setattr(owner, attr, value)
    result = check(DRAFTS[draft_name], 600, params, rule)
    assert result["p"] < WRONG, result


def test_without_replacement_siblings_recorded_as_iid_fail():
    """RSD's siblings must record q minus the earlier siblings; recording the full q is wrong."""
    result = check(lambda out, rng: tree(out, rng, (3, 2), replacement=False, record_iid=True), 600)
    assert result["p"] < WRONG, result


# ---- the real engine on a tiny model ----------------------------------------------------------

class TableRunner(Runner):
    """The tiny model behind the runner protocol, every row looked up in a table of its logits
    after each continuation of ``prompt`` up to ``depth`` tokens, filled by one batched forward
    over all of them: exact and batch-invariant by construction, and fast enough to decode
    thousands of short requests. :func:`test_hf_runner_matches_the_table` holds the HF runner's
    tree forwards to the same logits."""

    name = "table"

    def __init__(self, model, prompt, depth):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_context = model.config.max_position_embeddings
        self.num_layers = model.config.num_hidden_layers
        grid = torch.cartesian_prod(*[torch.arange(self.vocab_size)] * depth)  # [V^depth, depth]
        ids = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], 1)
        with torch.no_grad():
            logits = model(ids).logits.float()  # [V^depth, P + depth, V]
        self.table = {}
        for row, seq in zip(logits, ids.tolist()):
            for j in range(len(prompt) - 1, len(seq)):
                self.table.setdefault(tuple(seq[:j + 1]), row[j])
        self.committed: list[int] = []
        self.pending: list[list[int]] = []

    def prefill(self, ids, needs=NOTHING):
        self.committed = list(ids)
        return ForwardOutput(self.table[tuple(ids)][None])

    def forward(self, root, draft, needs=NOTHING):
        self.pending = [[root]] + [[root] + [draft.tokens[j] for j in draft.path_to(i)]
                                   for i in range(len(draft))]
        return ForwardOutput(torch.stack([self.table[tuple(self.committed + path)]
                                          for path in self.pending]))

    def commit(self, accepted):
        self.committed += self.pending[accepted[-1] + 1 if accepted else 0]
        self.pending = []

    @property
    def cache_len(self):
        return len(self.committed)

    @property
    def pending_rows(self):
        return len(self.pending)


class RandomTreeProposer(Proposer):
    """Drafts a random tree (two i.i.d. children at depth 1, one under each at depth 2) from a
    fixed q per context, with probs: a stand-in for a draft model."""

    def __init__(self, runner, seed=0):
        super().__init__(None, runner)
        self.rng = random.Random(seed)

    def q(self, context):
        code = hash(tuple(context)) & 0xFFFF
        weights = torch.rand(self.runner.vocab_size, generator=torch.Generator().manual_seed(code))
        return (weights ** 2 / (weights ** 2).sum()).double()

    def propose(self, context, budget):
        tokens, parents, rows = [], [], []
        for _ in range(2):
            q = self.q(context)
            tokens.append(draw(q, self.rng))
            parents.append(-1)
            rows.append(q)
        if budget.max_depth >= 2:
            for parent in (0, 1):
                q = self.q(list(context) + [tokens[parent]])
                tokens.append(draw(q, self.rng))
                parents.append(parent)
                rows.append(q)
        return Draft(tuple(tokens), tuple(parents), torch.stack(rows))


ENGINE_VOCAB = 6
ENGINE_PROMPT = [1, 4, 4, 3]
ENGINE_OPTIONS = SamplingParams(temperature=0.9, top_k=4, top_p=0.95, repetition_penalty=1.3,
                                presence_penalty=0.2, frequency_penalty=0.3,
                                logit_bias={"2": 0.8, "5": -0.6})
#: new tokens per request: the prefill's token, then one step with a tree of depth 2
ENGINE_NEW = 4


@pytest.fixture(scope="module")
def engine_runner():
    model = tiny_llama(vocab_size=ENGINE_VOCAB, hidden_size=16, layers=1, heads=2, kv_heads=1,
                       seed=3)
    # deepest row: 3 new tokens (the first step's root and a depth-2 draft; later steps are
    # capped by the tokens left)
    return TableRunner(model, ENGINE_PROMPT, ENGINE_NEW - 1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), ENGINE_OPTIONS],
                         ids=["plain", "options"])
def test_engine_with_random_probability_trees(engine_runner, params):
    """The distribution of new tokens 2..4 (those the speculative steps produce)."""
    n = 1200
    proposer = RandomTreeProposer(engine_runner)
    counts = Counter()
    accepted = 0
    for i in range(n):
        gen = Generation(engine_runner, proposer, ENGINE_PROMPT, ENGINE_NEW,
                         SamplingParams(**{**vars(params), "seed": i}))
        counts[tuple(gen.run()[1:])] += 1
        accepted += gen.stats.accepted_tokens
    exact = enumerate_sequences(
        lambda prefix: reference_probs(engine_runner.table[tuple(ENGINE_PROMPT) + prefix],
                                       ENGINE_PROMPT, prefix, params), ENGINE_NEW, ENGINE_VOCAB)
    marginal = Counter()
    for seq, mass in exact.items():
        marginal[seq[1:]] += mass
    result = chi_square(counts, dict(marginal), n)
    assert result["p"] > ALPHA, result
    assert accepted > n // 4  # the drafts were really used, not all rejected


def test_hf_runner_matches_the_table(engine_runner):
    from specdecode.models.hf import HFRunner

    hf = HFRunner(engine_runner.model)
    hf.prefill(ENGINE_PROMPT)
    draft = Draft((0, 5, 2, 3), (-1, -1, 0, 1))
    got = hf.forward(1, draft).logits
    engine_runner.prefill(ENGINE_PROMPT)
    torch.testing.assert_close(got, engine_runner.forward(1, draft).logits, atol=1e-5, rtol=1e-5)
