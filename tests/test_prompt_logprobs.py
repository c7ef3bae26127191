"""Prompt log-probabilities (``prompt_logprobs``; the server's ``echo`` with ``logprobs``): each
prompt token's is the model's own, bitwise what a prefill of the prompt up to it gives on the
native runner, the answer after a scored prompt is the answer without scoring (greedy and
seeded, every method), and the server returns them in OpenAI's echo form, as
lm-evaluation-harness reads them."""

from __future__ import annotations

import httpx
import pytest
import torch

from specdecode.api import Decoder
from specdecode.errors import SpecDecodeError
from specdecode.models.base import Needs
from specdecode.models.llama import LlamaRunner
from specdecode.prompt_logprobs import SCORE_ROWS, PromptScoring
from specdecode.sampling import SamplingParams
from tiny_models import tiny_llama
from tiny_server import EOS, MODEL, make_server

#: longer than two scored parts, so that parts meet inside the prompt
PROMPT = [(7 * i) % 90 + 3 for i in range(2 * SCORE_ROWS + 22)]


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(vocab_size=len(tokenizer), hidden_size=64, max_positions=512, seed=3)


@pytest.fixture(scope="module")
def runner(model):
    return LlamaRunner.from_transformers(model, "int4", max_context=448)


@pytest.fixture(scope="module")
def served(model, tokenizer, runner):
    with make_server(model, tokenizer, runners=[runner.replica(), runner.replica()]) as background:
        yield background


def decoder(runner, tokenizer, method="ar", **config):
    return Decoder(runner.replica(), tokenizer, method, [EOS], **config)


def test_each_prompt_token_gets_what_a_prefill_up_to_it_gives(runner, tokenizer):
    result = decoder(runner, tokenizer).generate(PROMPT, 4, prompt_logprobs=3)
    entries = result.prompt_logprobs
    assert len(entries) == len(PROMPT) and entries[0] is None
    alone = runner.replica()
    for i in range(1, len(PROMPT)):
        logp = torch.log_softmax(alone.prefill(PROMPT[:i]).logits[-1], -1)
        entry = entries[i]
        assert entry.token == PROMPT[i]
        assert entry.logprob == logp[PROMPT[i]].item()
        values, ids = logp.topk(3)
        assert entry.top == tuple(zip(ids.tolist(), values.tolist()))


@pytest.mark.parametrize("needs", [Needs(), Needs(final_hidden=True, layers=(1,))])
def test_the_scored_parts_add_up_to_the_prefills_output(runner, needs):
    scored, whole = runner.replica(), runner.replica()
    scoring = PromptScoring(PROMPT, 0, needs)
    out = None
    while not scoring.done:
        call = scoring.next_call()
        out = scoring.take(scored, call, call.run(scored))
    expected = whole.prefill(PROMPT, needs)
    assert torch.equal(out.logits, expected.logits)
    if needs.final_hidden:
        assert torch.equal(out.final_hidden, expected.final_hidden)
        assert torch.equal(out.layers[1], expected.layers[1])
    assert scored.cache_len == whole.cache_len == len(PROMPT)
    assert all(e.top == () for e in scoring.entries[1:])


@pytest.mark.parametrize("method", ["ar", "ngram", "suffix", "lookahead", "recycling"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5}])
def test_the_answer_after_a_scored_prompt_is_the_same(runner, tokenizer, method, sampling):
    plain = decoder(runner, tokenizer, method).generate(PROMPT, 24, **sampling)
    scored = decoder(runner, tokenizer, method).generate(PROMPT, 24, prompt_logprobs=0,
                                                         **sampling)
    assert scored.token_ids == plain.token_ids
    assert scored.prompt_logprobs is not None and plain.prompt_logprobs is None
    # a prefill of the first token, then chains of SCORE_ROWS rows in place of one prefill
    chains = -(-(len(PROMPT) - 1) // SCORE_ROWS)
    assert scored.stats.target_forwards == plain.stats.target_forwards + chains


def test_a_one_token_prompt_has_one_unscored_entry(runner, tokenizer):
    result = decoder(runner, tokenizer).generate([5], 3, prompt_logprobs=2)
    assert result.prompt_logprobs == [None]
    assert result.token_ids == decoder(runner, tokenizer).generate([5], 3).token_ids


def test_bad_prompt_logprobs_and_lossy_methods_are_refused(runner, tokenizer):
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(SpecDecodeError, match="prompt_logprobs must be an integer"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(SpecDecodeError, match="does not score the prompt"):
        decoder(runner, tokenizer, "lora_drop", adapters="none").generate(
            PROMPT, 4, prompt_logprobs=1)


# ---- the server: OpenAI's echo ---------------------------------------------------------------

def post(served, **body):
    return httpx.post(served.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def test_lm_eval_harness_scores_a_continuation(served, runner, tokenizer):
    """lm-evaluation-harness's loglikelihood request (``local-completions``): token ids, one
    new token, logprobs 1, echo; it sums ``token_logprobs[ctxlen:-1]`` and checks each token
    against the best of ``top_logprobs``."""
    context, continuation = PROMPT[:100], PROMPT[100:120]
    body = post(served, prompt=[context + continuation], max_tokens=1, temperature=0,
                logprobs=1, echo=True, seed=1234).json()
    lp = body["choices"][0]["logprobs"]
    entries = decoder(runner, tokenizer).generate(context + continuation, 1,
                                                  prompt_logprobs=1).prompt_logprobs
    assert len(lp["token_logprobs"]) == len(context) + len(continuation) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert sum(lp["token_logprobs"][len(context):-1]) == pytest.approx(
        sum(e.logprob for e in entries[len(context):]), abs=1e-4)
    greedy = all(tok == max(top.values()) for tok, top in
                 zip(lp["token_logprobs"][len(context):-1], lp["top_logprobs"][len(context):-1]))
    assert greedy == all(e.top[0][0] == e.token for e in entries[len(context):])
    assert body["usage"]["completion_tokens"] == 1


def test_echo_puts_the_prompt_before_the_same_answer(served):
    prompt = "The quick brown fox"
    plain = post(served, prompt=prompt, max_tokens=12).json()["choices"][0]
    echoed = post(served, prompt=prompt, max_tokens=12, echo=True).json()["choices"][0]
    assert echoed["text"] == prompt + plain["text"]
    assert echoed["logprobs"] is None


def test_max_tokens_zero_with_echo_returns_the_prompt_scored(served, runner, tokenizer):
    body = post(served, prompt=[PROMPT[:40], PROMPT[40:90]], max_tokens=0, echo=True,
                logprobs=2, n=2).json()
    assert len(body["choices"]) == 4
    assert body["usage"]["completion_tokens"] == 0
    for i, choice in enumerate(body["choices"]):
        ids = PROMPT[:40] if i < 2 else PROMPT[40:90]
        assert choice["text"] == tokenizer.decode(ids)
        assert choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids)
        expected = decoder(runner, tokenizer).generate(ids, 1, prompt_logprobs=2).prompt_logprobs
        assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in expected[1:]],
                                                         abs=1e-5)
        assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
        starts = [0]  # each token's first character in the text its tokens spell
        for token in lp["tokens"][:-1]:
            starts.append(starts[-1] + len(token))
        assert lp["text_offset"] == starts


