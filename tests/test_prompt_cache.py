"""The prompt cache: a prompt that starts with an earlier prompt and answer prefills only the
rest, from the rows its slot still holds or from the shared store, and gets bitwise the answer
a full prefill gives (greedy and seeded), within the store's memory budget."""

from __future__ import annotations

import httpx
import pytest
import torch

from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.models.kv_cache import INITIAL_SLOTS
from specdecode.models.llama import LlamaRunner
from specdecode.server import BackgroundServer
from specdecode.server.app import Server, Settings, create_app
from specdecode.server.goodput import Batching
from specdecode.server.prompt_cache import MIN_SAVED_TOKENS
from test_server import wait_idle
from tiny_models import tiny_llama
from tiny_server import CORPUS, EOS, MODEL

#: a free row curve: drafts always pay, so verify steps write tree rows the cache then holds
FLAT = {1: 1.0, 4096: 1.0001}
SYSTEM = " ".join(CORPUS * 3)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(vocab_size=len(tokenizer), hidden_size=64, max_positions=512, seed=3)


@pytest.fixture(scope="module")
def runner(model):
    return LlamaRunner.from_transformers(model, "int4", max_context=448)


# ---- the runner: rows of an earlier prompt and answer are the rows a prefill writes ---------

def prefill_logits(runner, ids, start=0):
    return runner.prefill_part(ids, start, len(ids)).logits


@pytest.mark.parametrize("kept", [0, 1, 57, 128, 150])
def test_a_prompt_after_kept_rows_gives_a_full_prefills_bits(runner, kept):
    first = [(7 * i) % 90 + 3 for i in range(140)]
    token = int(runner.prefill(first).logits[-1].argmax())
    history = list(first)
    for step in range(8):  # an answer's rows: verify steps of a root and a drafted chain
        drafted = [(token + step) % 90 + 3, 4]
        logits = runner.forward(token, Draft.chain(drafted)).logits
        runner.commit([0])  # the first drafted node accepted: its row moves next to the root's
        history += [token, drafted[0]]
        token = int(logits[1].argmax())
    assert runner.cache_len == len(history)
    prompt = history[:kept] + [(5 * i) % 80 + 4 for i in range(170 - kept)]
    runner.keep_prefix(kept)
    reused = prefill_logits(runner, prompt, kept)
    fresh = runner.replica()
    assert torch.equal(reused, prefill_logits(fresh, prompt))
    # the next step too: the reused rows are read by every later row
    step = runner.forward(5, Draft.chain([6, 7])).logits
    assert torch.equal(step, fresh.forward(5, Draft.chain([6, 7])).logits)


def test_saved_rows_load_into_a_replica(runner):
    prompt = [(11 * i) % 85 + 3 for i in range(200)]
    runner.prefill(prompt[:150])
    saved = runner.saved_rows(150)
    other = runner.replica()
    other.prefill([9] * 30)  # rows of something else, written over
    other.load_rows(saved, 133)
    assert other.cache_len == 133
    assert torch.equal(prefill_logits(other, prompt, 133), prefill_logits(runner.replica(), prompt))


def test_a_runner_whose_prompts_run_other_layers_refuses(model):
    fp32 = LlamaRunner.from_transformers(model, "fp32")
    assert not fp32.reuses_prefix
    fp32.prefill([3, 4, 5, 6])
    with pytest.raises(SpecDecodeError, match="prompts run other layers"):
        fp32.keep_prefix(2)


# ---- the library: a Decoder's next turn ----------------------------------------------------

def turns(decoder, first, follow_up, **options):
    """A conversation's two turns through ``decoder``: the second prompt is the first, its
    answer and ``follow_up``. Each turn's answer and the prompt tokens it did not prefill."""
    one = decoder.start(first, 24, chat=False, **options)
    answer = one.run()
    two = decoder.start(first + answer + follow_up, 24, chat=False, **options)
    return answer, two.run(), one.stats.cached_tokens, two.stats.cached_tokens


