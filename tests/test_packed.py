"""One forward for many sequences (``LlamaRunner.run_packed``): every call's output and its
runner's cache afterwards are bitwise what the same call gives alone, in every weight format and
for a Gemma-shaped model (sliding windows, head and post norms), with verify calls of every
draft shape and prompt parts of every kind in one pass."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.models.base import Needs, PrefillCall, VerifyCall
from specdecode.models.hf import HFRunner
from specdecode.models.kv_cache import INITIAL_SLOTS, BlockedKVCache
from specdecode.models.llama import PREFILL_BLOCK, LlamaRunner
from specdecode.models.native_shape import kv_cache_bytes
from tiny_models import tiny_llama, tiny_model

VOCAB = 96
WINDOW = 8


def llama(seed=0, heads=4):
    # int4 needs input sizes divisible by 32; 4 heads over 2 kv heads: grouped-query attention
    return tiny_llama(vocab_size=VOCAB, hidden_size=16 * heads, layers=3, heads=heads, kv_heads=2,
                      seed=seed, max_positions=512)


def gemma(seed=0):
    return tiny_model("gemma3_text", vocab_size=VOCAB, sliding_window=WINDOW, layers=2,
                      layer_types=["sliding_attention", "full_attention"], seed=seed,
                      max_position_embeddings=512)


#: "llama6": 6 heads over 2 kv heads, three a group like SmolLM2's (another attention block)
CASES = [("llama", "int4"), ("llama", "int8"), ("llama", "fp32"), ("llama", "bf16"),
         ("llama6", "int4"), ("gemma", "int4"), ("gemma", "fp32")]
_RUNNERS: dict[tuple[str, str], LlamaRunner] = {}


def runner_for(model: str, weights: str) -> LlamaRunner:
    if (model, weights) not in _RUNNERS:
        built = {"llama": llama, "llama6": lambda: llama(heads=6), "gemma": gemma}[model]()
        _RUNNERS[model, weights] = LlamaRunner.from_transformers(built, weights)
    return _RUNNERS[model, weights]


def tokens(rng, n):
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def random_draft(rng, shape: str) -> Draft:
    if shape == "empty":
        return Draft.empty()
    if shape == "chain":
        return Draft.chain(list(tokens(rng, rng.randrange(1, 8))))
    n = rng.randrange(2, 12)
    return Draft(tokens(rng, n), tuple(rng.randrange(-1, i) for i in range(n)))


def accepted(rng, draft: Draft) -> list[int]:
    """A root-to-node path of ``draft`` (or none of it), as a verifier might keep."""
    node = rng.randrange(-1, len(draft))
    return draft.path_to(node) if node >= 0 else []


def assert_same(packed, alone, what):
    assert (packed is None) == (alone is None), what
    if alone is None:
        return
    assert torch.equal(packed.logits, alone.logits), what
    assert (packed.final_hidden is None) == (alone.final_hidden is None), what
    if alone.final_hidden is not None:
        assert torch.equal(packed.final_hidden, alone.final_hidden), what
    assert packed.layers.keys() == alone.layers.keys(), what
    for layer in alone.layers:
        assert torch.equal(packed.layers[layer], alone.layers[layer]), (what, layer)


def committed(runner: LlamaRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed rows' keys and values [L, KH, length, D] of the runner's cache."""
    cache, n = runner.cache, runner.cache_len
    k = cache.keys.permute(0, 1, 2, 4, 3).flatten(2, 3)  # [L, KH, capacity, D]
    return k[:, :, :n], cache.values[:, :, :n]


def assert_same_caches(packed: LlamaRunner, alone: LlamaRunner, what) -> None:
    assert packed.cache_len == alone.cache_len and packed.pending_rows == alone.pending_rows, what
    for a, b in zip(committed(packed), committed(alone)):
        assert torch.equal(a, b), what


class Sequences:
    """Twin sets of replicas of one runner: the calls of each step run packed on one set and
    one by one on the other; their outputs and caches must be the same bits."""

    def __init__(self, base: LlamaRunner, count: int):
        self.base = base
        self.packed = [base.replica() for _ in range(count)]
        self.alone = [base.replica() for _ in range(count)]

    def step(self, calls: dict[int, object], rng) -> list:
        work = [(self.packed[i], call) for i, call in calls.items()]
        outs = self.base.run_packed(work)
        assert len(outs) == len(work)
        for (i, call), out in zip(calls.items(), outs):
            assert_same(out, call.run(self.alone[i]), (i, call))
        # the same verifier decision on both twins, then the caches must agree
        for (i, call), out in zip(calls.items(), outs):
            if isinstance(call, VerifyCall):
                path = accepted(rng, call.draft)
                self.packed[i].commit(path)
                self.alone[i].commit(path)
            assert_same_caches(self.packed[i], self.alone[i], i)
        return outs


