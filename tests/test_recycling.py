"""Token Recycling: template compilation, the breadth-first draft, the matrix update, budget
truncation, persistence across requests, and exactness against ``ar``."""

from types import SimpleNamespace

import pytest
import torch

import specdecode
from specdecode.control import Budget
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.proposer import Feedback
from specdecode.proposers.recycling import (RANK_ACCEPT, RecyclingConfig, RecyclingProposer,
                                            best_tree, compile_template, draft_tree,
                                            template_paths)
from specdecode.registry import get

from tiny_models import tiny_llama

V = 64
WIDE = Budget(max_depth=64, max_nodes=128)


def proposer(**config) -> RecyclingProposer:
    return RecyclingProposer(RecyclingConfig(**config), SimpleNamespace(vocab_size=V))


def filled(p: RecyclingProposer) -> RecyclingProposer:
    """Every row seen; row t = (t+1, t+2, ...) mod V, so each path of ranks gives a known token."""
    p.matrix[:] = (torch.arange(V)[:, None] + torch.arange(1, p.config.candidates + 1)) % V
    p.seen[:] = True
    return p


def path_tokens(draft: Draft, node: int) -> list[int]:
    return [draft.tokens[i] for i in draft.path_to(node)]


def test_paper_template_compiles_to_80_nodes_in_6_levels():
    tpl = compile_template(template_paths("2.2.2"), 8)
    assert len(tpl) == 80
    assert int(tpl.depths.max()) == 6
    assert [s.stop - s.start for s in tpl.levels] == [8, 21, 25, 15, 8, 3]
    parents = tpl.parents.tolist()
    assert all(-1 <= p < i for i, p in enumerate(parents))
    # each compiled node's chain of ranks back to the root is its template path
    paths = set()
    for i in range(len(tpl)):
        path, node = [], i
        while node >= 0:
            path.append(int(tpl.ranks[node]))
            node = parents[node]
        paths.add(tuple(reversed(path)))
    assert paths == set(template_paths("2.2.2"))


def test_compile_sorts_breadth_first_and_rejects_non_trees():
    tpl = compile_template([[0, 0], [1], [0]], 2)
    assert tpl.parents.tolist() == [-1, -1, 0]
    assert tpl.ranks.tolist() == [0, 1, 0]
    with pytest.raises(SpecDecodeError, match="no parent path"):
        compile_template([[0], [1, 0]], 2)
    with pytest.raises(SpecDecodeError, match="outside 0..1"):
        compile_template([[0], [2]], 2)
    with pytest.raises(SpecDecodeError, match="twice"):
        compile_template([[0], [0]], 2)


def test_named_templates():
    assert template_paths("chain3") == ((0,), (0, 0), (0, 0, 0))
    # with RANK_ACCEPT = (0.42, 0.09, 0.06, ...): [0] .42, [0,0] .176, [1] .09, [0,0,0] .074,
    # [2] .06, then [0,1] and [1,0] tie at .0378 (the smaller path first)
    assert best_tree(7) == ((0,), (0, 0), (1,), (0, 0, 0), (2,), (0, 1), (1, 0))
    # any prefix of a best tree is the best smaller tree, and a tree
    big = best_tree(64)
    assert best_tree(16) == big[:16]
    compile_template(big, 8)
    # ranks run out: with two candidates only ranks 0 and 1 appear
    assert {r for path in best_tree(20, (0.5, 0.3)) for r in path} == {0, 1}
    assert RANK_ACCEPT == tuple(sorted(RANK_ACCEPT, reverse=True))


def test_config_validation():
    for bad in ("nope", "chain0", "best", "best999", "2.2"):
        with pytest.raises(SpecDecodeError, match="unknown tree template"):
            RecyclingConfig(tree=bad)
    with pytest.raises(SpecDecodeError, match="candidates >= 8"):
        RecyclingConfig(candidates=4, tree="2.2.2")
    with pytest.raises(SpecDecodeError, match="candidates must be >= 1"):
        RecyclingConfig(candidates=0)
    assert RecyclingConfig(tree="chain5", candidates=1).candidates == 1
    assert get("recycling").make_config({"tree": "best8"}).tree == "best8"


def test_docstring_worked_example():
    matrix = torch.zeros(10, 2, dtype=torch.long)
    matrix[5] = torch.tensor([7, 9])
    matrix[7] = torch.tensor([3, 4])
    draft = draft_tree(matrix, compile_template([[0], [1], [0, 0]], 2), 5, 64, 128)
    assert draft.tokens == (7, 9, 3)
    assert draft.parents == (-1, -1, 0)


def test_breadth_first_draft_follows_the_matrix():
    p = filled(proposer(tree="2.2.2"))
    draft = p.propose([3, 10], WIDE)
    assert len(draft) == 80 and draft.probs is None and draft.max_depth == 6
    # with row t = (t+1, t+2, ...), a path of ranks r1..rd from root 10 gives tokens
    # 10 + r1 + 1, then + r2 + 1, ...
    tpl = compile_template(template_paths("2.2.2"), 8)
    for i in range(80):
        ranks = [int(tpl.ranks[j]) for j in draft.path_to(i)]
        expected, token = [], 10
        for r in ranks:
            token = (token + r + 1) % V
            expected.append(token)
        assert path_tokens(draft, i) == expected


