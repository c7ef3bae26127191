"""deer, the block diffusion drafter (proposers/deer.py, heads/networks.py ``DeerDrafter``): the
block's masking, the chain and tree drafts, ``Draft.probs`` at T > 0, the artifact, training.
Greedy exactness against ``ar``, the tiny-model acceptance and the drafting-equals-training
check are the shared ones (tests/test_exactness.py, test_acceptance.py, test_draft_heads.py)."""

from __future__ import annotations

import pytest
import torch

from specdecode.api import Decoder
from specdecode.control import Budget
from specdecode.drafting.tree import grow_tree
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.heads.artifact import load_heads, save_heads
from specdecode.heads.networks import feature_layers, make_network
from specdecode.models.hf import HFRunner
from specdecode.registry import get
from specdecode.sampling import SamplingParams
from specdecode.training.runs import descend
from specdecode.training.train_heads import _warm_start, depth_losses, step_loss

from conftest import repetitive_prompts, tiny_heads
from test_draft_heads import check_sampled_distribution, perturbed
from tiny_models import tiny_llama

BLOCK = 8


def test_a_block_reads_the_context_up_to_its_anchor_and_nothing_it_predicts():
    """Block t (root t + 1, masks predicting t + 2 ..) is the same whatever follows the root:
    neither the features after t nor the tokens the masks predict leak in; the root does
    reach every row (attention inside the block goes both ways)."""
    net = perturbed("deer")
    n, t = 16, 6
    feats, ids = torch.randn(n, net.size), torch.randint(50, (n,))
    base = net.train_outputs(feats, ids, BLOCK)
    later_feats, later_ids = feats.clone(), ids.clone()
    later_feats[t + 1:] += 1.0
    later_ids[t + 2:] = (later_ids[t + 2:] + 1) % 50
    changed = net.train_outputs(later_feats, later_ids, BLOCK)
    other_root = ids.clone()
    other_root[t + 1] = (ids[t + 1] + 1) % 50
    rooted = net.train_outputs(feats, other_root, BLOCK)
    for k in range(BLOCK):
        torch.testing.assert_close(changed[k][t], base[k][t])
        assert not torch.allclose(rooted[k][t], base[k][t])
    assert [len(base[k]) for k in range(BLOCK)] == [n - 1 - k for k in range(BLOCK)]
    # the trainer's sample of anchors computes what every anchor would at those positions
    anchors = torch.tensor([2, t, n - 3])
    sampled = net.train_outputs(feats, ids, BLOCK, anchors)
    torch.testing.assert_close(sampled[1], base[1][anchors])
    torch.testing.assert_close(sampled[3], base[3][anchors[:2]])  # n - 3 has no token 4 ahead


def test_feature_layers_are_a_low_and_a_middle_one():
    assert feature_layers("deer", 30) == (3, 15)
    assert feature_layers("deer", 2) == (1,)
    assert feature_layers("hydra", 30) == ()


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=0)


def drafts(tiny, sampling: SamplingParams, **config):
    """The first draft of ``deer`` with ``config`` after a repetitive prompt."""
    runner = HFRunner(tiny)
    settings = get("deer").make_config({"heads": tiny_heads("deer", tiny), **config})
    proposer = get("deer").proposer(settings, runner)
    prompt = repetitive_prompts()[0]
    output = Generation(runner, proposer, prompt, 8, sampling).run()
    # the proposer has the features of every committed position but the pending root's
    return proposer, proposer.propose(list(prompt) + list(output), Budget(64, 64))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chain_and_tree_shapes_with_probs_when_sampling(tiny, temperature):
    sampling = SamplingParams(temperature=temperature, seed=1)
    proposer, chain = drafts(tiny, sampling, shape="chain", min_path_prob=0.0)
    assert list(chain.parents) == list(range(-1, len(chain.tokens) - 1))
    assert len(chain.tokens) == BLOCK  # min_path_prob 0: the whole block
    _, tree = drafts(tiny, sampling, tree_nodes=12, min_path_prob=0.0)
    assert len(tree.tokens) == 12 and len(set(tree.parents)) < 12  # branched
    depths = []
    for p in tree.parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    assert max(depths) <= BLOCK
    if temperature == 0:
        # greedy chain: each block position's top token, whatever was drafted before it
        assert list(chain.tokens) == proposer.lm.block_logits().argmax(-1).tolist()
        assert chain.probs is None and tree.probs is None
        return
    for draft in (chain, tree):
        assert draft.probs is not None and draft.probs.shape[0] == len(draft.tokens)
        torch.testing.assert_close(draft.probs.sum(-1), torch.ones(len(draft.tokens)))
        assert all(draft.probs[i, token] > 0 for i, token in enumerate(draft.tokens))


