"""Drafts sized by what a row costs (specdecode/sizing.py), for one request: the same
allocation as the server's, on the runner's row-cost curve cached per file, format, CPU and
thread count (models/row_costs.py)."""

import json
from collections import Counter

import pytest
import torch

from specdecode.api import Decoder
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.estimates import (UNSEEN_ANSWER, Acceptance, AnswerLengths, RowCosts,
                                  expected_left_alone)
from specdecode.models import row_costs
from specdecode.models.llama import LlamaRunner
from specdecode.sampling import GREEDY, SamplingParams
from specdecode.sizing import (DEEPEN_AFTER, EXPLORE_BACKOFF, EXPLORE_EVERY, EXPLORE_NODES,
                               EXPLORE_SHARE, FIRST_DRAFTS, DraftSizing, DraftTime, explore_due,
                               learning_cap)

from conftest import repetitive_prompts

SEEDED = SamplingParams(temperature=0.8, seed=1)


def run_steps(sizer, accepted_of, steps: int, step_s: float = 1.0):
    """Steps of a proposer that drafts a 6-token chain whenever allowed; ``accepted_of(depth)``
    is what the verifier accepts of a draft that deep. The caps given, in order."""
    caps = []
    for _ in range(steps):
        depth, nodes = sizer.cap(6, 6)
        caps.append(depth)
        draft = Draft.chain(list(range(min(depth, nodes))))
        sizer.observe(draft, min(accepted_of(draft.max_depth), draft.max_depth), 0.0, step_s)
    return caps


def test_cheap_rows_and_good_drafts_draft_deep():
    sizer = DraftSizing(RowCosts({1: 1.0, 8: 1.05, 64: 2.0})).sequence(GREEDY)
    caps = run_steps(sizer, lambda depth: depth, 30)
    assert caps[-1] == 6


def test_a_request_accepted_whole_drafts_deep_after_requests_that_were_not():
    """Requests whose second token was never accepted leave their method a record of one-token
    drafts; a request whose drafts are accepted whole (a predicted output, a file edited
    again) still deepens its drafts within a few steps, borrowing from that record only how
    acceptance falls off below the levels it has seen."""
    sizing = DraftSizing(RowCosts({1: 1.0, 2: 1.0, 8: 1.15, 16: 1.6, 64: 5.0}))
    for _ in range(4):
        run_steps(sizing.sequence(GREEDY), lambda depth: min(depth, 1), 128)
    caps = run_steps(sizing.sequence(GREEDY), lambda depth: depth, 24)
    assert caps[-1] == 6, caps


def test_a_request_accepted_whole_tries_a_level_its_method_never_accepts():
    """Its method's record holds 50 six-token drafts of which only the first token was ever
    accepted: the second level is priced at nothing, and only a draft that reaches it can tell
    that this request differs (DEEPEN_AFTER drafts accepted whole, then a level deeper)."""
    sizing = DraftSizing(RowCosts({1: 1.0, 2: 1.0, 8: 1.15, 16: 1.6, 64: 5.0}))
    for _ in range(50):
        sizing.acceptance.observe(Draft.chain(range(6)), accepted=1)
    caps = run_steps(sizing.sequence(GREEDY), lambda depth: depth, 24)
    assert caps[:DEEPEN_AFTER] == [1] * DEEPEN_AFTER and caps[DEEPEN_AFTER] == 2, caps
    assert caps[-1] == 6, caps


def test_a_drafter_right_exactly_one_token_ahead_seldom_tries_a_second():
    """Every first token accepted, never a second, on rows that make a second level worth
    sending only if it is accepted more than half the time: after its first try fails, the
    request's own record keeps it from trying again until that record has faded."""
    sizing = DraftSizing(RowCosts({1: 1.0, 2: 1.3, 8: 3.0, 64: 20.0}))
    caps = run_steps(sizing.sequence(GREEDY), lambda depth: 1, 200)
    assert caps.count(1) > 190 and 1 <= caps.count(2) <= 6, Counter(caps)


