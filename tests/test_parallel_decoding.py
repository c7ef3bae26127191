"""Parallel decoding without a drafter: the Jacobi update, Lookahead's 2-D window as a tree and
its n-gram pool, ADED's tri-gram search, and SJD's sampled output distribution (with a wrong
rule that the same test rejects). Greedy identity with ``ar`` for all four is in
test_exactness.py (every registered method)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from specdecode import registry
from specdecode.control import Budget
from specdecode.draft import Draft
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.proposer import Feedback
from specdecode.proposers.aded import ADEDConfig, ADEDProposer, TrigramMatrix, search
from specdecode.proposers.jacobi import JacobiConfig, JacobiProposer
from specdecode.proposers.lookahead import LookaheadConfig, LookaheadProposer, NgramPool
from specdecode.proposers.sjd import SJDConfig, SJDProposer
from specdecode.sampling import SamplingParams

from tiny_models import tiny_llama

from test_sampling_stats import ALPHA, WRONG, TableRunner, chi_square, enumerate_sequences, reference_probs

V = 64
WIDE = Budget(max_depth=64, max_nodes=128)
RUNNER = SimpleNamespace(vocab_size=V)


def feedback(context, draft: Draft, predictions, accepted) -> Feedback:
    """A verify step whose target predicts ``predictions[r]`` at logits row r (row 0 = after the
    root); ``accepted`` draft nodes, then the bonus token the target predicts after them."""
    logits = torch.full((len(draft) + 1, V), -5.0)
    logits[torch.arange(len(draft) + 1), torch.tensor(predictions)] = 5.0
    last = accepted[-1] + 1 if accepted else 0
    tokens = tuple(draft.tokens[i] for i in accepted) + (predictions[last],)
    return Feedback(tuple(context), draft, logits, tuple(accepted), tokens)


# ---- Jacobi -----------------------------------------------------------------------------------

def test_jacobi_update_is_the_docstring_example():
    """W = 3, root r = 1, window (a, x, c) = (2, 9, 4): the target predicts a after r, b = 3
    after a, c after x, d = 5 after c. a is accepted, b is the bonus, and the next window is
    (c, d) from rows 2 and 3, padded with d."""
    jacobi = JacobiProposer(JacobiConfig(window=3), RUNNER)
    jacobi.start([7, 1])
    assert jacobi.propose([7, 1], WIDE).tokens == (1, 1, 1)  # before any forward: the root
    jacobi.guesses = [2, 9, 4]
    draft = jacobi.propose([7, 1], WIDE)
    assert draft.tokens == (2, 9, 4) and draft.is_chain
    step = feedback([7, 1], draft, [2, 3, 4, 5], accepted=[0])
    assert step.tokens == (2, 3)
    jacobi.observe(step)
    assert jacobi.propose([7, 1, 2, 3], WIDE).tokens == (4, 5, 5)
    # the budget caps the window
    assert jacobi.propose([7, 1, 2, 3], Budget(max_depth=2, max_nodes=128)).tokens == (4, 5)


def test_jacobi_reaches_the_fixed_point():
    """Once the window holds the target's own continuation, every token of it is accepted."""
    jacobi = JacobiProposer(JacobiConfig(window=4), RUNNER)
    jacobi.start([1])
    jacobi.guesses = [6, 7, 8, 9]
    draft = jacobi.propose([1], WIDE)
    step = feedback([1], draft, [6, 7, 8, 9, 10], accepted=[0, 1, 2, 3])
    assert step.tokens == (6, 7, 8, 9, 10)
    jacobi.observe(step)
    assert jacobi.guesses == []  # every row was used up: the next window starts from padding


# ---- Lookahead --------------------------------------------------------------------------------

def lookahead(**config) -> LookaheadProposer:
    return LookaheadProposer(LookaheadConfig(**config), RUNNER)


def path(draft: Draft, node: int) -> tuple[int, ...]:
    return tuple(draft.tokens[i] for i in draft.path_to(node))


def test_lookahead_window_is_a_tree_with_the_reference_mask():
    """W = 3, N = 4 with the levels filled: base row (b1, b2) after the root, levels L1 and L2
    of 3 columns. Cell (level l, column i) hangs under base column i with its own column below
    it, at depth i + l: the reference's attention mask and position ids."""
    la = lookahead(window=3, ngram=4, guesses=0, pool_from_context=False)
    la.start([1, 2, 3])
    la.base, la.levels = [10, 11], [[20, 21, 22], [30, 31, 32]]
    draft = la.propose([1, 2, 3], WIDE)
    paths = {path(draft, i) for i in range(len(draft))}
    assert paths == {(10,), (10, 11),                      # the base row, a chain
                     (20,), (10, 21), (10, 11, 22),        # level 1, column 0 under the root
                     (20, 30), (10, 21, 31), (10, 11, 22, 32)}
    assert len(draft) == (3 - 1) + 3 * (4 - 2)  # the reference's (W - 1) + W (N - 2) rows
    depth = {path(draft, i): draft.depths[i] for i in range(len(draft))}
    assert depth[(10, 11, 22, 32)] == 2 + 2 and depth[(20, 30)] == 0 + 2


