"""llama.cpp's ``/infill`` (server/infill.py), as editor plugins such as llama.vim send it: the
repository-level prompt laid out as llama-server lays it out, the middle every method's
``ar``'s, a warm-up of the other files' chunks (``n_predict`` 0) cached for the next request,
``n_indent`` and ``t_max_predict_ms``, ``response_fields``, streaming, and 400s; and its
``/completion`` around a plain prompt."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.fim import FILE_NAME, REPO_NAME, TAGS, fim_tokens
from specdecode.models.llama import LlamaRunner
from specdecode.server.infill import PLUGIN_ANSWER, LineLimits, fit
from tiny_models import tiny_llama
from tiny_server import EOS, build_tokenizer, make_server

#: Qwen2.5-Coder's tags, its repository-level ones, and an end of a middle
SPECIAL = (*TAGS[0], "<|repo_name|>", "<|file_sep|>", "<|endoftext|>")
EXTRA = [{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n", "time": 3.5},
         {"filename": "main.py", "text": "print(add(1, 2))\n"}]
PREFIX, SUFFIX, TYPED = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n", "ret"
#: room for llama-server's cut: a window of half the context, the files' budget beside it
CONTEXT = 1024
#: what llama.vim asks for, but greedy
GREEDY = {"samplers": ["temperature"], "temperature": 0.0}


@pytest.fixture(scope="module")
def fim_tokenizer():
    return build_tokenizer(special=SPECIAL)


@pytest.fixture(scope="module")
def runner(fim_tokenizer):
    model = tiny_llama(vocab_size=len(fim_tokenizer), hidden_size=32, max_positions=CONTEXT,
                       seed=1)
    return LlamaRunner.from_transformers(model, "int4", max_context=CONTEXT)


@pytest.fixture(scope="module")
def served(fim_tokenizer, runner):
    with make_server(None, fim_tokenizer, runners=[runner.replica(), runner.replica()],
                     method="suffix") as background:
        yield background


def infill(served, **body):
    return httpx.post(served.url + "/infill", json=body, timeout=60)


def expected(runner, tokenizer, method="ar", max_tokens=24, **request):
    """The middle the library writes for llama-server's prompt of ``EXTRA``, ``PREFIX``,
    ``TYPED`` and ``SUFFIX``."""
    fim = fim_tokens(tokenizer)
    ids, _ = fim.in_repository(tokenizer, [(c["filename"], c["text"]) for c in EXTRA], PREFIX,
                               SUFFIX, TYPED, *fit(CONTEXT, max(max_tokens, PLUGIN_ANSWER)))
    decoder = Decoder(runner.replica(), tokenizer, method, [EOS, *fim.ends])
    return ids, decoder.generate(ids, max_tokens, chat=False, **request)


def test_the_prompt_is_llama_servers_repository_layout(fim_tokenizer):
    fim = fim_tokens(fim_tokenizer)
    pre, suf, mid, repo, sep = (fim_tokenizer.convert_tokens_to_ids(t) for t in SPECIAL[:5])
    assert (fim.repo, fim.file) == (repo, sep)

    def enc(text):
        return fim_tokenizer.encode(text, add_special_tokens=False)

    ids, cut = fim.in_repository(fim_tokenizer, [("util.py", "x = 1\n")], PREFIX, SUFFIX, TYPED)
    assert not cut
    assert ids == [repo, *enc(REPO_NAME + "\n"), sep, *enc("util.py\n"), *enc("x = 1\n"),
                   sep, *enc(FILE_NAME + "\n"), pre, *enc(PREFIX), *enc(TYPED), suf,
                   *enc(SUFFIX), mid]
    plain = build_tokenizer(special=(*TAGS[0], "<|endoftext|>"))  # no file tag: snippets
    assert fim_tokens(plain).in_repository(plain, [("a.py", "x")], "", "")[0][:3] == \
        plain.encode("\n\n--- snippet ---\n\n", add_special_tokens=False)[:3]


def test_the_prompt_is_cut_to_fit_as_llama_server_cuts_it(fim_tokenizer):
    fim = fim_tokens(fim_tokenizer)
    files = [(f"f{i}.py", "def add(a, b):\n    return a + b\n" * 3) for i in range(6)]
    whole, cut = fim.in_repository(fim_tokenizer, files, PREFIX * 20, SUFFIX * 20, TYPED)
    assert not cut
    window, budget = fit(256, 24)
    assert (window, budget) == (128, 80)
    ids, cut = fim.in_repository(fim_tokenizer, files, PREFIX * 20, SUFFIX * 20, TYPED,
                                 window, budget)
    pre, suf, mid = (fim_tokenizer.convert_tokens_to_ids(t) for t in TAGS[0])
    files_part = whole[:whole.index(pre)]
    assert cut and ids[:ids.index(pre)] == files_part[-budget:]  # the files' last tokens
    typed = fim_tokenizer.encode(TYPED, add_special_tokens=False)
    before = ids[ids.index(pre) + 1:ids.index(suf) - len(typed)]
    after = ids[ids.index(suf) + 1:-1]
    assert len(before) == 3 * window // 4 and len(after) == window // 4 - 2 - len(typed)
    assert whole[whole.index(suf) - len(typed) - len(before):whole.index(suf)] == before + typed
    assert whole[whole.index(suf) + 1:][:len(after)] == after and ids[-1] == mid


@pytest.mark.parametrize("method", ["ar", "suffix", "ngram"])
def test_the_middle_is_the_librarys(served, runner, fim_tokenizer, method):
    ids, want = expected(runner, fim_tokenizer)
    got = infill(served, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=EXTRA,
                 prompt=TYPED, n_predict=24, specdecode={"method": method}, **GREEDY).json()
    assert got["content"] == want.text
    assert got["tokens_predicted"] == len(want.token_ids)
    assert got["tokens_evaluated"] == len(ids)
    assert got["stop_type"] == ("limit" if want.finish_reason == "length" else "eos")
    assert got["generation_settings"]["method"] == method


def test_a_warm_up_caches_the_other_files_for_the_next_request(served, fim_tokenizer):
    ring = [{"filename": "fox.txt", "text": "The quick brown fox jumps over the lazy dog.\n"},
            {"filename": "hi.txt", "text": "Hello world! How are you today?\n"}]
    warm = infill(served, input_extra=ring, n_predict=0, response_fields=[""], **GREEDY)
    assert warm.status_code == 200 and warm.json() == {}
    got = infill(served, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=ring,
                 prompt=TYPED, n_predict=8, **GREEDY,
                 response_fields=["content", "tokens_cached", "timings/prompt_n",
                                  "timings/predicted_n", "truncated"]).json()
    assert set(got) == {"content", "tokens_cached", "timings/prompt_n", "timings/predicted_n",
                        "truncated"}
    # the chunks' rows (up to the prefix tag) were read by the warm-up
    fim = fim_tokens(fim_tokenizer)
    ids, _ = fim.in_repository(fim_tokenizer, [(c["filename"], c["text"]) for c in ring], "", "")
    assert got["tokens_cached"] >= ids.index(fim.prefix) > 20
    assert got["timings/prompt_n"] > 0
    nothing = infill(served, input_prefix=PREFIX, n_predict=0, **GREEDY).json()
    assert nothing["content"] == "" and nothing["tokens_predicted"] == 0
    assert nothing["stop_type"] == "limit"


def test_n_indent_and_the_time_limit_end_a_line():
    indent = LineLimits(4, 0).start()
    text = "x = 1\n    y = 2\n  z = 3\n"
    assert indent.cut(text) == text.index("  z")
    assert indent.cut("x = 1\n    y") is None and indent.held("x = 1\n  ") == 2
    timed = LineLimits(0, 0.01).start()
    assert timed.cut("a") is None
    time.sleep(0.02)
    assert timed.cut("a b") is None  # no new line yet
    assert timed.cut("a b\nc") == len("a b\nc")


def test_the_server_cuts_where_the_limits_say(served, runner, fim_tokenizer):
    # the first seed whose middle (sampled: the tiny model writes no new line greedily) has a
    # line after the first that is not indented
    for seed in range(64):
        _, want = expected(runner, fim_tokenizer, max_tokens=40, temperature=1.0, seed=seed)
        cut = LineLimits(1, 0).start().cut(want.text)
        if cut is not None and 0 < cut < len(want.text):
            break
    else:
        pytest.fail("no seed of 64 gives a middle with an unindented line")
    for stream in (False, True):
        got = infill(served, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=EXTRA,
                     prompt=TYPED, n_predict=40, n_indent=1, samplers=["temperature"],
                     temperature=1.0, seed=seed, stream=stream)
        content = ("".join(json.loads(line[6:])["content"] for line in got.text.splitlines()
                           if line.startswith("data: ")) if stream else got.json()["content"])
        assert content == want.text[:cut]


def test_a_stream_is_the_whole_content(served):
    body = dict(input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=EXTRA, prompt=TYPED,
                n_predict=24, **GREEDY)
    whole = infill(served, **body).json()
    events = []
    with httpx.stream("POST", served.url + "/infill", json={**body, "stream": True},
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["stop"] and not any(e["stop"] for e in events[:-1])
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_llama_vims_request_is_served(served):
    """llama.vim's fields as it sends them (sampling top_k/top_p and its infill sampler)."""
    got = infill(served, id_slot=0, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=EXTRA,
                 prompt=TYPED, n_predict=16, stop=[], n_indent=4, top_k=40, top_p=0.9,
                 samplers=["top_k", "top_p", "infill"], stream=False, cache_prompt=True,
                 t_max_prompt_ms=500, t_max_predict_ms=1000,
                 response_fields=["content", "timings/prompt_n", "timings/prompt_ms",
                                  "timings/predicted_per_second", "truncated", "tokens_cached"])
    assert got.status_code == 200 and isinstance(got.json()["content"], str)
    # llama.vscode's: its default fields, chunks with a time, no response_fields
    vscode = infill(served, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=EXTRA,
                    prompt=TYPED, n_predict=16, top_k=40, top_p=0.99, stream=False,
                    samplers=["top_k", "top_p", "infill"], cache_prompt=True, n_indent=4,
                    t_max_prompt_ms=500, t_max_predict_ms=2500)
    assert vscode.status_code == 200
    body = vscode.json()
    assert {"content", "timings", "tokens_cached", "truncated", "stop_type"} <= set(body)
    assert body["timings"]["prompt_n"] + body["tokens_cached"] == body["tokens_evaluated"]


