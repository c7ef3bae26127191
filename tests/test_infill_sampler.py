"""llama.cpp's ``infill`` sampler (specdecode/infill_sampler.py) and temperature after the cuts
(``SamplingParams.temperature_last``): each step of the cut on hand-made candidates, the
distributions they give, and llama-server's chains on ``/infill`` and ``/completion`` answered
as the library answers them, with every method; and llama-server's other sampling fields
(server/llama_sampling.py): a client's every field, the penalty window, the samplers a request
turns on that are not served."""

from __future__ import annotations

import httpx
import pytest
import torch

from specdecode.api import Decoder
from specdecode.constraints import Vocabulary
from specdecode.errors import SpecDecodeError
from specdecode.fim import fim_tokens
from specdecode.infill_sampler import InfillSampler
from specdecode.models.llama import LlamaRunner
from specdecode.sampling import SamplingParams, filtered_probs
from specdecode.server.infill import PLUGIN_ANSWER, fit
from test_infill import CONTEXT, EXTRA, PREFIX, SPECIAL, SUFFIX, TYPED
from tiny_models import tiny_llama
from tiny_server import EOS, build_tokenizer, make_server

#: token id -> text of the hand-made candidates (8 and 9 end generation)
PIECES = [b"re", b"return", b"x", b"y", b"z", b"w", b"v", b"u", b"", b""]
ENDS = frozenset({8, 9})
#: llama.vim's sampling
VIM = {"samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.9}


def kept(probs: list[float], pieces=PIECES) -> dict[int, float]:
    """The cut of candidates with these probabilities (ids in order), as token -> the
    probability it is drawn with."""
    sampler = InfillSampler(pieces, ENDS, 9)
    out = filtered_probs(torch.tensor(probs).log(),
                         SamplingParams(temperature=1.0, top_k=len(probs), infill=sampler))
    return {i: round(float(p), 6) for i, p in enumerate(out) if p > 0}


def normalised(probs: dict[int, float]) -> dict[int, float]:
    total = sum(probs.values())
    return {i: round(p / total, 6) for i, p in probs.items()}


def test_the_ends_take_over_when_they_hold_enough():
    # 3 x 0.2 (ends) x 4 candidates > 0.8 (text): only the end stays
    assert kept([0.0, 0.0, 0.5, 0.2, 0.1, 0, 0, 0, 0.2, 0.0]) == {8: 1.0}


def test_a_token_that_begins_another_takes_its_probability():
    # "re" (0.15) alone is below 0.2; with "return" (0.12) merged into it, it stays and is
    # drawn with its own probability; "return" is dropped
    probs = [0.15, 0.12, 0.40, 0.33, 0, 0, 0, 0, 0, 0]
    assert kept(probs) == normalised({0: 0.15, 2: 0.40, 3: 0.33})
    # the more likely of the two keeps both
    probs[0], probs[1] = 0.12, 0.15
    assert kept(probs) == normalised({1: 0.15, 2: 0.40, 3: 0.33})
    # with no shared beginning, both are dropped
    assert kept(probs, [b"a", *PIECES[1:]]) == normalised({2: 0.40, 3: 0.33})


def test_text_below_either_floor_is_dropped():
    # 0.1 < 0.2; then y's 0.2 / 0.9 < 1 / (3 + 1)
    assert kept([0.45, 0.0, 0.25, 0.2, 0.1, 0, 0, 0, 0, 0]) == normalised({0: 0.45, 2: 0.25})


def test_the_answer_ends_where_no_text_survives():
    assert kept([0.0, 0.0] + [1 / 6] * 6 + [0.0, 0.0]) == {9: 1.0}  # six texts below 0.2


def test_temperature_last_cuts_the_unscaled_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    first = filtered_probs(logits, SamplingParams(temperature=0.5, top_p=0.8))
    last = filtered_probs(logits, SamplingParams(temperature=0.5, top_p=0.8,
                                                 temperature_last=True))
    # at T=1 the two most likely hold 0.88 (both kept); at T=0.5 the first holds 0.87 alone
    assert first.tolist() == [1.0, 0.0, 0.0, 0.0]
    want = torch.zeros(4)
    want[:2] = torch.tensor([4.0, 2.0]).softmax(-1)  # the kept two at T=0.5
    assert torch.allclose(last, want)
    same = SamplingParams(temperature=1.0, top_p=0.8)
    assert torch.equal(filtered_probs(logits, same),
                       filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8,
                                                             temperature_last=True)))


