"""The serving benchmark (scripts/serving_bench.py, specdecode/bench/serving*.py): workloads,
percentiles, mismatch counting, the report and the targets, without a server; the openai clients
(mixed streams, hang-ups, time limit) against the real server on loopback with a tiny model;
and (slow) one small sweep against `specdecode serve` in its own process."""

from __future__ import annotations

import json

import pytest

from specdecode.bench import serving
from specdecode.bench.code_edit import FUNCTIONS, INSTRUCTION
from specdecode.questions import Question
from specdecode.bench.multiturn_workloads import TOOLS
from specdecode.bench.serving_client import Batch, Outcome, ToolCallText, run_batch
from specdecode.bench.serving_report import (identical, markdown, mismatches, percentile,
                                             problems, summarize, targets)
from specdecode.bench.serving_servers import LLAMA_SERVER, OURS, ServerSpec, command
from specdecode.bench.serving_workloads import (AGENT_FUNCTIONS, AGENT_TASKS, Request,
                                                agent_system, build_workload,
                                                interleave_tasks, sampling_of)
from specdecode.errors import SpecDecodeError


def questions() -> list[Question]:
    """Three tasks of uneven sizes, in file order (MT-bench categories map to mt_bench)."""
    rows = [(1, "writing"), (2, "writing"), (3, "qa"), (4, "translation"), (5, "qa"),
            (6, "coding"), (7, "qa")]
    return [Question(qid, cat, (f"question {qid}", "a second turn")) for qid, cat in rows]


def test_spec_bench_requests_take_tasks_in_turn_and_first_turns_only():
    qs = questions()
    # Spec-Bench's order: mt_bench, translation, ..., qa; each task in file order
    assert [q.question_id for q in interleave_tasks(qs)] == [1, 4, 3, 2, 5, 6, 7]
    requests = build_workload("spec-bench", 4, qs)
    assert [r.index for r in requests] == [0, 1, 2, 3]
    assert [r.prompt for r in requests] == ["question 1", "question 4", "question 3",
                                            "question 2"]
    assert requests[1].source == "translation #4"
    assert requests[0].messages() == [{"role": "user", "content": "question 1"}]
    # every other request streams
    assert [r.streamed for r in requests] == [False, True, False, True]


def test_code_edit_requests_are_one_instruction_over_distinct_functions():
    requests = build_workload("code-edit", 64)
    assert len({r.prompt for r in requests}) == 64
    assert requests[2].prompt == INSTRUCTION.format(code=FUNCTIONS[2])
    assert requests[2].source == "def is_even(n):"


def test_agent_requests_share_their_system_prompt_and_tools_and_differ_in_their_task():
    requests = build_workload("agent", AGENT_FUNCTIONS * len(AGENT_TASKS))
    assert len({r.prompt for r in requests}) == len(requests)
    assert {r.system for r in requests} == {agent_system()}
    assert all(r.tools == tuple(TOOLS) for r in requests)
    assert all(FUNCTIONS[i] in agent_system() for i in range(AGENT_FUNCTIONS))
    # the tasks in turn, each over every function of the module once
    assert [r.prompt.split()[0] for r in requests[:4]] == ["What", "Add", "Write", "Does"]
    assert requests[1].prompt == AGENT_TASKS[1].format(name="count_words")
    assert requests[1].source == FUNCTIONS[5].splitlines()[0]
    named = [(r.prompt.split()[0], r.source) for r in requests]
    assert len(set(named)) == len(requests)
    assert requests[0].messages() == [{"role": "system", "content": agent_system()},
                                      {"role": "user", "content": requests[0].prompt}]


def test_tool_calls_are_recorded_alike_streamed_and_whole():
    from types import SimpleNamespace as Delta

    def call(name=None, arguments=None):
        return Delta(function=Delta(name=name, arguments=arguments))

    calls = ToolCallText()
    deltas = [Delta(content="", tool_calls=[call("read_file", "")]),
              Delta(content=None, tool_calls=[call(None, '{"path": ')]),
              Delta(content=None, tool_calls=[call(None, '"a.py"}')]),
              Delta(content=None, tool_calls=[call("write_file", '{}')]),
              Delta(content=None, tool_calls=None)]
    text = "".join(calls.piece(d) for d in deltas) + calls.close()
    assert text == '<call read_file {"path": "a.py"}><call write_file {}>'
    assert ToolCallText().close() == ""
    # a whole message: the same text as its stream
    whole = ToolCallText()
    message = Delta(content=None, tool_calls=[call("read_file", '{"path": "a.py"}'),
                                              call("write_file", "{}")])
    assert whole.piece(message) + whole.close() == text


