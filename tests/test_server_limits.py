"""The server's token limits, spoken to with the official ``openai`` client: ``max_tokens``
(chat and completions), ``max_completion_tokens`` (chat; OpenAI's newer name, which wins over
``max_tokens``) and ``--default-max-tokens`` (requests that give neither).

Each limit is checked by its value: the response has exactly that many tokens, the text the
Decoder API gives for the same limit, and ``finish_reason`` "length". The prompts are ones on
which the tiny model of ``test_server`` does not stop early (checked first, so a limit that is
ignored shows as a longer response, not as a coincidence)."""

from __future__ import annotations

import openai
import pytest

from test_server import chat, reference
from tiny_server import CONTEXT, MODEL, make_server, openai_client

PROMPT = "Tell me a story"
#: longer than every limit below and what the tiny model makes before end-of-sequence
UNLIMITED = 40


@pytest.fixture(scope="module")
def served(model, tokenizer):
    # default_max_tokens above every limit below: a limit that is dropped shows as more tokens
    with make_server(model, tokenizer, default_max_tokens=UNLIMITED) as background:
        yield background


@pytest.fixture(scope="module")
def long_answer(model, tokenizer):
    """The greedy chat answer to PROMPT without a limit: it must outlast every limit tested."""
    result = reference(model, tokenizer, PROMPT, UNLIMITED)
    assert len(result.token_ids) == UNLIMITED and result.finish_reason == "length", \
        "the tiny model stops early on PROMPT: pick a prompt it answers at length"
    return result


def ask(client, **limits):
    """A chat request for PROMPT with only the limits given (none: the server's default)."""
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], **limits)


def check_limited(response, expected, limit: int) -> None:
    choice = response.choices[0]
    assert response.usage.completion_tokens == limit
    assert choice.finish_reason == "length"
    text = choice.message.content if hasattr(choice, "message") else choice.text
    assert text == expected.text


@pytest.mark.parametrize("limit", [1, 5, 9])
def test_chat_max_tokens(client, model, tokenizer, long_answer, limit):
    response = chat(client, PROMPT, max_tokens=limit)
    check_limited(response, reference(model, tokenizer, PROMPT, limit), limit)


@pytest.mark.parametrize("limit", [1, 5, 9])
def test_chat_max_completion_tokens(client, model, tokenizer, long_answer, limit):
    response = ask(client, max_completion_tokens=limit)
    check_limited(response, reference(model, tokenizer, PROMPT, limit), limit)


def test_chat_max_completion_tokens_wins_over_max_tokens(client, model, tokenizer,
                                                         long_answer):
    """OpenAI deprecated max_tokens for chat in favour of max_completion_tokens: when a client
    sends both, the newer one is the limit, whichever is smaller."""
    for max_tokens, max_completion in ((12, 4), (3, 7)):
        response = ask(client, max_tokens=max_tokens, max_completion_tokens=max_completion)
        check_limited(response, reference(model, tokenizer, PROMPT, max_completion),
                      max_completion)


def test_chat_max_completion_tokens_streamed(client, model, tokenizer, long_answer):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=6,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == reference(model, tokenizer, PROMPT, 6).text
    assert finish == ["length"] and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("limit", [1, 5, 9])
def test_completion_max_tokens(client, model, tokenizer, limit):
    unlimited = reference(model, tokenizer, PROMPT, UNLIMITED, chat=False)
    assert len(unlimited.token_ids) == UNLIMITED, "the tiny model stops early on PROMPT"
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=limit)
    check_limited(response, reference(model, tokenizer, PROMPT, limit, chat=False), limit)


def test_the_default_max_tokens_applies_to_requests_without_a_limit(client, model, tokenizer,
                                                                    long_answer):
    check_limited(ask(client), long_answer, UNLIMITED)


def serve_settings(*argv: str):
    """The server settings ``specdecode serve ARGV`` parses to (checked, as at start-up)."""
    import argparse

    from specdecode.server import add_arguments, settings_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_of(parser.parse_args(list(argv)))[0]


def test_the_default_max_tokens_flag_reaches_the_server(model, tokenizer, long_answer):
    """``specdecode serve --default-max-tokens 7``: parsed, checked, and the limit of chat and
    completion requests that give none (a chat request with max_completion_tokens keeps its own)."""
    settings = serve_settings("--default-max-tokens", "7")
    assert settings.default_max_tokens == 7
    with make_server(model, tokenizer, default_max_tokens=settings.default_max_tokens) as served:
        client = openai_client(served)
        check_limited(ask(client),
                      reference(model, tokenizer, PROMPT, 7), 7)
        check_limited(client.completions.create(model=MODEL, prompt=PROMPT),
                      reference(model, tokenizer, PROMPT, 7, chat=False), 7)
        check_limited(ask(client, max_completion_tokens=3),
                      reference(model, tokenizer, PROMPT, 3), 3)


@pytest.mark.parametrize("model,served", [
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b"), ("default", "smollm2"),
    ("/models/Llama-3.2-3B.Q4_K_M.gguf", "Llama-3.2-3B.Q4_K_M"), ("/models/phi-3", "phi-3")])
def test_the_served_model_id_is_a_named_models_name_or_a_files_stem(model, served):
    assert serve_settings("--model", model).model_id == served
    assert serve_settings("--model", model, "--served-model-name", "mine").model_id == "mine"


def test_the_default_max_tokens_is_capped_by_the_context_left(model, tokenizer):
    """A request without a limit gets what fits: the default, or the context left if less."""

    with make_server(model, tokenizer, default_max_tokens=CONTEXT) as served:
        client = openai_client(served)
        prompt_tokens = client.completions.create(model=MODEL, prompt=PROMPT,
                                                  max_tokens=1).usage.prompt_tokens
        response = client.completions.create(model=MODEL, prompt=PROMPT)
        expected = reference(model, tokenizer, PROMPT, CONTEXT - prompt_tokens, chat=False)
        assert response.choices[0].text == expected.text
        assert response.usage.completion_tokens == len(expected.token_ids)
        assert response.choices[0].finish_reason == expected.finish_reason


@pytest.mark.parametrize("flag", ["0", "-4"])
def test_serve_rejects_a_default_max_tokens_below_one(flag, capsys):
    from specdecode.cli import main

    assert main(["serve", "--default-max-tokens", flag]) == 2
    assert f"--default-max-tokens must be >= 1, got {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_limit_beyond_the_context_is_refused_naming_the_fix(client, field):

    with pytest.raises(openai.BadRequestError) as info:
        ask(client, **{field: CONTEXT})
    assert "lower max_tokens to at most" in str(info.value)


def test_the_prompt_cache_file_flag_reaches_the_server_or_names_its_conflict():
    from specdecode.errors import SpecDecodeError

    assert serve_settings("--prompt-cache-file", "/tmp/p.safetensors").prompt_cache_file == (
        "/tmp/p.safetensors")
    for conflict in (["--replicas", "2"], ["--prompt-cache-mb", "0"]):
        with pytest.raises(SpecDecodeError, match="--prompt-cache-file"):
            serve_settings("--prompt-cache-file", "/tmp/p.safetensors", *conflict)
