"""Prompt lookup decoding (proposers/ngram.py): the longest earlier match of the context's
suffix proposes what followed it, the most recent among equals; a predicted output is searched
first at each length."""

import numpy as np
import pytest

from specdecode.control import Budget
from specdecode.proposers.ngram import NgramConfig, NgramProposer, lookup


def tokens(*ids):
    return np.asarray(ids, dtype=np.int64)


def test_the_worked_example_of_the_module():
    assert lookup(tokens(5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 7), 3, 1, 3) == [8, 5, 6]


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # "1 2 3" followed by 4 early on; "3" alone followed by 9 later
    assert lookup(tokens(1, 2, 3, 4, 3, 9, 1, 2, 3), 3, 1, 1) == [4]


def test_nothing_matches_and_nothing_is_drafted():
    assert lookup(tokens(1, 2, 3, 4), 3, 1, 3) == []


def test_a_reference_is_searched_first_at_each_length():
    context = tokens(7, 1, 2, 8, 1, 2)
    assert lookup(context, 2, 1, 2) == [8, 1]
    assert lookup(context, 2, 1, 2, reference=tokens(1, 2, 5, 6)) == [5, 6]


def test_a_longer_match_in_the_context_beats_a_shorter_one_in_the_reference():
    context = tokens(3, 1, 2, 8, 9, 3, 1, 2)
    assert lookup(context, 3, 1, 2, reference=tokens(2, 5, 6)) == [8, 9]


@pytest.mark.parametrize("reference", [tokens(), tokens(4), tokens(1, 2)])
def test_a_reference_without_a_token_after_the_match_drafts_from_the_context(reference):
    assert lookup(tokens(1, 2, 3, 1, 2), 2, 1, 1, reference=reference) == [3]


def test_the_proposer_forgets_a_reference_when_the_next_request_starts():
    proposer = NgramProposer(NgramConfig(), None)
    budget = Budget(max_depth=3, max_nodes=3)
    proposer.start([1, 2])
    proposer.use_reference([1, 2, 5, 6, 7])
    assert proposer.propose([1, 2], budget).tokens == (5, 6, 7)
    proposer.start([1, 2])
    assert proposer.propose([1, 2], budget).tokens == ()