@pytest.mark.parametrize("method", ["ar", "suffix"])
@pytest.mark.parametrize("options", [{}, {"temperature": 0.9, "seed": 5}])
def test_a_decoders_next_turn_prefills_only_what_is_new(model, method, options):
    from specdecode.api import Decoder

    first = [(7 * i) % 90 + 3 for i in range(150)]
    follow_up = [(3 * i) % 70 + 5 for i in range(20)]
    reused = LlamaRunner.from_transformers(model, "int4", max_context=448)
    answer, second, cached_first, cached_second = turns(
        Decoder(reused, None, method, eos_token_ids=[]), first, follow_up, **options)
    assert cached_first == 0
    # the held rows: all of the first turn but its last token (no forward has read it)
    assert cached_second >= len(first) + len(answer) - 1
    fresh = Decoder(reused.replica(), None, method, eos_token_ids=[], reuse_prompt=False)
    assert turns(fresh, first, follow_up, **options) == (answer, second, 0, 0)


def test_nothing_is_reused_once_the_cache_has_changed(model):
    from specdecode.api import Decoder

    runner = LlamaRunner.from_transformers(model, "int4", max_context=448)
    first = [(7 * i) % 90 + 3 for i in range(60)]
    decoder = Decoder(runner, None, "ar", eos_token_ids=[])
    answer = decoder.start(first, 16, chat=False).run()
    runner.prefill(first[:30] + [9] * 40)  # the same start, then other rows over the answer's
    again = decoder.start(first + answer, 16, chat=False)
    expected = Decoder(runner.replica(), None, "ar", eos_token_ids=[]).start(first + answer, 16,
                                                                              chat=False).run()
    assert again.run() == expected and again.stats.cached_tokens == 0
    # another decoder on the runner: the next turn reuses what that one left, not its own
    Decoder(runner, None, "ar", eos_token_ids=[]).start(first[:40] + [8] * 10, 8, chat=False).run()
    after = decoder.start(first + answer, 16, chat=False)
    assert after.run() == expected and after.stats.cached_tokens == 40


# ---- the server --------------------------------------------------------------------------

def serve(model, parallel, tokenizer, **settings):
    first = LlamaRunner.from_transformers(model, "int4", max_context=448)
    runners = [first] + [first.replica() for _ in range(parallel - 1)]
    options = dict(model_id=MODEL, method="suffix", batching=Batching(row_curve=FLAT))
    options.update(settings)
    return BackgroundServer(create_app(Server(runners, tokenizer, [EOS], Settings(**options))))


def chat(url, messages, **options):
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, **options}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    usage = response["usage"]
    return response["choices"][0]["message"]["content"], usage["prompt_tokens_details"]["cached_tokens"]


def conversation(url, opening, turns, **options):
    """A chat of ``turns`` user turns, each sent with the whole history: (answers, cached)."""
    messages = [{"role": "system", "content": SYSTEM}]
    answers, cached = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{opening} {CORPUS[turn % 4]}"})
        text, hit = chat(url, messages, **options)
        messages.append({"role": "assistant", "content": text})
        answers.append(text)
        cached.append(hit)
    return answers, cached


def metric(url, name):
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


@pytest.mark.parametrize("options", [{}, {"temperature": 0.9, "seed": 5}])
def test_a_conversation_reuses_its_history_and_answers_the_same(model, tokenizer, options):
    with serve(model, 2, tokenizer, prompt_cache_bytes=0) as served:
        plain, none = conversation(served.url, "Hello there.", 3, **options)
    with serve(model, 2, tokenizer) as served:
        cached, hits = conversation(served.url, "Hello there.", 3, **options)
        reused = metric(served.url, "specdecode_prompt_cache_hit_tokens_total")
    assert cached == plain
    assert none == [0, 0, 0]
    # the system prompt and every earlier turn come from the slot's rows
    assert hits[0] == 0 and hits[1] > 40 and hits[2] > hits[1], hits
    assert reused == sum(hits)


