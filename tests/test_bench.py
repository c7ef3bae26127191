"""The bench harness end to end on a tiny random model, the simulator against the engine, and
bad input rejected before any model loads."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from specdecode import kernels, registry
from specdecode.bench import cli as bench_cli
from specdecode.bench import simulate
from specdecode.questions import load_questions, pick_questions, sample_per_task
from specdecode.bench.datasets import load_workloads
from specdecode.bench.metrics import FIELDS
from specdecode.bench.roofline import vnni_cpu
from specdecode.bench.runner import Target
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.models.hf import HFRunner


class ToyTokenizer:
    """Characters <-> ids 4..95 and a chat template, enough for the harness on tiny_llama."""

    chat_template = "toy"

    def encode(self, text):
        return [4 + ord(c) % 92 for c in text]

    def __call__(self, text, add_special_tokens=True):  # it has no special tokens to add
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = [1]
        for m in messages:
            ids += [3] + self.encode(m["role"][0] + ":" + m["content"]) + [3]
        return ids + self.encode("a:")

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + (i - 4) % 92) for i in ids if i >= 4)


QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["abc abc abc abd", "again abc abc"]},
    {"question_id": 2, "category": "translation", "turns": ["xyz xyz xyz xy"]},
    {"question_id": 3, "category": "translation", "turns": ["hello hello hel"]},
    {"question_id": 4, "category": "qa", "turns": ["q: 1 2 3 1 2 3 1 2"]},
]


def write_questions(path, rows=QUESTIONS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bench_args(tmp_path, *extra):
    data = write_questions(tmp_path / "q.jsonl")
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(["--data", str(data), "--out", str(tmp_path / "out"),
                              "--max-new-tokens", "20", *extra])


def tiny_target(tiny_model, eos=(2,)):
    return Target(HFRunner(tiny_model), ToyTokenizer(), list(eos), tiny_model, None, "tiny")


def test_bench_end_to_end(tmp_path, tiny_model):
    plan = bench_cli.plan(bench_args(tmp_path, "--max-new-tokens", "16"))
    summary = bench_cli.bench(tiny_target(tiny_model), plan, progress=False)
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    # every exact method runs, or is left out with its reason (e.g. an untrained draft); lossy
    # ones run only when named (tests/test_lossy.py)
    names = list(summary["methods"])
    assert names[0] == "ar" and names[-2:] == ["hf", "hf-pld"]
    for name in registry.names(lossy=False):
        assert name in names or f"{name}: " in summary["meta"]["left out"]
    assert {"ar", "ngram"} <= set(names)
    # one record per contender x question x turn
    assert len(records) == len(names) * 5
    assert summary["tasks"] == ["mt_bench", "translation", "qa"]
    for name in names[:-2]:
        entry = summary["methods"][name]
        for cell in [entry["overall"], *entry["tasks"].values()]:
            assert set(FIELDS) <= set(cell)
            assert cell["identical_fraction"] == 1.0, name
    # the overall figures are those of the records (the rules themselves are checked on
    # hand-made records in test_summary_figures_follow_their_definitions)
    for name in names:
        rows = [r for r in records if r["method"] == name]
        cell = summary["methods"][name]["overall"]
        assert cell["new_tokens"] == sum(r["new_tokens"] for r in rows)
        assert cell["tokens_per_s"] == round(cell["new_tokens"] / sum(r["wall_s"] for r in rows), 4)
        speed = {n: summary["methods"][n]["overall"]["tokens_per_s"] for n in ("ar", "hf")}
        assert cell["speedup_vs_ar"] == pytest.approx(cell["tokens_per_s"] / speed["ar"], abs=2e-3)
        assert cell["speedup_vs_hf"] == pytest.approx(cell["tokens_per_s"] / speed["hf"], abs=2e-3)
        if rows[0]["kind"] == "method":
            steps = [n for r in rows for n in r["accepted_lengths"]]
            assert cell["mean_accepted"] == round(sum(steps) / len(steps), 4)
    assert summary["methods"]["ar"]["overall"]["speedup_vs_ar"] == 1.0
    assert summary["methods"]["ar"]["overall"]["mean_accepted"] == 1.0
    # greedy transformers generate reproduces ar on this runner (fp32, CPU)
    assert summary["methods"]["hf"]["overall"]["identical_fraction"] == 1.0
    ar = [r for r in records if r["method"] == "ar"]
    assert all("prompt_ids" in r for r in ar)
    for r in records:
        assert r["new_tokens"] == len(r["token_ids"]) <= 16
        if r["kind"] == "method":
            assert sum(r["accepted_lengths"]) + 1 >= r["new_tokens"]
    # the second turn carries the first answer: a longer prompt than turn 0
    turns = {r["turn"]: r["prompt_tokens"] for r in ar if r["question_id"] == 1}
    assert turns[1] > turns[0] + 10
    report = (out / "report.md").read_text()
    assert "| ngram |" in report and "Speedup over ar, per task" in report
    # matplotlib is part of the base install: the README's set-up command gives plots
    assert (out / "speedup.png").stat().st_size > 1000
    assert (out / "accepted_hist.png").stat().st_size > 1000


def test_max_minutes_stops_after_a_question_and_reports_the_ones_done(tmp_path, tiny_model):
    plan = bench_cli.plan(bench_args(tmp_path, "--methods", "ar", "--max-minutes", "1e-9"))
    summary = bench_cli.bench(tiny_target(tiny_model), plan, progress=False)
    records = (tmp_path / "out" / "records.jsonl").read_text().splitlines()
    assert {json.loads(line)["question_id"] for line in records} == {plan.questions[0].question_id}
    assert summary["meta"]["questions"].startswith("1 (")
    assert f"after 1 of {len(plan.questions)} questions" in summary["meta"]["left out"]


def record(method, kind, task, qid, tokens, wall, steps, identical, forwards=None,
           drafted=None, propose_s=None, prefill_s=None, prompt_tokens=0):
    return {"method": method, "kind": kind, "task": task, "question_id": qid, "turn": 0,
            "new_tokens": tokens, "wall_s": wall, "accepted_lengths": steps,
            "target_forwards": forwards if forwards is not None else 1 + len(steps),
            "identical_to_ar": identical, "draft_tokens": drafted, "propose_s": propose_s,
            "prefill_s": prefill_s, "prompt_tokens": prompt_tokens}


def test_summary_figures_follow_their_definitions():
    """Hand-made records whose every figure is worked out below (bench/metrics.py's rules)."""
    from specdecode.bench.metrics import summarize

    records = [
        record("ar", "method", "mt_bench", 1, 10, 1.0, [1] * 9, True, drafted=0, propose_s=0.0),
        record("ar", "method", "qa", 2, 20, 1.0, [1] * 19, True, drafted=0, propose_s=0.0),
        record("m", "method", "mt_bench", 1, 10, 0.5, [2, 2, 2, 2, 1], True, drafted=8,
               propose_s=0.1),
        record("m", "method", "qa", 2, 20, 2.0, [3, 3, 3, 3, 3, 3, 1], False, drafted=16,
               propose_s=0.3),
        record("hf", "peer", "mt_bench", 1, 10, 2.0, None, True, forwards=10),
        record("hf", "peer", "qa", 2, 20, 4.0, None, False, forwards=15),
    ]
    summary = summarize(records)
    assert summary["tasks"] == ["mt_bench", "qa"]
    m = summary["methods"]["m"]
    # pooled: 30 tokens in 2.5 s = 12/s; ar 30 in 2 s = 15/s; hf 30 in 6 s = 5/s
    assert m["overall"]["tokens_per_s"] == 12.0
    assert m["overall"]["speedup_vs_ar"] == 0.8 and m["overall"]["speedup_vs_hf"] == 2.4
    assert summary["methods"]["ar"]["overall"]["speedup_vs_hf"] == 3.0
    # per task: mt_bench 20/s against ar's 10/s, qa 10/s against 20/s
    assert (m["tasks"]["mt_bench"]["speedup_vs_ar"], m["tasks"]["qa"]["speedup_vs_ar"]) == (2.0, 0.5)
    # the median of the per-prompt ratios 2.0 and 0.5
    assert m["overall"]["median_speedup_vs_ar"] == 1.25
    # tau: 28 committed tokens over 12 verify steps; per task 9/5 and 19/7
    assert m["overall"]["mean_accepted"] == round(28 / 12, 4)
    assert (m["tasks"]["mt_bench"]["mean_accepted"], m["tasks"]["qa"]["mean_accepted"]) == (1.8, round(19 / 7, 4))
    # a peer's tau: (tokens - 1) / (forwards - 1), pooled: 28 / 23
    assert summary["methods"]["hf"]["overall"]["mean_accepted"] == round(28 / 23, 4)
    assert m["overall"]["identical_fraction"] == 0.5 and m["tasks"]["qa"]["identical_fraction"] == 0.0
    # 0.4 s of proposing over 24 draft nodes, and over 2.5 s of wall time
    assert m["overall"]["draft_ms_per_token"] == round(1000 * 0.4 / 24, 4)
    assert m["overall"]["propose_share"] == 0.16
    assert summary["methods"]["hf"]["overall"]["draft_ms_per_token"] is None
    # two prompts: too few for an interval
    assert m["overall"]["speedup_vs_ar_interval"] is None
    # recorded without their prompts' seconds: no prompt figures
    assert m["overall"]["prompt_tokens_per_s"] is None
    assert m["overall"]["decode_speedup_vs_ar"] is None


def test_prompt_figures_follow_their_definitions():
    """The prompt's seconds apart: prompt tokens/s, its share, the median time to the first
    token, and the speed after the prompt (each request's tokens after its first) against
    ar's, which its prompt seconds, the same for both, dilute in speedup_vs_ar."""
    from specdecode.bench.metrics import summarize
    from specdecode.bench.report import markdown

    records = [
        record("ar", "method", "rag", 1, 11, 3.0, [1] * 10, True, prefill_s=2.0,
               prompt_tokens=800),
        record("ar", "method", "qa", 2, 21, 2.5, [1] * 20, True, prefill_s=0.5,
               prompt_tokens=100),
        record("m", "method", "rag", 1, 11, 2.5, [2] * 5, True, prefill_s=2.0,
               prompt_tokens=800),
        record("m", "method", "qa", 2, 21, 1.5, [4] * 5, True, prefill_s=0.5,
               prompt_tokens=100),
        record("peer", "peer", "qa", 2, 21, 3.0, None, False, forwards=21),
    ]
    summary = summarize(records)
    ar, m = summary["methods"]["ar"]["overall"], summary["methods"]["m"]["overall"]
    assert ar["prompt_tokens_per_s"] == 360.0  # 900 tokens in 2.5 s
    assert ar["prefill_share"] == round(2.5 / 5.5, 4) and m["prefill_share"] == 0.625
    assert m["time_to_first_token_s"] == 1.25  # the median of 2.0 and 0.5
    # after the prompt: ar 30 tokens in 3 s, m in 1.5 s
    assert (ar["decode_tokens_per_s"], m["decode_tokens_per_s"]) == (10.0, 20.0)
    assert m["decode_speedup_vs_ar"] == 2.0 and m["speedup_vs_ar"] == round(5.5 / 4.0, 4)
    # per task: rag 10 tokens in 1 s against 0.5 s, qa 20 in 2 s against 1 s
    assert summary["methods"]["m"]["tasks"]["rag"]["decode_speedup_vs_ar"] == 2.0
    peer = summary["methods"]["peer"]["overall"]
    assert peer["prompt_tokens_per_s"] is None and peer["decode_speedup_vs_ar"] is None
    report = markdown(summary, {"sampling": "greedy"})
    assert "| m | 360 | 1.250 | 62% | 20.0 | 2.00x |" in report
    assert "## Speedup over ar after the prompt (the decoding alone), per task" in report


def test_speedup_interval_spans_what_the_prompts_drawn_can_give():
    """The bootstrap interval over prompts: a point where every prompt has the same speedup,
    inside the per-prompt extremes and around the pooled figure where they differ, the same on
    every call (a fixed seed), and none below five prompts."""
    from specdecode.bench.metrics import speedup_interval, summarize
    from specdecode.bench.report import markdown

    same = [(20, 1.0, 10, 1.0)] * 3 + [(40, 2.0, 40, 4.0)] * 3  # 2x every prompt
    assert speedup_interval(same) == (2.0, 2.0)
    mixed = [(10, 1.0, 10, 1.0 * f) for f in (0.8, 0.9, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0)]
    low, high = speedup_interval(mixed)
    pooled = (80 / 8) / (80 / 11.5)
    assert 0.8 <= low < pooled < high <= 3.0
    assert speedup_interval(mixed) == (low, high)
    assert speedup_interval(mixed[:4]) is None
    records = []
    for q, f in enumerate((0.8, 0.9, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0)):
        records.append(record("ar", "method", "qa", q, 10, f, [1] * 9, True))
        records.append(record("m", "method", "qa", q, 10, 1.0, [2] * 5, True))
    summary = summarize(records)
    m = summary["methods"]["m"]
    assert m["overall"]["speedup_vs_ar_interval"] == [round(low, 4), round(high, 4)]
    assert m["tasks"]["qa"]["speedup_vs_ar_interval"] == [round(low, 4), round(high, 4)]
    assert m["overall"]["speedup_vs_ar"] == round(pooled, 4)
    # the report: in the Overall table, and per task where a task has 5 prompts or more
    text = markdown(summary, {"sampling": "greedy"})
    shown = "{:.2f}-{:.2f}x".format(*m["overall"]["speedup_vs_ar_interval"])
    assert f"| m | method | 10.0 | {pooled:.2f}x | {shown} |" in text
    assert "95% intervals of the speedup over ar" in text and f"| m | {shown} | {shown} |" in text


@pytest.fixture(scope="module", params=["greedy", "sampled"])
def ngram_run(request, tmp_path_factory, tiny_model):
    """ar and ngram, 32 tokens, no end-of-sequence id (the engine would walk a draft past it,
    where a recording is silent)."""
    tmp = tmp_path_factory.mktemp(request.param)
    # greedy also checks repeats: two passes, new proposers each
    extra = ["--temperature", "0.9"] if request.param == "sampled" else ["--repeats", "2"]
    # full drafts: the simulator replays a proposer's drafts as it makes them
    plan = bench_cli.plan(bench_args(tmp, "--methods", "ngram", "--peers", "none",
                                     "--max-new-tokens", "32", "--draft-budget", "full", *extra))
    summary = bench_cli.bench(tiny_target(tiny_model, eos=()), plan, progress=False)
    return summary, tmp / "out" / "records.jsonl"


def test_simulator_agrees_with_engine(ngram_run):
    summary, path = ngram_run
    assert list(summary["methods"]) == ["ar", "ngram"]
    # greedy, and seeded sampling with a deterministic draft (verify.py), reproduce ar
    assert summary["methods"]["ngram"]["overall"]["identical_fraction"] == 1.0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2 * 5
    assert all(len(r["wall_s_repeats"]) == summary["meta"]["repeats"] for r in rows)
    engine = [r["accepted_lengths"] for r in rows if r["method"] == "ngram"]
    recording = simulate.load_recording(path)
    method = registry.get("ngram")
    replayed = simulate.simulate(recording, method, method.make_config())
    assert replayed == engine
    assert any(n > 1 for steps in engine for n in steps)  # drafts did land
    per_task = simulate.summarize(recording, replayed)
    assert list(per_task) == ["mt_bench", "translation", "qa", "overall"]
    steps = [n for s in engine for n in s]
    assert per_task["overall"]["mean_accepted"] == pytest.approx(sum(steps) / len(steps), abs=1e-4)


def test_simulate_cli_and_simulable_methods(ngram_run, capsys):
    _, path = ngram_run
    assert main(["simulate", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "ngram" in result and "recycling" not in result
    assert result["ar"]["tasks"]["overall"]["mean_accepted"] == 1.0
    assert not simulate.simulable(registry.get("recycling"))
    assert main(["simulate", str(path), "--methods", "recycling"]) == 2
    assert "needs the target model" in capsys.readouterr().err


def test_per_task_sample_spreads_over_mt_bench_categories():
    questions = sample_per_task(load_questions(), 8)
    mt = [q for q in questions if q.task == "mt_bench"]
    assert len(questions) == 48 and len({q.category for q in mt}) == 8
    assert len(load_questions()) == 240


def test_named_questions_run_in_the_order_given():
    questions = pick_questions(load_questions(), "401, 161")
    assert [q.question_id for q in questions] == [401, 161]
    edits = pick_questions(load_workloads("spec-bench,code-edit"), "code-edit-1,81")
    assert [q.question_id for q in edits] == ["code-edit-1", 81]


def _no_model(*_):
    raise AssertionError("the model must not load for bad input")


@pytest.mark.parametrize("rows,message", [
    (['{"question_id": 1, "category": "qa", "turns": ["hi"]}', '{"question_id": 2,'],
     "line 2: not valid JSON"),
    (['{"question_id": 1, "category": "qa"}'], "line 1: missing field(s) turns"),
    (['{"question_id": 1, "category": "qa", "turns": []}'], "line 1: turns must be"),
    (['{"question_id": 1, "category": "qa", "turns": ["a"]}',
      '{"question_id": 1, "category": "qa", "turns": ["b"]}'], "line 2: question_id 1 repeats"),
])
def test_malformed_question_file_names_the_line(tmp_path, capsys, monkeypatch, rows, message):
    monkeypatch.setattr("specdecode.cli.load_target", _no_model)
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(rows) + "\n")
    assert main(["bench", "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(data) in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["--data", "/nonexistent/q.jsonl"], "question file /nonexistent/q.jsonl does not exist"),
    (["--methods", "ar,nope"], "unknown method 'nope'"),
    (["--peers", "hf,vllm"], "unknown peer(s) 'vllm'"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--per-task", "0"], "--per-task must be positive"),
    (["--questions", "161,9999"], "--questions names ids that --data does not hold: 9999"),
    (["--questions", "161,161"], "--questions repeats a question id"),
    (["--questions", "161", "--per-task", "2"], "--questions and --per-task both choose"),
    (["--max-minutes", "0"], "--max-minutes must be positive"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["-c", "suffix.x=1", "--methods", "ngram"], "not in --methods"),
    (["-c", "ngram.bogus=1", "--methods", "ngram"], "has no config field 'bogus'"),
])
def test_bad_bench_input_fails_before_the_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr("specdecode.cli.load_target", _no_model)
    assert main(["bench", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_unwritable_out_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("specdecode.cli.load_target", _no_model)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "--out", str(blocker / "sub")]) == 2
    assert "cannot write to --out" in capsys.readouterr().err


def test_bad_recording(tmp_path):
    with pytest.raises(SpecDecodeError, match="does not exist"):
        simulate.load_recording(tmp_path / "none.jsonl")
    path = tmp_path / "r.jsonl"
    path.write_text('{"method": "ar", "task": "qa"}\n')
    with pytest.raises(SpecDecodeError, match="line 1: the ar record lacks prompt_ids"):
        simulate.load_recording(path)
    path.write_text('{"method": "ngram"}\n')
    with pytest.raises(SpecDecodeError, match="no 'ar' records"):
        simulate.load_recording(path)


def layer_macs(c) -> int:
    """Multiply-adds of one row through a Llama layer's linear maps, from its config."""
    d = c.hidden_size // c.num_attention_heads
    return (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * d
            + c.num_attention_heads * d * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)


def test_cached_layer_rate_is_the_layers_multiply_adds_over_the_median_time(monkeypatch):
    from specdecode.bench import roofline
    from specdecode.models.loading import LoadedModel, make_runner
    from tiny_models import tiny_llama

    model = tiny_llama(hidden_size=64, seed=0)
    runner = make_runner(LoadedModel(model, ToyTokenizer(), "tiny"), "native", "int4")
    clock = itertools.count()  # every timed call of the four layers takes one tick, 1 ms
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(clock) * 1e-3)
    rate = roofline.cached_layer_gmacs(runner, 16)
    assert rate == pytest.approx(16 * layer_macs(model.config) / 1e-3 / 1e9)


def test_runner_measurement_on_a_tiny_model(tmp_path, monkeypatch):
    from specdecode.bench import runners as runners_module
    from specdecode.bench.runners import FORWARD_SIZES, measure_runners, runners_markdown
    from specdecode.models.loading import LoadedModel
    from specdecode.models.quant import WEIGHT_FORMATS

    questions = load_questions(write_questions(tmp_path / "q.jsonl"))
    from specdecode.models.loading import make_runner
    from tiny_models import tiny_llama

    # int4 groups need input sizes divisible by 32
    loaded = LoadedModel(tiny_llama(hidden_size=64, seed=0), ToyTokenizer(), "tiny")
    built = {"hf (fp32)": make_runner(loaded, "hf")}
    built.update({f"native {fmt}": make_runner(loaded, "native", fmt) for fmt in WEIGHT_FORMATS})
    monkeypatch.setattr(runners_module, "STREAM_MIB", 8)  # a quick bandwidth probe
    monkeypatch.setattr(runners_module, "PROMPT_TOKENS", 40)
    result = measure_runners(built, loaded.tokenizer, [2], questions, context=24,
                             max_new_tokens=6, hf_model=loaded.model, progress=lambda _: None)
    runners = list(built)
    assert list(result["forward_ms"]) == runners  # no GGUF file: no llama.cpp row
    for row in result["forward_ms"].values():
        assert [int(k) for k in row] == list(FORWARD_SIZES) and all(v > 0 for v in row.values())
    assert list(result["ar"]) == runners + ["transformers generate"]
    assert result["ar"]["native fp32"]["identical_to_native_fp32"] == len(questions)
    assert all(row["new_tokens"] > 0 and row["tokens_per_s"] > 0 for row in result["ar"].values())
    # decode speed after the prefill: our runners report their prefill, transformers does not
    assert result["ar"]["native int4"]["decode_tokens_per_s"] > 0
    assert result["ar"]["transformers generate"]["decode_tokens_per_s"] is None
    # a row streams the linear layers and the head: 4 bytes a weight in fp32, 2 in bf16, 1 in
    # int8 (plus a float scale per output), 20 bytes per 32 weights in int4 (Q4_1 blocks)
    c = loaded.model.config
    weights = c.num_hidden_layers * layer_macs(c) + c.vocab_size * c.hidden_size
    sizes = result["memory"]["bytes"]
    assert sizes["hf (fp32)"] is None
    assert sizes["native fp32"] == 4 * weights and sizes["native bf16"] == 2 * weights
    assert sizes["native int4"] == weights // 32 * 20
    assert result["memory"]["stream_gbs"] > 0 and result["peers_failed"] == {}
    # prompt processing for every runner, the LM head alone for the native ones (hf has none)
    assert list(result["prompt_ms"]) == runners and all(v > 0 for v in result["prompt_ms"].values())
    assert result["prompt_tokens"] == 40 and list(result["head_ms"]) == runners[1:]
    assert all([int(k) for k in row] == list(FORWARD_SIZES) for row in result["head_ms"].values())
    report = runners_markdown(result, {"machine": "test"})
    assert "| native int4 |" in report and "| transformers generate |" in report
    assert "## One row against its memory bound" in report
    assert "## Prompt processing (40 tokens from an empty cache" in report
    if kernels.isa() == kernels.ISA_LEVELS.index("avx512"):
        c = loaded.model.config
        expected = c.num_hidden_layers * layer_macs(c) + c.vocab_size * c.hidden_size
        assert result["roofline"]["macs_per_row"] == expected
        roofline = result["roofline"]
        # rates only (timed apart on a shared machine, so not compared with one another here)
        assert roofline["peak_gmacs"] > 0 and roofline["q4_mix_gmacs"] > 0
        assert all(roofline["cached_layer_gmacs"][str(size)] > 0 for size in FORWARD_SIZES)
        assert "## Roofline of native int4" in report and "at the Q4 ceiling" in report
    else:
        assert result["roofline"] is None


def test_method_variants_run_several_configs_of_one_method():
    methods = bench_cli.parse_methods(
        "ngram:max_ngram=2:num_speculative_tokens=3,ngram,suffix:max_spec_tokens=4",
        ["ngram.num_speculative_tokens=6"])
    by_label = {label: (method.name, config) for label, method, config in methods}
    assert list(by_label) == ["ar", "ngram:max_ngram=2:num_speculative_tokens=3", "ngram",
                              "suffix:max_spec_tokens=4"]
    name, config = by_label["ngram:max_ngram=2:num_speculative_tokens=3"]
    assert name == "ngram" and (config.max_ngram, config.num_speculative_tokens) == (2, 3)
    assert by_label["ngram"][1].num_speculative_tokens == 6  # -c applies where no variant overrides
    assert by_label["suffix:max_spec_tokens=4"][1].max_spec_tokens == 4
    with pytest.raises(SpecDecodeError, match="expects KEY=VALUE"):
        bench_cli.parse_methods("ngram:max_ngram", [])


def step_record(method, accepted, drafted, propose_s, wall_s, kind="method"):
    return {"method": method, "kind": kind, "accepted_lengths": accepted,
            "draft_tokens": drafted, "propose_s": propose_s, "new_tokens": sum(accepted) + 1,
            "wall_s": wall_s}


def test_projection_arithmetic_on_fixed_inputs(tmp_path, capsys):
    from specdecode.bench import projection

    records = [step_record("ar", [1] * 10, 0, 0.001, 0.11),
               step_record("ar", [1] * 10, 0, 0.001, 0.11),
               # 8 steps, 24 tokens (tau 3), 56 draft nodes (8 rows a step), 8 ms of drafting
               step_record("chain", [3] * 8, 56, 0.008, 0.1),
               step_record("llama.cpp", [1], 0, None, 0.5, kind="peer")]
    steps = projection.method_steps(records)
    assert list(steps) == ["ar", "chain"]  # peers have no per-step data
    chain = steps["chain"]
    assert (chain["tau"], chain["rows"], chain["draft_ms"], chain["steps"]) == (3, 8, 1.0, 8)
    assert chain["measured_speedup"] == pytest.approx((25 / 0.1) / (22 / 0.22))
    assert chain["measured_decode_speedup"] is None  # recorded without prefill_s
    timed = [dict(r, prefill_s=0.01) for r in records]
    decode = projection.method_steps(timed)["chain"]["measured_decode_speedup"]
    assert decode == pytest.approx((24 / 0.09) / (20 / 0.2))
    assert steps["ar"]["draft_ms"] == pytest.approx(0.1)
    # c(r): 10 ms at 1 row, 12 at 8, 16 at 16, 40 at 64: linear between, the last slope beyond
    costs = {1: 10.0, 8: 12.0, 16: 16.0, 64: 40.0}
    assert projection.row_cost(costs, 1) == 10.0
    assert projection.row_cost(costs, 4.5) == pytest.approx(11.0)
    assert projection.row_cost(costs, 12) == pytest.approx(14.0)
    assert projection.row_cost(costs, 112) == pytest.approx(64.0)
    projected = projection.project(steps, costs)
    # chain: 3 tokens per (1 ms + 12 ms); ar: 1 token per (0.1 ms + 10 ms)
    assert projected["chain"] == pytest.approx((3 / 13.0) / (1 / 10.1))
    assert projected["ar"] == pytest.approx(1.0)
    # the CLI reads a run's records and a --runners run's costs; nothing is measured
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "runners.json").write_text(json.dumps(
        {"forward_ms": {"native int4": {str(k): v for k, v in costs.items()},
                        "llama.cpp (llama-bench)": {"1": 5.0, "8": 9.0}}}))
    assert main(["bench", "--project-from", str(run), "--row-costs",
                 str(tmp_path / "runners.json"), "--out", str(tmp_path / "o")]) == 0
    table = (tmp_path / "o" / "projection.md").read_text()
    assert "| chain | 3.00 | 8.00 | 1.000 | 2.50x | - | 2.33x |" in table
    assert "projected, native int4" in table and "llama-bench" not in table
    capsys.readouterr()


@pytest.mark.parametrize("argv,message", [
    (["--project-from", "/nonexistent"], "--project-from needs row costs"),
    (["--row-costs", "x.json"], "--row-costs goes with --project-from"),
    (["--runners", "--perplexity"], "separate runs"),
    (["--project-from", "/nonexistent", "--row-costs", "x"], "no records.jsonl there"),
    (["--perplexity", "--weights", "int4,int3"], "--weights 'int4,int3'"),
    (["--perplexity", "--text", "/nonexistent.txt"], "--text /nonexistent.txt does not exist"),
])
def test_bad_runner_options_fail_before_the_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr("specdecode.bench.runner_set.build", _no_model)
    monkeypatch.setattr("specdecode.cli.load_target", _no_model)
    assert main(["bench", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


FAKE_LLAMA_BENCH = """#!/bin/sh
cat <<'JSON'
[{"n_prompt": 1, "n_gen": 0, "samples_ns": [2000000]}, {"n_prompt": 2, "n_gen": 0, "samples_ns": [2500000]},
 {"n_prompt": 4, "n_gen": 0, "samples_ns": [3000000]}, {"n_prompt": 8, "n_gen": 0, "samples_ns": [4000000]},
 {"n_prompt": 16, "n_gen": 0, "samples_ns": [6000000]}, {"n_prompt": 64, "n_gen": 0, "samples_ns": [20000000]},
 {"n_prompt": 256, "n_gen": 0, "samples_ns": [128000000]}, {"n_prompt": 0, "n_gen": 32, "samples_ns": [64000000]}]
JSON
"""


def test_a_large_gguf_is_measured_without_a_float_copy(tmp_path, monkeypatch):
    """Past FLOAT_COPY_LIMIT nothing goes through transformers: the native runner reads the
    file, only the default format is built unless asked, and llama-bench runs beside it."""
    from specdecode.bench import runner_set
    from specdecode.bench import runners as runners_module
    from tiny_models import tiny_llama
    from test_llama_runner import write_gguf

    path = write_gguf(tiny_llama(hidden_size=64, seed=0), tmp_path / "m.gguf")
    monkeypatch.setattr(runner_set, "FLOAT_COPY_LIMIT", 0)
    monkeypatch.setattr("specdecode.models.loading.gguf_tokenizer", lambda *_: ToyTokenizer())
    monkeypatch.setattr("specdecode.models.loading._gguf_transformers_model", _no_model)
    built = runner_set.build(str(path), "auto", path)
    assert list(built.runners) == ["native int4"] and built.hf_model is None
    assert built.notes[0].startswith("hf runner and transformers generate: left out")
    assert "ask for them with --weights int4,fp32,bf16,int8" in built.notes[1]
    said = []
    built = runner_set.build(str(path), "int4,int8", path, say=said.append)
    assert list(built.runners) == ["native int4", "native int8"]
    assert len(said) == 1 and said[0].startswith(
        "native int8: block int8 from the file's blocks, no float copy, holds ")

    tool = tmp_path / "llama-bench"
    tool.write_text(FAKE_LLAMA_BENCH)
    tool.chmod(0o755)
    monkeypatch.setattr(runners_module, "STREAM_MIB", 8)
    monkeypatch.setattr(runners_module, "llama_cpp_available", lambda: False)
    questions = load_questions(write_questions(tmp_path / "q.jsonl"))
    result = runners_module.measure_runners(
        built.runners, built.tokenizer, [2], questions, context=24, max_new_tokens=4,
        gguf_path=path, llama_cpp_dir=str(tmp_path), progress=lambda _: None)
    bench_row = result["forward_ms"]["llama.cpp (llama-bench)"]
    assert bench_row == {"1": 2.0, "2": 2.5, "4": 3.0, "8": 4.0, "16": 6.0, "64": 20.0}
    # its pp at depth 0, of the prompt the runner's context holds (256 tokens: this tiny model's)
    assert result["prompt_tokens"] == 256 and result["prompt_ms"]["llama.cpp (llama-bench)"] == 128.0
    assert result["ar"]["llama.cpp (llama-bench) tg"]["decode_tokens_per_s"] == pytest.approx(500.0)
    # llama.cpp streams the file's tensors but the embedding (this file has its own head)
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    streamed = sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight")
    assert result["memory"]["bytes"]["llama.cpp (llama-bench)"] == streamed
    report = runners_module.runners_markdown(result, {"machine": "test"})
    assert "| llama.cpp (llama-bench) | 2.0 | 2.5 | 3.0 | 4.0 | 6.0 | 20.0 | 3.00x |" in report
    assert "| llama.cpp (llama-bench) | 128 | 2000 | - | - | - | - | - |" in report


@pytest.mark.skipif(not vnni_cpu(),
                    reason="the roofline's micro-kernels are AVX-512 VNNI code; this CPU has none")
def test_roofline_micro_kernels_build_apart_and_count_macs():
    from specdecode.bench import roofline

    ext = roofline.peak_kernels()
    assert not hasattr(kernels.load(), "int8_peak_macs")  # benchmark code stays out of the runner
    assert ext.int8_peak_macs(200_000) > 1e9 and ext.q4_mix_peak_macs(50_000) > 1e9


def test_code_edit_joins_spec_bench_as_a_task_of_its_own():
    from specdecode.bench.datasets import load_workloads
    from specdecode.questions import sample_per_task

    questions = sample_per_task(load_workloads("spec-bench,code-edit"), 2)
    tasks = [q.task for q in questions]
    assert tasks.count("code_edit") == 2 and len(set(tasks)) == 7
    edit = next(q for q in questions if q.task == "code_edit")
    assert "def area(width, height)" in edit.turns[0]
    with pytest.raises(SpecDecodeError, match="repeats question ids"):
        load_workloads("code-edit,code-edit")


def test_cached_layer_rate_counts_a_q4_k_m_files_split_layers(tmp_path, monkeypatch):
    """A Q4_K_M file's q/k/v group holds v in Q6_K, which the int4 runner runs beside int4 q/k
    (a SplitLinear): the roofline counts each row's multiply-adds through all three."""
    from specdecode.bench import roofline
    from specdecode.bench.shapes import Shape, write_shape
    from specdecode.models.llama import LlamaRunner
    from specdecode.models.quant import SplitLinear

    # eight layers: Q4_K_M gives the first one's attn_v Q6_K
    s = Shape("llama", 8, 256, 512, 4, 2, vocab=512, context=512)
    runner = LlamaRunner.from_gguf(write_shape(tmp_path / "km.gguf", s, "Q4_K_M"), "int4")
    assert isinstance(runner.layers[0].qkv, SplitLinear)
    clock = itertools.count()
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(clock) * 1e-3)
    head_dim = s.hidden // s.heads
    macs = (s.hidden * (s.heads + 2 * s.kv_heads) * head_dim + s.heads * head_dim * s.hidden
            + 3 * s.hidden * s.ffn)
    assert roofline.cached_layer_gmacs(runner, 16) == pytest.approx(16 * macs / 1e-3 / 1e9)
