"""PEARL (``pearl``): the int4 copy drafts on its own thread while the fp32 target verifies.
Exact against the fp32 target's ``ar``; the drafter really works during the target's forward;
a draft made ahead is used when the target took the whole draft and discarded (the drafter
rewound) when not; the kernels give the same bits with the GIL released and run on each
thread's own OpenMP team.

Files are tiny random-weight shapes written by ``specdecode.bench.shapes``; the greedy and
end-of-sequence cases on tiny ``transformers`` models are in test_exactness.py (every
registered method)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from specdecode import kernels
from specdecode.api import Decoder
from specdecode.bench.shapes import write_shape
from specdecode.control import Budget
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.models.llama import LlamaRunner
from specdecode.proposer import Feedback

PROMPTS = ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [1, 5, 9, 200, 300, 41, 7, 88, 5, 9, 200])


@pytest.fixture(scope="module")
def fp32_target(tmp_path_factory):
    path = write_shape(tmp_path_factory.mktemp("pearl") / "tiny.gguf", "tiny", "Q4_1", vocab=512)
    return LlamaRunner.from_gguf(path, "fp32")


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_equals_the_fp32_targets_ar_and_drafts_ahead(fp32_target, gamma):
    ar = Decoder(fp32_target, None, "ar", eos_token_ids=[])
    decoder = Decoder(fp32_target, None, "pearl", eos_token_ids=[], gamma=gamma)
    drafted = 0
    for prompt in PROMPTS:
        generation = decoder.start(prompt, 40)
        assert generation.run() == ar.start(prompt, 40).run()
        drafted += generation.stats.draft_tokens
    stats = decoder.proposer.stats
    assert stats.pre_verify_rounds > 0
    if gamma > 1:  # gamma 1 drafts only the target's next token: nothing is left to hand over
        assert stats.post_verify_rounds > 0 and stats.ahead_kept > 0
        assert drafted > 0


def test_the_target_thread_gets_its_threads_back(fp32_target):
    before = torch.get_num_threads()
    Decoder(fp32_target, None, "pearl", eos_token_ids=[]).start(PROMPTS[0], 8).run()
    assert torch.get_num_threads() == before


def test_the_drafter_drafts_while_the_target_verifies(fp32_target, monkeypatch):
    # the target's forward does not start until the drafter has drawn a token of this round:
    # drafting that waited for the forward (one thread) would leave every wait unanswered
    decoder = Decoder(fp32_target, None, "pearl", eos_token_ids=[])
    proposer = decoder.proposer
    drawn, overlapped, draw_threads = threading.Event(), [], set()
    draw, propose, forward = proposer.session.draw, proposer.propose, fp32_target.forward

    def recording_draw(*args):
        draw_threads.add(threading.current_thread().name)
        drawn.set()
        return draw(*args)

    def clearing_propose(context, budget):
        drawn.clear()
        return propose(context, budget)

    def waiting_forward(*args, **kwargs):
        overlapped.append(drawn.wait(timeout=60))
        return forward(*args, **kwargs)

    monkeypatch.setattr(proposer.session, "draw", recording_draw)
    monkeypatch.setattr(proposer, "propose", clearing_propose)
    monkeypatch.setattr(fp32_target, "forward", waiting_forward)
    tokens = decoder.start(PROMPTS[1], 30).run()
    monkeypatch.undo()
    assert tokens == Decoder(fp32_target, None, "ar", eos_token_ids=[]).start(PROMPTS[1], 30).run()
    assert overlapped and all(overlapped)
    assert draw_threads and all(name.startswith("pearl-drafter") for name in draw_threads)
    # the drafts the target verified after a kept round were made during the round before
    assert proposer.stats.ahead_kept > 0 and proposer.stats.post_verify_rounds > 0


def feedback(context, draft_tokens, tokens) -> Feedback:
    """A verify step whose target committed ``tokens`` after ``draft_tokens``'s draft."""
    accepted = [i for i, (d, t) in enumerate(zip(draft_tokens, tokens)) if d == t]
    accepted = accepted[:next((i for i, a in enumerate(accepted) if a != i), len(accepted))]
    return Feedback(tuple(context), Draft.chain(draft_tokens), torch.zeros(0), tuple(accepted),
                    tuple(tokens))


