"""Batched serving: the scheduler runs every active sequence in one packed forward of the
native runner; each response equals the same request sent alone (greedy and seeded), drafts are
budgeted by goodput, and a client leaving mid-stream loses nobody else's tokens."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx
import openai
import pytest

from specdecode.api import Decoder, with_turn_ends
from specdecode import registry
from specdecode.models.base import PrefillCall, VerifyCall
from specdecode.models.llama import LlamaRunner
from specdecode.server import BackgroundServer
from specdecode.server.app import Server, Settings, create_app
from specdecode.server import scheduler
from specdecode.server.goodput import Batching
from specdecode.sizing import FIRST_DRAFTS
from conftest import write_gguf
from test_server import wait_idle
from tiny_server import EOS, MODEL
from tiny_models import noisy_copy, tiny_llama

PROMPTS = ["Hello world! How are", "def add(a, b):\n    return", "The quick brown fox",
           "Speculative decoding drafts tokens and", "How are you today? I am",
           "return a + b\n", "jumps over the lazy dog. The quick", "thank you. Hello"]
#: one row costs as much as a whole step: no draft can pay
STEEP = {1: 1.0, 2: 2.0}
#: rows are free: every draft pays
FLAT = {1: 1.0, 4096: 1.0001}


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(vocab_size=len(tokenizer), hidden_size=64, max_positions=256, seed=3)


def serve(model, tokenizer, parallel=4, method="suffix", curve=FLAT, **settings):
    first = LlamaRunner.from_transformers(model, "int4")
    runners = [first] + [first.replica() for _ in range(parallel - 1)]
    options = dict(model_id=MODEL, method=method, max_queue=64,
                   batching=Batching(row_curve=curve))
    options.update(settings)
    return BackgroundServer(create_app(Server(runners, tokenizer, [EOS], Settings(**options))))


def solo(model, tokenizer, prompt, method, max_tokens, **sampling):
    decoder = Decoder(LlamaRunner.from_transformers(model, "int4"), tokenizer, method, [EOS])
    return decoder.generate(prompt, max_tokens, chat=True, **sampling).text


def ask_all(url, requests):
    """Send every (prompt, options) at once, each from its own thread; texts and usages."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = [None] * len(requests)

    def one(i, prompt, options):
        stream = options.pop("stream", False)
        messages = [{"role": "user", "content": prompt}]
        if stream:
            pieces = client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                    **options)
            out[i] = ("".join(c.choices[0].delta.content or "" for c in pieces if c.choices), None)
        else:
            r = client.chat.completions.create(model=MODEL, messages=messages, **options)
            out[i] = (r.choices[0].message.content, r.usage)

    threads = [threading.Thread(target=one, args=(i, p, dict(o))) for i, (p, o) in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(o is not None for o in out), "a request got no response"
    return out


@pytest.fixture
def packed_sizes(monkeypatch):
    """Sequences in each packed forward the scheduler runs."""
    sizes = []
    run_packed = LlamaRunner.run_packed

    def spy(self, work):
        sizes.append(len(work))
        return run_packed(self, work)

    monkeypatch.setattr(LlamaRunner, "run_packed", spy)
    return sizes


@pytest.mark.parametrize("method", ["ar", "suffix"])
def test_every_batched_response_equals_its_solo_response(model, tokenizer, packed_sizes, method):
    requests = [(p, dict(max_tokens=24, temperature=0, stream=i % 2 == 0))
                for i, p in enumerate(PROMPTS)]
    requests += [(p, dict(max_tokens=24, temperature=0.9, seed=7 + i))
                 for i, p in enumerate(PROMPTS[:4])]
    with serve(model, tokenizer, parallel=6, method=method) as served:
        got = ask_all(served.url, requests)
        wait_idle(served)
    for (prompt, options), (text, _) in zip(requests, got):
        sampling = ({} if options["temperature"] == 0 else
                    dict(temperature=options["temperature"], seed=options["seed"]))
        assert text == solo(model, tokenizer, prompt, method, 24, **sampling), prompt
    assert max(packed_sizes) >= 4, f"sequences were not packed: {packed_sizes}"


def test_each_slot_holds_and_reports_the_memory_of_its_own_sequence(tokenizer):
    """A slot's KV cache grows with its sequence, not to the longest context the server
    allows: after a long prompt on one slot, that slot reports twice the first storage in
    /health and /metrics, the idle one its first storage, both far below --max-context's; the
    answer is the solo answer."""
    from specdecode.models.native_shape import kv_cache_bytes
    from test_server import metric_values

    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, max_positions=2048, seed=4)
    prompt = " ".join(PROMPTS * 6)  # some 300 tokens: past the first 256 slots
    with serve(model, tokenizer, parallel=2, method="ar") as served:
        (text, usage), = ask_all(served.url, [(prompt, dict(max_tokens=8, temperature=0))])
        wait_idle(served)
        held = httpx.get(served.url + "/health").json()["kv_cache_bytes"]
        scraped = metric_values(httpx.get(served.url + "/metrics").text)
    assert 256 < usage.prompt_tokens + 8 <= 512
    runner = LlamaRunner.from_transformers(model, "int4")
    first, whole = runner.kv_bytes, kv_cache_bytes(runner.shape, runner.cache.capacity, "int4")
    assert sorted(held) == [first, 2 * first] and 2 * first < whole / 4
    assert [scraped["specdecode_kv_cache_bytes", (("slot", str(i)),)] for i in (0, 1)] == held
    assert text == solo(model, tokenizer, prompt, "ar", 8)