def test_drafts_stop_where_rows_cost_a_forward_and_return_to_explore():
    """Each row costs as much as a whole one-row forward and a draft is accepted one time in
    ten: no draft pays, so the request decodes as ar, sending a small draft (EXPLORE_NODES
    rows, as many forwards here) to see whether that changed once it costs at most
    EXPLORE_SHARE of the steps since the last."""
    sizer = DraftSizing(RowCosts({1: 1.0, 2: 2.0, 64: 64.0})).sequence(GREEDY)
    calls = iter(range(10**6))
    caps = run_steps(sizer, lambda depth: 1 if next(calls) % 10 == 0 else 0, 12 * EXPLORE_EVERY)
    late = caps[EXPLORE_EVERY:]
    explores = [step for step, cap in enumerate(late) if cap]
    assert all(late[step] == EXPLORE_NODES for step in explores), caps
    assert len(explores) >= 2, f"explored {len(explores)} times: {caps}"
    spacing = EXPLORE_NODES / EXPLORE_SHARE
    assert all(b - a > spacing for a, b in zip(explores, explores[1:])), explores


def explores(costs: RowCosts, level_s: float, skipped_s: float, steps: int = 600,
             accepts=lambda draft: 0) -> list[int]:
    """The steps after the first EXPLORE_EVERY at which a request sent a draft, each accepted
    ``accepts(draft)`` tokens; a draft model takes ``level_s`` a token and, before a draft,
    ``skipped_s`` for each token it skipped."""
    sizer, skipped, sent = DraftSizing(costs).sequence(GREEDY), 0, []
    for step in range(steps):
        depth, nodes = sizer.cap(6, 6, skipped_s * skipped, tokens_left=steps - step)
        draft = Draft.chain([0] * min(depth, nodes))
        draft_s = level_s * len(draft) + (skipped_s * skipped if len(draft) else 0.0)
        if step > EXPLORE_EVERY and len(draft):
            sent.append(step)
        skipped = 0 if len(draft) else skipped + 1
        sizer.observe(draft, accepts(draft) if len(draft) else 0, draft_s,
                      costs(1 + len(draft)) + draft_s)
    return sent


def test_a_lookup_explores_every_few_steps_and_a_dear_draft_model_seldom():
    """Drafts are never accepted. A lookup drafts in no time: after its first misses it
    explores every EXPLORE_EVERY steps doubled EXPLORE_BACKOFF times; a draft model takes
    0.5 s a token and, before an explore, 0.02 s for each token it skipped: it waits longer
    than that between explores, and its explores cost at most EXPLORE_SHARE of the decoding
    seconds. (Where a skipped token costs EXPLORE_SHARE of a step or more, a draft model never
    explores.)"""
    costs = RowCosts({1: 1.0, 8: 1.2, 64: 3.0})
    lookup = explores(costs, 0.0, 0.0)
    longest = EXPLORE_EVERY << EXPLORE_BACKOFF
    assert len(lookup) >= 600 // (longest + 1) - 1, lookup
    assert all(b - a == longest + 1 for a, b in zip(lookup[1:], lookup[2:])), lookup
    model = explores(costs, 0.5, 0.02)
    model_s = sum(0.5 * EXPLORE_NODES + 0.02 * (b - a - 1) + costs(1 + EXPLORE_NODES) - costs(1)
                  for a, b in zip(model, model[1:]))
    assert model, "the draft model never explored"
    assert all(b - a > longest + 1 for a, b in zip(model, model[1:])), (model, lookup)
    assert model_s <= EXPLORE_SHARE * 600 * costs(1) * 1.1, model_s


