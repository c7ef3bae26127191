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
from specdecode.bench.datasets import load_questions, sample_per_task
from specdecode.bench.metrics import FIELDS
from specdecode.bench.runner import Target
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.models.hf import HFRunner


class ToyTokenizer:
    """Characters <-> ids 4..95 and a chat template, enough for the harness on tiny_llama."""

    chat_template = "toy"

    def encode(self, text):
        return [4 + ord(c) % 92 for c in text]

    def __call__(self, text):
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
    # every registered method runs, or is left out with its reason (e.g. an untrained draft)
    names = list(summary["methods"])
    assert names[0] == "ar" and names[-2:] == ["hf", "hf-pld"]
    for name in registry.names():
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


def record(method, kind, task, qid, tokens, wall, steps, identical, forwards=None,
           drafted=None, propose_s=None):
    return {"method": method, "kind": kind, "task": task, "question_id": qid, "turn": 0,
            "new_tokens": tokens, "wall_s": wall, "accepted_lengths": steps,
            "target_forwards": forwards if forwards is not None else 1 + len(steps),
            "identical_to_ar": identical, "draft_tokens": drafted, "propose_s": propose_s}


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


@pytest.fixture(scope="module", params=["greedy", "sampled"])
def ngram_run(request, tmp_path_factory, tiny_model):
    """ar and ngram, 32 tokens, no end-of-sequence id (the engine would walk a draft past it,
    where a recording is silent)."""
    tmp = tmp_path_factory.mktemp(request.param)
    # greedy also checks repeats: two passes, new proposers each
    extra = ["--temperature", "0.9"] if request.param == "sampled" else ["--repeats", "2"]
    plan = bench_cli.plan(bench_args(tmp, "--methods", "ngram", "--peers", "none",
                                     "--max-new-tokens", "32", *extra))
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
    from specdecode.bench import runners
    from specdecode.models.loading import LoadedModel, make_runner, tiny_llama

    model = tiny_llama(hidden_size=64, seed=0)
    runner = make_runner(LoadedModel(model, ToyTokenizer(), "tiny"), "native", "int4")
    clock = itertools.count()  # every timed call of the four layers takes one tick, 1 ms
    monkeypatch.setattr(runners.time, "perf_counter", lambda: next(clock) * 1e-3)
    rate = runners.cached_layer_gmacs(runner, 16)
    assert rate == pytest.approx(16 * layer_macs(model.config) / 1e-3 / 1e9)


def test_runner_measurement_on_a_tiny_model(tmp_path):
    from specdecode.bench.runners import FORWARD_SIZES, measure_runners, runners_markdown
    from specdecode.models.loading import LoadedModel
    from specdecode.models.quant import WEIGHT_FORMATS

    questions = load_questions(write_questions(tmp_path / "q.jsonl"))
    from specdecode.models.loading import tiny_llama

    # int4 groups need input sizes divisible by 32
    loaded = LoadedModel(tiny_llama(hidden_size=64, seed=0), ToyTokenizer(), "tiny")
    result = measure_runners(loaded, loaded.tokenizer, [2], questions, None, context=24,
                             max_new_tokens=6, progress=lambda _: None)
    runners = ["hf (fp32)"] + [f"native {fmt}" for fmt in WEIGHT_FORMATS]
    assert list(result["forward_ms"]) == runners  # no GGUF file: no llama.cpp row
    for row in result["forward_ms"].values():
        assert [int(k) for k in row] == list(FORWARD_SIZES) and all(v > 0 for v in row.values())
    assert list(result["ar"]) == runners + ["transformers generate"]
    assert result["ar"]["native fp32"]["identical_to_native_fp32"] == len(questions)
    assert all(row["new_tokens"] > 0 and row["tokens_per_s"] > 0 for row in result["ar"].values())
    report = runners_markdown(result, {"machine": "test"})
    assert "| native int4 |" in report and "| transformers generate |" in report
    if kernels.isa() == kernels.ISA_LEVELS.index("avx512"):
        c = loaded.model.config
        expected = c.num_hidden_layers * layer_macs(c) + c.vocab_size * c.hidden_size
        assert result["roofline"]["macs_per_row"] == expected
        roofline = result["roofline"]
        assert roofline["peak_gmacs"] > 1
        # the kernel's mix, and the kernel itself, run the same VPDPBUSD with more work beside
        # them, so neither can pass the peak (a quarter more allowed: each is timed apart on a
        # shared machine)
        assert 1 < roofline["q4_mix_gmacs"] < 1.25 * roofline["peak_gmacs"]
        for size in FORWARD_SIZES:
            assert roofline["cached_layer_gmacs"][str(size)] < 1.25 * roofline["peak_gmacs"]
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
