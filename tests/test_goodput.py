"""Goodput draft budgets (server/goodput.py): the row-cost curve, acceptance estimates, and the
allocation that keeps speculation only where it is expected to pay."""

import itertools

import pytest

from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.estimates import Acceptance, RowCosts
from specdecode.server.goodput import Batching
from specdecode.sizing import EXPLORE_EVERY, EXPLORE_NODES, Candidate, allocate, explore_cap


def goodput(candidates, costs, fixed_rows, caps, overhead_s=0.0):
    gain = len(candidates) + sum(sum(ch for ch, _ in c.levels[:d]) for c, (d, _) in zip(candidates, caps))
    rows = fixed_rows + sum(sum(w for _, w in c.levels[:d]) for c, (d, _) in zip(candidates, caps))
    spent = overhead_s + sum(c.draft_s for c, (d, _) in zip(candidates, caps) if d)
    return gain / (costs(rows) + spent)


def test_row_costs_interpolate_and_extrapolate():
    costs = RowCosts({1: 2.0, 8: 3.4, 16: 5.0})
    assert costs(1) == 2.0 and costs(0.5) == 2.0
    assert costs(4.5) == pytest.approx(2.7)
    assert costs(16) == pytest.approx(5.0)
    assert costs(32) == pytest.approx(8.2)  # the last segment's slope, 0.2 a row
    with pytest.raises(SpecDecodeError, match="two or more points"):
        RowCosts({1: 2.0})
    with pytest.raises(SpecDecodeError, match="positive"):
        RowCosts({1: 2.0, 4: -1.0})


def test_acceptance_counts_by_depth():
    acc = Acceptance()
    acc.observe(Draft.chain([5, 6, 7]), accepted=2)
    assert acc.offered == [1, 1, 1] and acc.reached == [1, 1, 0] and acc.rows == [1, 1, 1]
    tree = Draft.from_paths([[5, 6], [5, 9], [8]])  # depth 1: 5, 8; depth 2: 6, 9
    acc.observe(tree, accepted=0)
    assert acc.offered == pytest.approx([1.98, 1.98, 0.98])
    assert acc.reached == pytest.approx([0.98, 0.98, 0.0])
    assert acc.rows == pytest.approx([2.98, 2.98, 0.98])


def test_levels_never_rise_with_depth_and_lean_on_the_prior():
    seq, method = Acceptance(), Acceptance()
    for _ in range(50):
        method.observe(Draft.chain([1, 2, 3, 4]), accepted=3)
    seq.observe(Draft.chain([1, 2, 3, 4]), accepted=0)
    levels = seq.levels(6, method)
    chances = [chance for chance, _ in levels]
    assert chances == sorted(chances, reverse=True)
    assert 0.5 < chances[0] < 1.0  # one miss of its own against the method's record
    assert chances[3] < 0.2  # the method never accepts depth 4
    assert [w for _, w in levels][:4] == pytest.approx([1.0] * 4)


def test_one_sequence_with_cheap_rows_drafts_deep():
    costs = RowCosts({1: 1.0, 16: 1.1, 64: 2.0})
    cand = Candidate([(0.9, 1.0), (0.8, 1.0), (0.7, 1.0), (0.6, 1.0)])
    assert allocate([cand], costs, fixed_rows=1) == [(4, 4)]


def test_a_full_batch_on_linear_costs_drafts_nothing():
    """Every row costs as much as a whole step: a draft row must commit a whole token to pay,
    which no draft does, so the step is plain autoregressive decoding."""
    costs = RowCosts({1: 1.0, 2: 2.0})
    cands = [Candidate([(0.9, 1.0), (0.8, 1.0)])] * 16
    assert allocate(cands, costs, fixed_rows=16) == [(0, 0)] * 16


def test_drafts_shrink_as_the_batch_grows():
    costs = RowCosts({1: 2.2, 8: 3.3, 16: 4.0, 64: 12.0, 256: 45.0})
    cand = Candidate([(0.7, 1.0), (0.5, 1.0), (0.35, 1.0), (0.25, 1.0), (0.15, 1.0)])
    rows = []
    for batch in (1, 4, 16, 64):
        caps = allocate([cand] * batch, costs, fixed_rows=batch)
        rows.append(sum(r for _, r in caps) / batch)
    assert rows == sorted(rows, reverse=True) and rows[0] > rows[-1]
    assert rows[0] >= 3 and rows[-1] <= 1