def test_the_infill_sampler_needs_top_k():
    sampler = InfillSampler(PIECES, ENDS, 9)
    with pytest.raises(SpecDecodeError, match="top_k"):
        SamplingParams(temperature=1.0, infill=sampler)
    with pytest.raises(SpecDecodeError, match="InfillSampler"):
        SamplingParams(temperature=1.0, top_k=4, infill="infill")


# ---- llama-server's chains through the server ----

@pytest.fixture(scope="module")
def fim_tokenizer():
    return build_tokenizer(special=SPECIAL)


@pytest.fixture(scope="module")
def sharp_runner(fim_tokenizer):
    """The tiny FIM model with its head sharpened: peaked enough that the infill cut keeps
    text (on the plain tiny model every candidate is below its floor: every answer empty)."""
    model = tiny_llama(vocab_size=len(fim_tokenizer), hidden_size=32, max_positions=CONTEXT,
                       seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return LlamaRunner.from_transformers(model, "int4", max_context=CONTEXT)


@pytest.fixture(scope="module")
def served(fim_tokenizer, sharp_runner):
    with make_server(None, fim_tokenizer, runners=[sharp_runner.replica()],
                     method="suffix") as background:
        yield background


def library_middle(runner, tokenizer, method: str, **sampling) -> str:
    """The library's middle of llama-server's /infill prompt (24 tokens at most)."""
    fim = fim_tokens(tokenizer)
    ids, _ = fim.in_repository(tokenizer, [(c["filename"], c["text"]) for c in EXTRA], PREFIX,
                               SUFFIX, TYPED, *fit(CONTEXT, PLUGIN_ANSWER))
    decoder = Decoder(runner.replica(), tokenizer, method, [EOS, *fim.ends])
    return decoder.generate(ids, 24, chat=False, **sampling).text


@pytest.mark.parametrize("method", ["ar", "suffix", "ngram"])
def test_llama_vims_sampling_is_the_librarys_infill_cut(served, sharp_runner, fim_tokenizer,
                                                         method):
    fim = fim_tokens(fim_tokenizer)
    sampler = InfillSampler(Vocabulary(fim_tokenizer, sharp_runner.vocab_size, [EOS]).token_bytes,
                            frozenset({EOS, *fim.ends}), EOS)
    changed = 0
    for seed in range(4):
        got = httpx.post(served.url + "/infill", timeout=60, json={
            "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA,
            "prompt": TYPED, "n_predict": 24, "seed": seed, **VIM,
            "specdecode": {"method": method}}).json()["content"]
        sampling = dict(temperature=1.0, top_k=40, top_p=0.9, seed=seed)
        assert got == library_middle(sharp_runner, fim_tokenizer, method, infill=sampler,
                                     **sampling)
        changed += got != library_middle(sharp_runner, fim_tokenizer, "ar", **sampling)
    assert changed  # the cut changes answers


def test_the_default_chain_applies_temperature_last(served, sharp_runner, fim_tokenizer):
    prompt = "def add(a, b):\n"
    chain = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)  # llama-server's
    changed = 0
    for seed in range(4):
        got = httpx.post(served.url + "/completion", timeout=60, json={
            "prompt": prompt, "n_predict": 16, "seed": seed}).json()["content"]
        decoder = Decoder(sharp_runner.replica(), fim_tokenizer, "ar", [EOS])
        last = decoder.generate(prompt, 16, chat=False, seed=seed, temperature_last=True,
                                **chain).text
        assert got == last
        changed += last != decoder.generate(prompt, 16, chat=False, seed=seed, **chain).text
    assert changed  # temperature first would answer otherwise


@pytest.mark.parametrize("samplers, says", [
    (["top_p", "top_k"], "in that order"),
    (["top_p", "temperature", "min_p"], "temperature between"),
    (["top_k", "top_k"], "twice"),
    (["top_p", "infill"], "top_k before it"),
    (["xtc"], "not served"),
    (["top_k", "mirror"], "not one of llama-server's"),
])
def test_chains_in_another_order_are_400s(served, samplers, says):
    got = httpx.post(served.url + "/infill", timeout=60, json={
        "input_prefix": PREFIX, "samplers": samplers, "n_predict": 4, "xtc_probability": 0.5})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == "samplers" and says in error["message"]


