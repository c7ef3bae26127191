"""Every registered method, greedy, token for token against ``ar`` on the same runner.

Adding a method to the registry adds it here: on tiny random-weight models (fast) and on the
real default model for a few real prompts (``slow``; CI runs it)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from specdecode import registry
from specdecode.api import Decoder

from conftest import PRECISE_TARGET, repetitive_prompts, tiny_heads
from tiny_models import scratch_dir, tiny_llama

DEV = Path(__file__).resolve().parents[1] / "src" / "specdecode" / "data" / "spec_bench_dev.jsonl"
if not DEV.is_file():
    DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "dev.jsonl"

#: lossy methods differ from ar on purpose: tests/test_lossy.py holds their quality floors
METHODS = [m for m in registry.names(lossy=False) if m != "ar"] + [
    pytest.param(m, marks=pytest.mark.skip(reason=f"{m} is lossy (registry marker): its output "
                                                  "differs from ar's on purpose; "
                                                  "tests/test_lossy.py checks its quality"))
    for m in registry.names(lossy=True)]


def needs_draft_model(method: str) -> bool:
    # auto's default parts draft with heads; a draft named makes them a draft model's
    # (test_auto_with_a_draft_model_part), so auto is tested with heads here
    return (method != "auto"
            and "draft" in {f.name for f in dataclasses.fields(registry.get(method).config)})


@functools.cache
def tiny_draft_dir() -> str:
    """A tiny random draft model (the tiny targets' vocabulary) saved as a checkpoint folder."""
    path = scratch_dir("specdecode-tiny-draft-")
    tiny_llama(seed=7, layers=1).save_pretrained(path)
    return str(path)


def needs_heads(method: str) -> bool:
    return "heads" in {f.name for f in dataclasses.fields(registry.get(method).config)}


def tiny_overrides(method: str, target=None) -> dict:
    """Config a method needs on the tiny model ``target`` (a tiny draft model instead of the
    distilled SmolLM2 draft, heads trained on it); empty for model-free methods."""
    overrides = {}
    if needs_draft_model(method):
        overrides["draft"] = tiny_draft_dir()
    if needs_heads(method):
        # min_path_prob 0: full trees, where an untrained-looking tiny head would send none
        overrides.update(heads=tiny_heads(registry.get(method).proposer.head_kind, target),
                         min_path_prob=0.0)
    return overrides


def decode(model, method, prompt, max_new, eos=None, **config):
    decoder = Decoder(model, None, method, eos_token_ids=eos or [], **config)
    return decoder.start(prompt, max_new).run()


@pytest.fixture(scope="module")
def tiny_models():
    return [tiny_llama(seed=0), tiny_llama(seed=1, layers=3, tie_embeddings=True)]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_on_tiny_models(tiny_models, method):
    for model in tiny_models:
        # one decoder for all prompts: state learnt across requests must not change tokens
        decoder = Decoder(model, None, method, eos_token_ids=[], **tiny_overrides(method, model))
        for prompt in repetitive_prompts():
            ar = decode(model, "ar", prompt, 32)
            assert decoder.start(prompt, 32).run() == ar, (method, prompt)


def test_auto_with_a_draft_model_part(tiny_models):
    """auto choosing between a lookup and a draft model, each step (the draft's tokens priced
    a forward each, its reading of what it skipped spread over the request), is ``ar``."""
    for model in tiny_models:
        decoder = Decoder(model, None, "auto", eos_token_ids=[], parts="suffix,draft_model",
                          draft=tiny_draft_dir())
        for prompt in repetitive_prompts():
            assert decoder.start(prompt, 32).run() == decode(model, "ar", prompt, 32), prompt


@pytest.mark.parametrize("method", METHODS)
def test_end_of_sequence_and_token_limit(tiny_models, method):
    model = tiny_models[0]
    prompt = repetitive_prompts()[0]
    full = decode(model, "ar", prompt, 32)
    eos = [full[9]]
    expected = full[: full.index(eos[0]) + 1]
    config = tiny_overrides(method, model)
    assert decode(model, method, prompt, 32, eos=eos, **config) == expected
    for limit in (1, 2, 5):
        assert decode(model, method, prompt, limit, **config) == full[:limit]


def dev_prompts(n_per_task: int = 1) -> list[str]:
    seen: dict[str, int] = {}
    prompts = []
    for line in DEV.read_text().splitlines():
        q = json.loads(line)
        task = q["category"] if q["category"] in {"translation", "summarization", "qa",
                                                  "math_reasoning", "rag"} else "mt_bench"
        if seen.get(task, 0) < n_per_task:
            seen[task] = seen.get(task, 0) + 1
            prompts.append(q["turns"][0])
    return prompts


@pytest.mark.slow
def test_ar_matches_transformers_generate(real_model):
    # the prompts and length of test_greedy_identical_on_real_model: our side is the reference
    # every method there is compared with (ar_tokens decodes it once per session), so the
    # reference itself is proved equal to transformers' greedy generate at no extra decode
    decoder = Decoder(real_model.model, real_model.tokenizer, "ar")
    for prompt in dev_prompts()[::2]:
        ids = decoder.encode(prompt)
        ours = ar_tokens(real_model.model, real_model.tokenizer, None, prompt, 32)
        theirs = real_model.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                           max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        assert ours == theirs


@functools.cache
def random_draft_dir(vocab_size: int) -> str:
    """A tiny random draft model of ``vocab_size`` tokens saved as a checkpoint folder, with
    positions for the dev prompts' long contexts (1,500 tokens of Gemma's RAG prompt)."""
    path = scratch_dir("specdecode-random-draft-")
    tiny_llama(vocab_size=vocab_size, seed=7, layers=1, max_positions=4096).save_pretrained(path)
    return str(path)


def stand_in_artifacts(method: str, runner) -> dict:
    """For a target nothing was trained for (Gemma): a random draft model of its vocabulary,
    or heads trained for seconds on it. Exactness holds whatever is drafted, so these test it
    as well as trained ones would; only the speed differs."""
    if needs_draft_model(method):
        return {"draft": random_draft_dir(runner.vocab_size)}
    if needs_heads(method):
        return {"heads": tiny_heads(registry.get(method).proposer.head_kind, runner),
                "min_path_prob": 0.0}
    return {}


def skip_without_artifacts(method: str, runner) -> None:
    """Skip, naming what is missing, when ``method``'s defaults need an artifact nobody
    trained for ``runner``'s model."""
    from specdecode.artifacts import find_artifacts

    if needs_draft_model(method) and not find_artifacts("draft_model", runner.fingerprint()):
        pytest.skip("no distilled draft model for this model: `specdecode train draft` "
                    "makes one for the default model")
    if needs_heads(method):
        from specdecode.heads.artifact import artifact_kind

        kind = registry.get(method).proposer.head_kind
        if not find_artifacts(artifact_kind(kind), runner.fingerprint()):
            pytest.skip(f"no trained {kind} heads for this model: `specdecode train heads "
                        f"--kind {kind}` makes them")


def check_greedy_identical(target, runner, tokenizer, method, prompts, max_new_tokens, eos=None,
                           config=None):
    """``method`` on ``target`` (a model or a runner; ``runner`` is what it runs on) gives
    ``ar``'s tokens for every prompt; ``config`` for the method (None: its defaults, skipping
    when they need an artifact nobody trained for this target)."""
    if config is None:
        skip_without_artifacts(method, runner)
    decoder = Decoder(target, tokenizer, method, eos, **(config or {}))
    for prompt in prompts:
        expected = ar_tokens(target, tokenizer, eos, prompt, max_new_tokens)
        assert decoder.generate(prompt, max_new_tokens).token_ids == expected, (method, prompt[:60])


#: ``ar``'s greedy tokens by (target, eos, prompt, length): every method compares with the
#: same reference, so it is decoded once per session, not once per method (the entry keeps its
#: target alive, so no other target can take its id)
_AR_TOKENS: dict[tuple, tuple[object, list[int]]] = {}


def ar_tokens(target, tokenizer, eos, prompt: str, max_new_tokens: int) -> list[int]:
    key = (id(target), tuple(eos or ()), prompt, max_new_tokens)
    if key not in _AR_TOKENS:
        tokens = Decoder(target, tokenizer, "ar", eos).generate(prompt, max_new_tokens).token_ids
        _AR_TOKENS[key] = (target, tokens)
    return _AR_TOKENS[key][1]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_on_real_model(real_model, method):
    from specdecode.models.hf import HFRunner

    check_greedy_identical(real_model.model, HFRunner(real_model.model), real_model.tokenizer,
                           method, dev_prompts()[::2], 32)


@pytest.fixture(scope="module")
def default_runner(real_model):
    from specdecode.models.loading import make_runner

    return make_runner(real_model)  # what the CLI, bench and server use: native int4 here


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_on_the_default_runner(real_model, default_runner, method, request):
    from specdecode.api import eos_ids
    from specdecode.models.llama import LlamaRunner

    assert isinstance(default_runner, LlamaRunner) and default_runner.weights == "int4"
    if method in PRECISE_TARGET:  # drafted by the int4 copy of an fp32 target
        default_runner = request.getfixturevalue("real_precise_runner")
    # translation (short, ends at its end of sequence) and RAG (3,381 characters of context);
    # the QA prompt's short answer proves nothing the translation does not
    check_greedy_identical(default_runner, default_runner, real_model.tokenizer, method,
                           dev_prompts()[1::4], 64, eos_ids(real_model.model, real_model.tokenizer))


@pytest.fixture(scope="module")
def gemma_runner(gemma_model):
    from specdecode.models.loading import make_runner

    return make_runner(gemma_model)  # native int4: the file's Q4_K blocks, the rest re-quantised


@pytest.fixture(scope="module")
def gemma_precise_runner(gemma_model):
    from specdecode.models.loading import make_runner

    return make_runner(gemma_model, "native", "fp32")


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_on_gemma(gemma_model, gemma_runner, method, request):
    from specdecode.api import eos_ids
    from specdecode.models.llama import LlamaRunner

    assert isinstance(gemma_runner, LlamaRunner) and gemma_runner.weights == "int4"
    if method in PRECISE_TARGET:  # drafted by the int4 copy of an fp32 target
        gemma_runner = request.getfixturevalue("gemma_precise_runner")
    # the summarization and RAG prompts are longer than Gemma's 512-position sliding window;
    # no draft model or heads are trained for Gemma: stand-ins run the model-based methods
    check_greedy_identical(gemma_runner, gemma_runner, gemma_model.tokenizer, method,
                           dev_prompts()[1::2], 64, eos_ids(gemma_model.model, gemma_model.tokenizer),
                           stand_in_artifacts(method, gemma_runner))


def installed_model(name: str):
    """A named real model published as part packages; skipped, naming its install command,
    where it is not installed (scripts/setup.sh installs the 0.5B, for CI)."""
    from specdecode.models.loading import load_model
    from specdecode.models.parted import PARTED_MODELS, is_assembled

    model = PARTED_MODELS[name]
    if not is_assembled(model):
        pytest.skip(f"{name} is not installed: `{model.install_command}` "
                    f"({model.size / 1e9:.2f} GB)")
    return load_model(name)


#: the real models we measure on: the 0.5B (installed by scripts/setup.sh; in the default run,
#: so CI runs it) and the 1.5B (installed by `specdecode models install qwen2.5-coder-1.5b`;
#: skipped without it; six minutes more, so only in the whole suite, `pytest -m ''`)
QWEN_CODER = (pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.ci), "qwen2.5-coder-1.5b")