def test_expensive_drafting_is_not_worth_it():
    costs = RowCosts({1: 1.0, 64: 1.5})
    cand = Candidate([(0.3, 1.0), (0.1, 1.0)], draft_s=2.0)
    assert allocate([cand], costs, fixed_rows=1) == [(0, 0)]


def test_wide_levels_cost_their_rows():
    costs = RowCosts({1: 1.0, 9: 2.0})
    cand = Candidate([(0.9, 4.0), (0.6, 4.0)])
    depth, rows = allocate([cand], costs, fixed_rows=1)[0]
    assert rows == 4 * depth


@pytest.mark.parametrize("seed", range(20))
def test_allocation_beats_no_drafts_and_full_drafts(seed):
    """On small random instances, the chosen caps are never worse than plain decoding or
    full drafts, and close to the best of every combination."""
    import random

    rng = random.Random(seed)
    points = sorted(rng.sample(range(2, 40), 3))
    base = rng.uniform(1, 3)
    curve = {1: base}
    for r in points:
        curve[r] = curve[max(curve)] + (r - max(curve)) * rng.uniform(0.01, 0.5)
    costs = RowCosts(curve)
    cands = []
    for _ in range(rng.randint(1, 3)):
        chance, levels = 1.0, []
        for _ in range(3):
            chance *= rng.uniform(0.2, 0.95)
            levels.append((chance, float(rng.randint(1, 3))))
        cands.append(Candidate(levels, draft_s=rng.uniform(0, 0.2)))
    fixed = len(cands)
    caps = allocate(cands, costs, fixed)
    ours = goodput(cands, costs, fixed, caps)
    assert ours >= goodput(cands, costs, fixed, [(0, 0)] * len(cands)) - 1e-12
    assert ours >= goodput(cands, costs, fixed, [(3, 0)] * len(cands)) - 1e-12
    best = max(goodput(cands, costs, fixed, [(d, 0) for d in depths])
               for depths in itertools.product(range(4), repeat=len(cands)))
    assert ours >= 0.9 * best


def test_bad_batching_settings_name_the_setting():
    with pytest.raises(SpecDecodeError, match="draft budget must be one of goodput, full"):
        Batching(draft_budget="max")
    with pytest.raises(SpecDecodeError, match="max draft rows"):
        Batching(max_draft_rows=-1)
    with pytest.raises(SpecDecodeError, match="prefill rows"):
        Batching(prefill_rows=0)


def test_a_sequence_left_without_drafts_explores_where_a_few_rows_cost_little():
    """A method whose estimate fell to nothing (one early miss) learns only from drafts sent:
    after EXPLORE_EVERY steps without one, a small draft goes anyway where its rows beside the
    forward's cost at most EXPLORE_SHARE of those steps (where rows cost a forward each, only
    after many more such steps)."""
    cheap, linear = RowCosts({1: 1.0, 64: 1.05}), RowCosts({1: 1.0, 2: 2.0})
    assert explore_cap(cheap, 8, 10, 10, EXPLORE_EVERY - 1) is None
    assert explore_cap(cheap, 8, 10, 10, EXPLORE_EVERY) == (EXPLORE_NODES, EXPLORE_NODES)
    assert explore_cap(cheap, 8, 2, 10, EXPLORE_EVERY) == (2, EXPLORE_NODES)
    assert explore_cap(cheap, 8, 0, 10, EXPLORE_EVERY) is None  # no token left to draft
    assert explore_cap(linear, 8, 10, 10, EXPLORE_EVERY) is None
    assert explore_cap(linear, 8, 10, 10, 5 * EXPLORE_EVERY) == (EXPLORE_NODES, EXPLORE_NODES)
    assert explore_cap(cheap, 8, 10, 10, EXPLORE_EVERY, draft_s=5.0) is None  # a costly drafter
