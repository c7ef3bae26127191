"""Fill in the middle (specdecode/fim.py): the tags of each family found by their text, the
prompt laid out prefix-suffix-middle, the tokens that end a middle ending it (and not left in
its text), every method's middle ``ar``'s, the CLI's ``--suffix`` and the server's OpenAI
``suffix``, and a clear error for a model without the tags. The last test (slow) fills in a
middle with the real Qwen2.5-Coder-1.5B.
"""

from __future__ import annotations

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.fim import TAGS, fim_tokens
from specdecode.models.hf import HFRunner

from tiny_server import (EOS, MODEL, build_tokenizer, make_server, openai_client,
                         tiny_served_model)

QWEN_TAGS = TAGS[0]
#: the tiny tokenizer's FIM tags and an end of a middle, special tokens after its pieces
SPECIAL = (*QWEN_TAGS, "<|endoftext|>")
PREFIX, SUFFIX = "def add(a, b):\n", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def fim_tokenizer():
    tokenizer = build_tokenizer(special=SPECIAL)
    tokenizer.add_tokens(["<|file_sep|>"])  # an end that is not special, as in Qwen's GGUF
    return tokenizer


@pytest.fixture(scope="module")
def fim_model(fim_tokenizer):
    return tiny_served_model(fim_tokenizer)


def ids_of(tokenizer, *texts):
    return [tokenizer.convert_tokens_to_ids(t) for t in texts]


@pytest.mark.parametrize("tags", TAGS)
def test_each_familys_tags_are_found_with_the_ends_the_vocabulary_holds(tags):
    tokenizer = build_tokenizer(special=(*tags, "<|endoftext|>", "<fim_pad>"))
    fim = fim_tokens(tokenizer)
    assert [fim.prefix, fim.suffix, fim.middle] == ids_of(tokenizer, *tags)
    assert fim.ends == tuple(ids_of(tokenizer, "<|endoftext|>", "<fim_pad>"))


def test_the_prompt_is_prefix_suffix_middle(fim_tokenizer):
    fim = fim_tokens(fim_tokenizer)
    pre, suf, mid = ids_of(fim_tokenizer, *QWEN_TAGS)
    before = fim_tokenizer.encode(PREFIX, add_special_tokens=False)
    after = fim_tokenizer.encode(SUFFIX, add_special_tokens=False)
    assert fim.prompt(fim_tokenizer, PREFIX, SUFFIX) == [pre, *before, suf, *after, mid]
    assert fim.prompt(fim_tokenizer, [5, 6], "") == [pre, 5, 6, suf, mid]  # ids as they are
    with pytest.raises(SpecDecodeError, match="text or token ids, not chat messages"):
        fim.prompt(fim_tokenizer, [{"role": "user", "content": "x"}], SUFFIX)


def test_a_model_without_the_tags_is_told_so():
    with pytest.raises(SpecDecodeError, match="no fill-in-the-middle tokens .* leave out the "
                                              "suffix"):
        fim_tokens(build_tokenizer())


@pytest.mark.parametrize("method", ["ngram", "suffix", "lookahead"])
def test_every_methods_middle_is_ars(fim_model, fim_tokenizer, method):
    def middle(name):
        decoder = Decoder(HFRunner(fim_model), fim_tokenizer, name, [EOS])
        return decoder.generate(PREFIX, 24, suffix=SUFFIX).token_ids

    assert middle(method) == middle("ar")


def test_the_tokens_that_end_a_middle_end_it_and_are_not_text(fim_model, fim_tokenizer):
    """<|file_sep|> is one (a middle may end with it), not the model's end of sequence: the
    middle stops there, and its text leaves it out (it is not a special token a decode
    drops)."""
    sep = fim_tokenizer.convert_tokens_to_ids("<|file_sep|>")
    decoder = Decoder(HFRunner(fim_model), fim_tokenizer, "ngram", [EOS])
    ended = decoder.generate(PREFIX, 24, suffix=SUFFIX, logit_bias={sep: 40})
    assert ended.finish_reason == "stop" and ended.token_ids == [sep]
    assert ended.text == ""
    assert fim_tokenizer.decode([sep], skip_special_tokens=True) == "<|file_sep|>"
    # not a fill-in request: the same token is no end
    raw = decoder.generate(PREFIX, 3, chat=False, logit_bias={sep: 40})
    assert raw.token_ids == [sep] * 3 and raw.finish_reason == "length"


def test_the_cli_refuses_suffix_for_a_model_without_the_tags(capsys):
    assert main(["generate", "def f():", "--suffix", "return 1", "--max-new-tokens", "4"]) == 2
    assert "no fill-in-the-middle tokens" in capsys.readouterr().err


def test_the_server_fills_in_openais_suffix(fim_model, fim_tokenizer, tokenizer, model):
    reference = Decoder(HFRunner(fim_model), fim_tokenizer, "suffix", [EOS])
    want = reference.generate(PREFIX, 16, suffix=SUFFIX)
    with make_server(fim_model, fim_tokenizer) as served:
        client = openai_client(served)
        got = client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=16,
                                        extra_body={"specdecode": {"method": "suffix"}})
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        # token ids as the prefix, and a batch of two prefixes
        ids = fim_tokenizer.encode(PREFIX, add_special_tokens=False)
        batch = client.completions.create(model=MODEL, prompt=[ids, ids], suffix=SUFFIX,
                                          max_tokens=16)
        assert [c.text for c in batch.choices] == [want.text, want.text]
        tokenized = httpx.post(served.url + "/tokenize", timeout=30, json={
            "prompt": PREFIX, "suffix": SUFFIX}).json()
        assert tokenized["tokens"] == fim_tokens(fim_tokenizer).prompt(fim_tokenizer, PREFIX,
                                                                       SUFFIX)
        sep = fim_tokenizer.convert_tokens_to_ids("<|file_sep|>")  # an end of a middle
        ended = client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX,
                                          max_tokens=16, logit_bias={str(sep): 40})
        assert ended.choices[0].finish_reason == "stop" and ended.choices[0].text == ""
    with make_server(model, tokenizer) as served:  # a model without the tags: a 400
        r = httpx.post(served.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PREFIX, "suffix": SUFFIX})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
        assert "no fill-in-the-middle tokens" in r.json()["error"]["message"]


@pytest.mark.slow
def test_qwen_coder_fills_in_a_middle_and_ends_it():
    """The 1.5B ends a middle with <|endoftext|>, which its GGUF file does not name its end of
    sequence: the middle stops there; ``suffix`` writes ``ar``'s middle."""
    from specdecode.api import eos_ids
    from specdecode.models.loading import load_model, make_runner

    loaded = load_model("qwen2.5-coder-1.5b")
    runner = make_runner(loaded, "auto", "auto", 1024)
    eos = eos_ids(loaded, loaded.tokenizer)
    prefix = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
              "    if n < 2:\n        return n\n")
    middles = [Decoder(runner, loaded.tokenizer, method, eos).generate(
        prefix, 48, suffix="\n\nprint(fibonacci(10))\n") for method in ("ar", "suffix")]
    assert middles[0].token_ids == middles[1].token_ids
    assert middles[0].finish_reason == "stop" and "fibonacci(n - 1)" in middles[0].text.replace(
        "n-1", "n - 1")
