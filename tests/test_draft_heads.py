"""Draft heads (hydra, clover, eagle): the networks, their artifacts, the FR-Spec shortlist and
the target's distribution under sampling. Greedy exactness against ``ar`` is in
tests/test_exactness.py, as for every registered method."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from specdecode.api import Decoder
from specdecode.artifacts import float_rows, int8_rows
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.heads.artifact import LARGE_TARGET_BYTES, load_heads, save_heads
from specdecode import kernels
from specdecode.heads.drafter import target_features, target_needs
from specdecode.heads import native_blocks
from specdecode.heads.native import to_native
from specdecode.heads.native_blocks import NativeCloverHeads, NativeDeerDrafter, NativeEagleHead
from specdecode.heads.native_hydra import NativeHydraHeads
from specdecode.heads.layers import MLP, RMSNorm
from specdecode.heads.networks import NETWORKS, eagle3_layers, make_network
from specdecode.heads.packing import packed, packed_rows
from specdecode.models.base import Needs
from specdecode.models.hf import HFRunner
from specdecode.registry import get
from specdecode.sampling import SamplingParams
from specdecode.training.self_data import frequency_shortlist, shortlist_coverage

from conftest import repetitive_prompts, tiny_heads
from tiny_models import tiny_llama
from test_sampling_stats import (ALPHA, ENGINE_NEW, ENGINE_OPTIONS, ENGINE_PROMPT, ENGINE_VOCAB,
                                 chi_square, enumerate_sequences, reference_probs)

KINDS = sorted(NETWORKS)


def perturbed(kind: str, size: int = 128, vocab: int = 50, seed: int = 0):
    """A network whose zero-initialised projections are made random, so every path matters
    ("eagle3": eagle reading three layers; deer with its anchor input)."""
    torch.manual_seed(seed)
    settings = {"feature_layers": (2, 5, 7)} if kind == "eagle3" else {}
    if kind == "deer":
        settings.update(anchor_input=True, row_inputs=True)  # as `train heads` makes it
    net = make_network(kind.removesuffix("3"), size, torch.randn(vocab, size), **settings)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return net


@pytest.mark.parametrize("kind", KINDS + ["eagle3"])
def test_drafting_computes_what_training_taught(kind):
    """A chain drafted through ingest/expand (the proposer's path: caches, tree masks,
    positions) gives the features the trainer's teacher-forced pass gives at the same place."""
    net = perturbed(kind)
    n, depth, t = 14, 3, 7
    width = net.size * max(1, len(net.feature_layers))
    feats, ids = torch.randn(n, width), torch.randint(50, (n,))
    taught = net.train_outputs(feats, ids, depth)
    net.reset()
    # the context in three pieces, as a prefill then verify steps hand it over (one row last)
    net.ingest(feats[:4], ids[1:5], torch.arange(4))
    net.ingest(feats[4:t], ids[5:t + 1], torch.arange(4, t))
    states, out = net.ingest(feats[t:t + 1], ids[t + 1:t + 2], torch.arange(t, t + 1))
    torch.testing.assert_close(out[0], taught[0][t], rtol=1e-4, atol=1e-4)
    parent = states[0]
    for d in range(1, depth):
        # a sibling first, so the node's row is not the first of its call
        st, out = net.expand([parent, parent], torch.tensor([ids[t + 1 + d] + 1, ids[t + 1 + d]]),
                             [d, d], [list(range(2 * (d - 1) + 1))[1::2]] * 2)
        torch.testing.assert_close(out[1], taught[d][t], rtol=1e-4, atol=1e-4)
        parent = st[1]


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_native_conversion_takes_any_drafters_linear_maps(fmt):
    """to_native puts every nn.Linear of any module (and the networks' norms and MLPs) on the
    kernels; each network's drafted features stay within the weights' rounding of torch's."""
    if not kernels.available():
        pytest.skip("the native kernels do not build here")
    custom = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(),
                                 torch.nn.Sequential(torch.nn.Linear(96, 40, bias=False)))
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        expected = custom(x)
    to_native(custom, fmt)
    assert not any(isinstance(m, torch.nn.Linear) for m in custom.modules())
    assert relative_error(expected, custom(x)) < 0.02
    for kind in KINDS:
        net = perturbed(kind).eval()
        feats, ids = torch.randn(9, net.size), torch.randint(50, (9,))
        with torch.no_grad():
            expected = net.ingest(feats, ids, torch.arange(9))[1]
        net.reset()
        to_native(net, fmt)
        assert not any(isinstance(m, (torch.nn.Linear, RMSNorm, MLP)) for m in net.modules())
        assert relative_error(expected, net.ingest(feats, ids, torch.arange(9))[1]) < 0.02, kind


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_native_hydra_calls_are_the_converted_modules_bitwise(fmt):
    """Hydra's heads in one kernel call (NativeHydraHeads) give the bits of the network
    converted by to_native (the same kernels and operations), call for call: the root, two
    nodes of one depth, and nodes of two depths in one call, out of depth order."""
    if not kernels.available():
        pytest.skip("the native kernels do not build here")
    net = perturbed("hydra").eval()
    native = NativeHydraHeads(net, fmt)
    converted = to_native(copy.deepcopy(net), fmt)
    feats, ids = torch.randn(5, net.size), torch.randint(50, (5,))

    def both(call, states, *args):
        with torch.no_grad():
            expected = getattr(converted, call)(*states[0], *args)
            got = getattr(native, call)(*states[1], *args)
        assert torch.equal(expected[1], got[1]), call
        return expected[0], got[0]

    roots = both("ingest", ([feats, ids], [feats, ids]), torch.arange(5))
    first = both("expand", ([[roots[0][0]] * 2], [[roots[1][0]] * 2]), torch.tensor([4, 7]),
                 [1, 1], [[], []])
    both("expand", ([[first[0][0], roots[0][0], first[0][1]]],
                    [[first[1][0], roots[1][0], first[1][1]]]),
         torch.tensor([3, 9, 12]), [2, 1, 2], [[0], [], [1]])
    with pytest.raises(RuntimeError, match="a path of 5 tokens; the heads read 1 to 4"):
        native.expand([(1, 2, 3, 4)], torch.tensor([5]), [4], [[0, 1, 2]])