@pytest.mark.parametrize("name, count, message", [
    ("code-edit", 65, "more than the 64 code-edit functions"),
    ("spec-bench", 8, "more than the 7 questions"),
    ("chat", 2, "unknown workload 'chat'"),
    ("code-edit", 0, "--requests must be positive"),
    ("agent", 65, "more than the 64 agent tasks"),
])
def test_bad_workloads_are_refused(name, count, message):
    with pytest.raises(SpecDecodeError, match=message):
        build_workload(name, count, questions())


def test_seeded_sampling_seeds_each_request_and_turns_off_llama_filters():
    assert sampling_of("greedy", 5).fields(3) == {"temperature": 0.0}
    fields = sampling_of("seeded", 5).fields(3)
    assert fields["seed"] == 8 and fields["temperature"] == 0.7 and fields["top_p"] == 1.0
    # llama-server's defaults (top-k 40, min-p 0.05) would sample another distribution
    assert fields["extra_body"] == {"top_k": 0, "min_p": 0.0}
    with pytest.raises(SpecDecodeError, match="unknown sampling"):
        sampling_of("beam", 0)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(20, 0, -1)]  # 20..1, unsorted
    assert percentile(values, 0.5) == 10.0 and percentile(values, 0.95) == 19.0
    assert percentile([3.0], 0.95) == 3.0 and percentile([], 0.5) is None


def outcome(index, text="a", finish="length", stream=False, **kw) -> Outcome:
    return Outcome(index, stream, text=text, finish_reason=finish, response_id=f"id{index}",
                   **kw)


def test_mismatches_compare_text_and_finish_reason_of_complete_answers_only():
    refs = {i: outcome(i, text=f"ref {i}") for i in range(5)}
    refs[4] = outcome(4, error="boom")  # no usable reference: not counted as a mismatch
    got = [outcome(0, text="ref 0"),                  # equal
           outcome(1, text="other"),                  # text differs
           outcome(2, text="ref 2", finish="stop"),   # finish reason differs
           outcome(3, text="", error="timeout"),      # an error, reported elsewhere
           outcome(4, text="x")]
    assert mismatches(got, refs) == [1, 2]
    # a client that hung up has no whole answer to compare
    assert mismatches([outcome(1, text="r", disconnected=True)], refs) == []


def test_problems_find_lost_repeated_duplicate_and_failed_responses():
    ok = [outcome(0), outcome(1)]
    assert problems(ok, [0, 1]) == []
    assert "1 outcomes for 2 requests" in problems(ok[:1], [0, 1])[0]
    twice = [outcome(0), outcome(0)]
    found = problems(twice, [0, 1])
    assert any("lost or repeated" in p for p in found)
    assert any("1 duplicate response ids" in p for p in found)
    assert problems([outcome(0), outcome(1, error="HTTP 500")], [0, 1]) == \
        ["request 1: HTTP 500"]


def test_summary_counts_completion_tokens_over_the_wall_time():
    outcomes = [outcome(i, completion_tokens=10, latency_s=float(i + 1), stream=i % 2 == 1,
                        ttft_s=0.1 * (i + 1) if i % 2 else None) for i in range(4)]
    outcomes.append(outcome(4, error="time limit reached first", completion_tokens=0))
    summary = summarize(Batch(outcomes, wall_s=8.0), {i: outcome(i) for i in range(5)})
    assert summary["completed"] == 4 and summary["errors"] == 1
    assert summary["completion_tokens"] == 40 and summary["tokens_per_s"] == 5.0
    assert (summary["p50_latency_s"], summary["p95_latency_s"]) == (2.0, 4.0)
    assert (summary["ttft_p50_s"], summary["ttft_p95_s"]) == (0.2, 0.4)  # streamed ones
    assert summary["mismatches"] == 0 and summary["problems"] == \
        ["request 4: time limit reached first"]
    # the reference batch has no mismatch count
    assert summarize(Batch(outcomes[:4], 8.0), None)["mismatches"] is None


