"""``specdecode train data`` (training/target_data.py): conversations written many per forward
on the native runner, into a shard that a later run resumes. On a tiny int4 runner with a
character tokenizer of its vocabulary: a conversation is the same whatever batch wrote it, an
interrupted shard is completed with exactly what was missing, passage conversations put what
the target wrote into the user's message, the sampler keeps top-p, and the features kept
while writing (``--features``) are the bits a prefill gives, which ``train heads`` reads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.heads.networks import eagle3_layers, make_network
from specdecode.models.base import NOTHING, Needs
from specdecode.models.llama import LlamaRunner
from specdecode.training.feature_store import FeatureStore, reader_name
from specdecode.training.self_data import OPENERS
from specdecode.training.target_data import (PASSAGE_SHARE, GenerateWriter, Plan, Settings,
                                             Writer, draw_tokens, feature_kinds, feature_needs,
                                             opener, plan, read_shard, write_shard)
from specdecode.training.train_heads import conversation_features, stored_features
from tiny_models import tiny_llama

VOCAB = 96
EOS = 3


class CharTokenizer:
    """Characters as token ids modulo the tiny vocabulary, with a chat template."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [4 + ord(c) % (VOCAB - 4) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 90) for i in ids if i != EOS)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self(text)["input_ids"] if tokenize else text


@pytest.fixture(scope="module")
def runner():
    model = tiny_llama(vocab_size=VOCAB, hidden_size=64, layers=2, heads=4, kv_heads=2, seed=3,
                       max_positions=512)
    return LlamaRunner.from_transformers(model, "int4", max_context=256)


def writer(runner, batch: int, needs: Needs = NOTHING) -> Writer:
    # passages of 16 tokens: a shard of both kinds of conversation
    settings = Settings(runner.fingerprint(), 12, 20, 1, passage_tokens=16)
    return Writer(runner, CharTokenizer(), {EOS}, settings, batch, needs)


def lines(path: Path) -> dict[int, str]:
    return {json.loads(line)["index"]: line for line in path.read_text().splitlines()}


def test_shard_resumes_with_what_was_missing_whatever_the_batch(runner, tmp_path):
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    assert write_shard(writer(runner, 4), whole, 7, 600, show=lambda _: None) == 7
    expected = lines(whole)
    assert sorted(expected) == list(range(7))
    settings = writer(runner, 1).settings
    kinds = set()
    for i in range(7):
        rng = random.Random(settings.seed * 1_000_003 + i)
        rng.getrandbits(62)  # the slot's generator seed, drawn before its plan
        kinds.add(plan(rng, settings).instruction is None)
    assert kinds == {True, False}  # both kinds of conversation in the shard (3 passages)
    for line in expected.values():
        record = json.loads(line)
        assert 0 < record["prompt_len"] < len(record["ids"])  # a prompt, then an answer
    # an interrupted run: three conversations and half of a fourth line
    kept = list(expected.values())[:3]
    resumed.write_text("".join(line + "\n" for line in kept) + kept[-1][:20])
    # a reader skips the cut line and leaves the file alone (a writer may be appending to it)
    assert len(read_shard(resumed)) == 3 and resumed.read_text().endswith(kept[-1][:20])
    assert write_shard(writer(runner, 3), resumed, 7, 600, show=lambda _: None) == 4
    assert lines(resumed) == expected  # batch 3 wrote what batch 4 wrote, nothing twice
    assert len(read_shard(resumed)) == 7