def agreeing(net, native, fmt: str):
    """``both(call, *args)``: the torch network's and the kernels' ``call`` on the same
    arguments, their scored rows within ``fmt``'s rounding (bf16 0.8%, int8 3%, int4 30% of
    these random weights; a wrong map or row is off by 100% or more); the torch states."""
    tolerance = {"bf16": 0.008, "int8": 0.03, "int4": 0.3}[fmt]

    def both(call, *args):
        with torch.no_grad():
            expected, got = getattr(net, call)(*args), getattr(native, call)(*args)
        assert relative_error(expected[1], got[1]) < tolerance, call
        return expected[0], got[0]
    return both


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_native_eagle_steps_compute_the_torch_layers_steps(kind, fmt, monkeypatch):
    """EAGLE's layer fused on the kernels (NativeEagleHead) drafts what the torch network
    drafts, call for call: contexts read in several steps, tree rows a few a call attending to
    their ancestors, the last step's tree forgotten at the next ingest, and a cache grown past
    its first size on the way. bf16 weights stay within 0.8% of torch's outputs (a tree row
    given its sibling's ancestors is 1.6% off); int8 within its rounding, 3%; int4 (the
    default) within its coarser rounding of these random weights, 30% (a wrong map or row is
    off by 100% or more)."""
    if not kernels.available():
        pytest.skip("the native kernels do not build here")
    monkeypatch.setattr(native_blocks, "INITIAL_ROWS", 16)
    net = perturbed(kind).eval()
    native = NativeEagleHead(net, fmt)
    width = net.size * max(1, len(net.feature_layers))
    gen = torch.Generator().manual_seed(3)
    read = 0
    both = agreeing(net, native, fmt)
    for n in (11, 1, 3, 2, 9):
        feats = torch.randn(n, width, generator=gen)
        ids = torch.randint(50, (n,), generator=gen)
        (root,), (native_root,) = both("ingest", feats, ids, torch.arange(read, read + n))
        read += n
        # a tree: two children of the root, then a child of each, then one under the first
        first = both("expand", [root, root], torch.tensor([4, 7]), [1, 1], [[], []])
        second = both("expand", first[0], torch.tensor([5, 9]), [2, 2], [[0], [1]])
        both("expand", second[0][:1], torch.tensor([6]), [3], [[0, 2]])
    assert native.cache.length == read and native.cache.slots > 16


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_native_clover_steps_compute_the_torch_networks_steps(fmt, monkeypatch):
    """Clover's blocks on the kernels (NativeCloverHeads: two one-layer stacks, the memory the
    regressive one's cache) draft what the torch network drafts, call for call: contexts read
    in several steps (the augmenting block's chain, the memory appended), nodes of several
    depths in one call, and both caches grown past their first size; within the rounding of
    each weight format, as EAGLE's (a wrong map, position or memory row is off by 100%)."""
    if not kernels.available():
        pytest.skip("the native kernels do not build here")
    monkeypatch.setattr(native_blocks, "INITIAL_ROWS", 16)
    net = perturbed("clover").eval()
    native = NativeCloverHeads(net, fmt)
    gen = torch.Generator().manual_seed(5)
    both, read = agreeing(net, native, fmt), 0
    for n in (11, 1, 3, 2, 9):
        feats = torch.randn(n, net.size, generator=gen)
        ids = torch.randint(50, (n,), generator=gen)
        (root,), (native_root,) = both("ingest", feats, ids, torch.arange(read, read + n))
        read += n
        first = both("expand", [root, root], torch.tensor([4, 7]), [1, 1], [[], []])
        both("expand", [first[0][0], first[0][1], root], torch.tensor([5, 9, 3]), [2, 2, 1],
             [[0], [1], []])
    assert native.augment.cache.length == native.regress.cache.length == read
    assert native.regress.cache.slots > 16


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
@pytest.mark.parametrize("layers,row_inputs", [(1, True), (2, True), (1, False)])
def test_native_deer_blocks_are_the_torch_networks_blocks(layers, row_inputs, fmt, monkeypatch):
    """DEER's layers fused on the kernels (NativeDeerDrafter) draft the torch network's block,
    step after step (the context's keys and values written from the fused features of three
    target layers, the anchor's row added to the block, and with ``row_inputs`` a mask a row
    and the root's mapped embedding; a cache grown on the way): bf16 within 0.8%, int8 within
    its rounding."""
    if not kernels.available():
        pytest.skip("the native kernels do not build here")
    monkeypatch.setattr(native_blocks, "INITIAL_ROWS", 16)
    torch.manual_seed(layers)
    net = make_network("deer", 128, torch.randn(50, 128), layers=layers, feature_layers=(1, 3),
                       anchor_input=True, row_inputs=row_inputs)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    native = NativeDeerDrafter(net.eval(), fmt)
    gen = torch.Generator().manual_seed(4)
    read = 0
    for n in (7, 1, 2, 12):
        feats = torch.randn(n, 3 * 128, generator=gen)
        ids = torch.randint(50, (n,), generator=gen)
        with torch.no_grad():
            (expected,), _ = net.ingest(feats, ids, torch.arange(read, read + n))
            (got,), _ = native.ingest(feats, ids, torch.arange(read, read + n))
        read += n
        assert got.shape == expected.shape == (net.max_depth, 128)
        assert relative_error(expected, got) < {"bf16": 0.008, "int8": 0.03}[fmt], n
    assert native.cache.length == read and native.cache.slots > 16