def test_sampled_chain_keeps_the_target_distribution():
    """The chain's own sampling code (the tree's is the other heads', tested with them)."""
    check_sampled_distribution("deer", {"shape": "chain"}, 400)


def test_greedy_chain_is_ar(tiny):
    ar = Decoder(tiny, None, "ar", eos_token_ids=[])
    decoder = Decoder(tiny, None, "deer", eos_token_ids=[], heads=tiny_heads("deer", tiny),
                      shape="chain", min_path_prob=0.0)
    for prompt in repetitive_prompts():
        assert decoder.start(prompt, 24).run() == ar.start(prompt, 24).run()


def test_artifact_round_trip_and_clear_errors(tiny, tmp_path):
    runner = HFRunner(tiny)
    embed = tiny.get_input_embeddings().weight
    torch.manual_seed(0)
    net = make_network("deer", 32, embed, feature_layers=(1,))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = save_heads(tmp_path / "d.safetensors", net, torch.tensor([1, 2, 3]),
                      runner.fingerprint(), {})
    loaded, head_ids, _, config = load_heads(str(path), runner, "deer", embed)
    assert config["network"]["feature_layers"] == [1] and config["network"]["block"] == BLOCK
    assert head_ids.tolist() == [1, 2, 3]
    feats, ids = torch.randn(10, 64), torch.randint(embed.shape[0], (10,))
    with torch.no_grad():
        torch.testing.assert_close(loaded.train_outputs(feats, ids, BLOCK)[3],
                                   net.train_outputs(feats, ids, BLOCK)[3], atol=0.05, rtol=0.05)
    with pytest.raises(SpecDecodeError, match="not 'deer_heads'"):
        load_heads(tiny_heads("hydra", tiny), runner, "deer", embed)
    with pytest.raises(SpecDecodeError, match="specdecode train heads --kind deer"):
        Decoder(tiny_llama(seed=9), None, "deer")
    with pytest.raises(SpecDecodeError, match="unknown shape"):
        get("deer").make_config({"shape": "star"})


def test_the_anchor_input_starts_silent_and_older_artifacts_load_without_it(tiny, tmp_path):
    """A fresh anchor path adds nothing (its map starts at zero); a trained one changes every
    block row; an artifact written before it came (no ``anchor_input``) loads as it was."""
    torch.manual_seed(0)
    embed = tiny.get_input_embeddings().weight
    old = make_network("deer", 32, embed, feature_layers=(1,))
    new = make_network("deer", 32, embed, feature_layers=(1,), anchor_input=True)
    assert new.load_state_dict(old.state_dict(), strict=False).missing_keys == ["anchor_in.weight"]
    feats, ids = torch.randn(12, 64), torch.randint(embed.shape[0], (12,))
    with torch.no_grad():
        torch.testing.assert_close(new.train_outputs(feats, ids, BLOCK)[2],
                                   old.train_outputs(feats, ids, BLOCK)[2])
        new.anchor_in.weight.normal_(0, 0.1)
        assert not torch.allclose(new.train_outputs(feats, ids, BLOCK)[2],
                                  old.train_outputs(feats, ids, BLOCK)[2])
    runner = HFRunner(tiny)
    path = save_heads(tmp_path / "old.safetensors", old, None, runner.fingerprint(), {})
    loaded = load_heads(str(path), runner, "deer", embed)[0]
    assert loaded.anchor_in is None and "anchor_input" in loaded.settings()


def test_the_row_inputs_start_as_one_mask_and_older_artifacts_load_without_them(tiny, tmp_path):
    """A network with ``row_inputs`` starts as the one without (every row's mask the shared
    one, the root's map zero); trained, its rows' masks and the root's map change the block; an
    artifact written before it came (one mask, no ``row_inputs``) loads as it was."""
    torch.manual_seed(0)
    embed = tiny.get_input_embeddings().weight
    old = make_network("deer", 32, embed, feature_layers=(1,), anchor_input=True)
    new = make_network("deer", 32, embed, feature_layers=(1,), anchor_input=True, row_inputs=True)
    assert new.mask.shape == (BLOCK, 32) and old.mask.shape == (32,)
    shared = {k: v for k, v in old.state_dict().items() if k != "mask"}
    assert new.load_state_dict(shared, strict=False).missing_keys == ["mask", "root_in.weight"]
    feats, ids = torch.randn(12, 64), torch.randint(embed.shape[0], (12,))
    with torch.no_grad():
        old.anchor_in.weight.normal_(0, 0.1)
        new.anchor_in.weight.copy_(old.anchor_in.weight)
        torch.testing.assert_close(new.train_outputs(feats, ids, BLOCK)[2],
                                   old.train_outputs(feats, ids, BLOCK)[2])
        new.root_in.weight.normal_(0, 0.1)
        new.mask[3].normal_(0, 1.0)
        moved = new.train_outputs(feats, ids, BLOCK)
        assert not torch.allclose(moved[0], old.train_outputs(feats, ids, BLOCK)[0])
    runner = HFRunner(tiny)
    path = save_heads(tmp_path / "old.safetensors", old, None, runner.fingerprint(), {})
    loaded = load_heads(str(path), runner, "deer", embed)[0]
    assert loaded.root_in is None and loaded.mask.shape == (32,)
    assert loaded.settings()["row_inputs"] is False