def test_prefill_order_takes_the_oldest_then_the_fewest_rows_left():
    assert scheduler.prefill_order([]) == []
    assert scheduler.prefill_order([300]) == [0]
    assert scheduler.prefill_order([500, 400, 10, 200, 30]) == [0, 2, 4, 3, 1]
    assert scheduler.prefill_order([5, 40, 40, 7]) == [0, 3, 1, 2]  # ties: the older first


@pytest.fixture(scope="module")
def long_model(tokenizer):
    return tiny_llama(vocab_size=len(tokenizer), hidden_size=64, max_positions=512, seed=4)


@pytest.fixture
def prompt_parts(monkeypatch):
    """Each packed forward's prompt parts: (prompt length, start, stop)."""
    steps = []
    run_packed = LlamaRunner.run_packed

    def spy(self, work):
        steps.append([(len(call.ids), call.start, call.stop) for _, call in work
                      if isinstance(call, PrefillCall)])
        return run_packed(self, work)

    monkeypatch.setattr(LlamaRunner, "run_packed", spy)
    return steps


def together(model, tokenizer, prompts, max_tokens=4, **settings):
    """The prompts (token ids) queued at once, as one job's sequences (admitted together, in
    this order) on a server of a slot each, `ar`, greedy: each one's result."""
    runners = [LlamaRunner.from_transformers(model, "int4")]
    runners += [runners[0].replica() for _ in prompts[1:]]
    backend = Server(runners, tokenizer, [EOS],
                     Settings(model_id=MODEL, method="ar", **settings)).backend
    ar = registry.get("ar")
    loop = asyncio.new_event_loop()
    job = scheduler.Job([scheduler.SequenceSpec(ids, max_tokens, (), {}, ar, ar.make_config())
                         for ids in prompts], loop)

    async def results():
        done = {}
        while len(done) < len(prompts):
            kind, index, payload = await job.events.get()
            assert kind != "error", payload
            if kind == "done":
                done[index] = payload
        return [done[i] for i in range(len(prompts))]

    backend.start()
    try:
        backend.submit(job)
        return loop.run_until_complete(results())
    finally:
        backend.stop()
        loop.close()


def alone(model, tokenizer, ids, max_tokens=4):
    decoder = Decoder(LlamaRunner.from_transformers(model, "int4"), tokenizer, "ar",
                      with_turn_ends([EOS], tokenizer))  # the server's ends
    return decoder.generate(ids, max_tokens, chat=False).token_ids