@pytest.mark.parametrize("max_tokens", [0, 6])
def test_a_streamed_echo_is_the_whole_ones(served, max_tokens):
    request = dict(prompt="Hello world", max_tokens=max_tokens, echo=True, logprobs=1)
    whole = post(served, **request).json()["choices"][0]
    text, tokens, values, offsets = "", [], [], []
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "stream": True, **request}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                text += choice["text"]
                if choice["logprobs"] is not None:
                    tokens += choice["logprobs"]["tokens"]
                    values += choice["logprobs"]["token_logprobs"]
                    offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"]
    assert values == whole["logprobs"]["token_logprobs"]
    # each chunk's offsets go on from the last chunk's
    assert offsets == whole["logprobs"]["text_offset"] and len(offsets) == len(tokens)


def test_echo_errors_are_400s(served):
    refused = post(served, prompt="def f(", suffix="\n", echo=True, max_tokens=4)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
    zero = post(served, prompt="Hello", max_tokens=0)
    assert zero.status_code == 400 and "max_tokens" in zero.json()["error"]["message"]


def test_lm_eval_harness_remote_tokenizer_reads_the_servers(served, tokenizer):
    """What lm-evaluation-harness's remote tokenizer asks (``GET /tokenizer_info`` with an
    ``eos_token``, ``POST /tokenize`` with ``add_special_tokens`` false), so that
    ``local-completions`` needs no tokenizer of its own."""
    info = httpx.get(served.url + "/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == tokenizer.eos_token == "<|im_end|>"
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 448
    for text in ("The quick brown fox", info["eos_token"]):
        got = httpx.post(served.url + "/tokenize", timeout=60,
                         json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert got == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert got == [EOS]
    chat = httpx.post(served.url + "/tokenize", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": True})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "add_special_tokens"


def test_vllms_prompt_logprobs_field(served, runner, tokenizer):
    """vLLM's form: per prompt token (the first None) the token and its N best, each with its
    log-probability, rank and text; a completion's choices carry it, a chat's response."""
    ids = PROMPT[:70]
    expected = decoder(runner, tokenizer).generate(ids, 2, prompt_logprobs=3).prompt_logprobs
    body = post(served, prompt=ids, max_tokens=2, prompt_logprobs=3, echo=True,
                logprobs=1).json()
    form = body["choices"][0]["prompt_logprobs"]
    assert len(form) == len(ids) and form[0] is None
    for entry, want, token in zip(form[1:], expected[1:], ids[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(want.logprob, abs=1e-5)
        assert entry[str(token)]["rank"] == want.rank >= 1
        assert [entry[str(t)]["rank"] for t, _ in want.top] == [1, 2, 3]
        assert len(entry) == 3 + (token not in {t for t, _ in want.top})
    # echo's lists keep their own count (logprobs 1) though the prompt was scored with 3
    assert all(len(top) == 1 for top in body["choices"][0]["logprobs"]["top_logprobs"][1:])
    chat = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == \
        chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    for bad, message in (({"prompt_logprobs": 21}, "must be an integer in [0, 20]"),
                         ({"prompt_logprobs": 1, "stream": True}, "whole responses only")):
        refused = post(served, prompt="Hi", max_tokens=2, **bad)
        assert refused.status_code == 400 and message in refused.json()["error"]["message"]