def started(runner, prompt):
    """A pearl proposer that has read ``prompt`` and whose first token is ``prompt``'s next."""
    decoder = Decoder(runner, None, "pearl", eos_token_ids=[], gamma=4)
    proposer = decoder.proposer
    proposer.start(prompt)
    proposer.observe(Feedback(tuple(prompt), Draft.empty(), torch.zeros(0), (), (7,),
                              prefill=True))
    return proposer


def test_a_rejected_post_verify_draft_is_discarded_and_the_drafter_rewinds(fp32_target):
    budget = Budget(8, 8)
    proposer = started(fp32_target, PROMPTS[1])
    context = list(PROMPTS[1]) + [7]
    # pre-verify: nothing ready; the target's token equals the drafter's first
    assert len(proposer.propose(context, budget)) == 0
    ahead = proposer._round.job.result()[0]
    proposer.observe(feedback(context, [], ahead[:1]))
    context += ahead[:1]
    # post-verify: the rest is handed over at once; the target rejects its second token
    draft = proposer.propose(context, budget)
    assert list(draft.tokens) == ahead[1:] and proposer.stats.post_verify_rounds == 1
    wrong = (draft.tokens[1] + 1) % fp32_target.vocab_size
    proposer.observe(feedback(context, list(draft.tokens), [draft.tokens[0], wrong]))
    assert proposer.stats.ahead_discarded == 1 and proposer._ready is None
    context += [draft.tokens[0], wrong]
    # pre-verify again, from the committed context: the drafter's cache holds it and its own
    # new tokens, none of the rejected ones, and drafts what a drafter that never saw them does
    assert len(proposer.propose(context, budget)) == 0
    again = proposer._round.job.result()[0]
    assert proposer.session.lm.tokens == context + again[:-1]
    assert proposer.session.lm.runner.cache.length == len(context) + len(again) - 1
    fresh = started(fp32_target, PROMPTS[1])
    fresh.propose(context, budget)
    assert fresh._round.job.result()[0] == again
    for p in (proposer, fresh):
        p.observe(feedback(context, [], [again[0]]))
        p.finish([])


def test_seeded_sampling_repeats_and_drafts_carry_probabilities(fp32_target):
    runs = [Decoder(fp32_target, None, "pearl", eos_token_ids=[])
            .start(PROMPTS[1], 30, temperature=0.7, seed=3).run() for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30
    decoder = Decoder(fp32_target, None, "pearl", eos_token_ids=[])
    drafts = []
    propose = decoder.proposer.propose
    decoder.proposer.propose = lambda c, b: drafts.append(propose(c, b)) or drafts[-1]
    # top-k 2: the tiny random model's flat distribution rarely lets the target's sample equal
    # the drafter's first token, which a draft made ahead needs
    decoder.start(PROMPTS[0], 30, temperature=0.7, top_k=2, seed=3).run()
    drafted = [d for d in drafts if len(d)]
    assert drafted and all(d.probs is not None and d.probs.shape == (len(d), fp32_target.vocab_size)
                           for d in drafted)


def test_an_int4_target_is_refused_with_the_fix(fp32_target):
    with pytest.raises(SpecDecodeError, match="--weights fp32"):
        Decoder(LlamaRunner.from_gguf(fp32_target.source, "int4"), None, "pearl")


def test_bad_config_is_refused(fp32_target):
    with pytest.raises(ValueError, match="gamma"):
        Decoder(fp32_target, None, "pearl", gamma=0)


def test_kernels_run_without_the_gil_on_each_threads_own_team():
    # a thread's OpenMP team is its own: the drafter's 1 leaves the caller's as it was
    module = kernels.load()
    before = torch.get_num_threads()
    seen = {}

    def drafter():
        torch.set_num_threads(1)
        seen["drafter"] = module.parallel_threads(64)

    thread = threading.Thread(target=drafter)
    thread.start()
    thread.join()
    assert seen["drafter"] == 1
    assert torch.get_num_threads() == before
    # while a kernel runs on one thread another thread's Python runs: the GIL is released.
    # With no forced switches, a thread holding the GIL through its kernels would let the
    # counter run only when it blocks, never inside the loop below
    x, w = torch.randn(64, 512), kernels.pack_dense(torch.randn(2048, 512))
    ticks, stop = [0], threading.Event()

    def counter():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # give the GIL back at once, so the kernels' thread is never kept waiting

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        thread = threading.Thread(target=counter)
        thread.start()
        before_ticks = ticks[0]
        for _ in range(200):
            kernels.dense_linear(x, w, 2048)
            if ticks[0] != before_ticks:
                break
        moved = ticks[0] != before_ticks
        stop.set()
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert moved
