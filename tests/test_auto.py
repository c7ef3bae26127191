"""``auto``: the proposer that picks, each step, the draft with the most expected tokens per
second. Its exactness is the shared tests' (tests/test_exactness.py runs every registered
method); here, on scripted parts and a fixed row-cost curve (no model, no timing), that it
switches to the part whose drafts the target accepts, skips drafting a part that does not pay,
feeds every part every step, and sends valid merged trees."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdecode.control import Budget
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.models.base import NOTHING, Needs
from specdecode.proposer import Feedback, Proposer
from specdecode.proposers.auto import AutoConfig, AutoProposer, merged
from specdecode.estimates import RowCosts
from specdecode.sizing import FIRST_DRAFTS

#: the target's greedy text: token i follows the first i tokens
TRUTH = list(range(2000))
#: one second a forward, each row adds a hundredth: rows cost little next to a whole forward,
#: and the microseconds the scripted parts take to draft weigh nothing
COSTS = RowCosts({1: 1.0, 64: 1.63})
WRONG = 10**6  # a token the target never writes


class Scripted(Proposer):
    """A part whose draft is a function of the context; counts its calls."""

    def __init__(self, draft_of, needs: Needs = NOTHING):
        super().__init__(None, None)
        self.draft_of = draft_of
        self.needs = needs
        self.proposed = 0
        self.observed = 0

    def propose(self, context, budget):
        self.proposed += 1
        return self.draft_of(len(context))

    def observe(self, feedback):
        self.observed += 1


def repeating_then_silent(n: int) -> Draft:
    """Like a suffix tree: the next 4 true tokens while the text repeats (first 400 tokens),
    nothing after."""
    return Draft.chain(TRUTH[n:n + 4]) if n < 400 else Draft.empty()


def wrong_then_right(n: int) -> Draft:
    """Like a head: wrong while the text repeats, the next 2 true tokens after."""
    return Draft.chain([WRONG, WRONG + 1]) if n < 400 else Draft.chain(TRUTH[n:n + 2])


def decode(auto: AutoProposer, start: int, stop: int) -> list[Draft]:
    """Greedy decoding of TRUTH from ``start`` to ``stop`` tokens through ``auto``: the drafts
    it sent, each verified by walking it along TRUTH as the verifier would."""
    auto.start(TRUTH[:start])
    sent = []
    n = start
    while n < stop:
        draft = auto.propose(TRUTH[:n], Budget(64, 128, tokens_left=stop - n))
        node, accepted = -1, []
        for token in TRUTH[n:]:
            child = next((c for c in draft.children(node) if draft.tokens[c] == token), None)
            if child is None:
                break
            accepted.append(child)
            node = child
        tokens = TRUTH[n:n + len(accepted) + 1]
        auto.observe(Feedback(tuple(TRUTH[:n]), draft, torch.zeros(1 + len(draft), 1),
                              accepted, tokens))
        sent.append(draft)
        n += len(tokens)
    auto.finish(TRUTH[start:n])
    return sent


def scripted_auto(**config) -> tuple[AutoProposer, Scripted, Scripted]:
    suffix, head = Scripted(repeating_then_silent), Scripted(wrong_then_right)
    auto = AutoProposer(AutoConfig(parts="suffix,hydra", **config), None, [suffix, head], COSTS)
    return auto, suffix, head


def test_switches_to_the_part_the_target_accepts():
    auto, suffix, head = scripted_auto()
    steps = len(decode(auto, 1, 400))
    repetitive = dict(auto.choices)
    assert repetitive.get("suffix", 0) >= 0.9 * steps, repetitive
    # the head drafted only to learn its worth (its first drafts, then every explore_every
    # steps)
    assert head.proposed <= FIRST_DRAFTS + steps // auto.config.explore_every + 1, (
        head.proposed, steps)
    # every step was fed to both parts, the one not drafting included
    assert suffix.observed == head.observed == steps

    steps = len(decode(auto, 400, 1400))
    novel = dict(auto.choices)
    assert novel.get("hydra", 0) >= 0.75 * steps, novel
    assert novel.get("suffix", 0) == 0, novel  # an empty draft is never sent


def test_an_arm_that_never_pays_is_not_sent():
    never = Scripted(lambda n: Draft.chain([WRONG]))
    also_never = Scripted(lambda n: Draft.chain([WRONG + 1, WRONG + 2]))
    auto = AutoProposer(AutoConfig(parts="a,b"), None, [never, also_never], COSTS)
    steps = len(decode(auto, 1, 200))
    assert auto.choices["none"] >= 0.9 * steps, dict(auto.choices)


class PerToken(Scripted):
    """A part priced as a draft model: each token a forward of its own, ``level_s`` by its
    curve, after reading what it skipped (``catch_up_s``; a nanosecond keeps its drafting
    untimed, so that the curve, not the microseconds a scripted draft takes, prices it)."""

    def __init__(self, draft_of, level_s: float, catch_up_s: float = 1e-9):
        super().__init__(draft_of)
        self.level_s, self.catch_up_s = level_s, catch_up_s
        self.depths: list[int] = []

    def draft_seconds(self, context):
        return self.catch_up_s, self.level_s

    def propose(self, context, budget):
        self.depths.append(budget.max_depth)
        return super().propose(context, budget)


def one_ahead(n: int) -> Draft:
    """Like a draft model that agrees with the target on the next token only."""
    return Draft.chain([TRUTH[n], WRONG, WRONG + 1, WRONG + 2])


def nothing(n: int) -> Draft:
    return Draft.empty()


def test_a_draft_model_part_drafts_as_deep_as_its_tokens_pay():
    """Tokens that cost a fifth of a forward each, right one ahead: the part drafts that one
    token (a deeper one would cost a fifth of a forward for nothing), and where the lookup
    beside it has nothing, it is sent every step."""
    model = PerToken(one_ahead, 0.2)
    auto = AutoProposer(AutoConfig(parts="suffix,draft_model"), None,
                        [Scripted(nothing), model], COSTS)
    steps = len(decode(auto, 1, 300))
    assert model.depths.count(1) >= 0.9 * len(model.depths), Counter(model.depths)
    assert auto.choices["draft_model"] >= 0.9 * steps, dict(auto.choices)


def test_a_draft_model_part_that_does_not_pay_only_learns():
    """Tokens that cost nine tenths of a forward, right 60% of the time, never pay: the part
    drafts its first FIRST_DRAFTS tokens, then only where a small draft costs at most
    EXPLORE_SHARE of the steps since its last (far fewer than a lookup's explores)."""
    model = PerToken(lambda n: Draft.chain([TRUTH[n] if n % 5 < 3 else WRONG]), 0.9)
    auto = AutoProposer(AutoConfig(parts="suffix,draft_model"), None,
                        [Scripted(nothing), model], COSTS)
    steps = len(decode(auto, 1, 400))
    assert FIRST_DRAFTS <= model.proposed < FIRST_DRAFTS + steps // auto.config.explore_every
    assert auto.choices["none"] >= 0.9 * steps, dict(auto.choices)


@pytest.mark.parametrize("left, drafts", [(1000, True), (4, False)])
def test_a_draft_model_parts_catch_up_is_spread_over_the_tokens_left(left, drafts):
    """A part that must first read what it skipped (two forwards' worth) drafts where the
    request's steps left repay the reading, and not near its end."""
    model = PerToken(one_ahead, 0.2, catch_up_s=2.0)
    auto = AutoProposer(AutoConfig(parts="suffix,draft_model"), None,
                        [Scripted(nothing), model], COSTS)
    auto.start(TRUTH[:1])
    auto.propose(TRUTH[:1], Budget(64, 128, tokens_left=left))
    assert model.proposed == drafts


@pytest.mark.parametrize("answers, drafts", [(1000, True), (4, False)])
def test_a_draft_model_parts_catch_up_is_spread_over_what_answers_say_is_left(answers, drafts):
    """With 1000 tokens of budget left, a part two forwards behind drafts after answers of
    1000 tokens and not after answers of 4: the budget is not what is left."""
    model = PerToken(one_ahead, 0.2, catch_up_s=2.0)
    auto = AutoProposer(AutoConfig(parts="suffix,draft_model"), None,
                        [Scripted(nothing), model], COSTS)
    for _ in range(3):
        auto.start(TRUTH[:1])
        auto.finish(TRUTH[1:1 + answers])
    auto.start(TRUTH[:1])
    auto.propose(TRUTH[:1], Budget(64, 128, tokens_left=1000))
    assert model.proposed == drafts


def test_step_seconds_besides_the_forward_are_learnt_per_row():
    """What a step costs besides its forward and its drafting (verification, the LM head's
    rows, the parts' bookkeeping) is learnt as a fixed part and a part per draft row, so a
    draft of many rows costs what it does: steps of 0..4 rows at 0.2 s + 0.05 s a row (beside
    the curve's forward) give that line back; rows that never vary give their median."""
    auto, _, _ = scripted_auto()
    clock = 0.0
    for step in range(200):
        rows = step % 5
        auto._step = (clock, rows, 0.0)
        clock += COSTS(1.0 + rows) + 0.2 + 0.05 * rows
        auto._learn_overhead(clock)
    fixed, per_row = auto.overhead.line
    assert fixed == pytest.approx(0.2, abs=1e-6) and per_row == pytest.approx(0.05, abs=1e-6)
    assert auto._seconds(4) == pytest.approx(COSTS(5.0) + 0.4)
    steady, _, _ = scripted_auto()
    for step in range(50):
        steady._step = (float(step), 2, 0.0)
        steady._learn_overhead(step + COSTS(3.0) + 0.3)
    assert steady.overhead.line == pytest.approx((0.3, 0.0))


def test_a_stalled_step_does_not_price_every_row():
    """On a shared machine a step can take twice a forward for nothing it did: one such step
    among steps of a few rows, or the only step with draft rows, leaves the line where the
    other steps put it (it once priced a row at 12 ms, and auto stopped drafting)."""
    auto, _, _ = scripted_auto()
    clock = 0.0
    for step in range(64):
        rows = step % 5
        stall = 5.0 if step == 40 else 0.0
        auto._step = (clock, rows, 0.0)
        clock += COSTS(1.0 + rows) + 0.2 + 0.05 * rows + stall
        auto._learn_overhead(clock)
    # (rows 3 and 4 share a group: its median sits a little off the line)
    assert auto.overhead.line == pytest.approx((0.2, 0.05), abs=0.01)
    lone, _, _ = scripted_auto()
    for step in range(20):
        rows = 3 if step == 10 else 0
        lone._step = (float(step), rows, 0.0)
        lone._learn_overhead(step + COSTS(1.0 + rows) + 0.2 + (5.0 if rows else 0.0))
    assert lone.overhead.line == pytest.approx((0.2, 0.0))


def test_merged_tree_is_a_valid_draft_holding_both():
    chain = Draft.chain([1, 2, 3])
    tree = Draft((1, 5, 7, 8), (-1, 0, -1, 2))  # 1 -> 5, 7 -> 8
    both = merged([chain, tree])
    assert both.probs is None
    assert both.tokens[:3] == (1, 2, 3) and both.parents[:3] == (-1, 0, 1)  # the first whole
    paths = {tuple(both.tokens[n] for n in both.path_to(i)) for i in range(len(both))}
    assert paths == {(1,), (1, 2), (1, 2, 3), (1, 5), (7,), (7, 8)}
    for node in range(-1, len(both)):  # siblings differ: one node per token
        kids = [both.tokens[c] for c in both.children(node)]
        assert len(kids) == len(set(kids))
    assert merged([chain, tree]).truncated(3, 3).tokens == (1, 2, 3)


def test_sends_merged_trees_that_verify():
    # both parts right at depth 1, each wrong at depth 2 on alternate steps: the merged tree
    # is accepted deeper than either
    def left(n):
        return Draft.chain([TRUTH[n], TRUTH[n + 1] if n % 2 else WRONG])

    def right(n):
        return Draft.chain([TRUTH[n], WRONG + 1 if n % 2 else TRUTH[n + 1]])

    auto = AutoProposer(AutoConfig(parts="a,b"), None, [Scripted(left), Scripted(right)], COSTS)
    sent = decode(auto, 1, 600)
    assert auto.choices["a+b"] >= 0.5 * len(sent), dict(auto.choices)
    for draft in sent:
        assert Draft(draft.tokens, draft.parents) == draft  # passes Draft's own checks
    assert not AutoProposer(AutoConfig(parts="a,b", merge=False), None,
                            [Scripted(left), Scripted(right)], COSTS).config.merge


def test_needs_are_the_union_of_the_parts():
    parts = [Scripted(Draft.empty, Needs(final_hidden=True, layers=(3,))),
             Scripted(Draft.empty, Needs(layers=(1, 3)))]
    auto = AutoProposer(AutoConfig(parts="a,b"), None, parts, COSTS)
    assert auto.needs == Needs(final_hidden=True, layers=(1, 3))


def test_the_default_parts_draft_with_a_named_draft_model():
    assert AutoConfig().part_names == ["suffix", "hydra"]
    assert AutoConfig(draft="qwen2.5-coder-0.5b").part_names == ["suffix", "draft_model"]
    assert AutoConfig(parts="suffix,dyspec", draft="d.gguf").part_names == ["suffix", "dyspec"]


def test_bad_parts_are_named():
    with pytest.raises(SpecDecodeError, match="two or more parts"):
        AutoConfig(parts="suffix")
    with pytest.raises(SpecDecodeError, match="repeat"):
        AutoConfig(parts="suffix,suffix")
    with pytest.raises(SpecDecodeError, match="repeat"):
        AutoConfig(parts="suffix+suffix")
    assert AutoConfig(parts="suffix+eagle").part_names == ["suffix", "eagle"]
    with pytest.raises(SpecDecodeError, match="registered exact method"):
        AutoProposer(AutoConfig(parts="suffix,auto"), None)
    with pytest.raises(SpecDecodeError, match="explore_every"):
        AutoConfig(explore_every=0)