def test_explores_come_back_every_few_steps_once_a_draft_is_accepted():
    """Each draft in a row whose first token was rejected doubles the steps before the next
    explore, up to EXPLORE_BACKOFF times; an accepted one brings them back to EXPLORE_EVERY
    (a step without a draft changes nothing)."""
    assert not explore_due(EXPLORE_EVERY - 1, 0) and explore_due(EXPLORE_EVERY, 0)
    assert not explore_due(2 * EXPLORE_EVERY - 1, 1) and explore_due(2 * EXPLORE_EVERY, 1)
    longest = EXPLORE_EVERY << EXPLORE_BACKOFF
    assert not explore_due(longest - 1, 99) and explore_due(longest, 99)
    acceptance = Acceptance()
    for _ in range(3):
        acceptance.observe(Draft.chain([0, 0]), 0)
    acceptance.observe(Draft.empty(), 0)
    assert acceptance.missed == 3
    acceptance.observe(Draft.chain([0, 0]), 1)
    assert acceptance.missed == 0


def test_an_idle_request_sends_the_allocations_draft_once_its_method_is_seen_to_pay():
    """A request whose drafts missed stops drafting, and would send a small explore draft
    after EXPLORE_EVERY idle steps. Where meanwhile another request of its method had its
    drafts accepted whole, the allocation (on the method's record as prior) pays for a deep
    draft: that is what goes, not the explore."""
    costs = RowCosts({1: 1.0, 8: 1.2, 64: 3.0})
    sizing = DraftSizing(costs)
    missing, accepted = sizing.sequence(GREEDY), sizing.sequence(GREEDY)
    while missing.idle < EXPLORE_EVERY:
        depth, nodes = missing.cap(6, 6)
        missing.observe(Draft.chain([0] * min(depth, nodes)), 0, 0.0, costs(1 + depth))
    assert sizing.sequence(GREEDY).cap(6, 6)[0] < 6  # the record alone: no deep draft yet
    run_steps(accepted, lambda depth: depth, 60)
    assert missing.cap(6, 6) == (6, 6)


def test_a_method_whose_first_token_does_not_pay_still_explores():
    """Where a row costs a whole forward, a method never seen drafting sends no one-token
    first draft (it could not repay itself), but after enough idle steps it sends the small
    explore draft any method sends, in every path that sizes through learning_cap."""
    linear = RowCosts({1: 1.0, 2: 2.0})
    never = dict(own_drafts=0, record=Acceptance(), tokens_left=100)
    assert learning_cap(linear, 1, 6, 6, idle=0, **never) is None
    assert learning_cap(linear, 1, 6, 6, idle=EXPLORE_EVERY, **never) is None
    assert learning_cap(linear, 1, 6, 6, idle=5 * EXPLORE_EVERY,
                        **never) == (EXPLORE_NODES, EXPLORE_NODES)


def test_what_a_draft_row_adds_besides_the_curve_prices_first_and_explore_drafts():
    """Rows free by the curve, but each draft row adds 1.5 forwards' worth to its step (a long
    context's attention, measured as the step's overhead): neither a first draft nor an
    explore of four rows pays then."""
    free = RowCosts({1: 1.0, 64: 1.01})
    first = dict(own_drafts=0, record=Acceptance(), idle=0, tokens_left=100)
    explore = dict(own_drafts=FIRST_DRAFTS, record=Acceptance(), idle=100, tokens_left=100)
    assert learning_cap(free, 1, 6, 6, **first) == (1, 1)
    assert learning_cap(free, 1, 6, 6, row_s=1.5, **first) is None
    assert learning_cap(free, 1, 6, 6, **explore) == (EXPLORE_NODES, EXPLORE_NODES)
    assert learning_cap(free, 1, 6, 6, row_s=1.5, **explore) is None