@pytest.fixture(scope="module", params=QWEN_CODER)
def qwen_coder(request):
    return installed_model(request.param)


@pytest.fixture(scope="module")
def qwen_coder_runner(qwen_coder):
    from specdecode.models.loading import make_runner

    return make_runner(qwen_coder)  # native int4: the file's blocks as they are where they can be


@pytest.fixture(scope="module")
def qwen_coder_precise(qwen_coder):
    from specdecode.models.loading import make_runner

    # block int8 holds every block type of the file exactly: the precise target in 1.25 bytes a
    # weight (fp32 holds 8, two copies: 14 GB for the 1.5B)
    return make_runner(qwen_coder, "native", "int8")


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_on_qwen_coder(qwen_coder, qwen_coder_runner, method, request):
    """Every exact method on Qwen2.5-Coder-0.5B and 1.5B (their own Q5_0/Q8_0/Q4_K/Q6_K and
    Q4_K_M files), with drafts sized by the row costs as users get them; the draft methods
    draft with the 0.5B; no heads are trained for them: stand-ins run the head methods."""
    from specdecode.api import eos_ids

    runner = qwen_coder_runner
    if method in PRECISE_TARGET:  # drafted by the int4 copy of an fp32 target
        runner = request.getfixturevalue("qwen_coder_precise")
    # the draft methods draft with the model's own GGUF file (`-c draft=qwen2.5-coder-0.5b`);
    # the head methods with untrained heads over the first ids (training stand-ins over its
    # 151,936-token head takes minutes): full trees, so every path of the tree code runs
    config = {}
    if needs_draft_model(method):
        config["draft"] = "qwen2.5-coder-0.5b"
    if needs_heads(method):
        config.update(heads=tiny_heads(registry.get(method).proposer.head_kind, runner,
                                       tuple(range(4096)), steps=0), min_path_prob=0.0)
    # the translation (short, 21 tokens to its end of sequence, names copied from the prompt
    # for retrieval drafts); on the 1.5B also the summarization (709 prompt tokens: long
    # context; the default run's long context is the default model's RAG prompt, above)
    long_context = request.node.callspec.params["qwen_coder"] == "qwen2.5-coder-1.5b"
    check_greedy_identical(runner, runner, qwen_coder.tokenizer, method,
                           dev_prompts()[1:3 if long_context else 2], 32,
                           eos_ids(qwen_coder, qwen_coder.tokenizer), config)