def test_bad_requests_are_400s(served, model, tokenizer):
    sampler = infill(served, input_prefix=PREFIX, samplers=["dry"], dry_multiplier=0.8)
    assert sampler.status_code == 400 and sampler.json()["error"]["param"] == "samplers"
    unknown = infill(served, input_prefix=PREFIX, mirostat=2)
    assert unknown.status_code == 400 and "mirostat" in unknown.json()["error"]["message"]
    with make_server(model, tokenizer) as plain:  # a model without the tags
        refused = infill(plain, input_prefix=PREFIX)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_prefix"


@pytest.mark.parametrize("path", ["/completion", "/completions"])
def test_llama_servers_completion_is_the_librarys(served, runner, fim_tokenizer, path):
    prompt = "def add(a, b):\n"
    want = Decoder(runner.replica(), fim_tokenizer, "ar", [EOS]).generate(prompt, 16, chat=False)
    got = httpx.post(served.url + path, timeout=60, json={
        "prompt": prompt, "n_predict": 16, **GREEDY}).json()
    assert got["content"] == want.text and got["tokens_predicted"] == len(want.token_ids)
    ids = fim_tokenizer(prompt)["input_ids"]
    by_ids = httpx.post(served.url + path, timeout=60, json={
        "prompt": ids, "n_predict": 16, "return_tokens": True, **GREEDY}).json()
    assert by_ids["tokens"] == want.token_ids and by_ids["tokens_evaluated"] == len(ids)
    assert by_ids["tokens_cached"] > 0  # the same prompt again: its rows were kept