@pytest.mark.parametrize("accepted", [1, 0], ids=["accepted", "rejected"])
def test_a_method_seldom_seen_drafting_sends_single_tokens_to_learn_its_worth(accepted):
    """A draft model whose token costs 60% of a target forward, rows nearly free: on the prior
    of a level never drafted, no draft pays, and without first drafts it would never draft,
    however well it drafts. Its first FIRST_DRAFTS are a token each, where one sure to be
    accepted would pay: after reading a short prompt (seven forwards' worth: the 0.5B reading
    51 tokens for the 1.5B on two AVX2 cores) with 128 tokens to repay it (a request that has
    written 128 expects as many more), not with 8. Then
    what it is worth decides: its tokens accepted, it keeps drafting; rejected, it stops as
    soon as the upper bound of its acceptance no longer pays for a token (two misses here)."""
    costs = RowCosts({1: 1.0, 2: 1.02, 64: 3.0})
    behind = dict(catch_up_s=7.0, level_s=0.6)
    assert DraftSizing(costs).sequence(GREEDY).cap(6, 6, tokens_left=8, **behind) == (0, 0)
    assert DraftSizing(costs).sequence(GREEDY).cap(6, 6, tokens_left=128, generated=128,
                                                   **behind) == (1, 1)
    sizer, caps = DraftSizing(costs).sequence(GREEDY), []
    for step in range(EXPLORE_EVERY):
        depth, nodes = sizer.cap(6, 6, level_s=0.6, tokens_left=200 - step)
        caps.append(depth)
        draft = Draft.chain([0] * min(depth, nodes))
        sizer.observe(draft, accepted * len(draft), 0.6 * len(draft), costs(1 + len(draft)))
    assert caps[0] == 1, caps
    if accepted:
        assert all(caps), caps
    else:
        assert caps[:2] == [1, 1] and not any(caps[2:]), caps


def test_the_first_token_bound_rules_a_drafter_out_only_on_evidence_enough():
    """Wilson's upper bound on a first token's chance: 1 before any draft, high after a few
    misses, near the rate seen after many."""
    record = Acceptance()
    assert record.first_bound() == 1.0
    bounds = {}
    for drafts in range(1, 201):
        record.observe(Draft.chain([0]), int(drafts % 4 == 0))  # one in four accepted
        bounds[drafts] = record.first_bound()
    assert 0.6 < bounds[4] < 0.7 and bounds[12] < 0.5 and 0.25 < bounds[200] < 0.31
    assert all(bounds[n + 4] < bounds[n] for n in range(4, 197, 4))


@pytest.mark.parametrize("earlier, drafts", [(4, FIRST_DRAFTS), (40, 0)],
                         ids=["after-four-drafts", "after-forty"])
def test_a_new_request_drafts_to_learn_until_its_methods_record_rules_it_out(earlier, drafts):
    """A draft model whose token costs 60% of a forward; an earlier request of its method
    accepted one of its first tokens in four. On four drafts that does not rule it out (it
    might accept three in four on this text): a new request sends its own FIRST_DRAFTS tokens
    and, as they are accepted, goes on drafting; on forty, the record is evidence enough and
    the new request sends none."""
    costs = RowCosts({1: 1.0, 2: 1.02, 64: 3.0})
    sizing = DraftSizing(costs)
    first = sizing.sequence(GREEDY)
    for k in range(earlier):
        first.observe(Draft.chain([0]), int(k % 4 == 0), 0.6, costs(2))
    new, caps = sizing.sequence(GREEDY), []
    for step in range(3 * EXPLORE_EVERY):
        depth, nodes = new.cap(6, 6, level_s=0.6, tokens_left=200 - step)
        caps.append(depth)
        draft = Draft.chain([0] * min(depth, nodes))
        new.observe(draft, len(draft), 0.6 * len(draft), costs(1 + len(draft)))
    assert caps[:drafts] == [1] * drafts, caps
    assert all(caps) if drafts else not any(caps), caps


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_an_untimed_draft_is_priced_by_its_drafters_curve(sampling):
    """Before any draft is timed (and always, for a seeded request, which reads no timings),
    a level costs what the drafter's curve says: free, a request drafts; at twice a target
    forward a level, it does not."""
    costs = RowCosts({1: 1.0, 8: 1.05, 64: 2.0})
    assert DraftSizing(costs).sequence(sampling).cap(6, 6, level_s=0.0)[0] >= 1
    assert DraftSizing(costs).sequence(sampling).cap(6, 6, level_s=2.0)[0] == 0


