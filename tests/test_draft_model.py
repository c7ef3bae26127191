"""draft_model and dyspec on tiny random models: greedy output identical to ``ar`` for chains and
trees with every controller, seeded sampling repeats, drafts carry the distribution each token
was drawn from (checked against the draft model run from scratch, which also checks that its
KV cache stays aligned with the target), and bad input (vocabulary mismatch, draft length 0, an
artifact made for another target)."""

from __future__ import annotations

import pytest
import torch

from specdecode import registry
from specdecode.api import Decoder
from specdecode.control import AcceptanceHead, Budget
from specdecode.draft import Draft
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.hf import HFRunner
from specdecode.drafting.artifacts import load_draft
from specdecode.drafting.caches import STEADY_ROWS
from specdecode.estimates import RowCosts
from specdecode.models.row_costs import cached_row_costs
from specdecode.proposer import Feedback
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.sampling import NodeDistributions, SamplingParams
from transformers import AutoModelForCausalLM
from specdecode.training import distill_draft

from conftest import repetitive_prompts
from tiny_models import noisy_copy, tiny_llama

CONTROLLERS = ["fixed", "heuristic", "confidence", "specdecpp"]
#: a draft's row costs where every row counts (a tiny draft's measured ones are about flat)
STEEP_DRAFT = RowCosts({1: 1.0, 2: 1.5, 64: 30.0})


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    """Checkpoint folders: a different small model (rarely agrees) and a noisy copy of the
    target (agrees often, so accepted tokens, cache reuse and rejections all happen)."""
    paths = {}
    for name, model in [("other", tiny_llama(seed=3, layers=1, hidden_size=16, heads=2, kv_heads=1)),
                        ("close", noisy_copy(target, 0.3, seed=1))]:
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        paths[name] = str(path)
    return paths


def decoder(target, method, draft, controller=None, **config):
    if controller:
        config["controller"] = controller
    # full drafts: these test the draft paths, which sizing by row costs would mostly skip on
    # a tiny target (a draft forward costs about what the target's does)
    dec = Decoder(target, None, method, eos_token_ids=[], draft=draft, draft_budget="full",
                  **config)
    # specdecpp needs a trained head; an untrained one still exercises the stopping rule
    dec.proposer.acceptance_head = AcceptanceHead(dec.proposer.lm.hidden_size, 1)
    return dec


@pytest.mark.parametrize("which,controller", [("other", "fixed")] +
                         [("close", controller) for controller in CONTROLLERS])
def test_chain_greedy_identical_to_ar(target, drafts, which, controller):
    dec = decoder(target, "draft_model", drafts[which], controller)
    accepted = 0
    for prompt in repetitive_prompts()[:2]:
        ar = Decoder(target, None, "ar", eos_token_ids=[]).start(prompt, 32).run()
        gen = dec.start(prompt, 32)
        assert gen.run() == ar, (controller, which, prompt)
        accepted += gen.stats.accepted_tokens
    if which == "close":
        assert accepted > 0  # the aligned-cache path was exercised, not only rejections


@pytest.mark.parametrize("draft_runner", ["hf", "native"])
@pytest.mark.parametrize("which", ["other", "close"])
def test_tree_greedy_identical_to_ar(target, drafts, which, draft_runner):
    dec = decoder(target, "dyspec", drafts[which], tree_nodes=10, max_depth=5, expand_width=3,
                  min_path_prob=0.0, draft_runner=draft_runner)
    for prompt in repetitive_prompts()[:3]:
        ar = Decoder(target, None, "ar", eos_token_ids=[]).start(prompt, 32).run()
        assert dec.start(prompt, 32).run() == ar, (which, prompt)


@pytest.mark.parametrize("method,config", [("draft_model", {"controller": "confidence"}),
                                           ("dyspec", {"tree_nodes": 8, "min_path_prob": 0.0})])