def relative_error(a, b):
    return float((a - b).norm() / a.norm())


def test_untrained_heads_predict_the_next_token_again():
    """Zero-initialised outputs make each network the identity on the feature at the start."""
    embed = torch.randn(50, 64)
    feats = torch.randn(9, 64)
    ids = torch.randint(50, (9,))
    for kind in ("hydra", "clover"):
        out = make_network(kind, 64, embed).train_outputs(feats, ids, 2)
        torch.testing.assert_close(out[0], feats[:len(out[0])])


def test_int8_rows_round_trip():
    t = torch.randn(300, 256)
    stored = int8_rows({"w": t, "small": torch.randn(4, 4), "norm": torch.randn(256)})
    assert stored["w"].dtype == torch.int8 and stored["small"].dtype == torch.float32
    back = float_rows(stored)
    assert set(back) == {"w", "small", "norm"}
    assert (back["w"] - t).abs().max() <= t.abs().amax(1).max() / 127


def test_shortlist_is_the_most_frequent_tokens_and_coverage_counts_answers():
    sequences = [([1, 2, 3, 3, 3, 4], 2), ([5, 3, 4, 4], 1)]
    ids = frequency_shortlist(sequences, 2, vocab=8)
    assert ids.tolist() == [3, 4]
    # answers: [3, 3, 3, 4] and [3, 4, 4]: all inside
    assert shortlist_coverage(ids, sequences) == 1.0
    assert shortlist_coverage(torch.tensor([3]), sequences) == pytest.approx(4 / 7)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=0)