def test_lookahead_collects_ngrams_and_moves_the_window():
    la = lookahead(window=3, ngram=4, guesses=2, pool_from_context=False)
    la.start([1, 2, 3])
    la.base, la.levels = [10, 11], [[20, 21, 22], [30, 31, 32]]
    draft = la.propose([1, 2, 3], WIDE)
    rows = {path(draft, i): i + 1 for i in range(len(draft))}
    predictions = [0] * (len(draft) + 1)
    predictions[0] = 5  # the bonus: nothing accepted
    for column, top in enumerate([(20, 30), (10, 21, 31), (10, 11, 22, 32)]):
        predictions[rows[top]] = 40 + column
    la.observe(feedback([1, 2, 3], draft, predictions, accepted=[]))
    # each column's diagonal plus its prediction, under the column's base token
    assert la.pool.candidates(3) == [(20, 30, 40)]
    assert la.pool.candidates(10) == [(21, 31, 41)]
    assert la.pool.candidates(11) == [(22, 32, 42)]
    # one position on: level 1 after the new root is the base row, the predictions the top
    assert la.base == [21, 22] and la.levels == [[30, 31, 32], [40, 41, 42]]
    # the new root 5 has no n-grams yet; 10 has, and verifies them before the window
    assert la.propose([1, 2, 3, 10], WIDE).tokens[:3] == (21, 31, 41)


def test_lookahead_fills_its_levels_from_a_prompt_copy():
    la = lookahead(window=4, ngram=4, guesses=4, pool_from_context=False)
    la.start([1, 2, 3, 4, 5])
    assert len(la.base) == 4 + 4 - 3 and not la.levels and set(la.base) <= {1, 2, 3, 4, 5}
    for step in range(2):
        draft = la.propose([1, 2, 3, 4, 5], WIDE)
        la.observe(feedback([1, 2, 3, 4, 5], draft, [7] * (len(draft) + 1), accepted=[]))
        # every row loses a column per step while the levels fill
        assert [len(row) for row in [[5] + la.base] + la.levels] == [4 + 1 - step] * (step + 2)
    assert la.full and not la.pool.table  # n-grams only come from a full window


def test_ngram_pool_keeps_the_most_recent_guesses():
    pool = NgramPool(guesses=2)
    pool.add(1, (2, 3))
    pool.add(1, (4, 5))
    pool.add(1, (2, 3))  # seen again: most recent
    pool.add(1, (6, 7))  # full: the least recently seen, (4, 5), goes
    assert pool.candidates(1) == [(6, 7), (2, 3)]
    pool.add_text([1, 8, 9, 1, 8], 3)
    assert pool.candidates(1) == [(8, 9), (6, 7)] and pool.candidates(8) == [(9, 1)]


def test_lookahead_pool_outlives_the_request():
    """The pool stays on the proposer: a second request with the same prompt verifies n-grams
    from the first one on its very first step (a server slot keeps its proposer)."""
    model = tiny_llama(seed=0)
    from specdecode.api import Decoder

    decoder = Decoder(model, None, "lookahead", eos_token_ids=[], pool_from_context=False)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    first = decoder.start(prompt, 24)
    first.run()
    assert decoder.proposer.pool.table
    second = decoder.start(prompt, 24)
    assert second.run() == first.tokens
    assert second.stats.mean_accepted >= first.stats.mean_accepted


# ---- ADED -------------------------------------------------------------------------------------

def test_aded_search_is_the_docstring_example():
    matrix = TrigramMatrix()
    for c in (3, 3, 3, 4):
        matrix.add(1, 2, c)
    matrix.add(2, 3, 5)
    assert matrix.successors(1, 2, 4) == [(3, 0.75), (4, 0.25)]
    chain = search(matrix, [9, 1, 2], 15, 4, 1.0, 8, 64)
    assert (chain.tokens, chain.parents) == ((3, 5), (-1, 0))
    tree = search(matrix, [9, 1, 2], 16, 4, 1.0, 8, 64)
    assert (tree.tokens, tree.parents) == ((3, 4, 5), (-1, -1, 0))
    # the budget keeps the most visited nodes, still a tree
    assert search(matrix, [9, 1, 2], 16, 4, 1.0, 8, 1).tokens == (3,)
    assert search(matrix, [9, 1, 2], 16, 4, 1.0, 1, 64).tokens == (3, 4)
    assert len(search(matrix, [2], 16, 4, 1.0, 8, 64)) == 0  # no pair to start from


