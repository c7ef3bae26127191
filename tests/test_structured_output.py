"""Constraints under speculation: every registered method gives ``ar``'s tokens under the same
grammar or ban (greedy, tiny random models with a small byte vocabulary), ``ar`` under a
constraint equals a decoder written here from the model's logits and llguidance's masks alone,
the sampled distribution under a constraint is the masked target's (chi-square, exactly
enumerated), and log-probabilities equal ones computed from ``transformers``' logits.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from specdecode import registry
from specdecode.api import Decoder
from specdecode.constraints import Vocabulary, make_constraint
from specdecode.draft import Draft
from specdecode.engine import Generation
from specdecode.errors import SpecDecodeError
from specdecode.models.hf import HFRunner
from specdecode.proposers.ar import Autoregressive as ArProposer
from specdecode.sampling import SamplingParams

from conftest import repetitive_prompts
from test_exactness import tiny_overrides
from test_sampling_stats import ALPHA, RandomTreeProposer, TableRunner, chi_square
from tiny_models import tiny_llama

EOS = 2
#: a 96-token byte vocabulary for the tiny models: specials 0-2, JSON's characters, a few
#: multi-character pieces (so a key can be spelt several ways, as in a real BPE vocabulary)
SINGLES = b'{}[]":,.-0123456789abcdefghijklmnopqrstuvwxyz ABCXYZ'
PIECES = [b'{"', b'":', b'",', b'"}', b'","', b'":"', b"true", b"false", b"null", b"name",
          b"age", b"na", b"me", b"ag", b"id", b"ok", b"abc", b"xyz", b"12", b"00", b'"]', b'["',
          b"},{", b'":[']
TOKENS = [b"", b"", b""] + [bytes([c]) for c in SINGLES] + PIECES
TOKENS += [bytes([0x80 + i]) for i in range(96 - len(TOKENS))]  # never valid UTF-8 alone

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["abc", "xyz"]},
                                  "maxItems": 3}},
          "required": ["name", "ok", "tags"], "additionalProperties": False}
METHODS = registry.names(lossy=False)  # lossy methods have their own loop, unconstrained


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary(TOKENS, 96, [EOS])


@pytest.fixture(scope="module")
def tiny_models():
    return [tiny_llama(seed=0), tiny_llama(seed=1, layers=3, tie_embeddings=True)]


def text(tokens) -> bytes:
    return b"".join(TOKENS[t] for t in tokens)


def run(model, method, prompt, max_new, vocab, config=None, **request):
    decoder = Decoder(model, None, method, eos_token_ids=[EOS], vocabulary=vocab,
                      **(config or {}))
    gen = decoder.start(prompt, max_new, **request)
    gen.run()
    return gen


# ---- ar under a constraint is plain masked decoding ----------------------------------------

def test_ar_under_a_schema_equals_masked_greedy_written_out(tiny_models, vocab):
    """A decoder from the model's logits and llguidance's own matcher, no specdecode code."""
    import llguidance
    import numpy as np

    model = tiny_models[0]
    for prompt in repetitive_prompts()[:3]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            SCHEMA, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(vocab.ll, grammar, log_level=0)
        ids, out = list(prompt), []
        while len(out) < 48 and not matcher.is_stopped():
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                                 bitorder="little")[:96].astype(bool)
            token = int(logits.masked_fill(~torch.from_numpy(bits), -math.inf).argmax())
            out.append(token)
            if token == EOS:
                break
            assert matcher.consume_token(token)
            ids.append(token)
        gen = run(model, "ar", prompt, 48, vocab, json_schema=SCHEMA)
        assert gen.tokens == out
        if gen.finish_reason == "stop":
            json.loads(text(gen.tokens))  # a finished grammar is valid JSON


# ---- every method: ar's tokens under the same constraint ------------------------------------

CONSTRAINTS = {
    "schema": dict(json_schema=SCHEMA),
    "regex": dict(regex=r"(na|me|[a-e]){3,12}\.[0-9]+"),
    "lark": dict(grammar='start: item ("," item)*\nitem: /[a-c]+/ | "null"'),
    "ban": dict(banned=["aa", [5, 6, 7]]),
}


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_ar_tokens_under_a_constraint(tiny_models, vocab, method, kind):
    request = CONSTRAINTS[kind]
    forced = 0
    for model in tiny_models:
        decoder = Decoder(model, None, method, eos_token_ids=[EOS], vocabulary=vocab,
                          **tiny_overrides(method, model))
        for prompt in repetitive_prompts()[:2]:
            ar = run(model, "ar", prompt, 40, vocab, **request)
            gen = decoder.start(prompt, 40, **request)
            assert gen.run() == ar.tokens, (method, kind, prompt)
            assert gen.finish_reason == ar.finish_reason
            forced += gen.stats.forced_tokens
            assert gen.stats.new_tokens == len(gen.tokens)
    if kind == "schema":  # its keys and braces are forced: committed without a forward
        assert forced > 0


def test_bans_change_the_output_and_never_appear(tiny_models, vocab):
    model = tiny_models[0]
    prompt = repetitive_prompts()[0]
    free = run(model, "ar", prompt, 40, vocab).tokens
    banned_text = text(free[3:5]).decode("latin-1")
    banned_seq = free[8:10]
    for method in ("ar", "ngram", "suffix"):
        gen = run(model, method, prompt, 40, vocab, banned=[banned_text, banned_seq])
        assert gen.tokens != free
        assert banned_text.encode("latin-1") not in text(gen.tokens)
        assert all(gen.tokens[i:i + 2] != banned_seq for i in range(len(gen.tokens)))
        assert gen.tokens == run(model, "ar", prompt, 40, vocab,
                                 banned=[banned_text, banned_seq]).tokens


def test_a_grammar_that_cannot_finish_ends_with_length(tiny_models, vocab):
    gen = run(tiny_models[0], "suffix", repetitive_prompts()[0], 12, vocab,
              regex=r"[a-z]{50}")
    assert gen.finish_reason == "length" and len(gen.tokens) == 12


def test_a_finished_grammar_stops(tiny_models, vocab):
    gen = run(tiny_models[0], "ngram", repetitive_prompts()[0], 30, vocab, regex=r"abc[.]xyz")
    assert gen.finish_reason == "stop" and text(gen.tokens) == b"abc.xyz"
    assert gen.stats.forced_tokens >= 1  # the "." after "abc" has one token only: forced


@pytest.mark.parametrize("grammar, ends", [
    ("start: TEXT <[TAG]> TEXT\nTEXT: /(.|\\n)*/", False),  # text, the special tag, text
    # a strict tool call's shape: free text, or text then the tag and a call
    ('start: called* TEXT\ncalled: opened "[]"\nopened: TEXT <[TAG]>\nTEXT: /(.|\\n)*/', True),
    ('start: "a" TEXT\nTEXT: /[^"]*/', True),
])
def test_only_the_special_tokens_a_grammar_names_pass_its_mask(grammar, ends):
    """Special tokens have no bytes; wherever text may go on, the mask lets through no special
    token but those the grammar names and the end of sequence where the grammar may end (a
    grammar naming a special token let every special token through there, and then failed on
    the one it had allowed), and the grammar takes every token the mask lets through."""
    from tiny_server import EOS as END, build_tokenizer

    tokenizer = build_tokenizer(special=("<|tool_call|>",))
    tag = tokenizer.convert_tokens_to_ids("<|tool_call|>")
    vocabulary = Vocabulary(tokenizer, len(tokenizer), [END])
    constraint = make_constraint(vocabulary, grammar=grammar.replace("TAG", str(tag))).start()
    constraint.commit(vocabulary.ll.tokenize_str("ab c"))
    allowed = constraint.allowed(())
    specials = sorted(tokenizer.all_special_ids) + [tag]
    named = [tag] if "TAG" in grammar else []
    assert [t for t in specials if allowed[t]] == sorted(named + ([END] if ends else []))
    for token in map(int, allowed.nonzero()[:, 0]):
        if token != END:
            assert constraint.matcher.consume_token(token), constraint.matcher.get_error()
            constraint.matcher.rollback(1)


def test_draft_pruning_keeps_only_what_the_grammar_allows(vocab):
    spec = make_constraint(vocab, regex=r"ab+c")
    state = spec.start()
    a, b, c = (TOKENS.index(x) for x in (b"a", b"b", b"c"))
    draft = Draft((a, c, b, c, a), (-1, -1, 0, 2, 2))  # a; c (bad); a-b; a-b-c; a-b-a (bad)
    kept = state.prune(draft)
    assert kept.tokens == (a, b, c) and kept.parents == (-1, 0, 1)
    leaves = state.prune(draft, keep_rejected_leaves=True)
    assert leaves.tokens == (a, c, b, c, a)
    state.commit([a, b])
    assert state.forced() is None  # b or c may follow
    assert state.permits([], c) and not state.permits([], a)


@pytest.mark.parametrize("request_, message", [
    (dict(json_schema={"type": "object", "properties": {"a": {"type": "nope"}}}),
     "invalid json schema"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(regex="[a-"), "invalid regex"),
    (dict(grammar="start: foo("), "invalid grammar"),
    (dict(regex="a", json_object=True), "at most one of"),
    (dict(banned="abc"), "not one string"),
    (dict(banned=[[500]]), "token ids in 0..95"),
])
def test_bad_constraints_name_the_problem(vocab, request_, message):
    with pytest.raises(SpecDecodeError, match=message.replace("(", r"\(")):
        make_constraint(vocab, **request_)


# ---- the sampled distribution is the masked target's ----------------------------------------

STAT_TOKENS = [b"a", b"b", b"", b"c", b"ab", b"ba"]  # id 2 is the end of sequence
STAT_PROMPT = [1, 4, 4, 3]
STAT_NEW = 3
STAT_REGEX = r"[abc]*c[ab]*"  # needs a c; a path's mask depends on whether it has one yet
STAT_BAN = ["aa"]


class NoProbs(RandomTreeProposer):
    """The same random trees without probabilities (a deterministic proposer's rule)."""

    def propose(self, context, budget):
        draft = super().propose(context, budget)
        return Draft(draft.tokens, draft.parents)


@pytest.fixture(scope="module")
def stat_runner():
    model = tiny_llama(vocab_size=6, hidden_size=16, layers=1, heads=2, kv_heads=1, seed=3)
    return TableRunner(model, STAT_PROMPT, STAT_NEW)


def masked_distributions(runner, vocab, params):
    """Exact probability of each output under the constraint, from the table's logits, the
    grammar engine's masks and the ban checked on the text: no specdecode code."""
    import llguidance
    import numpy as np

    grammar = llguidance.LLMatcher.grammar_from_regex(STAT_REGEX)
    exact: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], mass: float):
        matcher = llguidance.LLMatcher(vocab.ll, grammar, log_level=0)
        assert matcher.consume_tokens(list(prefix)) if prefix else True
        if len(prefix) == STAT_NEW or matcher.is_stopped():
            exact[prefix] = exact.get(prefix, 0.0) + mass
            return
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                             bitorder="little")[:6].astype(bool)
        logits = runner.table[tuple(STAT_PROMPT) + prefix].clone()
        for t in range(6):
            out = b"".join(STAT_TOKENS[x] for x in prefix + (t,))
            if not bits[t] or any(ban.encode() in out for ban in STAT_BAN):
                logits[t] = -math.inf
        probs = (logits / params.temperature).softmax(-1).double()
        for t in range(6):
            if probs[t] > 0:
                if t == EOS:
                    exact[prefix + (t,)] = exact.get(prefix + (t,), 0.0) + mass * float(probs[t])
                else:
                    walk(prefix + (t,), mass * float(probs[t]))

    walk((), 1.0)
    return exact