def test_features_kept_while_writing_are_a_prefills_and_train_heads_reads_them(runner,
                                                                               tmp_path):
    """``--features``: the shard holds what it holds without them; each conversation's kept
    rows (the final hidden states and a layer's, the answer's prompt from its prefill and
    every token after from its decode row) are the bits one prefill of the whole conversation
    gives, and ``train heads`` reads them instead of the runner. Features another runner
    computed, or without a layer the network reads, are not read."""
    plain, kept = tmp_path / "plain.jsonl", tmp_path / "kept.jsonl"
    write_shard(writer(runner, 3), plain, 5, 600, show=lambda _: None)
    needs = Needs(final_hidden=True, layers=(1,))
    store = FeatureStore(kept, reader_name(runner), runner.fingerprint())
    write_shard(writer(runner, 3, needs), kept, 5, 600, show=lambda _: None, store=store)
    assert lines(kept) == lines(plain)
    assert len(list(store.root.glob("*.safetensors"))) == 5
    eagle = make_network("eagle", 64, runner.tables.input_embeddings(), feature_layers=(1,))
    for ids, _ in read_shard(kept).values():
        want = runner.prefill(ids, needs)
        got = store.load(ids, (1,))
        assert torch.equal(got.final_hidden, want.final_hidden.float())
        assert torch.equal(got.layers[1], want.layers[1].float())
        inputs, final = stored_features(store, eagle, ids)
        want_inputs, want_final = conversation_features(runner, eagle, ids)
        assert torch.equal(inputs, want_inputs) and torch.equal(final, want_final)
    assert store.missed == 0
    assert store.load(ids, (0, 1)) is None  # a layer it does not hold
    other = FeatureStore(kept, "hf-fp32", runner.fingerprint())
    assert other.load(ids, (1,)) is None and other.missed == 1


def test_features_names_the_kinds_whose_layers_are_kept():
    assert feature_needs(feature_kinds("hydra, eagle"), 28) == \
        Needs(final_hidden=True, layers=eagle3_layers(28))
    assert feature_needs(feature_kinds(""), 28) == NOTHING
    with pytest.raises(SpecDecodeError, match="--features: unknown kind 'medusa'"):
        feature_kinds("hydra,medusa")


class PaddedCharTokenizer(CharTokenizer):
    pad_token_id = 0
    eos_token_id = EOS


def test_generate_writer_writes_the_same_kind_of_shard_and_resumes(tmp_path):
    """The GPU's writer (transformers' batched generate; run here on the CPU): each line a
    chat prompt then an answer within its limit, cut after end-of-sequence; a later run with
    a larger count writes only the missing ids, a batch at a time."""
    model = tiny_llama(vocab_size=VOCAB, hidden_size=64, layers=2, heads=4, kv_heads=2, seed=3,
                       max_positions=512)
    settings = Settings("tiny", 12, 20, 5, passage_tokens=16)
    path = tmp_path / "gpu.jsonl"

    def write(count: int) -> int:
        writer = GenerateWriter(model, PaddedCharTokenizer(), {EOS}, settings, batch=3)
        return write_shard(writer, path, count, 600, show=lambda _: None)

    assert write(4) == 4
    first = lines(path)
    assert write(7) == 3 and sorted(lines(path)) == list(range(7))
    assert {i: lines(path)[i] for i in first} == first
    for ids, prompt_len in read_shard(path, settings).values():
        answer = ids[prompt_len:]
        assert ids[:prompt_len][-len("<assistant>"):] == PaddedCharTokenizer()("<assistant>")["input_ids"]
        assert 0 < len(answer) <= 20 and EOS not in answer[:-1]


def test_shard_of_other_settings_is_refused(runner, tmp_path):
    path = tmp_path / "shard.jsonl"
    write_shard(writer(runner, 2), path, 2, 600, show=lambda _: None)
    other = Settings(runner.fingerprint(), 12, 20, seed=1)  # no passages
    with pytest.raises(SpecDecodeError, match="other settings"):
        read_shard(path, other)


def test_openers_vary_beyond_the_fixed_ones():
    rng = random.Random(0)
    drawn = [opener(rng) for _ in range(2000)]
    assert len(set(drawn)) > 500
    assert set(OPENERS) & set(drawn)  # the old openers stay among them
    assert any(o.startswith("Translate") for o in drawn)


def test_draw_token_samples_the_nucleus():
    # p = .5, .3, .12, .05, .03: the nucleus of top-p 0.95 is the first four (mass before the
    # fifth: 0.97 > 0.95), renormalised
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    logits = probs.log() * 0.7  # at temperature 0.7, softmax(logits / 0.7) = probs
    generator = torch.Generator().manual_seed(0)
    draws = 20000
    counts = torch.bincount(torch.tensor([draw_tokens([logits], [0.7], [generator])[0]
                                          for _ in range(draws)]), minlength=5)
    nucleus = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.0]) / 0.97
    assert counts[4] == 0
    # 4.5 standard deviations of each frequency: a wrong rule (no cut, or the cut one token
    # early) is off by 10 or more
    bound = 4.5 * (nucleus * (1 - nucleus) / draws).sqrt() + 1e-9
    assert ((counts / draws - nucleus).abs() <= bound).all(), counts / draws
    assert draw_tokens([logits], [0.0], [generator]) == [0]


