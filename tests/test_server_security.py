"""`specdecode serve` against hostile and careless clients, on loopback.

Every hostile or careless request is replayed with raw HTTP and must get its 4xx in OpenAI's error
shape, after which the server must still answer ``/health`` and a completion. Then: requests
never name files (the same answer whatever exists on the disk), per-request configs stay in
the server's ranges and memory budget, the per-slot proposer cache is bounded in bytes, a
prompt too long by its size alone is refused before tokenizing, and long prompts prefilled in
parts give the same tokens as one prefill. The long-prompt stall itself is timed in
``scripts/prefill_stall.py``, not here.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import re

import httpx
import openai
import pytest
import torch

from specdecode import registry
from specdecode.api import Decoder
from specdecode.models.base import Needs
from specdecode.models.hf import HFRunner
from specdecode.models.llama import PREFILL_BLOCK, LlamaRunner
from specdecode.server import BackgroundServer
from specdecode.server import limits
from specdecode.server.app import Server, Settings, create_app
from specdecode.server.frontend import LOOPBACK_HOSTS
from specdecode.server.artifacts import ARTIFACT_FIELDS, Catalogue, Entry
from specdecode.server.options import allowed_hosts
from specdecode.server.protocol import ApiError
from specdecode.server.scheduler import DECODERS_PER_SLOT, _Decoder, _Slot

from tiny_models import tiny_llama
from test_server import GOOD, chat, served, still_serving  # noqa: F401 (served: a fixture)
from tiny_server import CONTEXT, EOS, MODEL, build_tokenizer, make_server

JSON = {"content-type": "application/json"}


def body(**changes) -> bytes:
    return json.dumps(dict(GOOD, **changes)).encode()


def config(method: str, **fields) -> bytes:
    return body(specdecode={"method": method, "config": fields})


def post(served, path, content: bytes, headers=JSON) -> httpx.Response:
    return httpx.post(served.url + path, content=content, headers=headers, timeout=30)


def expect_error(r: httpx.Response, status: int, needle: str, param=...) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"], error["message"]
    if param is not ...:
        assert error["param"] == param
    return error


# ---- every hostile request: its 4xx, and the server still serves ----------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

HOSTILE = [
    # a request naming files: refused without opening them
    ("heads=/etc/shadow", CHAT, config("eagle", heads="/etc/shadow"), JSON, 400,
     "requests pick artifacts by name", "specdecode.config.heads"),
    ("heads=missing path", CHAT, config("eagle", heads="/no/such/file.safetensors"), JSON, 400,
     "requests pick artifacts by name", "specdecode.config.heads"),
    ("draft=/tmp, draft_runner=hf", CHAT, config("draft_model", draft="/tmp", draft_runner="hf"),
     JSON, 400, "requests pick artifacts by name", "specdecode.config.draft"),
    ("adapters=/etc/passwd", CHAT, config("early_exit", adapters="/etc/passwd"), JSON, 400,
     "requests pick artifacts by name", "specdecode.config.adapters"),
    # unbounded memory
    ("recycling candidates=100000", CHAT, config("recycling", candidates=100000), JSON, 400,
     "must be in 1..64 on this server", "specdecode.config.candidates"),
    ("suffix max_cached_requests per request", CHAT, config("suffix", max_cached_requests=5),
     JSON, 400, "is set when the server starts", "specdecode.config.max_cached_requests"),
    ("a draft's shortlist per request", CHAT, config("draft_model", draft_vocab=7), JSON, 400,
     "is set when the server starts", "specdecode.config.draft_vocab"),
    ("a draft's format per request", CHAT, config("dyspec", draft_weights="fp32"), JSON, 400,
     "is set when the server starts", "specdecode.config.draft_weights"),
    # 500s where a 400 belongs
    ("JSON nested 30000 deep", CHAT, b"[" * 30000 + b"]" * 30000, JSON, 400, "too deeply", None),
    ("JSON nested 40 deep", CHAT, body(pad=json.loads("[" * 40 + "]" * 40)), JSON,
     400, "more than 32 levels", "pad"),
    ("lone surrogate in model", CHAT, body(model="\ud800"), JSON, 400, "lone UTF-16 surrogate",
     "model"),
    ("lone surrogate in a prompt", COMPLETIONS,
     json.dumps({"model": MODEL, "prompt": "x\ud800"}).encode(), JSON, 400,
     "lone UTF-16 surrogate", "prompt"),
    ("lone surrogate in a key", CHAT, json.dumps({**GOOD, "\udfff": 1}).encode(), JSON, 400,
     "lone UTF-16 surrogate", None),
    ("NaN temperature", CHAT, body(temperature=float("nan")), JSON, 400, "NaN is not a JSON",
     None),
    # browsers
    ("text/plain POST", CHAT, body(), {"content-type": "text/plain"}, 415,
     "Content-Type: application/json", None),
    ("no content type", CHAT, body(), {}, 415, "Content-Type: application/json", None),
    ("form POST", COMPLETIONS, b"model=tiny&prompt=hi",
     {"content-type": "application/x-www-form-urlencoded"}, 415, "application/json", None),
    ("foreign Host (DNS rebinding)", CHAT, body(), {**JSON, "host": "evil.example"}, 421,
     "does not answer for host", None),
    ("foreign Host on GET /health", "/health", None, {"host": "evil.example:8000"}, 421,
     "does not answer for host", None),
    # unclear errors
    ("text part without text", CHAT,
     body(messages=[{"role": "user", "content": [{"type": "text"}]}]), JSON, 400,
     "has no 'text' field", "messages"),
    ("prompt too long by its size", COMPLETIONS,
     json.dumps({"model": MODEL, "prompt": "fox " * 3000}).encode(), JSON, 400,
     "has at least", "prompt"),
]


@pytest.mark.parametrize("name,path,content,headers,status,needle,param", HOSTILE,
                         ids=[h[0] for h in HOSTILE])
def test_each_hostile_request_gets_its_4xx_and_the_server_keeps_serving(
        served, name, path, content, headers, status, needle, param):
    if content is None:
        r = httpx.get(served.url + path, headers=headers, timeout=30)
    else:
        r = post(served, path, content, headers)
    expect_error(r, status, needle, param)
    still_serving(served)


def test_paths_get_one_answer_whether_they_exist_or_not(served):
    """The error names what the request may give, never the file: /etc/passwd (exists),
    /etc/shadow (exists, unreadable to most), a missing file and a folder read alike."""
    messages = {post(served, CHAT, config("eagle", heads=p)).json()["error"]["message"]
                .replace(repr(p), "")
                for p in ("/etc/passwd", "/etc/shadow", "/no/such/file", "/tmp")}
    assert len(messages) == 1
    assert "passwd" not in messages.pop()


def test_cross_origin_pages_get_no_cors_headers_by_default(served):
    preflight = httpx.options(served.url + CHAT, headers={
        "origin": "http://evil.example", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})
    assert preflight.status_code >= 400
    assert "access-control-allow-origin" not in preflight.headers
    r = post(served, CHAT, body(), {**JSON, "origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_and_allowed_hosts_when_the_operator_asks(model, tokenizer):
    with make_server(model, tokenizer, cors_origins=("http://localhost:3000",),
                     allowed_hosts=("127.0.0.1", "api.internal")) as served:
        preflight = httpx.options(served.url + CHAT, headers={
            "origin": "http://localhost:3000", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.options(served.url + CHAT, headers={
            "origin": "http://evil.example", "access-control-request-method": "POST"})
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"
        assert post(served, CHAT, body(), {**JSON, "host": "api.internal:443"}).status_code == 200
        assert post(served, CHAT, body(), {**JSON, "host": "localhost"}).status_code == 421


@pytest.mark.parametrize("names,host,expected", [
    (None, "127.0.0.1", LOOPBACK_HOSTS), (None, "::1", LOOPBACK_HOSTS),
    (None, "localhost", LOOPBACK_HOSTS), (None, "0.0.0.0", None), (None, "10.0.0.5", None),
    ("*", "127.0.0.1", None), ("api.example, LOCALHOST", "0.0.0.0", ("api.example", "localhost")),
])
def test_allowed_hosts_default_to_loopback_names_on_loopback(names, host, expected):
    assert allowed_hosts(names, host) == expected


def test_a_huge_seed_with_n_choices_wraps_instead_of_reporting_a_seed_never_sent(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    options = dict(temperature=1.0, max_tokens=12)
    both = chat(client, "Tell me", seed=2**64 - 1, n=2, **options)
    assert len(both.choices) == 2
    # choice 1 uses seed + 1, which wraps to 0
    zero = chat(client, "Tell me", seed=0, **options)
    assert both.choices[1].message.content == zero.choices[0].message.content


def test_a_config_error_found_after_queueing_names_the_config(served):
    r = post(served, CHAT, config("eagle"))  # 'auto': no heads were trained for this model
    expect_error(r, 400, "no trained eagle heads", "specdecode.config")
    still_serving(served)


# ---- per-request config bounds ------------------------------------------------------------

def test_every_numeric_config_field_of_every_method_has_a_server_range():
    """A new method (or field) a request may set without bounds fails here."""
    missing = []
    for name in registry.names():
        for f in dataclasses.fields(registry.get(name).config):
            if not limits.is_numeric(f) or limits.startup_only(f):
                continue
            if limits.bounds(f) is None:
                missing.append(f"{name}.{f.name}")
            else:
                low, high = limits.bounds(f)
                assert low <= f.default <= high, f"{name}.{f.name}: default outside its range"
    assert not missing, f"give these fields param(..., bounds=(low, high)): {missing}"


def test_every_text_config_field_is_an_artifact_field_or_free_text_of_bounded_length():
    for name in registry.names():
        for f in dataclasses.fields(registry.get(name).config):
            if isinstance(f.default, str) and f.name in ARTIFACT_FIELDS:
                assert f.default in ARTIFACT_FIELDS[f.name], f"{name}.{f.name}"
    with pytest.raises(ApiError, match="longer than 64"):
        limits.check_overrides(registry.get("recycling"), {"tree": "chain" + "1" * 100})


@pytest.mark.parametrize("method,field,value", [
    ("recycling", "candidates", 65), ("recycling", "candidates", "100000"),
    ("ngram", "num_speculative_tokens", 10**9), ("eagle", "tree_nodes", 10**6),
    ("del", "head_cost", "inf"), ("suffix", "max_spec_tokens", "1000000"),
    ("early_exit", "exit_layer", 10**6),
])
def test_out_of_range_values_are_refused_naming_the_field(served, method, field, value):
    """Numbers sent as strings (the config coerces them, as from the command line) included."""
    r = post(served, CHAT, config(method, **{field: value}))
    expect_error(r, 400, "on this server", f"specdecode.config.{field}")


def test_a_config_over_the_memory_budget_is_refused_before_anything_is_allocated(model, tokenizer):
    vocab = model.config.vocab_size
    small = limits.proposer_bytes(registry.get("recycling").make_config(), vocab)
    made = []
    with make_server(model, tokenizer, proposer_memory_bytes=small + 1) as served:
        served_app = served.server.config.app
        scheduler = served_app.state.server.backend
        make = scheduler.make_proposer
        scheduler.make_proposer = lambda *a: made.append(a[0]) or make(*a)
        expect_error(post(served, CHAT, config("recycling", candidates=16)), 400,
                     "MiB of proposer memory", "specdecode.config")
        assert made == []
        assert post(served, CHAT, config("recycling")).status_code == 200
        assert made == ["recycling"]


# ---- the per-slot proposer cache: bounded in count and in bytes -----------------------------

def test_the_slot_cache_drops_least_recently_used_proposers_by_count_and_by_bytes():
    slot = _Slot(runner=None)
    method = registry.get("ar")

    def add(key, size, budget):
        slot.make_room(size, budget)
        slot.decoders[key] = _Decoder(method, None, None, size)

    for i in range(DECODERS_PER_SLOT + 3):
        add(i, 1, budget=10**9)
    assert list(slot.decoders) == list(range(3, DECODERS_PER_SLOT + 3))
    add("big", 60, budget=100)  # with 8 small ones: room only after dropping the oldest
    add("bigger", 50, budget=100)
    assert "big" not in slot.decoders and sum(d.bytes for d in slot.decoders.values()) <= 100


def rss_bytes() -> int:
    """The process's resident memory, once what it no longer holds is freed and the heap's
    free pages are given back (else garbage of earlier tests, collected or not in between,
    moves the reading by hundreds of MB in a process of several GB)."""
    from specdecode.models.weights import return_freed_memory

    gc.collect()
    return_freed_memory()
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read())[1]) * 1024


def test_memory_stays_bounded_over_100_requests_with_distinct_configs():
    """Recycling over a 50,000-token vocabulary (as a real model's): each distinct config is a
    new proposer of 0.8-25 MB. The slots keep at most the budget; the process's memory after
    100 distinct configs exceeds its memory after the first by less than that."""

    big = tiny_llama(vocab_size=50_000, hidden_size=16, max_positions=CONTEXT, seed=2)
    budget = 48 * 2**20
    with make_server(big, build_tokenizer(), parallel=2, proposer_memory_bytes=budget) as served:
        scheduler = served.server.config.app.state.server.backend

        def send(candidates, depth):
            content = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2,
                                  "specdecode": {"method": "recycling", "config": {
                                      "candidates": candidates, "tree": f"chain{depth}"}}})
            assert post(served, COMPLETIONS, content.encode()).status_code == 200

        send(2, 1)
        before = rss_bytes()
        for i in range(100):  # 100 distinct configs: candidates 15..64 x two trees
            send(15 + i // 2, 1 + i % 2)
        after = rss_bytes()
        kept = [sum(d.bytes for d in slot.decoders.values()) for slot in scheduler._free]
        held = [sum(t.nbytes for t in (d.proposer.matrix, d.proposer.seen))
                for slot in scheduler._free for d in slot.decoders.values()]
    print(f"RSS before {before / 2**20:.0f} MiB, after 100 distinct configs "
          f"{after / 2**20:.0f} MiB; slot caches {[k // 2**20 for k in kept]} MiB")
    assert all(k <= budget for k in kept) and sum(held) <= 2 * budget
    assert after - before < 2 * budget + 64 * 2**20  # unbounded: 16 kept x 13 MB on average


# ---- long prompts: size checked before tokenizing; prefilled in parts, exactly ---------------

@pytest.fixture(scope="module")
def long_model(tokenizer):
    """The tiny model with room for prompts of three prefill parts."""
    return tiny_llama(vocab_size=len(tokenizer), hidden_size=32, max_positions=4 * PREFILL_BLOCK,
                      seed=1)


def test_a_prompt_too_long_by_its_size_is_never_tokenized(model, tokenizer):
    server = Server([HFRunner(model)], tokenizer, [EOS], Settings(model_id=MODEL))
    calls = []
    pool = server._tokenizers
    copies = [pool.get() for _ in range(pool.qsize())]
    for copy in copies:
        original = copy.__class__.__call__
        copy.__class__ = type("Spy", (copy.__class__,), {
            "__call__": lambda self, *a, **k: calls.append(1) or original(self, *a, **k)})
        pool.put(copy)
    too_long = "x" * (CONTEXT * server.chars_per_token)
    with pytest.raises(ApiError, match="has at least"):
        server.encode(too_long, chat=False)
    with pytest.raises(ApiError, match="has at least"):
        server.encode([{"role": "user", "content": too_long}], chat=True)
    assert calls == []
    assert server.encode("fox " * 10, chat=False) and calls == [1]


def test_prefill_in_parts_gives_the_logits_and_hidden_states_of_one_prefill(long_model):
    runner = LlamaRunner.from_transformers(long_model)
    ids = [(7 * i) % 220 + 5 for i in range(2 * PREFILL_BLOCK + 37)]
    needs = Needs(final_hidden=True, layers=(1,))
    whole = runner.prefill(ids, needs)
    length = runner.cache_len
    assert runner.prefill_part(ids, 0, PREFILL_BLOCK, needs) is None
    assert runner.prefill_part(ids, PREFILL_BLOCK, 2 * PREFILL_BLOCK, needs) is None
    parts = runner.prefill_part(ids, 2 * PREFILL_BLOCK, len(ids), needs)
    assert torch.equal(parts.logits, whole.logits)
    assert torch.equal(parts.final_hidden, whole.final_hidden)
    assert len(parts.final_hidden) == len(ids)
    assert torch.equal(parts.layers[1], whole.layers[1])
    assert runner.cache_len == length
    with pytest.raises(Exception, match="must start at 0 or where the last part stopped"):
        runner.prefill_part(ids, PREFILL_BLOCK, len(ids))


@pytest.mark.parametrize("method", ["ar", "ngram", "recycling", "suffix"])
def test_long_prompts_prefilled_in_parts_beside_short_ones_equal_plain_decoding(
        long_model, tokenizer, method):
    """Native runner slots: a prompt of 2.5 parts and two short ones at once; every answer's
    tokens equal plain decoding's (ar, one prefill)."""
    import threading

    model = long_model
    runners = [LlamaRunner.from_transformers(model)]
    runners += [runners[0].replica() for _ in range(2)]
    long_ids = [(11 * i) % 220 + 5 for i in range(2 * PREFILL_BLOCK + 60)]
    prompts = [long_ids, [5, 9, 33, 40], [70, 71, 72]]
    reference = Decoder(LlamaRunner.from_transformers(model), tokenizer, "ar", [EOS])
    expected = [reference.start(p, 12).run() for p in prompts]
    with make_server(model, tokenizer, runners=runners) as served:
        answers = [None] * len(prompts)

        def send(i):
            content = json.dumps({"model": MODEL, "prompt": prompts[i], "max_tokens": 12,
                                  "specdecode": {"method": method, "return_token_ids": True}})
            answers[i] = post(served, COMPLETIONS, content.encode()).json()

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert [a["choices"][0]["token_ids"] for a in answers] == expected


# ---- the catalogue: artifacts by name ------------------------------------------------------

def test_a_request_picks_a_catalogued_artifact_by_name_and_only_of_its_kind(tmp_path, model,
                                                                            tokenizer):
    from conftest import tiny_heads

    path = tiny_heads("hydra", HFRunner(model))
    runner = HFRunner(model)
    catalogue = Catalogue.for_target(runner.fingerprint(), {"mine": path})
    assert catalogue.entries["mine"].kind == "hydra_heads"
    hydra, eagle = registry.get("hydra"), registry.get("eagle")
    assert catalogue.resolve(hydra, "heads", "mine") == path
    size = catalogue.entries["mine"].loaded_bytes
    assert size > 0 and catalogue.loaded_bytes(hydra, "heads", path) == size
    assert catalogue.loaded_bytes(hydra, "heads", "auto") == size  # the largest it could pick
    with pytest.raises(ApiError, match="requests pick artifacts by name"):
        catalogue.resolve(eagle, "heads", "mine")  # hydra heads are no eagle heads
    with pytest.raises(ApiError, match="'auto', 'mine'"):
        catalogue.resolve(hydra, "heads", path)  # its path is not its name
    server = Server([HFRunner(model)], tokenizer, [EOS], Settings(model_id=MODEL), None, catalogue)
    ref = Decoder(HFRunner(model), tokenizer, "ar", [EOS]).generate("Hello world", 16)
    with BackgroundServer(create_app(server)) as served:
        r = post(served, CHAT, json.dumps({
            "model": MODEL, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Hello world"}],
            "specdecode": {"method": "hydra", "config": {"heads": "mine"},
                           "return_token_ids": True}}).encode())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref.token_ids


def test_the_catalogue_refuses_a_bad_artifact_at_start(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    from specdecode.errors import SpecDecodeError

    with pytest.raises(SpecDecodeError, match="not a safetensors artifact"):
        Catalogue.for_target("fp", {"junk": str(tmp_path / "junk.safetensors")})
    with pytest.raises(SpecDecodeError, match="two artifacts are named"):
        Catalogue([Entry("a", tmp_path, "x", 1), Entry("a", tmp_path, "y", 1)])


@pytest.mark.parametrize("args,message", [
    (["--artifact", "no-equals-sign"], "--artifact takes NAME=PATH"),
    (["--artifact", "x=/no/such/file.safetensors"], "no such file or folder"),
    (["--allowed-hosts", " , "], "--allowed-hosts needs at least one name"),
    (["--proposer-memory-mb", "0"], "--proposer-memory-mb must be >= 1"),
])
def test_serve_rejects_bad_security_flags_before_loading_the_model(args, message, capsys):
    from specdecode.cli import main

    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_real_model_long_prompt_in_parts_equals_one_prefill_for_every_shipped_method(real_model):
    """SmolLM2 on the native runner: a prompt of several parts, served beside a short one, gives
    the tokens plain decoding gives after one prefill, for ar, the model-free methods and the
    methods drafting from the shipped artifacts (eagle reads the prompt's hidden states)."""
    import threading

    from specdecode.api import eos_ids
    from specdecode.models.loading import make_runner

    eos = eos_ids(real_model.model, real_model.tokenizer)
    first = make_runner(real_model, "native")
    runners = [first, first.replica()]
    text = " ".join(f"Item {i}: the {i % 7}th colour of the list is {['red', 'blue'][i % 2]}."
                    for i in range(60))
    prompt = f"{text}\nWhich colour is item 41?"
    reference = Decoder(make_runner(real_model, "native"), real_model.tokenizer, "ar", eos)
    expected = reference.generate(prompt, 24).token_ids
    assert len(reference.encode(prompt)) > 3 * PREFILL_BLOCK
    server = Server(runners, real_model.tokenizer, eos, Settings(model_id="smollm2"))
    with BackgroundServer(create_app(server)) as served:
        for method in ("ar", "suffix", "recycling", "eagle", "hydra"):
            answers = {}

            def send(name, content, tokens):
                answers[name] = post(served, CHAT, json.dumps({
                    "model": "smollm2", "max_tokens": tokens,
                    "messages": [{"role": "user", "content": content}],
                    "specdecode": {"method": method, "return_token_ids": True}}).encode())

            long = threading.Thread(target=send, args=("long", prompt, 24))
            long.start()
            send("short", "Hi", 4)
            long.join(600)
            assert answers["short"].status_code == 200, answers["short"].text
            assert answers["long"].json()["choices"][0]["token_ids"] == expected, method


@pytest.mark.parametrize("header,name", [
    ("127.0.0.1:8000", "127.0.0.1"), ("[::1]:8000", "::1"), ("[::1]", "::1"), ("::1", "::1"),
    ("LocalHost", "localhost"), ("evil.example:80", "evil.example"), ("", ""),
])
def test_host_names_are_read_without_their_port(header, name):
    from specdecode.server.app import host_name

    assert host_name(header) == name