def test_a_short_prompt_is_not_held_behind_long_ones(long_model, tokenizer, prompt_parts):
    """Two long prompts, then a short one, queued together, prompt rows for one part and a bit
    a step: the first step prefills the oldest prompt's first part and the whole short prompt,
    the second long prompt waits; every answer is the one it gets alone."""
    part = scheduler.PREFILL_PART_ROWS
    words = tokenizer.encode(" ".join(PROMPTS * 10), add_special_tokens=False)
    assert len(words) >= 2 * part + 50
    prompts = [words[:2 * part + 40], words[9:2 * part + 39], words[:20]]
    got = together(long_model, tokenizer, prompts,
                   batching=Batching(row_curve=FLAT, prefill_rows=part + 1))
    long, other, short = (len(ids) for ids in prompts)
    assert prompt_parts[0] == [(long, 0, part), (short, 0, short)]
    assert prompt_parts[1] == [(long, part, 2 * part), (other, 0, part)]
    for ids, result in zip(prompts, got):
        assert result.token_ids == alone(long_model, tokenizer, ids)


@pytest.mark.parametrize("cache_mb", [1024, 0])
def test_prompts_sent_together_compute_their_common_start_once(long_model, tokenizer,
                                                               prompt_parts, cache_mb):
    """Two prompts with a common start of 200 tokens (and a short one of its own) queued
    together: the second waits while the first computes the common rows, copies them, and
    prefills only its own 40 (``--prompt-cache-mb 0``: it computes them all); both answers are
    the ones they get alone."""
    part = scheduler.PREFILL_PART_ROWS
    words = tokenizer.encode(" ".join(PROMPTS * 12), add_special_tokens=False)
    assert len(words) >= 400
    first, second, own = words[:240], words[:200] + words[300:340], words[5:30]
    got = together(long_model, tokenizer, [first, second, own],
                   batching=Batching(row_curve=FLAT, prefill_rows=2 * part),
                   prompt_cache_bytes=cache_mb * 2**20)
    computed = [(length, start, stop) for step in prompt_parts for length, start, stop in step]
    if cache_mb:
        assert computed == [(240, 0, part), (25, 0, 25), (240, part, 240), (240, 200, 240)]
        assert [result.stats.cached_tokens for result in got] == [0, 200, 0]
    else:
        assert sorted(computed) == sorted([(240, 0, part), (25, 0, 25), (240, 0, part),
                                           (240, part, 240), (240, part, 240)])
    for ids, result in zip((first, second, own), got):
        assert result.token_ids == alone(long_model, tokenizer, ids)


def test_the_choices_of_one_request_read_its_prompt_once(long_model, tokenizer, prompt_parts):
    """A request's ``n`` sequences share their whole prompt: one computes it, the others copy
    all its rows but the last (whose logits they need) and compute that one."""
    words = tokenizer.encode(" ".join(PROMPTS * 12), add_special_tokens=False)[:200]
    got = together(long_model, tokenizer, [words] * 3, max_tokens=6,
                   batching=Batching(row_curve=FLAT))
    computed = [(length, start, stop) for step in prompt_parts for length, start, stop in step]
    part = scheduler.PREFILL_PART_ROWS
    assert computed == [(200, 0, part), (200, part, 200), (200, 199, 200), (200, 199, 200)]
    assert [result.stats.cached_tokens for result in got] == [0, 199, 199]
    assert [result.token_ids for result in got] == [alone(long_model, tokenizer, words, 6)] * 3


def test_goodput_keeps_drafts_where_rows_are_free_and_drops_them_where_not(model, tokenizer):
    requests = [(p, dict(max_tokens=32, temperature=0)) for p in PROMPTS[:4]] * 2
    drafted = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        with serve(model, tokenizer, parallel=4, method="suffix", curve=curve) as served:
            got = ask_all(served.url, requests)
        drafted[name] = sum(usage.draft_tokens for _, usage in got)
        texts = [text for text, _ in got]
        drafted[name + "_texts"] = texts
    # steep: only the method's one-token first drafts (sizing.first_draft), FIRST_DRAFTS of
    # them and those of the other slots' sequences drafting in the same step
    assert drafted["steep"] <= FIRST_DRAFTS + 3, drafted["steep"]
    assert drafted["flat"] > 4 * drafted["steep"]
    assert drafted["flat_texts"] == drafted["steep_texts"]