def test_identical_counts_requests_complete_in_both():
    a = [outcome(0, "x"), outcome(1, "y"), outcome(2, "z", error="e")]
    b = [outcome(0, "x"), outcome(1, "other"), outcome(2, "z")]
    assert identical(a, b) == (1, 2)


def cell(server, clients, tps, sampling="greedy", mism=0, **extra):
    return {"server": server, "workload": "code-edit", "sampling": sampling,
            "concurrency": clients, "tokens_per_s": tps, "p50_latency_s": 1.0,
            "p95_latency_s": 2.0, "ttft_p50_s": None, "completed": 4, "errors": 0,
            "mismatches": None if clients == 1 else mism, "problems": [], **extra}


def test_report_table_has_a_row_per_cell_with_the_gain_over_one_client():
    cells = [cell("specdecode ar", 1, 50.0, peak_rss_mb=300.4),
             cell("specdecode ar", 16, 210.0),
             cell("llama-server", 16, 150.0, mism=6),
             {"server": "llama-server", "workload": "code-edit", "sampling": "greedy",
              "concurrency": 64, "skipped": "failed: no"}]
    cells[1]["disconnect"] = {"hung_up": 4, "others": 12, "others_correct": 12,
                              "busy_after": 0, "resent": 4, "resent_correct": 4,
                              "server_outcomes": "cancelled 4, length 28"}
    text = markdown({"command": "python scripts/serving_bench.py"}, cells, ["a check"])
    rows = [line for line in text.splitlines() if line.startswith("| specdecode ar |")
            or line.startswith("| llama-server |")]
    header = next(line for line in text.splitlines() if line.startswith("| server | workload"))
    assert all(r.count("|") == header.count("|") for r in rows[:4])
    assert "| 1 | 50.0 | 1.00x |" in rows[0] and "reference" in rows[0] and "300 MiB" in rows[0]
    assert "| 16 | 210.0 | 4.20x |" in rows[1] and "| 0/4 |" in rows[1]
    # llama-server has no one-client cell here: no gain to show; its mismatches are shown
    assert "| 16 | 150.0 | - |" in rows[2] and "| 6/4 |" in rows[2]
    assert "skipped: failed: no" in rows[3]
    assert "| specdecode ar | code-edit | 16 | 4 | 12/12 | 0 | 4/4 | cancelled 4, length 28 |" \
        in text
    assert "- a check" in text and "- command: python scripts/serving_bench.py" in text


def test_targets_are_checked_where_the_cells_exist():
    cells = [cell("specdecode ar", 1, 50.0), cell("specdecode ar", 16, 150.0),
             cell("specdecode suffix", 1, 80.0), cell("specdecode suffix", 16, 400.0),
             cell("llama-server", 16, 200.0)]
    found = targets(cells, "specdecode suffix", "specdecode ar", LLAMA_SERVER)
    assert "specdecode ar, code-edit, greedy: 16 clients give 3.00x one client (NOT met: " \
           "at least 4x)" in found
    assert "specdecode suffix, code-edit, greedy: 16 clients give 5.00x one client (met: " \
           "at least 4x)" in found
    assert any("specdecode suffix 400.0 vs specdecode ar 150.0" in a and "(met" in a
               for a in found)
    assert any("specdecode ar 150.0 vs llama-server 200.0" in a and "NOT met" in a
               for a in found)
    # one client: no llama-server cell, no comparison with it
    assert not any("1 client:" in a and "llama-server" in a for a in found)


def test_server_commands_give_both_servers_the_same_slots_threads_and_context(tmp_path):
    gguf, binary = tmp_path / "m.gguf", tmp_path / "llama-server"
    ours = command(ServerSpec(OURS, "ar", ("--runner", "native")), 9000, 16, 2048, 2,
                   "smollm2", gguf, None)
    assert ours[ours.index("--parallel") + 1] == "16"
    assert ours[ours.index("--max-context") + 1] == "2048"
    assert ours[ours.index("--method") + 1] == "ar" and ours[-2:] == ["--runner", "native"]
    llama = command(ServerSpec(LLAMA_SERVER), 9001, 16, 2048, 2, "smollm2", gguf, binary)
    assert llama[0] == str(binary) and llama[llama.index("-m") + 1] == str(gguf)
    assert llama[llama.index("--parallel") + 1] == "16"
    assert llama[llama.index("-c") + 1] == str(16 * 2048)  # split among its 16 slots
    assert llama[llama.index("-t") + 1] == llama[llama.index("-tb") + 1] == "2"
    # its slots' prompt cache, as ours keeps its own; the model's template (tools need it)
    assert "--cache-prompt" in llama and "--jinja" in llama