def decode_steps(seqs: Sequences, live: list[int], rng, steps: int, extra=None) -> None:
    """``steps`` passes of verify calls of every draft shape for the ``live`` sequences (and
    ``extra(step)``'s calls beside them)."""
    shapes = ["chain", "tree", "empty"]
    for step in range(steps):
        calls = {}
        for j, i in enumerate(live):
            needs = [Needs(), Needs(final_hidden=True), Needs(layers=(1,))][(i + step) % 3]
            calls[i] = VerifyCall(rng.randrange(VOCAB), random_draft(rng, shapes[(i + step) % 3]),
                                  needs)
        calls.update(extra(step) if extra else {})
        seqs.step(calls, rng)


@pytest.mark.parametrize("model,weights", CASES)
def test_packed_calls_equal_solo_calls_bitwise(model, weights):
    base = runner_for(model, weights)
    rng = random.Random(11)
    seqs = Sequences(base, 7)
    # whole prompts of different lengths (one of several blocks), packed; features of some
    lengths = [5, 1, 40, PREFILL_BLOCK + 30, 17, 3]
    prompts = [tokens(rng, n) for n in lengths]
    seqs.step({i: PrefillCall(p, 0, len(p), Needs(final_hidden=i % 2 == 0, layers=(1,) * (i % 3 == 0)))
               for i, p in enumerate(prompts)}, rng)
    live = list(range(len(prompts)))
    decode_steps(seqs, live, rng, 3)
    # a long prompt in parts (first, middle, last; the middle one two blocks) beside the
    # decoding sequences, the parts asking for features
    long = tokens(rng, 3 * PREFILL_BLOCK + 20)
    parts = [(0, PREFILL_BLOCK), (PREFILL_BLOCK, 3 * PREFILL_BLOCK), (3 * PREFILL_BLOCK, len(long))]
    needs = Needs(final_hidden=True, layers=(1,))
    decode_steps(seqs, live, rng, len(parts), lambda step: {6: PrefillCall(long, *parts[step], needs)})
    # then that one decodes with the others
    decode_steps(seqs, live + [6], rng, 3)
    # a sequence starts over with a new prompt while the others decode
    decode_steps(seqs, live[1:], rng, 1, lambda step: {0: PrefillCall(tokens(rng, 9), 0, 9)})
    decode_steps(seqs, live + [6], rng, 2)


def test_threads_split_the_packed_forward_without_changing_a_bit():
    torch.set_num_threads(2)
    base = runner_for("llama", "int4")
    rng = random.Random(3)
    seqs = Sequences(base, 5)
    prompts = [tokens(rng, n) for n in (60, 2, 33, 150, 7)]
    seqs.step({i: PrefillCall(p, 0, len(p)) for i, p in enumerate(prompts)}, rng)
    decode_steps(seqs, list(range(5)), rng, 4)


@pytest.mark.parametrize("weights", ["int4", "fp32"])
def test_a_cache_that_grows_gives_the_bits_of_one_allocated_whole(weights):
    """A replica's cache starts with a few slots and grows (copying its rows over) while a
    prompt in parts and drafts are written; a twin whose cache holds its whole capacity from
    the start computes the same bits, packed beside it. A new prompt gives the memory back."""
    base = runner_for("llama", weights)
    rng = random.Random(7)
    seqs = Sequences(base, 2)
    grown, whole = seqs.packed
    whole.cache = BlockedKVCache(*whole.cache._shape, whole.cache.capacity, whole.cache._dtype,
                                 initial=whole.cache.capacity)
    start = grown.cache.slots
    assert start == INITIAL_SLOTS < grown.cache.capacity and grown.kv_bytes < whole.kv_bytes
    long = tokens(rng, 2 * PREFILL_BLOCK + 90)
    for first, stop in ((0, PREFILL_BLOCK), (PREFILL_BLOCK, len(long))):
        seqs.step({0: PrefillCall(long, first, stop), 1: PrefillCall(long, first, stop)}, rng)
    decode_steps(seqs, [0, 1], rng, 3)
    assert grown.cache.slots == 2 * start < whole.cache.slots  # doubled once, for 346 rows
    assert grown.kv_bytes == kv_cache_bytes(base.shape, 2 * start, weights)
    seqs.step({0: PrefillCall(tokens(rng, 5), 0, 5)}, rng)
    assert grown.cache.slots == start


def test_storage_grows_in_whole_blocks_up_to_its_capacity():
    cache = BlockedKVCache(2, 1, 8, 96, torch.float32, initial=20)
    assert cache.slots == 32 and cache.keys.shape == (2, 1, 2, 8, 16)
    cache.reserve(33)
    assert cache.slots == 64  # twice as many
    cache.reserve(65)
    assert cache.slots == 96 and cache.nbytes == 2 * (2 * 1 * 96 * 8 * 4)  # the capacity
    with pytest.raises(SpecDecodeError, match="holds 96 rows, not 97"):
        cache.reserve(97)
    unbounded = BlockedKVCache(2, 1, 8, None, torch.float32, initial=16)
    unbounded.reserve(1000)
    assert unbounded.slots == 1008