@pytest.mark.parametrize("proposer_kind", [ArProposer, NoProbs, RandomTreeProposer])
def test_sampling_under_a_constraint_keeps_the_masked_distribution(stat_runner, proposer_kind):
    vocab = Vocabulary(STAT_TOKENS, 6, [EOS])
    spec = make_constraint(vocab, regex=STAT_REGEX, banned=STAT_BAN)
    params = SamplingParams(temperature=0.8)
    proposer = (ArProposer(registry.get("ar").make_config({}), stat_runner)
                if proposer_kind is ArProposer else proposer_kind(stat_runner))
    n = 1500
    counts: Counter = Counter()
    for i in range(n):
        gen = Generation(stat_runner, proposer, STAT_PROMPT, STAT_NEW,
                         SamplingParams(temperature=0.8, seed=i, constraint=spec), [EOS])
        counts[tuple(gen.run())] += 1
    result = chi_square(counts, masked_distributions(stat_runner, vocab, params), n)
    assert result["p"] > ALPHA, result


# ---- log-probabilities -------------------------------------------------------------------------

def test_logprobs_are_the_same_whatever_drafted_them(tiny_models, vocab):
    model = tiny_models[0]
    prompt = repetitive_prompts()[1]
    ar = run(model, "ar", prompt, 24, vocab, logprobs=3)
    for method in ("ngram", "suffix"):
        gen = run(model, method, prompt, 24, vocab, logprobs=3)
        assert gen.tokens == ar.tokens and len(gen.logprobs) == len(gen.tokens)
        for mine, theirs in zip(gen.logprobs, ar.logprobs):
            assert mine.token == theirs.token
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_logprobs_equal_transformers_with_sampling_processors(tiny_models, vocab):
    """At temperature 0.7 with top-k 5: log of the processed distribution each token came from."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    model = tiny_models[0]
    prompt = repetitive_prompts()[2]
    gen = run(model, "ngram", prompt, 12, vocab, temperature=0.7, top_k=5, seed=4, logprobs=2)
    ids = torch.tensor([prompt + gen.tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    for j, entry in enumerate(gen.logprobs):
        row = TopKLogitsWarper(5)(ids, TemperatureLogitsWarper(0.7)(ids, logits[j:j + 1]))
        expected = row[0].log_softmax(-1)
        assert entry.logprob == pytest.approx(float(expected[entry.token]), abs=1e-4)
        assert entry.top[0][1] == pytest.approx(float(expected.max()), abs=1e-4)
    # raw_logprobs: the same draws, reported as the model's own log-softmax
    raw = run(model, "ngram", prompt, 12, vocab, temperature=0.7, top_k=5, seed=4, logprobs=2,
              raw_logprobs=True)
    assert raw.tokens == gen.tokens
    for j, entry in enumerate(raw.logprobs):
        own = logits[j].log_softmax(-1)
        assert entry.logprob == pytest.approx(float(own[entry.token]), abs=1e-4)
        assert [t for t, _ in entry.top] == own.topk(2).indices.tolist()


@pytest.mark.slow
def test_logprobs_on_the_default_model_equal_transformers(real_model):
    """The default model (the fp32 ``transformers`` runner): each committed token's logprob and
    top-5 from the model's own logits, for ``ar`` and the default method."""
    model, tokenizer = real_model.model, real_model.tokenizer
    runner = HFRunner(model)
    prompt = "Give three facts about the Moon as a JSON list."
    results = {}
    for method in ("ar", registry.DEFAULT_METHOD):
        decoder = Decoder(runner, tokenizer, method)
        results[method] = decoder.generate(prompt, 40, logprobs=5)
    ar = results["ar"]
    ids = Decoder(runner, tokenizer, "ar").encode(prompt)
    full = torch.tensor([ids + ar.token_ids])
    with torch.no_grad():
        expected = model(full).logits[0, len(ids) - 1:-1].float().log_softmax(-1)
    for method, result in results.items():
        assert result.token_ids == ar.token_ids, method
        for j, entry in enumerate(result.logprobs):
            assert entry.logprob == pytest.approx(float(expected[j, entry.token]), abs=1e-3)
            values, top = expected[j].topk(5)
            assert [t for t, _ in entry.top] == top.tolist(), (method, j)
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-3)


