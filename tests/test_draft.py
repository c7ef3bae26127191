import pytest
import torch

from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError


def test_chain_structure():
    d = Draft.chain([4, 5, 6])
    assert d.parents == (-1, 0, 1)
    assert d.is_chain and d.depths == (1, 2, 3)
    assert d.children(-1) == [0] and d.children(1) == [2] and d.children(2) == []
    assert d.path_to(2) == [0, 1, 2]


def test_from_paths_merges_prefixes():
    d = Draft.from_paths([[1, 2, 3], [1, 2, 4], [1, 5], [6]])
    assert d.tokens == (1, 2, 3, 4, 5, 6)
    assert d.parents == (-1, 0, 1, 1, 0, -1)
    assert not d.is_chain
    assert d.depths == (1, 2, 3, 3, 2, 1)


def test_ancestor_mask_and_positions():
    d = Draft.from_paths([[1, 2], [3]])  # nodes: 0:1 (root child), 1:2 (child of 0), 2:3
    mask = d.ancestor_mask()
    expected = torch.tensor([
        [1, 0, 0, 0],   # root sees itself
        [1, 1, 0, 0],   # node 0: root + itself
        [1, 1, 1, 0],   # node 1: root, node 0, itself
        [1, 0, 0, 1],   # node 2: root + itself, not its sibling's branch
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert d.position_offsets().tolist() == [0, 1, 2, 1]


def test_truncated_keeps_ancestors():
    d = Draft.from_paths([[1, 2, 3], [4, 5]])
    t = d.truncated(max_depth=2)
    assert t.tokens == (1, 2, 4, 5) and t.parents == (-1, 0, -1, 2)
    assert d.truncated(max_depth=0).tokens == ()
    assert d.truncated(max_depth=9, max_nodes=2).tokens == (1, 2)


def test_truncated_slices_probs():
    probs = torch.eye(4)[[1, 2, 3]]
    t = Draft.chain([1, 2, 3], probs=probs).truncated(max_depth=2)
    assert torch.equal(t.probs, probs[:2])


@pytest.mark.parametrize("tokens,parents", [([1, 2], [-1]), ([1, 2], [-1, 1]), ([1], [-2])])
def test_malformed_drafts_rejected(tokens, parents):
    with pytest.raises(ValueError):
        Draft(tokens, parents)


def test_probs_rows_must_match_nodes():
    with pytest.raises(ValueError, match="probs"):
        Draft.chain([1, 2], probs=torch.ones(3, 4) / 4)


def test_errors_are_value_errors():
    assert issubclass(SpecDecodeError, ValueError)