def test_bad_sweep_options_fail_before_any_server_starts(tmp_path, capsys):
    base = ["--out", str(tmp_path / "out"), "--servers", "ar"]
    for extra, message in [
        (["--concurrency", "1,x"], "comma-separated integers"),
        (["--concurrency", "0,4"], "must be >= 1"),
        (["--servers", "ar,nosuch"], "nosuch"),
        (["--servers", "ar,ar"], "repeats a server"),
        (["--samplings", "beam"], "--samplings takes names"),
        (["--requests", "8", "--concurrency", "16"], "fewer than the largest concurrency"),
        (["--max-tokens", "0"], "--max-tokens must be positive"),
        (["--disconnect-clients", "3"], "is not one of --concurrency"),
    ]:
        assert serving.main(base + extra) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_slot_context_fits_the_longest_prompt_and_the_answer():
    class Tokenizer:  # a token a character, 10 for the template, 100 a tool
        def apply_chat_template(self, messages, tools, add_generation_prompt):
            return [0] * (sum(len(m["content"]) for m in messages) + 10 + 100 * len(tools or ()))

    workloads = {"w": [Request(0, "w", "s", "x" * 100), Request(1, "w", "s", "x" * 300)]}
    # 310 prompt tokens + 64 answer + 64 margin = 438 -> 512
    assert serving.slot_context(Tokenizer(), workloads, 64, 8192) == 512
    with pytest.raises(SpecDecodeError, match="more than the model's 256"):
        serving.slot_context(Tokenizer(), workloads, 64, 256)
    # the system prompt and the tools count: 100 + 50 + 10 + 200 + 64 + 64 = 488 -> 512
    tooled = {"w": [Request(0, "w", "s", "x" * 100, "y" * 50, ({}, {}))]}
    assert serving.slot_context(Tokenizer(), tooled, 64, 8192) == 512
    assert serving.slot_context(Tokenizer(), tooled, 100, 8192) == 768


# ---- the clients against a real server (tiny model, in this process) ------------------------

@pytest.fixture(scope="module")
def served():
    from tiny_server import build_tokenizer, make_server
    from tiny_models import tiny_llama

    tokenizer = build_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, max_positions=256, seed=1)
    with make_server(model, tokenizer, parallel=2, max_queue=16, method="ar") as server:
        yield server


def requests_of(n: int) -> list[Request]:
    prompts = ["The quick brown fox", "Hello world!", "def add(a, b):", "How are you?"]
    return [Request(i, "test", "t", prompts[i % len(prompts)]) for i in range(n)]


def test_a_batch_mixes_streams_and_equals_its_solo_answers(served):
    from tiny_server import MODEL

    requests = requests_of(6)
    for sampling in (sampling_of("greedy", 0), sampling_of("seeded", 3)):
        solo = run_batch(served.url, MODEL, requests, sampling, 12, 1, 120)
        loaded = run_batch(served.url, MODEL, requests, sampling, 12, 3, 120)
        refs = {o.index: o for o in solo.outcomes}
        summary = summarize(loaded, refs)
        assert summary["problems"] == [] and summary["completed"] == 6
        assert summary["mismatches"] == 0
        assert summary["completion_tokens"] == sum(o.completion_tokens for o in solo.outcomes)
        assert all(o.completion_tokens > 0 for o in loaded.outcomes)
        streamed = [o for o in loaded.outcomes if o.stream]
        assert [o.index for o in streamed] == [1, 3, 5]
        assert all(o.ttft_s is not None and 0 < o.ttft_s <= o.latency_s for o in streamed)