def test_rows_a_slot_wrote_over_come_back_from_the_store(model, tokenizer):
    # one slot: conversation B writes over A's rows; A's next turn finds them in the store
    def interleaved(url):
        a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CORPUS[0]}]
        b = [{"role": "user", "content": CORPUS[2] + " " + CORPUS[1] * 3}]
        first, _ = chat(url, a)
        other, _ = chat(url, b)
        a += [{"role": "assistant", "content": first}, {"role": "user", "content": CORPUS[3]}]
        return [first, other, *chat(url, a)]

    with serve(model, 1, tokenizer, prompt_cache_bytes=0) as served:
        plain = interleaved(served.url)
    with serve(model, 1, tokenizer) as served:
        cached = interleaved(served.url)
        wait_idle(served)
        saved = metric(served.url, "specdecode_prompt_cache_entries")
    assert cached[:3] == plain[:3]
    assert cached[3] > MIN_SAVED_TOKENS, "A's history did not come from the store"
    assert saved >= 1


def test_a_long_system_prompt_comes_back_from_the_store_to_a_slot_that_grew(model, tokenizer):
    # one slot: A's prompt outgrows the cache's first storage, B's new prompt gives it back,
    # C shares A's system prompt (shorter than the first storage), loaded from the store
    system = {"role": "system", "content": " ".join(CORPUS * 5)}
    requests = [[system, {"role": "user", "content": "A: " + CORPUS[0] * 6}],
                [{"role": "user", "content": CORPUS[2] + " " + CORPUS[1] * 3}],
                [system, {"role": "user", "content": "C: " + CORPUS[1]}]]
    assert len(tokenizer.apply_chat_template(requests[0])) > INITIAL_SLOTS
    with serve(model, 1, tokenizer, prompt_cache_bytes=0) as served:
        plain = [chat(served.url, messages) for messages in requests]
    with serve(model, 1, tokenizer) as served:
        cached = [chat(served.url, messages) for messages in requests]
    assert [text for text, _ in cached] == [text for text, _ in plain]
    assert INITIAL_SLOTS * 3 // 4 < cached[2][1] < INITIAL_SLOTS, cached  # from the store


def test_the_store_keeps_to_its_budget(model, tokenizer):
    # a budget of about one saved prompt: each conversation written over evicts the one before
    runner = LlamaRunner.from_transformers(model, "int4", max_context=448)
    runner.prefill(list(range(3, 200)))
    one_prompt = runner.saved_rows(197).nbytes
    with serve(model, 1, tokenizer, prompt_cache_bytes=int(one_prompt * 1.5)) as served:
        for i in range(4):
            chat(served.url, [{"role": "user", "content": f"{i} " + CORPUS[i] * 6}])
        wait_idle(served)
        held = metric(served.url, "specdecode_prompt_cache_bytes")
        evicted = metric(served.url, "specdecode_prompt_cache_evictions_total")
    assert 0 < held <= one_prompt * 1.5
    assert evicted >= 1


# ---- across restarts: --prompt-cache-file ------------------------------------------------------

def serve_file(path, tokenizer, cache_file, weights="int4", **settings):
    """A one-slot server on the GGUF file at ``path`` that keeps its prompt cache in
    ``cache_file``."""
    runner = LlamaRunner.from_gguf(path, weights, max_context=448)
    options = dict(model_id=MODEL, method="suffix", prompt_cache_file=str(cache_file))
    options.update(settings)
    return BackgroundServer(create_app(Server([runner], tokenizer, [EOS], Settings(**options))))


@pytest.fixture(scope="module")
def gguf_path(model, tmp_path_factory):
    from test_llama_runner import write_gguf

    return write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("options", [{}, {"temperature": 0.9, "seed": 5}])