COMPLETE = {"prompt": "def add(a, b):\n", "n_predict": 12, "return_tokens": True, **GREEDY}


def complete(served, **body):
    return httpx.post(served.url + "/completion", json={**COMPLETE, **body}, timeout=60)


def test_a_grammar_or_a_json_schema_constrains_the_answer(served, runner, fim_tokenizer):
    decoder = Decoder(runner.replica(), fim_tokenizer, "ar", [EOS])
    prompt = COMPLETE["prompt"]
    gbnf = 'root ::= "return " [a-z]+ " + " [a-z]+'
    got = complete(served, grammar=gbnf).json()
    assert got["content"] == decoder.generate(prompt, 12, chat=False, grammar=gbnf).text
    assert got["content"].startswith("return ")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    got = complete(served, json_schema=schema, n_predict=16).json()
    assert got["content"] == decoder.generate(prompt, 16, chat=False, json_schema=schema).text
    assert got["content"].startswith('{"a":')
    anything = complete(served, json_schema={}, n_predict=8).json()["content"]
    assert anything.startswith("{")  # an empty schema: any object, as llama-server reads it
    both = complete(served, json_schema=schema, grammar=gbnf).json()["content"]
    assert both.startswith("return ")  # the grammar wins, as in llama-server
    bad = complete(served, grammar="root ::= (")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grammar"