def test_init_takes_an_older_artifacts_weights_and_its_mask_for_every_row(tiny, tmp_path):
    """`train heads --init` with an artifact written before the row inputs: every weight of
    the same name and shape, and its one mask vector as every row's mask."""
    torch.manual_seed(0)
    embed = tiny.get_input_embeddings().weight
    runner = HFRunner(tiny)
    old = make_network("deer", 32, embed, feature_layers=(1,), anchor_input=True)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(torch.randn_like(p))
    path = save_heads(tmp_path / "old.safetensors", old, None, runner.fingerprint(), {})
    new = make_network("deer", 32, embed, feature_layers=(1,), anchor_input=True, row_inputs=True)
    _warm_start(new, str(path), runner.fingerprint())
    stored = load_heads(str(path), runner, "deer", embed)[0].state_dict()
    for name, value in new.state_dict().items():
        if name == "root_in.weight":
            assert not value.any()  # not in the old artifact: its zero start
        elif name != "embed":
            torch.testing.assert_close(value, stored[name].expand(value.shape))


@pytest.mark.parametrize("row_inputs", [False, True])
def test_training_lowers_the_loss(row_inputs):
    torch.manual_seed(0)
    embed = torch.randn(40, 64)
    head = torch.randn(40, 64)
    net = make_network("deer", 64, embed, block=4, anchor_input=True, row_inputs=row_inputs)
    optim = torch.optim.AdamW(net.parameters(), lr=3e-3)
    feats, ids = torch.randn(24, 64), torch.randint(40, (24,))
    losses = []
    for step in range(30):
        per_depth = depth_losses(net.train_outputs(feats, ids, 4), feats, head)
        losses.append(descend(step_loss("deer", per_depth), optim, net.parameters(), step))
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_the_loss_weighs_the_blocks_first_rows_most():
    """DEER's second stage and DFlash: row k's loss weighted 0.8^k (normalised)."""
    one, none = torch.tensor(1.0), torch.tensor(0.0)
    first = step_loss("deer", {0: one, **{k: none for k in range(1, 8)}})
    last = step_loss("deer", {**{k: none for k in range(7)}, 7: one})
    assert float(first / last) == pytest.approx(0.8 ** -7)
    assert float(step_loss("deer", {k: one for k in range(8)})) == pytest.approx(1.0)


@pytest.mark.parametrize("shortlist", [False, True])
def test_block_tree_is_the_tree_grown_by_drafter_calls(tiny, shortlist):
    """Greedy, deer's tree made from the block's rankings once per depth (grow_block_tree) is
    the tree the generic best-first growth makes by feeding nodes to the drafter (grow_tree,
    with rounds enough to read every node it needs), for blocks peaked enough to branch."""
    runner = HFRunner(tiny)
    ids = tuple(range(1, tiny.config.vocab_size, 2)) if shortlist else None
    settings = get("deer").make_config({"heads": tiny_heads("deer", tiny, ids), "tree_nodes": 16,
                                        "min_path_prob": 0.01, "max_forwards": 64})
    proposers = [get("deer").proposer(settings, runner) for _ in range(2)]
    reads = [proposer.lm.catch_up for proposer in proposers]
    gen = torch.Generator().manual_seed(4)
    for prompt in repetitive_prompts():
        # greedy: both proposers see the same history, then score the same peaked block
        outputs = [Generation(runner, p, prompt, 6, SamplingParams()).run() for p in proposers]
        block = torch.randn(BLOCK, len(ids or range(tiny.config.vocab_size)), generator=gen) * 4
        for proposer, read in zip(proposers, reads):
            proposer.lm.catch_up = peaked(proposer.lm, read, block)
        context = list(prompt) + list(outputs[0])
        made = proposers[0].propose(context, Budget(64, 64))
        generic = grow_tree(proposers[1].session, context, Budget(64, 64), settings)
        assert len(made.tokens) > 1 and max(made.parents) >= 0  # a tree deeper than the root's
        assert (made.tokens, made.parents) == (generic.tokens, generic.parents)


def peaked(lm, read, block: torch.Tensor):
    """``lm.catch_up``: ``read`` (its own catch_up) reads the context, then ``block`` is
    scored as its block."""

    def catch_up(context):
        read(context)
        lm.block = block
        return block[0], None
    return catch_up