def test_artifacts_load_refuse_and_say_how_to_train(tiny, tmp_path):
    runner = HFRunner(tiny)
    path = tiny_heads("hydra", tiny)
    embed = tiny.get_input_embeddings().weight
    net, head_ids, source, config = load_heads(path, runner, "hydra", embed)
    assert source == path and head_ids is None and config["network"]["heads"] == 4
    with pytest.raises(SpecDecodeError, match="another target model"):
        load_heads(path, HFRunner(tiny_llama(seed=5)), "hydra", embed)
    with pytest.raises(SpecDecodeError, match="not 'eagle_heads'"):
        load_heads(path, runner, "eagle", embed)
    # 'auto' with nothing trained for this target: one line saying how to train
    with pytest.raises(SpecDecodeError, match=r"specdecode train heads --kind clover"):
        Decoder(tiny_llama(seed=9), None, "clover")
    ids = torch.tensor([3, 7, 11])
    saved = save_heads(tmp_path / "h.safetensors", net, ids, runner.fingerprint(), {"x": 1})
    assert load_heads(str(saved), runner, "hydra", embed)[1].tolist() == [3, 7, 11]


def test_a_large_target_without_heads_is_told_to_write_its_data_first(tiny, tmp_path):
    """A 1B target's trainer cannot write its own conversations in minutes: the message names
    its file in the two commands (the shard with its features, then the trainer)."""
    large = tmp_path / "large.gguf"
    with large.open("wb") as f:  # sparse: the size is all that is read
        f.truncate(LARGE_TARGET_BYTES)

    class Target(HFRunner):
        source = str(large)

    with pytest.raises(SpecDecodeError) as err:
        load_heads("auto", Target(tiny_llama(seed=9)), "eagle", tiny.get_input_embeddings().weight)
    assert (f"specdecode train data --model {large} --out SHARD --features eagle`, then "
            f"`specdecode train heads --model {large} --kind eagle --shard SHARD`") in str(err.value)


def test_bad_tree_settings_are_named(tiny):
    with pytest.raises(SpecDecodeError, match="tree_nodes must be >= 1"):
        get("eagle").make_config({"tree_nodes": 0})


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "deer"])  # deer: tests/test_deer.py
def test_sampled_heads_keep_the_target_distribution(kind):
    """Heads draft trees with probabilities at T > 0; the engine's output over the tokens the
    speculative steps produce has the target's exact distribution (chi-square, as for the
    other proposers in tests/test_sampling_stats.py), through the HF runner."""
    check_sampled_distribution(kind, {}, 1200)


@pytest.mark.parametrize("kind", ["hydra", "deer"])
def test_sampled_drafts_from_a_shortlist_keep_the_target_distribution(kind):
    """With a shortlist (the shipped heads have one) a node's distribution is processed on the
    shortlist alone (drafting/session.py ``shortlist_probs``): still the target's output
    distribution, with a token off the shortlist."""
    shortlist = tuple(range(1, ENGINE_VOCAB))
    # no penalties: they read token ids, so with them the vocabulary's processing is kept
    options = SamplingParams(temperature=0.9, top_k=4, top_p=0.95)
    check_sampled_distribution(kind, {}, 1200, drafter=lambda model: {
        "heads": tiny_heads(kind, model, shortlist)}, options=options)