def test_storage_made_in_a_forward_takes_saved_rows_outside_inference_mode():
    """Forwards run in inference mode, where the storage grows and where a new prompt gives it
    back; the server's prompt cache loads saved rows into it between forwards, outside
    inference mode, so storage made in a forward must take them (torch refuses in-place
    writes to inference tensors there)."""
    base = runner_for("llama", "int4")
    rng = random.Random(11)
    first, second = base.replica(), base.replica()
    long = tokens(rng, INITIAL_SLOTS + 40)
    first.prefill(long)
    saved = first.saved_rows(len(long))
    second.prefill(long)  # grows in its forward
    assert second.cache.slots == 2 * INITIAL_SLOTS and not torch.is_inference_mode_enabled()
    second.load_rows(saved, len(long) - 3)
    second.keep_prefix(0)
    second.prefill(long[:5])  # a new prompt: its forward gives the storage back
    assert second.cache.slots == INITIAL_SLOTS
    second.load_rows(saved, 100)  # a shared system prompt, say
    first.keep_prefix(100)
    assert all(torch.equal(a, b) for a, b in zip(committed(first), committed(second)))


def test_runner_of_another_model_is_refused():
    base = runner_for("llama", "int4")
    other = LlamaRunner.from_transformers(llama(seed=1), "int4")
    call = VerifyCall(1, Draft.empty())
    with pytest.raises(SpecDecodeError, match="does not share this runner's weights"):
        base.run_packed([(base.replica(), call), (other, call)])
    hf = HFRunner(llama())
    with pytest.raises(SpecDecodeError, match="does not share this runner's weights"):
        base.run_packed([(hf, call)])


def test_bad_work_is_refused_before_any_call_runs():
    base = runner_for("llama", "int8")
    first, second = base.replica(), base.replica()
    first.prefill([1, 2, 3])
    second.prefill([4, 5])
    second.forward(6, Draft.empty())  # left pending: a second forward is refused
    before = committed(first)
    with pytest.raises(SpecDecodeError, match="twice without commit"):
        base.run_packed([(first, VerifyCall(7, Draft.chain([8, 9]))), (second, VerifyCall(1, Draft.empty()))])
    assert first.cache_len == 3 and first.pending_rows == 0
    assert all(torch.equal(a, b) for a, b in zip(before, committed(first)))
    with pytest.raises(SpecDecodeError, match="two calls in one pass"):
        base.run_packed([(first, VerifyCall(7, Draft.empty())), (first, VerifyCall(7, Draft.empty()))])
    with pytest.raises(SpecDecodeError, match="must start at 0 or where the last part stopped"):
        base.run_packed([(first, PrefillCall(tuple(range(300)), PREFILL_BLOCK, 2 * PREFILL_BLOCK))])


def test_every_format_packs_calls():
    # prompts of fp32 and bf16 go through other layers and run alone, beside the packed forward
    assert all(runner_for("llama", weights).packs_calls for weights in ("int4", "int8", "fp32", "bf16"))


def test_default_run_packed_of_hf_runner_equals_solo():
    model = llama(seed=2)
    base = HFRunner(model)
    assert not base.packs_calls
    rng = random.Random(5)
    packed, alone = [base.replica() for _ in range(3)], [base.replica() for _ in range(3)]
    prompts = [tokens(rng, n) for n in (4, 19, 9)]
    calls = [PrefillCall(p, 0, len(p), Needs(final_hidden=True)) for p in prompts]
    for step in range(3):
        outs = base.run_packed(list(zip(packed, calls)))
        for call, runner, out in zip(calls, alone, outs):
            assert_same(out, call.run(runner), step)
        calls = [VerifyCall(rng.randrange(VOCAB), random_draft(rng, shape)) for shape in ("chain", "tree", "empty")]
        if step:
            for twins in zip(packed, alone):
                for runner in twins:
                    runner.commit([])


def test_row_costs_leave_the_runner_untouched():
    from specdecode.models.row_costs import measure_row_costs

    runner = runner_for("llama", "int4").replica()
    runner.prefill([3, 4, 5])
    runner.forward(6, Draft.chain([7, 8]))  # pending rows too
    before = committed(runner)
    costs = measure_row_costs(runner, rows=(1, 4, 16), repeats=2)
    assert list(costs) == [1, 4, 16] and all(t > 0 for t in costs.values())
    assert runner.cache_len == 3 and runner.pending_rows == 3
    assert all(torch.equal(a, b) for a, b in zip(before, committed(runner)))
    with pytest.raises(SpecDecodeError, match="row counts must be positive"):
        measure_row_costs(runner, rows=(0, 4))


@pytest.mark.slow
def test_default_model_packs_bitwise(real_model):
    from specdecode.models.loading import make_runner

    base = make_runner(real_model, max_context=512)
    rng = random.Random(2)
    seqs = Sequences(base, 4)
    prompts = [tokens(rng, n) for n in (12, 150, 1, 40)]
    seqs.step({i: PrefillCall(p, 0, len(p), Needs(final_hidden=i == 1)) for i, p in enumerate(prompts)}, rng)
    decode_steps(seqs, list(range(4)), rng, 3)