def test_n_probs_are_the_models_own_or_the_sampled_distributions(served, runner,
                                                                  fim_tokenizer):
    decoder = Decoder(runner.replica(), fim_tokenizer, "ar", [EOS])
    prompt = COMPLETE["prompt"]
    sampled = dict(samplers=["top_k", "temperature"], top_k=3, temperature=0.9, seed=5)
    wants = {}
    for post in (False, True):
        got = complete(served, n_probs=3, post_sampling_probs=post, **sampled).json()
        want = decoder.generate(prompt, 12, chat=False, temperature=0.9, top_k=3, seed=5,
                                logprobs=3, raw_logprobs=not post)
        probs = got["completion_probabilities"]
        assert [p["id"] for p in probs] == got["tokens"] == want.token_ids
        key = "prob" if post else "logprob"
        for entry, theirs in zip(probs, want.logprobs):
            value = math.exp(theirs.logprob) if post else theirs.logprob
            assert entry[key] == pytest.approx(value, abs=1e-5)
            assert [t["id"] for t in entry["top_" + key + "s"]] == [t for t, _ in theirs.top]
            assert bytes(entry["bytes"]).decode() == entry["token"]
        if post:  # the sampled distribution: three tokens at most, their probabilities <= 1
            assert all(sum(t["prob"] for t in e["top_probs"]) <= 1 + 1e-6 for e in probs)
        else:  # the model's own: every token has a probability, top-k or not
            assert all(len(e["top_logprobs"]) == 3 for e in probs)
        wants[post] = want.logprobs
    # the same tokens; the model's own log-probability is below the cut distribution's
    assert all(raw.logprob < cut.logprob for raw, cut in zip(wants[False], wants[True]))
    whole = complete(served, n_probs=2, n_predict=12).json()
    streamed = []
    with httpx.stream("POST", served.url + "/completion", timeout=60,
                      json={**COMPLETE, "n_probs": 2, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                streamed += json.loads(line[6:]).get("completion_probabilities", [])
    assert streamed == whole["completion_probabilities"]
    assert complete(served, n_probs=21).status_code == 400


def test_props_tell_the_context_slots_and_defaults(served, fim_tokenizer):
    props = httpx.get(served.url + "/props", timeout=30).json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == CONTEXT and props["total_slots"] == 2
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    assert settings["params"]["samplers"][-1] == "temperature"
    assert props["chat_template"] == fim_tokenizer.chat_template
    assert props["eos_token"] == fim_tokenizer.eos_token