def test_a_restarted_server_reads_its_prompts_rows_from_the_file(gguf_path, tokenizer, tmp_path,
                                                                 options):
    cache_file = tmp_path / "prompts.safetensors"
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CORPUS[0]}]
    with serve_file(gguf_path, tokenizer, cache_file) as served:
        answer, _ = chat(served.url, first, **options)
    assert cache_file.exists()
    follow_up = first + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": CORPUS[1]}]
    with serve_file(gguf_path, tokenizer, tmp_path / "none.safetensors",
                    prompt_cache_bytes=0) as served:
        want = [chat(served.url, messages, **options) for messages in (first, follow_up)]
    with serve_file(gguf_path, tokenizer, cache_file) as served:
        got = [chat(served.url, messages, **options) for messages in (first, follow_up)]
    prompt = len(tokenizer.apply_chat_template(first, add_generation_prompt=True))
    assert [text for text, _ in got] == [text for text, _ in want]
    assert got[0][1] == prompt - 1  # all but the last prompt token, read from the file
    assert got[1][1] >= prompt - 1


def test_a_file_written_for_other_rows_is_not_read(gguf_path, tokenizer, tmp_path, caplog):
    cache_file = tmp_path / "prompts.safetensors"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CORPUS[2]}]
    with serve_file(gguf_path, tokenizer, cache_file, weights="int8") as served:
        want, _ = chat(served.url, messages)
    with serve_file(gguf_path, tokenizer, cache_file) as served:  # int4: other rows
        got, cached = chat(served.url, messages)
    assert cached == 0 and "written for other weights" in caplog.text
    cache_file.write_bytes(b"not a safetensors file")
    with serve_file(gguf_path, tokenizer, cache_file) as served:
        assert chat(served.url, messages) == (got, 0)
    assert "could not be read" in caplog.text


def test_a_runner_whose_rows_cannot_be_kept_is_refused(model, tokenizer, tmp_path):
    runner = LlamaRunner.from_transformers(model, "int4", max_context=448)  # no file
    with pytest.raises(SpecDecodeError, match="--prompt-cache-file"):
        Server([runner], tokenizer, [EOS], Settings(model_id=MODEL,
                                                     prompt_cache_file=str(tmp_path / "f")))


def test_a_file_that_cannot_be_written_is_logged_and_shutdown_goes_on(gguf_path, tokenizer,
                                                                      tmp_path, caplog):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CORPUS[3]}]
    with serve_file(gguf_path, tokenizer, blocked / "prompts.safetensors") as served:
        chat(served.url, messages)
    assert "could not be written" in caplog.text


# ---- a Decoder's rows in a file: generate --prompt-cache-file ------------------------------

@pytest.mark.parametrize("method", ["ar", "suffix"])
@pytest.mark.parametrize("options", [{}, {"temperature": 0.9, "seed": 5}])
def test_a_decoder_reads_an_earlier_processs_rows_from_the_file(gguf_path, tmp_path, method,
                                                                options):
    from specdecode.api import Decoder

    def decoder(reuse=True):  # a new runner each time: what another process starts with
        runner = LlamaRunner.from_gguf(gguf_path, "int4", max_context=448)
        return Decoder(runner, None, method, eos_token_ids=[], reuse_prompt=reuse)

    context = [(7 * i) % 90 + 3 for i in range(150)]
    asked, asked_again = context + [5, 6, 7], context + [8, 9]
    cache_file = tmp_path / "rows.safetensors"
    first = decoder()
    answer = first.start(asked, 16, chat=False, **options).run()
    assert first.save_prompt_cache(cache_file) == len(asked) + len(answer) - 1
    assert decoder().save_prompt_cache(cache_file) == 0  # holds nothing: the file stays
    want = [decoder(reuse=False).start(ids, 16, chat=False, **options).run()
            for ids in (asked_again, asked)]
    for ids, expected in zip((asked_again, asked), want):
        later = decoder()
        assert later.load_prompt_cache(cache_file, ids) == len(asked) + len(answer) - 1
        generation = later.start(ids, 16, chat=False, **options)
        assert generation.run() == expected
        assert generation.stats.cached_tokens == common_start(ids, asked + answer, len(ids) - 1)