def test_clients_that_hang_up_leave_nothing_stuck():
    from test_server import SlowRunner
    from tiny_server import MODEL, build_tokenizer, make_server
    from tiny_models import tiny_llama

    tokenizer = build_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, max_positions=256, seed=1)
    # 20 ms a forward: the hang-up reaches the server long before the answer's 30 tokens
    with make_server(model, tokenizer, runners=[SlowRunner(model), SlowRunner(model)],
                     method="ar") as served:
        requests = requests_of(2)
        refs = {o.index: o for o in run_batch(served.url, MODEL, requests,
                                              sampling_of("greedy", 0), 30, 1, 120).outcomes}
        result = serving.disconnect_test(served.url, OURS, MODEL, requests, refs, 30, 2, 120)
    assert result["hung_up"] == 1  # request 1: streamed and index % 4 == 1
    assert result["others_correct"] == result["others"] == 1
    assert result["busy_after"] == 0 and result["busy_at_end"] == 0
    assert result["resent_correct"] == result["resent"] == 1
    assert "cancelled 1" in result["server_outcomes"] and result["errors"] == []


def test_a_batch_past_its_time_limit_records_errors_not_hangs(served):
    from tiny_server import MODEL

    batch = run_batch(served.url, MODEL, requests_of(4), sampling_of("greedy", 0), 200, 1,
                      time_limit=0.05)
    assert len(batch.outcomes) == 4 and batch.wall_s < 30
    assert any(o.error for o in batch.outcomes)
    assert problems(batch.outcomes, [0, 1, 2, 3])


# ---- one small sweep against `specdecode serve` in its own process (real model) -------------

@pytest.mark.slow
def test_small_sweep_against_our_server_process(tmp_path):
    out = tmp_path / "serving"
    # the CI model (the bench's default, the 1.5B, is installed by hand)
    status = serving.main(["--model", "smollm2", "--servers", "ar", "--workloads", "code-edit",
                           "--samplings", "greedy", "--concurrency", "1,2", "--requests", "2",
                           "--max-tokens", "8", "--out", str(out)])
    data = json.loads((out / "serving.json").read_text())
    assert status == 0, data
    cells = data["cells"]
    assert [(c["concurrency"], c["completed"]) for c in cells] == [(1, 2), (2, 2)]
    assert cells[1]["mismatches"] == 0 and cells[1]["disconnect"]["busy_after"] == 0
    assert all(c["tokens_per_s"] > 0 and c["peak_rss_mb"] > 0 for c in cells)
    assert "| specdecode ar | code-edit | greedy | 2 |" in (out / "serving.md").read_text()
    assert len((out / "responses.jsonl").read_text().splitlines()) == 4


def test_only_our_servers_wrong_answers_fail_the_run():
    ours_wrong = cell("specdecode ar", 4, 10.0, mism=1)
    llama_wrong = cell("llama-server", 4, 10.0, mism=3)
    assert serving.failed([llama_wrong]) == []
    assert serving.failed([ours_wrong]) == \
        ["specdecode ar code-edit greedy x4: 1 answers differ from their solo answers"]
    crashed = {"server": "specdecode ar", "workload": "code-edit", "sampling": "greedy",
               "concurrency": 4, "skipped": "failed: the server exited with status 1"}
    late = dict(crashed, skipped="the run's --time-limit was reached")
    assert serving.failed([crashed, late]) == \
        ["specdecode ar code-edit greedy x4: failed: the server exited with status 1"]
    stuck = cell("specdecode ar", 4, 10.0, disconnect={
        "others": 3, "others_correct": 3, "resent": 1, "resent_correct": 1, "busy_after": 2,
        "errors": []})
    assert "the hang-up test failed" in serving.failed([stuck])[0]


def test_an_interrupted_run_still_reports_the_cells_it_measured():
    cells = [cell("specdecode ar", 1, 50.0),
             {"server": "specdecode ar", "workload": "code-edit", "sampling": "greedy",
              "concurrency": 4, "skipped": "the run was interrupted here"},
             {"server": "specdecode ar", "workload": "code-edit", "sampling": "greedy",
              "concurrency": 16}]  # never reached
    text = markdown({}, cells, [])
    assert "| 4 | skipped: the run was interrupted here |" in text
    assert "| 16 | skipped: not run |" in text
    assert targets(cells, "specdecode suffix", "specdecode ar", LLAMA_SERVER) == []