def check_sampled_distribution(kind: str, config: dict, n: int, drafter=None,
                               options: SamplingParams = ENGINE_OPTIONS) -> None:
    """``n`` seeded generations of ``kind`` (with ``config``) on a tiny model match the
    target's distribution under ``options``, and drafts were accepted. ``drafter(model)``: the
    config naming what drafts for the tiny model (default: heads trained on it)."""
    model = tiny_llama(vocab_size=ENGINE_VOCAB, hidden_size=16, layers=1, heads=2, kv_heads=1,
                       seed=3)
    runner = HFRunner(model)
    trained = drafter(model) if drafter is not None else {"heads": tiny_heads(kind, model)}
    # min_path_prob 0: full trees every step, so the rejection rule is exercised throughout
    config = get(kind).make_config({**trained, "min_path_prob": 0.0, **config})
    proposer = get(kind).proposer(config, runner)
    counts, accepted = Counter(), 0
    for i in range(n):
        gen = Generation(runner, proposer, ENGINE_PROMPT, ENGINE_NEW,
                         SamplingParams(**{**vars(options), "seed": i}))
        counts[tuple(gen.run()[1:])] += 1
        accepted += gen.stats.accepted_tokens
    with torch.no_grad():
        def probs(prefix):
            ids = torch.tensor([ENGINE_PROMPT + list(prefix)])
            return reference_probs(model(ids).logits[0, -1].float(), ENGINE_PROMPT, prefix,
                                   options)
        exact = enumerate_sequences(probs, ENGINE_NEW, ENGINE_VOCAB)
    marginal = Counter()
    for seq, mass in exact.items():
        marginal[seq[1:]] += mass
    result = chi_square(counts, dict(marginal), n)
    assert result["p"] > ALPHA, result
    assert accepted > n // 4  # the drafts were really used


@pytest.mark.parametrize("kind", KINDS)
def test_heads_drafts_are_accepted_over_many_steps(tiny, kind):
    """The distribution test above runs one or two verify steps per request; here each network
    drafts through whole generations (about 30 verify steps per prompt, the draft cache fed
    after every one), greedy and sampled: greedy gives ``ar``'s tokens, and in both the
    target accepts drafted tokens (a drafter fed features of the wrong positions, or none,
    would still be exact but accept less or nothing)."""
    heads = tiny_heads(kind, tiny)
    ar = Decoder(tiny, None, "ar", eos_token_ids=[])
    for temperature in (0.0, 0.7):
        # full drafts: on the tiny model a head's drafting outweighs its whole forward
        decoder = Decoder(tiny, None, kind, eos_token_ids=[], heads=heads, min_path_prob=0.0,
                          draft_budget="full")
        accepted = steps = 0
        for seed, prompt in enumerate(repetitive_prompts()):
            generation = decoder.start(prompt, 48, temperature=temperature, seed=seed)
            tokens = generation.run()
            if temperature == 0:
                assert tokens == ar.start(prompt, 48).run(), (kind, prompt)
            accepted += generation.stats.accepted_tokens
            steps += len(generation.stats.accepted_lengths)
        assert steps >= 100, (kind, temperature, steps)
        # measured: 62-77 accepted greedy, 93-100 at T=0.7, over 135-173 steps
        assert accepted >= steps // 5, (kind, temperature, accepted, steps)


@pytest.mark.parametrize("native", [False, True], ids=["hf", "native"])
def test_runners_keep_the_features_their_logits_come_from(tiny, native):
    from specdecode.draft import Draft
    from specdecode.models.llama import LlamaRunner

    runner = LlamaRunner.from_transformers(tiny, "fp32") if native else HFRunner(tiny)
    needs = Needs(final_hidden=True)
    prompt = [5, 6, 7, 8, 9]
    assert runner.prefill(prompt).final_hidden is None  # only what was asked for
    out = runner.prefill(prompt, needs)
    assert out.final_hidden.shape == (len(prompt), 32)
    torch.testing.assert_close(runner.early_exit.head(out.final_hidden[-1:]), out.logits)
    out = runner.forward(3, Draft((4, 5, 6), (-1, 0, -1)), needs)
    assert out.final_hidden.shape == (4, 32)
    assert torch.equal(runner.early_exit.head(out.final_hidden), out.logits) or not native
    torch.testing.assert_close(runner.early_exit.head(out.final_hidden), out.logits)