def test_passage_plans_are_a_share_and_vary():
    settings = Settings("tiny", 12, 20, 5, passage_tokens=64)
    rng = random.Random(0)
    plans = [plan(rng, settings) for _ in range(4000)]
    passages = [p for p in plans if p.instruction is not None]
    assert abs(len(passages) / len(plans) - PASSAGE_SHARE) < 0.03
    assert len({p.instruction for p in passages}) > 50 and len({p.opener for p in passages}) > 100
    assert {p.before for p in passages} == {True, False}
    none = Settings("tiny", 12, 20, 5, passage_tokens=0)
    assert all(plan(rng, none).instruction is None for _ in range(500))
    assert settings.context >= 64 + 64 + 20  # the passage and its instruction, then the answer


def test_passage_plan_puts_the_written_passage_into_the_users_message():
    tokenizer = CharTokenizer()
    written = tokenizer("the passage")["input_ids"]
    passage = tokenizer.decode(written)
    for before in (True, False):
        p = Plan("Write an article about cats.", 0.7, "Summarize it.", before)
        assert p.first_prompt(tokenizer, "<user>") == tokenizer.apply_chat_template(
            [{"role": "user", "content": "Write an article about cats."}], True)
        parts = ["Summarize it.", passage] if before else [passage, "Summarize it."]
        assert p.answer_prompt(tokenizer, written) == tokenizer.apply_chat_template(
            [{"role": "user", "content": "\n\n".join(parts)}], True)
        assert p.first_temperature == 0.7 and p.first_tokens(Settings("t", 12, 20, 5, 33)) == 33
    turn = Plan("Question:", 0.0)  # a self-written user turn: after the header, at T = 1
    assert turn.first_prompt(tokenizer, "<user>") == tokenizer("<user>Question:")["input_ids"]
    assert turn.first_temperature == 1.0 and turn.first_tokens(Settings("t", 12, 20, 5, 33)) == 12


def test_draw_tokens_row_is_its_draw_alone():
    """The batched draw gives each row what it draws alone, whatever shares the batch (the
    writer's conversations must not depend on their neighbours)."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    temperatures = [0.0, 0.7, 1.0, 0.7, 0.0, 1.0]

    def generators():
        return [torch.Generator().manual_seed(10 + i) for i in range(6)]

    alone = [draw_tokens([row], [t], [g])[0]
             for row, t, g in zip(logits, temperatures, generators())]
    together = draw_tokens(list(logits), temperatures, generators())
    assert together == alone
    assert draw_tokens(list(logits[1:3]), temperatures[1:3], generators()[1:3]) == alone[1:3]


def test_batch_drains_before_the_deadline_and_keeps_what_it_began(runner, tmp_path,
                                                                  monkeypatch):
    """A clock that moves one second a forward: near the deadline no conversation is begun
    that could not end before it, so none is in flight when it passes and every one written is
    the one an unbounded run writes; a deadline shorter than one conversation still stops the
    run there, dropping the first batch."""
    whole = tmp_path / "whole.jsonl"
    write_shard(writer(runner, 3), whole, 12, 600, show=lambda _: None)
    expected = lines(whole)
    seconds = [0.0]
    run_packed = runner.run_packed

    def one_second_a_forward(calls):
        seconds[0] += 1
        return run_packed(calls)

    monkeypatch.setattr(runner, "run_packed", one_second_a_forward)
    w = writer(runner, 3)
    most = w._most_forwards()
    assert most == 16 + 20  # the passage's 16 tokens, then an answer's 20
    got = {index: done for index, done, _ in w.write(iter(range(12)), 2 * most,
                                                     clock=lambda: seconds[0])}
    assert 3 < len(got) < 12  # more than the first batch, fewer than asked for
    assert w.dropped == 0 and w.forwards <= 2 * most
    for index, (ids, prompt_len) in got.items():
        record = json.loads(expected[index])
        assert (ids, prompt_len) == (record["ids"], record["prompt_len"])
    short, seconds[0] = writer(runner, 3), 0.0
    assert list(short.write(iter(range(12)), 5, clock=lambda: seconds[0])) == []
    assert short.dropped == 3 and short.forwards == 5