def common_start(a, b, limit):
    n = 0
    while n < min(len(a), len(b), limit) and a[n] == b[n]:
        n += 1
    return n


def test_a_decoder_reads_no_rows_written_for_other_weights_or_missing(gguf_path, model,
                                                                      tmp_path, caplog):
    from specdecode.api import Decoder

    cache_file = tmp_path / "rows.safetensors"
    int8 = Decoder(LlamaRunner.from_gguf(gguf_path, "int8", max_context=448), None, "ar",
                   eos_token_ids=[])
    assert int8.load_prompt_cache(cache_file) == 0  # no file yet
    int8.start([5] * 80, 4, chat=False).run()
    assert int8.save_prompt_cache(cache_file) == 83
    int4 = Decoder(LlamaRunner.from_gguf(gguf_path, "int4", max_context=448), None, "ar",
                   eos_token_ids=[])
    assert int4.load_prompt_cache(cache_file) == 0 and "written for other weights" in caplog.text
    in_memory = Decoder(LlamaRunner.from_transformers(model, "int4", max_context=448), None, "ar",
                        eos_token_ids=[])
    with pytest.raises(SpecDecodeError, match="--prompt-cache-file"):
        in_memory.save_prompt_cache(cache_file)


@pytest.mark.parametrize("method,config", [("draft_model", {}),
                                           ("dyspec", {"tree_nodes": 8, "max_depth": 4})])
@pytest.mark.parametrize("options", [{}, {"temperature": 0.9, "seed": 5}])
def test_a_draft_models_rows_come_back_from_the_file_too(gguf_path, model, tmp_path, method,
                                                        config, options):
    # a draft model read from a file keeps its own rows of the prompt beside the target's: a
    # later process's draft holds them (it reads only what follows), and the answers are a
    # fresh decoder's, greedy and seeded
    from specdecode.api import Decoder
    from test_llama_runner import write_gguf
    from tiny_models import noisy_copy

    draft = write_gguf(noisy_copy(model, 0.3, seed=1), tmp_path / "draft.gguf")

    def decoder(reuse=True):
        runner = LlamaRunner.from_gguf(gguf_path, "int4", max_context=448)
        return Decoder(runner, None, method, eos_token_ids=[], reuse_prompt=reuse,
                       draft_budget="full", draft=str(draft), **config)

    context = [(7 * i) % 90 + 3 for i in range(150)]
    asked, asked_again = context + [5, 6, 7], context + [8, 9]
    cache_file = tmp_path / "rows.safetensors"
    first = decoder()
    first.start(asked, 16, chat=False, **options).run()
    draft_ids = list(first.proposer.lm.tokens)
    assert len(draft_ids) >= len(asked)
    first.save_prompt_cache(cache_file)
    expected = decoder(reuse=False).start(asked_again, 16, chat=False, **options).run()
    later = decoder()
    later.load_prompt_cache(cache_file, asked_again)
    assert later.proposer.lm.tokens == draft_ids  # held, not read again
    assert later.start(asked_again, 16, chat=False, **options).run() == expected
    # a target-only file (ar wrote it) leaves the draft to read the prompt itself
    plain = Decoder(LlamaRunner.from_gguf(gguf_path, "int4", max_context=448), None, "ar",
                    eos_token_ids=[])
    plain.start(asked, 4, chat=False).run()
    plain.save_prompt_cache(cache_file)
    fresh = decoder()
    fresh.load_prompt_cache(cache_file, asked_again)
    assert fresh.proposer.lm.tokens == []