@pytest.mark.parametrize("native", [False, True], ids=["hf", "native"])
@pytest.mark.parametrize("kind", KINDS)
def test_heads_read_the_targets_features_at_the_committed_positions(tiny, kind, native):
    """Every feature row a head proposer hands its drafter is the target's feature (final
    hidden state, or EAGLE-3's layers side by side) at the position it stands for: the prompt's after the prefill, then each verify step's
    root and accepted nodes, in order. A row from a neighbouring position (or a rejected
    node's) still gives exact output, so only this check catches it."""
    from specdecode.models.llama import LlamaRunner

    runner = LlamaRunner.from_transformers(tiny, "fp32") if native else HFRunner(tiny)
    # min_path_prob 0: full trees, so accepted nodes are often not the first rows
    config = get(kind).make_config({"heads": tiny_heads(kind, tiny), "min_path_prob": 0.0})
    proposer = get(kind).proposer(config, runner)
    handed: list[torch.Tensor] = []
    add_features = proposer.lm.add_features
    proposer.lm.add_features = lambda rows: (handed.append(rows.clone()), add_features(rows))
    prompt = [t % runner.vocab_size for t in repetitive_prompts()[0]]
    gen = Generation(runner, proposer, prompt, 24, eos_token_ids=())
    output = gen.run()
    assert gen.stats.accepted_tokens > 0  # the trees were used, so accepted paths moved rows
    given = torch.cat(handed)
    # every committed position but the last token's (the pending root)
    assert len(given) == len(prompt) + len(output) - 1
    truth = target_features(proposer.net, runner.prefill(prompt + output[:-1], proposer.needs))
    torch.testing.assert_close(given, truth, rtol=1e-4, atol=1e-4)


def test_the_default_model_ships_every_trained_artifact():
    """A fresh install runs every model-based method on the default model: the package holds
    the exit adapters, the distilled draft and the three head networks, all trained for one
    target (the real-model exactness tests load them by fingerprint)."""
    from specdecode.artifacts import packaged_dir, read_metadata

    shipped = {}
    for path in packaged_dir().glob("*.safetensors"):
        kind, fingerprint, _ = read_metadata(path)
        shipped[kind] = fingerprint
        assert path.stat().st_size < 20e6, path  # small enough to ship
    assert {"exit_adapters", "draft_model", "hydra_heads", "clover_heads",
            "eagle_heads", "deer_heads"} <= set(shipped)
    assert len(set(shipped.values())) == 1


# ---- EAGLE-3: three layers' features, training-time test, old artifacts ----------------------

def test_eagle3_reads_the_papers_low_middle_and_high_layers():
    # EAGLE-3's code: the inputs of layers 2, L // 2 and L - 3 (from 0) = outputs after them
    assert eagle3_layers(30) == (2, 15, 27) and eagle3_layers(32) == (2, 16, 29)
    assert eagle3_layers(2) == (1,) and eagle3_layers(1) == ()


@pytest.mark.parametrize("native", [False, True], ids=["hf", "native"])
def test_runners_return_the_eagle3_layers_at_prefill_and_verify(native):
    from specdecode.draft import Draft
    from specdecode.models.llama import LlamaRunner

    model = tiny_llama(layers=8, seed=2)
    runner = LlamaRunner.from_transformers(model, "fp32") if native else HFRunner(model)
    net = make_network("eagle", 32, runner.tables.input_embeddings(), feature_layers=eagle3_layers(8))
    needs = target_needs(net)
    assert needs == Needs(layers=(2, 4, 5))
    prompt = [5, 6, 7, 8, 9]
    assert runner.prefill(prompt).layers == {}  # other methods are given nothing more
    out = runner.prefill(prompt, needs)
    assert out.final_hidden is None and set(out.layers) == {2, 4, 5}
    assert target_features(net, out).shape == (5, 96)
    with torch.no_grad():  # layer k's output: transformers' hidden_states[k]
        reference = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for layer in (2, 4, 5):
        torch.testing.assert_close(out.layers[layer].float(), reference[layer][0],
                                   rtol=1e-4, atol=1e-4)
    out = runner.forward(3, Draft((4, 5, 6), (-1, 0, -1)), needs)
    assert target_features(net, out, [0, 2]).shape == (2, 96)