def test_a_draft_far_behind_catches_up_where_the_request_can_repay_it():
    """Drafts accepted whole on cheap rows: a draft model 10 s behind (a long prompt it has
    not read) drafts when 1000 tokens are left to spread those seconds over, not when 8 are;
    a draft that is not behind drafts either way."""
    sizer = DraftSizing(RowCosts({1: 1.0, 8: 1.05, 64: 2.0})).sequence(GREEDY)
    run_steps(sizer, lambda depth: depth, 10)
    assert sizer.cap(6, 6, 10.0, tokens_left=8)[0] == 0
    assert sizer.cap(6, 6, 10.0, tokens_left=1000)[0] >= 1
    assert sizer.cap(6, 6, 0.0, tokens_left=8)[0] >= 1


def test_a_catch_up_is_spread_over_the_tokens_its_methods_answers_say_are_left():
    """A draft model 40 s behind with 1000 tokens of budget left: after answers of 8 tokens it
    does not catch up (the budget is not what is left), nor after answers of 1000 while its
    own answer is short (what it has written says at most as much), but once it has written
    500 of them it does; a request already past every recent answer's length counts on as
    many as it has written; a seeded one reads no other answers: it expects as many tokens as
    it has written (not after answers of 1000 at its start, after 500 of its own past answers
    of 8)."""
    costs = RowCosts({1: 1.0, 8: 1.05, 64: 2.0})
    caps = {}
    for name, length, generated, sampling in (
            ("short", 8, 0, GREEDY), ("long start", 1000, 0, GREEDY),
            ("long on", 1000, 500, GREEDY), ("past", 8, 500, GREEDY),
            ("seeded start", 1000, 0, SEEDED), ("seeded on", 8, 500, SEEDED)):
        sizing = DraftSizing(costs)
        for _ in range(5):
            done = sizing.sequence(sampling)
            run_steps(done, lambda depth: depth, 10)
            done.finish(length)
        sizer = sizing.sequence(sampling)
        run_steps(sizer, lambda depth: depth, 10)
        caps[name] = sizer.cap(6, 6, 40.0, tokens_left=1000, generated=generated)[0]
    assert caps["short"] == 0 and caps["long start"] == 0, caps
    assert caps["long on"] >= 1 and caps["past"] >= 1, caps
    assert caps["seeded start"] == 0 and caps["seeded on"] >= 1, caps


def test_answer_lengths_give_the_tokens_a_request_can_expect_to_add():
    lengths = AnswerLengths()
    # nothing seen: what the request says of itself (as many as it has written, at least 32)
    assert lengths.expected_left(0, 128) == UNSEEN_ANSWER
    assert lengths.expected_left(100, 128) == 100
    for n in (20, 40, 128, 60):
        lengths.observe(n)
    # the lower quartile of what the answers longer than those generated added past them
    assert lengths.expected_left(0, 128) == UNSEEN_ANSWER  # 40 of 20, 40, 60, 128: at most 32
    assert lengths.expected_left(30, 98) == 10  # of 10, 30, 98
    assert lengths.expected_left(50, 50) == 10  # of 10, 50 (at most 50 alone)
    assert lengths.expected_left(200, 300) == 200  # past every answer: as many as written
    # a mixed record: most answers short, a few long ones pull the mean up, not the quartile
    mixed = AnswerLengths()
    for n in [20] * 6 + [128] * 2:
        mixed.observe(n)
    assert mixed.expected_left(0, 128) == 20
    # a record of long answers does not outbid a request that has written little yet
    long = AnswerLengths()
    for n in [128] * 8:
        long.observe(n)
    assert long.expected_left(0, 128) == UNSEEN_ANSWER
    assert long.expected_left(60, 68) == 60


def test_a_request_alone_expects_as_many_tokens_as_it_has_written():
    assert expected_left_alone(0, 128) == UNSEEN_ANSWER
    assert expected_left_alone(50, 78) == 50
    assert expected_left_alone(100, 28) == 28
    assert expected_left_alone(0, 5) == 5