def test_full_budget_ignores_the_curve(model, tokenizer):
    requests = [(p, dict(max_tokens=32, temperature=0)) for p in PROMPTS[:4]] * 2
    with serve(model, tokenizer, parallel=4, method="suffix", curve=STEEP,
               batching=Batching(draft_budget="full", row_curve=STEEP)) as served:
        got = ask_all(served.url, requests)
    assert sum(usage.draft_tokens for _, usage in got) > 0


def test_auto_sizes_its_own_drafts_in_the_server(model, tokenizer):
    """auto prices each part's drafting itself (a draft model's tokens beside a lookup's): the
    scheduler hands its sequences their whole budget, where one curve, acceptance and drafting
    time for the method would size them (this steep curve leaves a lookup its first drafts)."""
    requests = [(p, dict(max_tokens=32, temperature=0)) for p in PROMPTS[:4]]
    with serve(model, tokenizer, parallel=4, method="auto", curve=STEEP,
               config={"parts": "suffix,ngram"}) as served:
        got = ask_all(served.url, requests)
    assert [text for text, _ in got] == [solo(model, tokenizer, p, "ar", 32) for p in PROMPTS[:4]]
    assert sum(usage.draft_tokens for _, usage in got) > FIRST_DRAFTS + 3


def test_a_client_leaving_mid_stream_costs_the_others_nothing(model, tokenizer):
    with serve(model, tokenizer, parallel=4, method="ar") as served:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}],
                "max_tokens": 200, "stream": True, "temperature": 0}
        stay = [(p, dict(max_tokens=40, temperature=0)) for p in PROMPTS[1:4]]
        results = {}
        thread = threading.Thread(target=lambda: results.setdefault("stay", ask_all(served.url, stay)))
        with httpx.stream("POST", served.url + "/v1/chat/completions", json=body) as r:
            thread.start()
            for line in r.iter_lines():
                if '"content"' in line:
                    break  # leave once text arrives
        thread.join(120)
        wait_idle(served)
        metrics = httpx.get(served.url + "/metrics").text
    for (prompt, _), (text, _) in zip(stay, results["stay"]):
        assert text == solo(model, tokenizer, prompt, "ar", 40)
    assert 'specdecode_sequences_total{method="ar",outcome="cancelled"} 1.0' in metrics
    assert "specdecode_batch_sequences_count" in metrics


def test_an_opted_in_lossy_method_is_served_beside_packed_sequences(model, tokenizer):
    """A lossy method runs its own loop, one piece a step beside the packed forward; the
    exact requests around it still get their solo answers."""
    client_body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}],
                   "max_tokens": 16, "temperature": 0,
                   "specdecode": {"method": "superposed", "allow_lossy": True}}
    with serve(model, tokenizer, parallel=3, method="ar") as served:
        exact = {}
        thread = threading.Thread(target=lambda: exact.setdefault("got", ask_all(
            served.url, [(p, dict(max_tokens=16, temperature=0)) for p in PROMPTS[1:3]])))
        thread.start()
        lossy = httpx.post(served.url + "/v1/chat/completions", json=client_body, timeout=60)
        thread.join(120)
    assert lossy.status_code == 200, lossy.text
    assert lossy.json()["choices"][0]["message"]["content"] == solo(
        model, tokenizer, PROMPTS[0], "superposed", 16)
    for prompt, (text, _) in zip(PROMPTS[1:3], exact["got"]):
        assert text == solo(model, tokenizer, prompt, "ar", 16)