def test_training_time_test_lowers_the_loss_on_the_heads_own_predictions():
    """Trained unrolled on its own predictions (3 steps), the head's loss at steps 2 and 3
    drafting-style is lower than trained teacher-forced only (1 step), from the same start.
    (The teacher is the target's distribution, so any token sequence serves as data.)"""
    from specdecode.training.train_heads import conversation_features, depth_losses, step_loss

    model = tiny_llama(layers=4, seed=1)
    runner = HFRunner(model)
    head = runner.tables.output_embeddings().float()
    layers = eagle3_layers(4)
    net = make_network("eagle", 32, runner.tables.input_embeddings(), feature_layers=layers)
    torch.manual_seed(0)
    data = []
    for _ in range(2):
        ids = torch.randint(runner.vocab_size, (36,))
        data.append((ids, *conversation_features(runner, net, ids.tolist())))

    def unrolled_losses(train_depth: int) -> list[float]:
        torch.manual_seed(0)
        net = make_network("eagle", 32, runner.tables.input_embeddings(), feature_layers=layers)
        optim = torch.optim.AdamW(net.parameters(), lr=3e-3)
        for step in range(12):
            ids, inputs, final = data[step % len(data)]
            losses = depth_losses(net.train_outputs(inputs, ids, train_depth), final, head)
            optim.zero_grad()
            step_loss("eagle", losses).backward()
            optim.step()
        with torch.no_grad():
            per_depth = [depth_losses(net.train_outputs(inputs, ids, 3), final, head)
                         for ids, inputs, final in data]
        return [sum(float(d[k]) for d in per_depth) / len(data) for k in (1, 2)]

    taught, tested = unrolled_losses(1), unrolled_losses(3)
    assert all(b < a for a, b in zip(taught, tested)), (taught, tested)


def test_old_eagle_artifacts_still_load_and_draft_exactly(tiny, tmp_path):
    """An artifact saved before EAGLE-3 (no feature_layers: EAGLE-1's final features) loads
    as the network it was and asks the target for final features; a new one asks for its
    layers; both draft exactly."""
    runner = HFRunner(tiny)
    embed = runner.tables.input_embeddings()
    old = make_network("eagle", 32, embed)
    assert "feature_layers" not in old.settings()  # what the old trainer stored
    path = save_heads(tmp_path / "old.safetensors", old, None, runner.fingerprint(), {})
    ar = Decoder(tiny, None, "ar", eos_token_ids=[])
    prompt = repetitive_prompts()[0]
    for heads, needs in ((str(path), Needs(final_hidden=True)),
                         (tiny_heads("eagle", tiny), Needs(layers=(1,)))):
        decoder = Decoder(tiny, None, "eagle", eos_token_ids=[], heads=heads, min_path_prob=0.0)
        assert decoder.proposer.needs == needs
        assert decoder.start(prompt, 24).run() == ar.start(prompt, 24).run()


def test_held_out_agreement_counts_answer_positions_only():
    """``train heads``' held-out measure: at depth k, output row t is right where its top
    shortlist token (mapped to the vocabulary) is the target's greedy token after position
    t + k + 1, counted over the answer's positions only; checked against a direct count."""
    import types

    from specdecode.training.train_heads import evaluate

    torch.manual_seed(0)
    vocab, width, length, prompt_len = 40, 8, 30, 12
    full_head = torch.randn(vocab, width)
    head_ids = torch.randperm(vocab)[:25]
    final = torch.randn(length, width)
    outputs = {k: torch.randn(length - k - 1, width) for k in range(3)}
    # half of depth 0's rows copy the teacher's next state: right wherever it is on the shortlist
    outputs[0][::2] = final[1::2][: len(outputs[0][::2])]

    class Net:
        def reset(self):
            pass

        def train_outputs(self, inputs, tokens, depth):
            return {k: outputs[k] for k in range(depth)}

    data = types.SimpleNamespace(evaluation=[(list(range(length)), prompt_len)],
                                 features=lambda net, ids: (None, final), full_head=full_head,
                                 head=full_head[head_ids], head_ids=head_ids,
                                 read_ahead=lambda net, upcoming: None)
    expected = []
    for k in range(3):
        hits = total = 0
        for t in range(length - k - 1):
            if t + k + 1 < prompt_len - 1:
                continue
            want = int((final[t + k + 1] @ full_head.T).argmax())
            got = int(head_ids[(outputs[k][t] @ full_head[head_ids].T).argmax()])
            hits, total = hits + (got == want), total + 1
        expected.append(round(hits / total, 4))
    assert evaluate(Net(), data, 3) == expected
    assert expected[0] > expected[1]  # the copied rows count