def test_aded_learns_verified_tokens_and_the_targets_predictions():
    aded = ADEDProposer(ADEDConfig(learn_from_target=True), RUNNER)
    aded.start([1, 2])
    assert aded.propose([1, 2], WIDE).tokens == ()
    draft = Draft.chain([3])
    # the target predicts 3 after (1, 2) and 6 after (2, 3): 3 accepted, bonus 6
    aded.observe(feedback([1, 2], draft, [3, 6], accepted=[0]))
    assert aded.matrix.counts[(1, 2)] == Counter({3: 2})  # predicted and verified
    assert aded.matrix.counts[(2, 3)] == Counter({6: 2})
    plain = ADEDProposer(ADEDConfig(learn_from_target=False), RUNNER)
    plain.start([1, 2])
    plain.observe(feedback([1, 2], Draft.chain([4]), [3, 6], accepted=[]))
    assert plain.matrix.counts == {(1, 2): Counter({3: 1})}  # only the verified token
    assert plain.propose([1, 2], WIDE).tokens == (3,)


# ---- configuration errors ---------------------------------------------------------------------

@pytest.mark.parametrize("method, overrides, message", [
    ("jacobi", {"window": 0}, "window must be an integer in 1..64"),
    ("sjd", {"window": 65}, "window must be an integer in 1..64"),
    ("lookahead", {"ngram": 2}, "ngram must be an integer in 3..16"),
    ("lookahead", {"window": 0}, "window must be an integer in 1..32"),
    ("lookahead", {"guesses": -1}, "guesses must be an integer >= 0"),
    ("aded", {"simulations": 0}, "simulations must be an integer in 1..256"),
    ("aded", {"c_puct": -1.0}, "c_puct must be a finite number >= 0"),
])
def test_bad_config_names_the_problem(method, overrides, message):
    with pytest.raises(SpecDecodeError, match=message):
        registry.get(method).make_config(overrides)


# ---- SJD: the sampled output distribution -----------------------------------------------------

SJD_VOCAB = 5
SJD_PROMPT = [1, 4, 3]
#: new tokens per request: the prefill's, then verify steps with windows of up to 3 guesses
SJD_NEW = 4
SJD_SAMPLING = SamplingParams(temperature=0.9, top_k=4, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def sjd_runner():
    model = tiny_llama(vocab_size=SJD_VOCAB, hidden_size=16, layers=1, heads=2, kv_heads=1, seed=5)
    return TableRunner(model, SJD_PROMPT, SJD_NEW - 1)


def sjd_check(runner, n, wrong_guess=False) -> tuple[dict, int]:
    """Decode ``n`` seeded requests with SJD (window 3) and test the distribution of new tokens
    2..SJD_NEW against the model's own, enumerated."""
    proposer = SJDProposer(SJDConfig(window=3), runner)
    if wrong_guess:
        # wrong on purpose: the guess is the argmax of p but records p as the q it came from
        proposer.draw = lambda q: int(q.argmax())
    counts, accepted = Counter(), 0
    for i in range(n):
        gen = Generation(runner, proposer, SJD_PROMPT, SJD_NEW,
                         SamplingParams(**{**vars(SJD_SAMPLING), "seed": i}))
        counts[tuple(gen.run()[1:])] += 1
        accepted += gen.stats.accepted_tokens
    exact = enumerate_sequences(
        lambda prefix: reference_probs(runner.table[tuple(SJD_PROMPT) + prefix], SJD_PROMPT,
                                       prefix, SJD_SAMPLING), SJD_NEW, SJD_VOCAB)
    marginal = Counter()
    for seq, mass in exact.items():
        marginal[seq[1:]] += mass
    return chi_square(counts, dict(marginal), n), accepted


def test_sjd_keeps_the_target_distribution(sjd_runner):
    result, accepted = sjd_check(sjd_runner, 1500)
    assert result["p"] > ALPHA, result
    assert accepted > 1500 // 4  # the sampled guesses were really accepted, not all rejected


def test_sjd_with_greedy_guesses_recorded_as_sampled_fails(sjd_runner):
    result, _ = sjd_check(sjd_runner, 1500, wrong_guess=True)
    assert result["p"] < WRONG, result


def test_sjd_same_seed_same_tokens(sjd_runner):
    proposer = SJDProposer(SJDConfig(window=3), sjd_runner)
    params = SamplingParams(**{**vars(SJD_SAMPLING), "seed": 11})
    runs = [Generation(sjd_runner, proposer, SJD_PROMPT, SJD_NEW, params).run() for _ in range(2)]
    assert runs[0] == runs[1]
