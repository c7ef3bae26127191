"""The tree growth's reads (drafting/tree.py): a drafter forward is spent on a node only while
the running mean of the best child's probability of the nodes read before says its children
can reach ``min_path_prob``; the mean is learnt after each growth and starts anew with each
request."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from specdecode.control import Budget
from specdecode.drafting import tree
from specdecode.drafting.session import DraftSession
from specdecode.sampling import GREEDY

VOCAB = 8


def logits_for(probs: dict[int, float]) -> torch.Tensor:
    """Logits [VOCAB] whose softmax gives ``probs`` and spreads the rest over other tokens."""
    rest = (1.0 - sum(probs.values())) / (VOCAB - len(probs))
    return torch.tensor([math.log(probs.get(t, rest)) for t in range(VOCAB)])


class ScriptedDrafter:
    """A draft cache whose root is sure of token 1 at 0.6 and every node it reads is sure of
    nothing: its best child has probability 0.25, so a child of a node of value 0.6 is worth
    0.15, below the 0.2 floor: each read places nothing."""

    head_ids = None
    vocab_size = VOCAB

    def __init__(self):
        self.tree_tokens: list[int] = []
        self.reads = 0

    def catch_up(self, context):
        self.tree_tokens = []
        return logits_for({1: 0.6}), torch.zeros(1)

    def feed(self, tokens, parents):
        self.reads += 1
        self.tree_tokens += tokens
        return torch.stack([logits_for({2: 0.25}) for _ in tokens]), torch.zeros(len(tokens), 1)


SETTINGS = SimpleNamespace(tree_nodes=8, max_depth=4, expand_width=4, max_forwards=6,
                           min_path_prob=0.2)


def grow(session: DraftSession) -> int:
    """One step's growth: the drafter forwards it spent after the catch-up."""
    before = session.lm.reads
    draft = tree.grow_tree(session, [0, 5], Budget(4, 8), SETTINGS)
    assert list(draft.tokens) == [1]  # the same draft whether the node is read or not
    return session.lm.reads - before


def test_a_node_whose_children_would_fall_below_the_floor_is_no_longer_read():
    session = DraftSession(ScriptedDrafter())
    session.start([0, 5], GREEDY)
    reads = [grow(session) for _ in range(30)]
    # at first a node is valued at its own 0.6 and read; its best child's 0.25 teaches the
    # mean, until 0.6 times the mean is below the floor and the node stays unread
    assert reads[0] == 1
    assert sum(reads) < 30 and reads[-1] == 0
    first_unread = reads.index(0)
    assert all(r == 0 for r in reads[first_unread:])
    assert 0.6 * session.child_confidence < SETTINGS.min_path_prob
    assert session.child_confidence >= tree.CONFIDENCE_FLOOR


def test_each_request_learns_its_own_confidence():
    session = DraftSession(ScriptedDrafter())
    session.start([0, 5], GREEDY)
    for _ in range(30):
        grow(session)
    assert session.child_confidence < 1.0
    session.start([0, 5], GREEDY)  # a seeded request's trees must not follow earlier requests
    assert session.child_confidence == 1.0
    assert grow(session) == 1