def test_drafting_seconds_count_against_a_draft():
    """The same rows and acceptance; only the proposer's drafting seconds differ."""
    costs = RowCosts({1: 1.0, 8: 1.2, 64: 3.0})
    cheap, dear = DraftSizing(costs).sequence(GREEDY), DraftSizing(costs).sequence(GREEDY)
    for sizer, draft_s in ((cheap, 0.01), (dear, 2.0)):
        for _ in range(20):
            depth, _ = sizer.cap(6, 6)
            draft = Draft.chain([0] * depth)
            sizer.observe(draft, min(1, depth), draft_s if depth else 0.0, 1.5)
    assert cheap.cap(6, 6)[0] >= 1 and dear.cap(6, 6)[0] == 0


def test_seconds_each_draft_row_adds_count_against_deep_drafts():
    """The same curve and acceptance (each level accepted half as often as the one above);
    one sizing's steps cost 0.08 s more a draft row than the curve says (a long context's
    attention, the head's rows), the other's nothing more: the first drafts shallower."""
    costs = RowCosts({1: 1.0, 8: 1.05, 64: 2.0})
    free, dear = DraftSizing(costs).sequence(GREEDY), DraftSizing(costs).sequence(GREEDY)
    for sizer, row_s in ((free, 0.0), (dear, 0.08)):
        for step in range(64):
            depth = step % 7  # every draft size, so both lines see the rows vary
            accepted = next((k for k in range(depth) if step % 2 ** (k + 1)), depth)
            sizer.observe(Draft.chain([0] * depth), accepted, 0.0,
                          costs(1 + depth) + 0.1 + row_s * depth)
    assert dear.sizing.overhead.line == pytest.approx((0.1, 0.08), abs=1e-6)
    assert free.sizing.overhead.line == pytest.approx((0.1, 0.0), abs=1e-6)
    assert 1 <= dear.cap(6, 6)[0] < free.cap(6, 6)[0]


def test_untimed_sizing_ignores_measured_seconds():
    sizing = DraftSizing(RowCosts({1: 1.0, 8: 1.2, 64: 3.0}))
    sizing.draft_time.observe(4, 50.0)
    assert sizing.sequence(GREEDY).cap(6, 6)[0] == 0
    assert sizing.sequence(SEEDED).cap(6, 6)[0] > 0
    # a method whose drafts carry no probabilities commits ar's tokens whatever its draft
    # sizes: a seeded request of it is sized on what was measured, as a greedy one
    lookups = DraftSizing(sizing.costs, samples_drafts=False)
    lookups.draft_time.observe(4, 50.0)
    assert lookups.sequence(SEEDED).cap(6, 6)[0] == 0


@pytest.fixture(scope="module")
def runner(tiny_model):
    return LlamaRunner.from_transformers(tiny_model, "int4")


@pytest.mark.parametrize("method", ["suffix", "ngram", "recycling", "lookahead"])
def test_sized_drafts_stay_exact_and_full_ones_too(runner, method):
    for prompt in repetitive_prompts()[:3]:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 40).run()
        for budget in ("goodput", "full"):
            decoder = Decoder(runner, None, method, eos_token_ids=[], draft_budget=budget)
            assert (decoder.sizing is None) == (budget == "full")
            assert decoder.start(prompt, 40).run() == ar, (method, budget)


def test_auto_sizes_its_own_drafts(runner):
    """auto prices and cuts each part's drafts itself (a draft model's tokens beside a
    lookup's): no sizer caps it by the pooled acceptance of its arms, which would hold a
    lookup's draft to a draft model's price."""
    prompt = repetitive_prompts()[0]
    ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(prompt, 40).run()
    auto = Decoder(runner, None, "auto", eos_token_ids=[], parts="suffix,ngram")
    assert auto.sizing is None
    generation = auto.start(prompt, 40)
    assert generation.run() == ar and generation.stats.draft_tokens