@pytest.mark.parametrize("argv,message", [
    (["--json-schema", "/nonexistent/schema.json"], "cannot read --json-schema file"),
    (["--grammar", "/nonexistent/g.lark"], "cannot read --grammar file"),
    (["--logprobs", "50"], "logprobs must be an integer in [0, 20]"),
])
def test_cli_bad_constraint_options_fail_before_loading(capsys, argv, message):
    from specdecode.cli import main

    assert main(["generate", "hi", "--method", "ngram"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_jump_forward_saves_forwards_and_changes_no_token(tiny_models, vocab):
    model, prompt = tiny_models[1], repetitive_prompts()[1]
    on = run(model, "ar", prompt, 40, vocab, json_schema=SCHEMA)
    off = run(model, "ar", prompt, 40, vocab, json_schema=SCHEMA, jump_forward=False)
    assert on.tokens == off.tokens and off.stats.forced_tokens == 0
    assert on.stats.forced_tokens > 0
    assert on.stats.target_forwards == off.stats.target_forwards - on.stats.forced_tokens


def test_a_constraint_travels_to_another_process(vocab):
    """Ray replicas receive requests pickled: the vocabulary is rebuilt from its tokens."""
    import pickle

    spec = make_constraint(vocab, json_schema=SCHEMA, banned=["ab"])
    copy = pickle.loads(pickle.dumps(spec))
    assert torch.equal(copy.start().allowed(()), spec.start().allowed(()))
    small = Vocabulary([b"", b"", b"", b"a", b"b"], 5, [EOS])  # no token spells "test"
    assert make_constraint(small, regex="ab").start().forced() == 3


def test_byte_level_tokens_are_read_as_their_bytes():
    """A byte-level BPE stores a newline as "Ċ" and a space as "Ġ": the grammar must see the
    bytes, or a JSON string would take a raw newline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat\nsat on the mat", '{"a": "b c"}'] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    vocab = Vocabulary(fast, len(fast), [fast.eos_token_id])
    newline = fast.convert_tokens_to_ids("Ċ")
    assert vocab.token_bytes[newline] == b"\n"
    assert vocab.token_bytes[fast.eos_token_id] == b""
    state = make_constraint(vocab, json_schema={"type": "string"}).start()
    state.commit([fast.convert_tokens_to_ids('"')])
    assert not state.permits([], newline)
    assert state.permits([], fast.convert_tokens_to_ids("a"))


def test_forced_chains_are_marked_so_acceptance_tracking_skips_them(tiny_models, vocab):
    """A server's goodput estimate reads each verify call's draft and what it accepted; a
    jump-forward chain is committed whole by the constraint, so it is marked, never a draft."""
    decoder = Decoder(tiny_models[0], None, "suffix", eos_token_ids=[EOS], vocabulary=vocab)
    gen = decoder.start(repetitive_prompts()[0], 40, json_schema=SCHEMA)
    gen.advance(gen.begin().run(gen.runner))
    forced_rows = proposed = 0
    while gen.finish_reason is None:
        call = gen.next_call()
        if call.forced:  # the chain is the tokens the constraint already committed
            forced_rows += len(call.draft)
            assert list(call.draft.tokens) == gen.tokens[-len(call.draft):]
        else:
            proposed += 1
        gen.advance(call.run(gen.runner))
    gen.close()
    # forced tokens at the very end (the grammar finished) never need a forward
    assert 0 < forced_rows <= gen.stats.forced_tokens and proposed > 0