def test_unseen_rows_draft_nothing_unless_pruning_is_off():
    p = proposer(tree="2.2.2")
    assert len(p.propose([5], WIDE)) == 0
    p.matrix[5] = torch.arange(20, 28)
    p.seen[5] = True
    draft = p.propose([5], WIDE)
    # only the root's row is known: its 8 candidates, nothing below them
    assert draft.tokens == tuple(range(20, 28)) and draft.parents == (-1,) * 8
    paper = proposer(tree="2.2.2", prune_unseen=False)
    draft = paper.propose([5], WIDE)
    assert len(draft) == 80 and set(draft.tokens) == {0}


def test_budget_truncation_keeps_a_tree():
    p = filled(proposer(tree="2.2.2"))
    shallow = p.propose([1], Budget(max_depth=2, max_nodes=128))
    assert len(shallow) == 8 + 21 and shallow.max_depth == 2
    small = p.propose([1], Budget(max_depth=64, max_nodes=10))
    full = p.propose([1], WIDE)
    assert small.tokens == full.tokens[:10] and small.parents == full.parents[:10]
    assert len(p.propose([1], Budget(max_depth=0, max_nodes=128))) == 0
    assert len(p.propose([1], Budget(max_depth=64, max_nodes=0))) == 0
    # pruning and truncation together: indices are remapped onto the surviving nodes
    p.seen[(1 + 1) % V] = False  # the first candidate's row is unknown: its subtree goes
    pruned = p.propose([1], Budget(max_depth=3, max_nodes=20))
    assert len(pruned) == 20
    assert all(path_tokens(pruned, i)[0] != 2 or pruned.depths[i] == 1 for i in range(20))
    assert Draft(pruned.tokens, pruned.parents) == pruned  # parents valid (checked on build)


def test_observe_recycles_every_row_including_the_root():
    p = proposer()
    draft = Draft((11, 12, 13), (-1, 0, -1))
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    p.observe(Feedback(context=(1, 2, 10), draft=draft, logits=logits, accepted=(0, 1),
                       tokens=(11, 12, 40)))
    top = logits.topk(8, dim=-1).indices
    for token, row in [(10, 0), (11, 1), (12, 2), (13, 3)]:
        assert p.matrix[token].tolist() == top[row].tolist()
    assert p.seen.nonzero().flatten().tolist() == [10, 11, 12, 13]
    assert p.matrix[20].tolist() == [0] * 8


def test_observe_prefers_the_accepted_node_for_a_repeated_token():
    for accepted in [(0,), (1,)]:
        p = proposer()
        draft = Draft((11, 11), (-1, -1))  # the same token at two nodes
        logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
        p.observe(Feedback((10,), draft, logits, accepted, (11, 5)))
        assert p.matrix[11].tolist() == logits[1 + accepted[0]].topk(8).indices.tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


PROMPTS = [[5, 17, 33, 8], [40, 41, 42, 43, 44, 45, 40, 41, 42], list(range(3, 60, 2))]
LENGTHS = (1, 7, 48)  # 1: the prefill's token only; 7: a draft cut by the token limit


@pytest.fixture(scope="module")
def ar_outputs(model):
    ar = specdecode.Decoder(model, None, method="ar")
    return {(i, n): ar.start(prompt, max_new_tokens=n).run()
            for i, prompt in enumerate(PROMPTS) for n in LENGTHS}


@pytest.mark.parametrize("config", [{}, {"tree": "2.2.2"}, {"tree": "chain4"},
                                    {"tree": "2.2.2", "prune_unseen": False}])
def test_greedy_output_identical_to_ar(model, ar_outputs, config):
    rec = specdecode.Decoder(model, None, method="recycling", **config)
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        for n in LENGTHS:
            gen = rec.start(prompt, max_new_tokens=n)
            assert gen.run() == ar_outputs[i, n]
            accepted += gen.stats.accepted_tokens
    assert accepted > 0  # the trees were used, not just empty drafts


def test_sampled_output_identical_to_ar_with_a_seed(model):
    # a deterministic draft is verified by ancestral sampling: same seed, same tokens as ar
    options = dict(temperature=0.8, top_p=0.95, seed=3)
    ar = specdecode.Decoder(model, None, method="ar")
    rec = specdecode.Decoder(model, None, method="recycling")
    for prompt in PROMPTS:
        expected = ar.start(prompt, max_new_tokens=40, **options).run()
        assert rec.start(prompt, max_new_tokens=40, **options).run() == expected


def test_matrix_persists_across_requests(model):
    decoder = specdecode.Decoder(model, None, method="recycling")
    first = decoder.start(PROMPTS[2], max_new_tokens=40)
    first.run()
    assert decoder.proposer.seen.any()
    second = decoder.start(PROMPTS[2], max_new_tokens=40)
    second.run()
    assert second.tokens == first.tokens
    # the repeated request starts with what the first one learnt, so it drafts from step one
    # and accepts more per target forward
    assert second.stats.mean_accepted > first.stats.mean_accepted
    fresh = specdecode.Decoder(model, None, method="recycling")
    assert not fresh.proposer.seen.any()