def test_seeded_sampling_repeats(target, drafts, method, config):
    dec = decoder(target, method, drafts["close"], **config)
    prompt = repetitive_prompts()[1]
    runs = [dec.start(prompt, 30, temperature=0.9, top_k=40, seed=seed).run() for seed in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_self_draft_accepts_everything_when_sampling(target):
    """With the target as its own draft, q == p: every sampled draft token is accepted, which
    a draft whose probs were not its sampling distribution would not achieve."""
    runner = HFRunner(target)
    config = registry.get("draft_model").make_config({"draft_runner": "hf"})  # q is p's, exactly
    proposer = DraftModelProposer(config, runner, draft_model=target)
    gen = Generation(runner, proposer, repetitive_prompts()[0], 36,
                     SamplingParams(temperature=1.0, top_p=0.9, seed=1))
    gen.run()
    assert gen.stats.accepted_tokens == gen.stats.draft_tokens > 20  # every draft token


def _check_draft_probs(proposer, model, context, draft, sampling, prompt_len):
    """probs[i] is a distribution holding tokens[i], and equals the draft model's own processed
    distribution at node i's parent, computed from scratch (no cache), minus the earlier
    siblings (drawn without replacement)."""
    assert draft.probs is not None and draft.probs.shape == (len(draft), model.config.vocab_size)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(len(draft)), atol=1e-5, rtol=0)
    for i, token in enumerate(draft.tokens):
        assert draft.probs[i, token] > 0
        parent = draft.parents[i]
        path = list(context) + ([draft.tokens[n] for n in draft.path_to(parent)] if parent >= 0 else [])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([path])).logits[0, -1:].float()
        q = NodeDistributions(logits, sampling, path, prompt_len, Draft.empty()).probs(0)
        earlier = [draft.tokens[s] for s in draft.children(parent) if s < i]
        q[earlier] = 0
        torch.testing.assert_close(draft.probs[i], q / q.sum(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["draft_model", "dyspec"])
@pytest.mark.parametrize("draft_runner", ["hf", "native"])
def test_drafts_carry_their_sampling_distribution(target, drafts, method, draft_runner):
    # the native draft in fp32: its logits are transformers' within 1e-4 (test_llama_runner)
    # dyspec: full trees (the default stops at path probability 0.2, which a random tiny
    # draft at T = 0.8 rarely passes)
    shape = {"tree_nodes": 8, "min_path_prob": 0.0} if method == "dyspec" else {"num_speculative_tokens": 4}
    dec = decoder(target, method, drafts["close"], draft_runner=draft_runner, draft_weights="fp32",
                  **shape)
    draft_model = AutoModelForCausalLM.from_pretrained(drafts["close"], dtype=torch.float32).eval()
    sampling = SamplingParams(temperature=0.8, top_k=50, repetition_penalty=1.2, seed=3)
    gen = dec.start(repetitive_prompts()[2], 40, **vars(sampling))
    checked = 0
    original = dec.proposer.propose

    def checking(context, budget):
        nonlocal checked
        draft = original(context, budget)
        if len(draft):
            _check_draft_probs(dec.proposer, draft_model, context, draft, sampling,
                               len(repetitive_prompts()[2]))
            checked += 1
        return draft

    dec.proposer.propose = checking
    gen.run()
    assert checked >= 3


@pytest.mark.parametrize("method", ["draft_model", "dyspec"])
@pytest.mark.parametrize("draft_runner", ["hf", "native"])
def test_cache_holds_the_committed_tokens(target, drafts, draft_runner, method):
    """After each verify step the draft's cache holds a prefix of the committed tokens and no
    tree rows, and it kept accepted tokens it drafted itself instead of feeding them again
    (for a tree, the accepted path's rows, wherever they lay)."""
    full_trees = {"min_path_prob": 0.0} if method == "dyspec" else {}
    dec = decoder(target, method, drafts["close"], draft_runner=draft_runner, **full_trees)
    lm = dec.proposer.lm
    gen = dec.start(repetitive_prompts()[0], 40)
    reused, before = 0, None
    for _ in gen:
        context = gen.prompt_ids + gen.tokens
        if gen.finish_reason is None:  # a cut at the token limit leaves accepted rows past it
            assert lm.tokens == context[:len(lm.tokens)] and not lm.tree_tokens
            if draft_runner == "native":
                assert lm.runner.cache.length == len(lm.tokens)
        if before is not None and len(lm.tokens) > before:
            reused += 1
        before = len(context)
    assert reused > 0


@pytest.mark.parametrize("method", ["draft_model", "dyspec"])
def test_the_tokens_a_native_draft_skipped_are_priced_by_its_row_costs(target, drafts, method):
    """What a draft must read before it drafts: after the prompt, every prompt token and the
    first one, as its runner's row-cost curve prices them; right after a draft, nothing past a
    step's usual rows; a level, one forward. A transformers draft's cost is not measured."""
    prompt = repetitive_prompts()[0]
    dec = decoder(target, method, drafts["close"], draft_runner="native")
    gen = dec.start(prompt, 40)
    steps = iter(gen)
    next(steps)  # the prefill: the draft has read nothing yet
    # a level: one forward of the draft's own runner, whose curve is measured apart
    assert gen.draft_seconds()[1] == cached_row_costs(dec.proposer.lm.runner.runner)[1] > 0
    # (a tiny draft's rows are measured to cost about the same: a curve that tells them apart)
    curve = dec.proposer.lm.row_costs = STEEP_DRAFT
    behind, level = gen.draft_seconds()
    rows = len(gen.prompt_ids) + 1
    assert behind == pytest.approx(curve(rows) - curve(STEADY_ROWS)) and behind > 0
    next(steps)  # a step that drafted
    assert gen.draft_seconds() == (0.0, level)
    hf = decoder(target, method, drafts["close"], draft_runner="hf").start(prompt, 40)
    next(iter(hf))
    assert hf.draft_seconds() == (0.0, 0.0)


@pytest.mark.parametrize("method", ["draft_model", "dyspec"])
def test_a_seeded_request_prices_its_first_catch_up_whatever_the_draft_held(target, drafts,
                                                                           method):
    """A seeded sampled request's draft sizes decide its random draws, so what an earlier
    request left in the draft's cache must not price them: until it first catches up, its
    catch-up is priced as a read of its whole context. A greedy request prices what the
    draft must really read (here nothing: the same prompt was read before)."""
    prompt = repetitive_prompts()[0]
    dec = decoder(target, method, drafts["close"], draft_runner="native")
    curve = dec.proposer.lm.row_costs = STEEP_DRAFT
    list(dec.start(prompt, 8))
    greedy = dec.start(prompt, 40)
    next(iter(greedy))
    assert greedy.draft_seconds()[0] == 0.0
    greedy.close()
    seeded = dec.start(prompt, 40, temperature=0.8, seed=3)
    steps = iter(seeded)
    next(steps)
    rows = len(seeded.prompt_ids) + 1
    behind = seeded.draft_seconds()[0]
    assert behind == pytest.approx(curve(rows) - curve(STEADY_ROWS)) and behind > 0
    next(steps)  # it drafted: the cache holds what it read
    assert seeded.draft_seconds()[0] == 0.0


@pytest.mark.parametrize("draft_runner", ["hf", "native"])
def test_keep_drafting_stops_the_chain(target, drafts, draft_runner):
    config = registry.get("draft_model").make_config({"draft": drafts["close"],
                                                      "draft_runner": draft_runner})
    proposer = DraftModelProposer(config, HFRunner(target))
    proposer.start([5, 6, 7])
    calls = []
    budget = Budget(6, 6, lambda signal: calls.append(signal) or signal.depth < 2)
    draft = proposer.propose([5, 6, 7, 8], budget)
    assert len(draft) == 2 and [s.depth for s in calls] == [1, 2]
    hidden_size = proposer.lm.hidden_size
    assert all(0 < s.prob <= 1 and s.hidden.shape == (hidden_size,) for s in calls)
    # the first token accepted: its row (the draft fed it to draft the second) is kept
    logits = torch.zeros(3, target.config.vocab_size)
    proposer.observe(Feedback((5, 6, 7, 8), draft, logits, (0,), (draft.tokens[0], 1)))
    assert proposer.lm.tokens == [5, 6, 7, 8, draft.tokens[0]] and not proposer.lm.tree_tokens


def test_vocabulary_mismatch_names_both_sizes(target, tmp_path):
    tiny_llama(vocab_size=80, seed=2).save_pretrained(tmp_path)
    with pytest.raises(SpecDecodeError, match="draft model's vocabulary has 80 tokens but the "
                                              "target's has 96"):
        Decoder(target, None, "draft_model", draft=str(tmp_path))


@pytest.mark.parametrize("method,field", [("draft_model", "num_speculative_tokens"),
                                          ("dyspec", "tree_nodes")])
def test_draft_length_zero_is_refused(target, drafts, method, field):
    with pytest.raises(SpecDecodeError, match=f"{field} must be >= 1, got 0"):
        Decoder(target, None, method, draft=drafts["other"], **{field: 0})


def test_unknown_controller_runner_and_missing_head(target, drafts):
    with pytest.raises(SpecDecodeError, match="unknown controller 'nope'; known: fixed, heuristic"):
        Decoder(target, None, "draft_model", draft=drafts["other"], controller="nope")
    with pytest.raises(SpecDecodeError, match="unknown draft_runner 'gpu'; known: native, hf"):
        Decoder(target, None, "draft_model", draft=drafts["other"], draft_runner="gpu")
    with pytest.raises(SpecDecodeError, match="unknown weight format 'int3'"):
        Decoder(target, None, "draft_model", draft=drafts["other"], draft_weights="int3")
    dec = Decoder(target, None, "draft_model", draft=drafts["other"], controller="specdecpp")
    with pytest.raises(SpecDecodeError, match="needs an acceptance head"):
        dec.start([5, 6, 7], 4)


def test_distilled_artifact_round_trip_and_refusal(tmp_path):
    """A student distilled from one target loads for it (sharing its embeddings, drafting over
    the shortlist, with its acceptance head) and is refused for another target."""
    target = tiny_llama(seed=0, tie_embeddings=True)
    head_ids = torch.arange(0, 96, 2)
    student = distill_draft.make_student(target, 1, head_ids)
    seqs = [([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], 4), ([10, 11, 12, 13, 10, 11, 12, 13], 3)]
    params = [p for p in student.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-2)
    first = distill_draft.kl_loss(student, target, seqs[0][0], head_ids).item()
    for _ in range(15):
        loss = distill_draft.kl_loss(student, target, seqs[0][0], head_ids)
        optim.zero_grad()
        loss.backward()
        optim.step()
    assert loss.item() < first
    head = AcceptanceHead(target.config.hidden_size, 2)
    runner = HFRunner(target)
    path = distill_draft.save_draft(tmp_path / "d.safetensors", student, head_ids,
                                    runner.fingerprint(), {"steps": 15}, head)
    loaded = load_draft(str(path), runner)
    assert torch.equal(loaded.head_ids, head_ids) and loaded.acceptance_head is not None
    x = torch.tensor([seqs[1][0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=x).logits, student(input_ids=x).logits,
                                   atol=1e-2, rtol=1e-2)  # float16 storage
    prompt = seqs[1][0]
    dec = Decoder(target, None, "draft_model", eos_token_ids=[], draft=str(path),
                  controller="specdecpp")
    ar = Decoder(target, None, "ar", eos_token_ids=[]).start(prompt, 24).run()
    assert dec.start(prompt, 24).run() == ar
    draft = dec.proposer.propose(prompt, Budget(5, 5))
    assert len(draft) == 5 and all(t % 2 == 0 for t in draft.tokens)  # only shortlist tokens
    other = tiny_llama(seed=5, tie_embeddings=True)
    with pytest.raises(SpecDecodeError, match="trained for another target model"):
        Decoder(other, None, "draft_model", draft=str(path))


def test_heuristic_schedule_is_plus_two_minus_one():
    from specdecode.control import HeuristicLength

    c = HeuristicLength(start=5, longest=8)
    lengths = []
    for drafted, accepted in [(5, 5), (7, 7), (8, 8), (8, 3), (7, 0), (6, 0), (0, 0)]:
        c.observe(drafted, accepted)
        lengths.append(c.budget().max_depth)
    # full accept: +2 (capped at 8); any rejection: -1; an empty draft: no change
    assert lengths == [7, 8, 8, 7, 6, 5, 5]
    for _ in range(10):
        c.observe(1, 0)
    assert c.budget().max_depth == 1


def test_confidence_and_specdecpp_stopping_rules():
    from specdecode.control import ConfidenceStop, DraftSignal, SpecDecPlusPlus

    keep = ConfidenceStop(threshold=0.4, max_depth=9).budget().keep_drafting
    assert keep(DraftSignal(1, 0.41)) and not keep(DraftSignal(2, 0.39))
    head = AcceptanceHead(4, 1)
    with torch.no_grad():  # a head that predicts acceptance 0.8 for every token
        for p in head.parameters():
            p.zero_()
        head.out.bias.fill_(torch.logit(torch.tensor(0.8)).item())
    keep = SpecDecPlusPlus(head, threshold=0.5, min_depth=2, max_depth=12).budget().keep_drafting
    h = torch.zeros(4)
    # depth 1 scores nothing; then P(all accepted) = 0.8, 0.64, 0.512, 0.41 -> stop past 0.5
    assert [keep(DraftSignal(d, 0.9, h)) for d in range(1, 6)] == [True, True, True, True, False]
    assert keep(DraftSignal(1, 0.9, h))  # a new draft starts afresh


def test_train_draft_rejects_bad_options_before_loading(capsys):
    from specdecode.cli import main

    assert main(["train", "draft", "--max-minutes", "0"]) == 2
    assert "--max-minutes must be positive" in capsys.readouterr().err
