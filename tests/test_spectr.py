"""SpecTr's K-SEQ verifier keeps the target's distribution, and wrong variants are caught.

The harness of test_sampling_stats.py (hand-built p and q over 5 tokens, drafts drawn from q,
sequences compared with the exactly enumerated distribution by a chi-square test): K-SEQ on
i.i.d. sibling trees and on k separate i.i.d. chains (SpecTr's k sequences), with and without
sampling options; K-SEQ with gamma pinned to 1 (its residual goes negative and is clipped) and
with the residual of recursive rejection must fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import specdecode.verify as verify_module
from specdecode.draft import Draft
from specdecode.verify import kseq_gamma

from test_sampling_stats import ALPHA, OPTIONS, PLAIN, WRONG, check, draw, table, tree


def spectr(draft: Draft) -> Draft:
    return dataclasses.replace(draft, sibling_rule="spectr")


def sequences(out, rng, k=3, depth=3) -> Draft:
    """``k`` i.i.d. chains from q, kept apart (SpecTr's k draft sequences)."""
    tokens, parents, rows = [], [], []
    for _ in range(k):
        parent, prefix = -1, out
        for _ in range(depth):
            q = table("q", prefix)
            tokens.append(draw(q, rng))
            parents.append(parent)
            rows.append(q)
            parent, prefix = len(tokens) - 1, prefix + (tokens[-1],)
    return spectr(Draft(tuple(tokens), tuple(parents), torch.stack(rows)))


DRAFTS = {
    "iid tree": lambda out, rng: spectr(tree(out, rng, (3, 2))),
    "iid sequences": sequences,
    "one chain (k=1: speculative sampling)": lambda out, rng: sequences(out, rng, k=1),
}


@pytest.mark.parametrize("name", list(DRAFTS))
def test_kseq_keeps_the_target_distribution(name):
    result = check(DRAFTS[name], 1500)
    assert result["p"] > ALPHA, result


def test_kseq_keeps_the_distribution_under_sampling_options():
    result = check(DRAFTS["iid sequences"], 800, OPTIONS)
    assert result["p"] > ALPHA, result


def _gamma_one(p, q, k):
    """Wrong: gamma pinned to 1, the residual's negative part clipped."""
    part = torch.minimum(q, p)
    beta = float(part.sum())
    return 1.0, part * ((1 - (1 - beta) ** k) / beta)


def _one_chance(p, q, k):
    """Wrong: the right gamma, but the residual removes the accepted mass of one draft, not of
    k chances (no (1 - (1 - beta)^k) / beta factor)."""
    gamma, _ = kseq_gamma(p, q, k)
    return gamma, torch.minimum(q, p / gamma)


WRONG_RULES = {"gamma pinned to 1": _gamma_one, "one chance's residual": _one_chance}


@pytest.mark.parametrize("name", list(WRONG_RULES))
def test_wrong_rules_fail(monkeypatch, name):
    monkeypatch.setattr(verify_module, "kseq_gamma", WRONG_RULES[name])
    result = check(DRAFTS["iid sequences"], 1500, PLAIN)
    assert result["p"] < WRONG, result


def test_gamma_is_feasible_and_one_for_a_single_draft():
    gen = torch.Generator().manual_seed(0)
    for k in (1, 2, 4, 8):
        p = torch.rand(7, generator=gen, dtype=torch.float64) ** 3
        q = torch.rand(7, generator=gen, dtype=torch.float64) ** 3
        p, q = p / p.sum(), q / q.sum()
        gamma, mass = kseq_gamma(p, q, k)
        assert 1.0 <= gamma <= k and bool((p - mass >= -1e-12).all())
        if k == 1:  # speculative sampling: accepted mass min(p, q)
            assert gamma == 1.0 and torch.allclose(mass, torch.minimum(p, q))


def test_siblings_with_different_q_are_refused():
    q1, q2 = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.2, 0.8, 0.0])
    draft = Draft((0, 1), (-1, -1), torch.stack([q1, q2]), sibling_rule="spectr")
    with pytest.raises(ValueError, match="i.i.d."):
        verify_module.verify(draft, torch.zeros(3, 3), PLAIN, [0], 1, torch.Generator())
