"""The server's ``diffusion:POLICY`` methods (server/diffusion.py), spoken to with the official
``openai`` client on the tiny served model: a response is the policy's decoding of the dLLM
(here the tiny model itself, run as a block-diffusion model), streamed or not, and what cannot
run is refused with a 400 naming the field."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest

from specdecode.api import encode_prompt
from specdecode.diffusion.decode import diffuse
from specdecode.diffusion.model import DiffusionModel
from specdecode.diffusion.registry import get_policy
from specdecode.models.llama import LlamaRunner
from specdecode.server import limits
from specdecode.server.diffusion import Dllm, served_method, served_policies

from test_server import chat
from tiny_server import EOS, MODEL, make_server, openai_client

PROMPT = "Tell me a story"
BLOCK = 4


def dllm_of(model, tokenizer) -> Dllm:
    return Dllm(LlamaRunner.from_transformers(model), len(tokenizer) - 1, BLOCK, "tiny")


@pytest.fixture(scope="module")
def served(model, tokenizer):
    with make_server(model, tokenizer, dllm=dllm_of(model, tokenizer)) as background:
        yield background


def expected(model, tokenizer, policy: str, tokens: int, **config) -> str:
    """The policy's decoding of PROMPT on a dLLM of its own, outside the server."""
    dllm = dllm_of(model, tokenizer)
    result = diffuse(DiffusionModel(dllm.runner, dllm.mask_id), get_policy(policy).make(config),
                     encode_prompt(tokenizer, PROMPT), tokens, [EOS], BLOCK)
    return tokenizer.decode(result.tokens, skip_special_tokens=True)


def ask(client, method: str, **kwargs):
    extra = {"method": method, "allow_lossy": True, **kwargs.pop("specdecode", {})}
    return chat(client, PROMPT, max_tokens=kwargs.pop("max_tokens", 10),
                extra_body={"specdecode": extra}, **kwargs)


def test_a_policy_answers_as_the_dllm_decodes_it(client, model, tokenizer):
    reference = expected(model, tokenizer, "one_per_step", 10)
    for method in ("diffusion:one_per_step", "diffusion:freedave"):  # freedave: the same tokens
        assert ask(client, method).choices[0].message.content == reference
    streamed = ask(client, "diffusion:threshold", stream=True,
                   specdecode={"config": {"threshold": 0.01}})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == expected(model, tokenizer, "threshold", 10, threshold=0.01)


def test_what_cannot_run_is_refused_by_field(client):
    cases = [({"temperature": 0.7}, "temperature"),
             ({"specdecode": {"config": {"threshold": 2.0}}}, "specdecode.config"),
             ({"specdecode": {"config": {"draft_steps": 1000}}}, "specdecode.config.draft_steps"),
             ({"logprobs": True}, "logprobs"),
             ({"response_format": {"type": "json_object"}}, "response_format")]
    for kwargs, param in cases:
        policy = "freedave" if "draft_steps" in param else "threshold"
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, f"diffusion:{policy}", **kwargs)
        assert info.value.body["param"] == param, (kwargs, info.value.body)
    for method, words in (("diffusion:cfg", "does not serve"), ("diffusion:nope", "unknown"),):
        with pytest.raises(openai.BadRequestError, match=words):
            ask(client, method)
    with pytest.raises(openai.BadRequestError, match="allow_lossy"):
        chat(client, PROMPT, extra_body={"specdecode": {"method": "diffusion:threshold"}})


def test_without_a_dllm_the_policies_are_refused_with_the_fix(model, tokenizer):
    with make_server(model, tokenizer) as background:
        with pytest.raises(openai.BadRequestError, match="serve --dllm"):
            ask(openai_client(background), "diffusion:threshold")
        listed = [m["id"] for m in httpx.get(background.url + "/v1/models").json()["data"]]
        assert not any("diffusion:" in name for name in listed)


def test_every_numeric_field_of_a_served_policy_has_a_server_range():
    for name in served_policies():
        for f in dataclasses.fields(served_method(name).config):
            if limits.is_numeric(f):
                low, high = limits.bounds(f)
                assert low <= f.default <= high, f"{name}.{f.name}"