@pytest.mark.parametrize("kind", ["hydra", "eagle", "eagle3", "deer"])
def test_packed_conversations_train_as_each_alone(kind):
    """``train heads --pack``: conversations packed one after another give, on the rows that
    score a token of their own conversation, the outputs each gives alone (a row sees its own
    conversation only, at positions from its start), and the packed loss reads those rows
    only: the mean of the per-conversation losses weighted by their rows. deer's rows are its
    anchors': every position of each conversation here, offset by where it starts."""
    from specdecode.training.train_heads import depth_losses

    net = perturbed(kind).eval()
    width = net.size * max(1, len(net.feature_layers))
    gen = torch.Generator().manual_seed(4)
    lengths, depth = [9, 5, 12], 3
    feats = [torch.randn(n, width, generator=gen) for n in lengths]
    finals = [torch.randn(n, net.size, generator=gen) for n in lengths]
    ids = [torch.randint(50, (n,), generator=gen).tolist() for n in lengths]
    tokens, starts = packed(ids)
    assert starts == [0, 9, 14] and len(tokens) == 26
    head = torch.randn(50, net.size, generator=gen)
    anchors = torch.cat([torch.arange(n - 1) + s for n, s in zip(lengths, starts)])
    packed_input = (anchors, starts) if kind == "deer" else (starts,)
    with torch.no_grad():
        together = net.train_outputs(torch.cat(feats), torch.tensor(tokens), depth,
                                     *packed_input)
        alone = [net.train_outputs(f, torch.tensor(i), depth) for f, i in zip(feats, ids)]
        for k in range(depth):
            rows = anchors if kind == "deer" else torch.arange(len(tokens))
            rows = rows[:len(together[k])]
            keep = packed_rows(len(tokens), starts, k, rows)
            torch.testing.assert_close(together[k][keep], torch.cat([a[k] for a in alone]),
                                       rtol=1e-5, atol=1e-5)
        joint = depth_losses(together, torch.cat(finals), head,
                             anchors if kind == "deer" else None, starts)
        parts = [depth_losses(a, f, head) for a, f in zip(alone, finals)]
    for k in range(depth):
        counts = [len(a[k]) for a in alone]
        mean = sum(p[k] * c for p, c in zip(parts, counts)) / sum(counts)
        torch.testing.assert_close(joint[k], mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["hydra", "eagle3", "deer"])
def test_padded_reads_give_each_conversations_own_features(kind):
    """``train heads`` on the hf runner reads conversations of different lengths in one padded
    forward: each one's features are its own prefill's, and a cache that fills part-way keeps
    what fits and still returns the rest."""
    from specdecode.training.train_heads import _Data, batch_features, conversation_features

    model = tiny_llama(layers=4, seed=2)
    runner = HFRunner(model)
    layers = eagle3_layers(4) if kind == "eagle3" else []
    net = make_network(kind.rstrip("3"), 32, runner.tables.input_embeddings(),
                       **({"feature_layers": layers} if layers else {}))
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(runner.vocab_size, (n,), generator=gen).tolist()
                 for n in (17, 5, 30)]
    alone = [conversation_features(runner, net, ids) for ids in sequences]
    together = batch_features(model, net, sequences)
    for (inputs, final), (want_inputs, want_final) in zip(together, alone):
        assert inputs.shape == want_inputs.shape and final.shape == want_final.shape
        torch.testing.assert_close(inputs, want_inputs, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(final, want_final, rtol=1e-4, atol=1e-5)
    room = sum(i.nbytes + f.nbytes for i, f in alone[:2])
    data = _Data([], [], runner, "", "", None, None, None, 1.0, cache_limit=room,
                 padded_reads=True)
    read = data.features_of(net, sequences)
    assert len(data.cache) == 2 and tuple(sequences[2]) not in data.cache
    torch.testing.assert_close(read[2][1], alone[2][1], rtol=1e-4, atol=1e-5)