def test_seeded_sampling_repeats_under_sized_drafts(runner):
    prompt = repetitive_prompts()[0]
    runs = [Decoder(runner, None, "suffix", eos_token_ids=[]).start(
        prompt, 40, temperature=0.8, seed=7).run() for _ in range(2)]
    assert runs[0] == runs[1]


def test_a_bad_draft_budget_is_refused(runner):
    with pytest.raises(SpecDecodeError, match="draft_budget must be one of goodput, full"):
        Decoder(runner, None, "suffix", draft_budget="some")


def test_row_costs_are_measured_once_per_file_and_kept(tmp_path, monkeypatch, runner):
    """A runner on a file keeps its curve in the cache folder: a later process (here: a cleared
    memo) reads it instead of measuring; another thread count is another curve."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"weights")
    monkeypatch.setattr(type(runner), "cost_key", lambda self: f"file:{weights}:int4")
    measured = []

    def measure(r, rows, repeats=row_costs.REPEATS):
        measured.append(tuple(rows))
        return {n: 0.001 * (1 + n / 64) for n in rows}

    monkeypatch.setattr(row_costs, "measure_row_costs", measure)
    monkeypatch.setattr(row_costs, "_MEASURED", {})
    first = row_costs.cached_row_costs(runner, (1, 8, 64))
    monkeypatch.setattr(row_costs, "_MEASURED", {})
    assert row_costs.cached_row_costs(runner, (1, 8)) == {1: first[1], 8: first[8]}
    assert measured == [(1, 8, 64)]
    row_costs.cached_row_costs(runner, (1, 8, 256))  # only the new point is measured
    assert measured[-1] == (256,)
    [kept] = (tmp_path / "specdecode" / "row-costs").glob("*.json")
    assert set(json.loads(kept.read_text())["seconds"]) == {"1", "8", "64", "256"}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        row_costs.cached_row_costs(runner, (1, 8))
    finally:
        torch.set_num_threads(threads)
    assert measured[-1] == (1, 8)


def test_drafting_seconds_per_level_are_told_from_the_fixed_part():
    """A draft model's seconds grow with the depth it drafts to; a lookup's do not."""
    per_token, lookup = DraftTime(), DraftTime()
    for depth in [1, 2, 3, 4, 5] * 4:
        per_token.observe(depth, 0.002 + 0.013 * depth)
        lookup.observe(depth, 0.0004)
    fixed, level = per_token.line()
    assert fixed == pytest.approx(0.002) and level == pytest.approx(0.013)
    assert lookup.line() == (pytest.approx(0.0004), 0.0)
    same = DraftTime()
    for _ in range(5):
        same.observe(3, 0.03)
    assert same.line() == (0.0, pytest.approx(0.01))  # one depth: all of it a level


def test_a_costly_draft_per_level_is_kept_short():
    """The same nearly free rows and the same acceptance (each level accepted 80% of the time
    given the one before); a draft that costs 40% of a forward a level (a 0.5B draft of a 1.5B
    target) is sized shorter than one whose levels cost nothing."""
    costs = RowCosts({1: 1.0, 8: 1.05, 64: 2.0})
    caps = []
    for level_s in (0.0, 0.4):
        sizing = DraftSizing(costs)
        for depth in [1, 2, 3, 4, 5, 6] * 4:
            sizing.draft_time.observe(depth, 0.01 + level_s * depth)
        sizer = sizing.sequence(GREEDY)
        for accepted in [0, 1, 1, 2, 2, 3, 3, 4, 5, 6] * 5:
            sizer.acceptance.observe(Draft.chain([0] * 6), accepted)
        caps.append(sizer.cap(6, 6)[0])
    assert caps[0] == 6 and 1 <= caps[1] < caps[0], caps


def test_a_point_slowed_by_other_work_is_settled_below_bigger_forwards():
    assert row_costs.settled({1: 0.11, 2: 0.16, 8: 0.113, 16: 0.25, 64: 0.9, 128: 0.66}) == {
        1: 0.11, 2: 0.113, 8: 0.113, 16: 0.25, 64: 0.66, 128: 0.66}
