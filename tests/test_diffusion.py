"""Block-diffusion decoding on tiny random models: the block forward, the loop, each policy.

A random model is no diffusion model, but every property tested here is one of the decoder,
not of the model's quality: where attention reaches, FreeDave's identity with the reference,
how many positions a policy commits, that a grammar's output parses."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from specdecode.constraints import Vocabulary, make_constraint
from specdecode.diffusion.decode import diffuse
from specdecode.diffusion.learn2pd_filter import train_filter, trajectories
from specdecode.diffusion.model import DiffusionModel
from specdecode.diffusion.parallelbench import TASKS, failure_rate, valid_outputs
from specdecode.diffusion.registry import get_policy, policy_names
from specdecode.errors import SpecDecodeError
from specdecode.models.llama import LlamaRunner

from test_structured_output import EOS, SCHEMA, TOKENS
from tiny_models import tiny_llama

MASK = 95  # the tiny vocabulary's last id: a lone 0xDF byte, never valid text
PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 9, 9, 12], [1, 30]]


def sharp_llama():
    """A tiny random Llama whose head is sharpened further, so its confidences spread over
    (0, 1) as a trained model's do (the plain tiny model's stay near 1 / vocabulary)."""
    net = tiny_llama(seed=0)
    with torch.no_grad():
        net.lm_head.weight.mul_(4.0)
    return net


@pytest.fixture(scope="module")
def model():
    return DiffusionModel(LlamaRunner.from_transformers(sharp_llama()), MASK)


def run(model, name, prompt, new=24, block=8, constraint=None, **config):
    return diffuse(model, get_policy(name).make(config), prompt, new, [EOS], block, constraint)


def test_the_block_is_bidirectional_and_the_context_causal(model):
    model.prefill(PROMPTS[0])
    block = [MASK] * 8
    base = model.denoise(block)
    changed = model.denoise(block[:5] + [17] + block[6:])
    # position i is predicted by row i - 1, which sees the whole block: a token at offset 5
    # changes the predictions before it; position 0 comes from the last prompt row, which
    # sees no block row
    assert not torch.equal(base[2], changed[2])
    assert torch.equal(base[0], changed[0])
    # several states in one forward give each state's logits bitwise as alone
    together = model.denoise_states([block, block[:5] + [17] + block[6:]])
    assert torch.equal(together[0], base) and torch.equal(together[1], changed)


def test_position_zero_is_the_ar_prediction(model):
    runner = model.runner
    expected = int(runner.prefill(PROMPTS[1]).logits[-1].argmax())
    assert run(model, "one_per_step", PROMPTS[1], new=1).tokens == [expected]


def test_one_per_step_commits_one_position_a_step(model):
    result = run(model, "one_per_step", PROMPTS[0])
    assert set(result.commits) == {1} and result.steps == len(result.tokens) == 24
    assert result.forwards == 1 + 24 + 2  # prefill, a step per token, two appended blocks


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("steps", [1, 3, 8])
def test_freedave_is_one_per_step_in_fewer_steps(model, block, steps):
    for prompt in PROMPTS:
        reference = run(model, "one_per_step", prompt, new=32, block=block)
        fast = run(model, "freedave", prompt, new=32, block=block, draft_steps=steps)
        assert fast.tokens == reference.tokens
        assert fast.steps <= reference.steps
    if steps > 1:
        assert fast.steps < reference.steps


def test_a_low_threshold_commits_several_positions_a_step(model):
    result = run(model, "threshold", PROMPTS[0], threshold=0.05)
    assert len(result.tokens) == 24 and max(result.commits) > 1 and result.steps < 24
    strict = run(model, "threshold", PROMPTS[0], threshold=1.0)
    assert set(strict.commits) == {1}


@pytest.mark.parametrize("name, config", [
    ("localleap", dict(anchor_threshold=0.3, relaxed_threshold=0.3, radius=0)),
    ("ete", dict(threshold=0.3, bits_per_round=0.0)),
    ("ccd", dict(history=1, threshold=0.3)),
])
def test_policies_reduce_to_threshold_at_their_limits(model, name, config):
    for prompt in PROMPTS:
        assert run(model, name, prompt, **config).tokens == \
            run(model, "threshold", prompt, threshold=0.3).tokens


def test_relaxed_neighbours_and_entropy_budgets_commit_more(model):
    base = run(model, "threshold", PROMPTS[0], threshold=0.5)
    leap = run(model, "localleap", PROMPTS[0], anchor_threshold=0.5, relaxed_threshold=0.01,
               radius=3)
    ete = run(model, "ete", PROMPTS[0], threshold=0.5, bits_per_round=8.0)
    assert leap.steps < base.steps and ete.steps < base.steps


def test_ccd_waits_for_a_prediction_to_hold(model):
    result = run(model, "ccd", PROMPTS[0], history=3, threshold=0.0)
    # the first two steps of a block cannot have a 3-step history: one position each
    assert result.commits[:2] == [1, 1] and max(result.commits) > 1


def test_prophet_goes_all_in_when_the_gap_is_reached(model):
    eager = run(model, "prophet", PROMPTS[0], early_gap=0.0, middle_gap=0.0, late_gap=0.0)
    assert eager.commits == [8, 8, 8]  # each block in one step
    never = run(model, "prophet", PROMPTS[0], early_gap=1e9, middle_gap=1e9, late_gap=1e9)
    assert never.tokens == run(model, "one_per_step", PROMPTS[0]).tokens


def test_cfg_output_parses_under_a_json_schema(model):
    vocab = Vocabulary(TOKENS, 96, [EOS])
    for prompt in PROMPTS:
        for threshold in (0.0, 0.9):
            spec = make_constraint(vocab, json_schema=SCHEMA)
            result = run(model, "cfg", prompt, new=64, constraint=spec.start(),
                         threshold=threshold)
            text = b"".join(TOKENS[t] for t in result.tokens if t != EOS)
            assert set(json.loads(text)) == {"name", "ok", "tags"}
    assert max(result.commits) > 1  # threshold 0: whole runs from the frontier


def test_learn2pd_filter_learns_the_oracle(model, tmp_path):
    x, y = trajectories(model, PROMPTS, 16, 8, [EOS])
    assert x.shape == (len(y), 5) and 0 < float(y.mean()) < 1
    net = train_filter(x, y, epochs=200)
    accuracy = float(((net(x).squeeze(-1) > 0) == (y > 0.5)).float().mean())
    assert accuracy > max(float(y.mean()), 1 - float(y.mean()))  # beats the majority guess
    path = tmp_path / "filter.pt"
    torch.save(net.state_dict(), path)
    result = run(model, "learn2pd", PROMPTS[0], filter=str(path), threshold=0.0)
    assert max(result.commits) > 1 and len(result.tokens) == 24


def test_learn2pd_runs_the_shipped_filter_by_default(model):
    policy = get_policy("learn2pd").make()
    assert sum(p.numel() for p in policy.net.parameters()) == 1281
    # the shipped filter, trained on the default dLLM, commits several positions a step on a
    # model of its own when a low threshold lets it
    result = run(model, "learn2pd", PROMPTS[0], threshold=0.05)
    assert len(result.tokens) == 24 and max(result.commits) > 1


def test_registry_lists_every_policy_with_its_paper():
    assert policy_names()[0] == "one_per_step"
    assert {"threshold", "prophet", "localleap", "ete", "ccd", "freedave", "cfg",
            "learn2pd", "window"} <= set(policy_names())
    assert [n for n in policy_names() if get_policy(n).exact] == ["freedave"]
    for name in policy_names():
        info = get_policy(name)
        # one file each, its docstring citing the paper
        assert info.paper and info.summary
        assert len(sys.modules[info.policy.__module__].__doc__) > 200


def test_bad_input_names_the_problem(model):
    with pytest.raises(SpecDecodeError, match="unknown diffusion policy 'nope'"):
        get_policy("nope")
    with pytest.raises(SpecDecodeError, match="mask_id 96 is outside"):
        DiffusionModel(model.runner, 96)
    with pytest.raises(SpecDecodeError, match="needs a grammar"):
        run(model, "cfg", PROMPTS[0])
    spec = make_constraint(Vocabulary(TOKENS, 96, [EOS]), regex="ab+")
    with pytest.raises(SpecDecodeError, match="does not follow grammars; use the cfg policy"):
        run(model, "threshold", PROMPTS[0], constraint=spec.start())
    with pytest.raises(SpecDecodeError, match="cannot load the Learn2PD filter nothing.pt"):
        get_policy("learn2pd").make({"filter": "nothing.pt"})
    with pytest.raises(SpecDecodeError, match="no config field 'radius'"):
        get_policy("threshold").make({"radius": 2})


# ---- ParallelBench: failures come from parallelism alone ------------------------------------

def test_exact_marginals_never_fail_one_at_a_time_and_parallelism_breaks_dependent_tasks():
    for task in TASKS:
        for name in ("one_per_step", "freedave"):
            assert failure_rate(get_policy(name).make(), task, 5, instances=10)[0] == 0.0
    # copying has no dependency: every position at once is still right
    assert failure_rate(get_policy("threshold").make({"threshold": 0.1}), "copy", 5, 10) == (0.0, 5.0)
    # a permutation committed in parallel repeats an item: wrong every time
    failed, per_step = failure_rate(get_policy("threshold").make({"threshold": 0.1}), "shuffle", 5, 10)
    assert failed == 1.0 and per_step > 1


def test_valid_outputs_are_what_each_task_means():
    assert valid_outputs("copy", [4, 5], [9]) == [(4, 5)]
    assert valid_outputs("replace", [4, 5], [9]) == [(9, 5), (4, 9)]
    assert valid_outputs("shuffle", [4, 5], []) == [(4, 5), (5, 4)]


# ---- the CLI ---------------------------------------------------------------------------------

class ByteTokenizer:
    """Enough of a tokenizer for the CLI on the tiny model: one id a character."""

    def __call__(self, text):
        return {"input_ids": [1] + [3 + ord(c) % 90 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_generate_diffusion_runs_a_policy(model, capsys):
    from specdecode.cli import build_parser
    from specdecode.diffusion.cli import generate

    args = build_parser("generate").parse_args(
        ["generate", "hello", "--diffusion", "freedave", "--no-chat", "--json",
         "--block-size", "4", "--max-new-tokens", "8", "--mask-id", str(MASK),
         "--dllm", "none"])
    load = lambda _: (model.runner, ByteTokenizer(), [EOS])  # noqa: E731
    assert generate(args, {"draft_steps": "4"}, {}, load) == 0
    out = json.loads(capsys.readouterr().out)
    reference = run(model, "one_per_step", ByteTokenizer()("hello")["input_ids"], new=8, block=4)
    assert out["token_ids"] == reference.tokens and out["policy"] == "freedave"


def test_methods_lists_the_policies_apart(capsys):
    from specdecode.cli import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    policies = out[out.index("diffusion policies"):]
    for name in policy_names():
        assert f"\n{name}" in policies
    assert "freedave  (exact: one_per_step's output)" in policies


def test_window_with_the_whole_block_in_view_is_threshold(model):
    """Every row recomputed each step (refresh 1) and the window covering the block: nothing
    is cached or pruned, so it is the threshold policy on the same forward."""
    for prompt in PROMPTS:
        full = run(model, "window", prompt, inner=8, outer=8, refresh=1, threshold=0.5)
        assert full.tokens == run(model, "threshold", prompt, threshold=0.5).tokens


def test_window_recomputes_only_its_active_rows(model):
    rows_run = []
    real = model.denoise_rows

    def counting(block, rows, see):
        rows_run.append(len(rows))
        return real(block, rows, see)

    model.denoise_rows = counting
    try:
        result = run(model, "window", PROMPTS[0], new=32, block=32, inner=4, outer=12,
                     refresh=8, threshold=0.5)
    finally:
        del model.denoise_rows
    assert len(result.tokens) == 32
    assert rows_run[0] == 12  # the first step: the whole reach (the far field is pruned)
    assert min(rows_run) <= 5  # between refreshes: the active rows and the frontier's row


@pytest.mark.parametrize("argv, message", [
    (["--diffusion", "nope"], "unknown diffusion policy 'nope'"),
    (["--diffusion", "threshold", "--method", "ngram"], "drop --method"),
    (["--diffusion", "threshold", "--temperature", "0.7"], "drop --temperature"),
    (["--diffusion", "threshold", "--repetition-penalty", "1.2"], "takes no penalties"),
    (["--diffusion", "threshold", "--logit-bias", "5=2"], "takes no penalties or logit bias"),
    (["--diffusion", "threshold", "--suffix", "x"], "drop --suffix"),
    (["--diffusion", "threshold", "--logprobs", "2"], "reports no log-probabilities"),
    (["--diffusion", "threshold", "--prompt-logprobs", "0"], "reports no log-probabilities"),
    (["--diffusion", "threshold", "-c", "threshold=2"], "threshold must be in (0, 1]"),
    (["--diffusion", "threshold", "--regex", "a+"], "does not follow grammars or bans"),
    (["--diffusion", "cfg"], "the cfg policy needs a grammar"),
])
def test_generate_diffusion_bad_input_is_one_line(capsys, argv, message):
    from specdecode.cli import main

    assert main(["generate", "hi"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