# ---- llama-server's other sampling fields (server/llama_sampling.py) ----

#: a client's request with every field of llama-server's, most at the value that turns a
#: sampler off (as SillyTavern sends them)
EVERY_FIELD = {
    "n_predict": 16, "temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
    "typical_p": 1, "top_n_sigma": -1, "xtc_probability": 0, "xtc_threshold": 0.1,
    "repeat_last_n": 4, "repeat_penalty": 1.3, "presence_penalty": 1.5,
    "frequency_penalty": 0.5, "dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2,
    "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":"], "mirostat": 0,
    "mirostat_tau": 5, "mirostat_eta": 0.1, "dynatemp_range": 0, "dynatemp_exponent": 1,
    "min_keep": 0, "stop": "\n\n", "ignore_eos": False, "n_probs": 0, "cache_prompt": True,
    "n_keep": 0, "timings_per_token": False, "stream": False,
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                 "temperature"]}
#: what the library is asked for to answer it the same
EVERY_FIELD_LIBRARY = dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05,
                           repetition_penalty=1.3, presence_penalty=1.5, frequency_penalty=0.5,
                           penalty_last_n=4, temperature_last=True)


def test_a_clients_every_field_is_the_librarys_llama_sampling(served, sharp_runner,
                                                              fim_tokenizer):
    prompt = "def add(a, b):\n    return a + b\n" * 2  # repeated: the penalties matter
    bias_text = fim_tokenizer.encode(" jumps", add_special_tokens=False)
    decoder = Decoder(sharp_runner.replica(), fim_tokenizer, "ar", [EOS])
    changed = 0
    for seed in range(3):
        body = {**EVERY_FIELD, "prompt": prompt, "seed": seed,
                "logit_bias": [[7, -3.0], [" jumps", 2], [9, False]]}
        got = httpx.post(served.url + "/completion", json=body, timeout=60).json()["content"]
        bias = {7: -3.0, 9: -100.0, **{t: 2.0 for t in bias_text}}
        want = decoder.generate(prompt, 16, chat=False, stop=["\n\n"], seed=seed,
                                logit_bias=bias, **EVERY_FIELD_LIBRARY).text
        assert got == want
        for samplers in ("edskypmxt", ["penalties", "top-k", "nucleus", "min-p", "temp"]):
            again = httpx.post(served.url + "/completion", timeout=60,
                               json={**body, "samplers": samplers}).json()["content"]
            assert again == want, samplers
        as_object = {**body, "logit_bias": {"7": -3.0, " jumps": 2, "9": False}}
        assert httpx.post(served.url + "/completion", json=as_object,
                          timeout=60).json()["content"] == want
        openai_counting = {**EVERY_FIELD_LIBRARY, "penalty_last_n": None}
        changed += want != decoder.generate(prompt, 16, chat=False, stop=["\n\n"], seed=seed,
                                            logit_bias=bias, **openai_counting).text
    assert changed  # the window changes answers


@pytest.mark.parametrize("fields, param", [
    ({"typical_p": 0.9}, "samplers"),  # typ_p is in the default chain
    ({"mirostat": 2}, "mirostat"),
    ({"dynatemp_range": 0.5}, "dynatemp_range"),
    ({"min_keep": 5}, "min_keep"),
    ({"n_cmpl": 2}, "n_cmpl"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"logit_bias": [[1, 2, 3]]}, "logit_bias"),
    ({"logit_bias": {"7": "much"}}, "logit_bias"),
    ({"logit_bias": {"7": 500}}, "logit_bias"),
    ({"logit_bias": [["", 1]]}, "logit_bias"),
])
def test_samplers_turned_on_that_are_not_served_are_400s(served, fields, param):
    got = httpx.post(served.url + "/completion", timeout=60,
                     json={"prompt": "The quick", "n_predict": 4, **fields})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param


def test_a_sampler_outside_the_chain_is_not_applied(served):
    # llama-server applies only the chain: typical_p without typ_p in it changes nothing
    body = {"prompt": "The quick", "n_predict": 8, "seed": 1, "samplers": ["top_k", "temp"]}
    plain = httpx.post(served.url + "/completion", json=body, timeout=60).json()
    typical = httpx.post(served.url + "/completion", json={**body, "typical_p": 0.5},
                         timeout=60).json()
    assert typical["content"] == plain["content"]