def test_draft_rows_that_cost_more_than_the_curve_says_are_priced(model, tokenizer, monkeypatch):
    """Rows nearly free by the curve, but each draft row slows the step by 10 ms, as a long
    context's attention does (the curve is measured after a one-token prompt): the scheduler
    fits that per-row part of its overhead and drafts far less than where rows are as free as
    the curve says. A fixed overhead alone would make drafts look cheaper still."""
    requests = [(p, dict(max_tokens=32, temperature=0)) for p in PROMPTS[:4]] * 2
    cheap = {1: 0.002, 4096: 0.0021}
    batching = Batching(row_curve=cheap, max_draft_rows=8)
    drafted = {}
    run_packed = LlamaRunner.run_packed
    for name, row_s in (("free", 0.0), ("costly", 0.01)):
        def slowed(self, work, row_s=row_s):
            time.sleep(row_s * sum(len(call.draft) for _, call in work
                                   if isinstance(call, VerifyCall)))
            return run_packed(self, work)

        monkeypatch.setattr(LlamaRunner, "run_packed", slowed)
        with serve(model, tokenizer, parallel=4, method="suffix", batching=batching) as served:
            got = ask_all(served.url, requests)
        drafted[name] = sum(usage.draft_tokens for _, usage in got)
        drafted[name + "_texts"] = [text for text, _ in got]
    assert drafted["costly_texts"] == drafted["free_texts"]
    assert drafted["free"] > 0 and drafted["costly"] < drafted["free"] / 2, drafted


def test_a_draft_models_levels_are_priced(model, tokenizer, tmp_path, monkeypatch):
    """A draft model drafts a token a forward: the scheduler prices each level of its drafts
    (by the draft's own row-cost curve, then by its timed drafting: one request's sizing),
    not only a fixed cost a step, which let a real draft model be sent at its controller's
    full length where a token or two pays (on two AVX2 cores, slower than plain decoding)."""
    draft = write_gguf(noisy_copy(model, 0.1, seed=1), tmp_path / "draft.gguf")
    level_seconds = []
    allocate = scheduler.allocate

    def recorded(candidates, *args):
        level_seconds.extend(candidate.level_s for candidate in candidates)
        return allocate(candidates, *args)

    monkeypatch.setattr(scheduler, "allocate", recorded)
    requests = [(p, dict(max_tokens=24, temperature=0)) for p in PROMPTS[:2]]
    with serve(model, tokenizer, parallel=2, method="draft_model",
               config={"draft": str(draft)}) as served:
        got = ask_all(served.url, requests)
    assert [text for text, _ in got] == [solo(model, tokenizer, p, "ar", 24) for p in PROMPTS[:2]]
    assert sum(usage.draft_tokens for _, usage in got) > 0
    # most steps: a step whose timed drafts a loaded machine made look no slower deeper fits
    # its line flat (DraftTime.line: a lookup's shape, nothing a level), which this suite
    # running beside others once produced
    assert level_seconds and statistics.median(level_seconds) > 0


@pytest.mark.parametrize("method", ["draft_model", "dyspec"])
def test_a_seeded_request_with_sampled_drafts_repeats_at_any_load(model, tokenizer, tmp_path,
                                                                  method):
    """draft_model and dyspec verify sampled drafts by the rejection rule, so a seeded
    request's tokens follow its draft sizes: each is sized by the curve and its own steps, and
    its draft's catch-up priced as if the slot's draft had read nothing before it, so that it
    gets the same answer beside five others as after seven others on one slot."""
    draft = write_gguf(noisy_copy(model, 0.1, seed=1), tmp_path / "draft.gguf")
    requests = [(p, dict(max_tokens=24, temperature=0.9, seed=7 + i))
                for i, p in enumerate(PROMPTS)]
    # min_path_prob 0: trees however flat the tiny draft's distributions
    config = {"draft": str(draft)} | ({"min_path_prob": 0.0} if method == "dyspec" else {})
    texts, drafted = {}, {}
    for parallel in (6, 1):
        with serve(model, tokenizer, parallel=parallel, method=method, config=config) as served:
            got = ask_all(served.url, requests)
        texts[parallel] = [text for text, _ in got]
        drafted[parallel] = sum(usage.draft_tokens for _, usage in got)
    assert min(drafted.values()) > len(PROMPTS), drafted
    assert texts[6] == texts[1]
