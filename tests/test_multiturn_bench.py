"""The multi-turn bench (scripts/multiturn_bench.py): its agent's tools, the history it sends,
and one small run against our server with and without the prompt cache (real processes)."""

from __future__ import annotations

import json

import pytest

from specdecode.bench import multiturn
from specdecode.bench.multiturn_workloads import PROJECT, conversations


def test_the_agents_tools_read_and_write_the_project():
    agent = conversations(["agent"], 0)[0]
    assert agent.run_tool("read_file", '{"path": "stats.py"}') == PROJECT["stats.py"]
    assert agent.run_tool("write_file", '{"path": "new.py", "content": "x = 1\\n"}') == \
        "wrote 6 characters to new.py"
    assert agent.run_tool("read_file", '{"path": "new.py"}') == "x = 1\n"
    assert agent.run_tool("read_file", '{"path": "gone.py"}') == "error: no file gone.py"
    assert agent.run_tool("read_file", "{not json").startswith("error: bad arguments")
    assert agent.run_tool("delete_file", '{"path": "stats.py"}') == "error: no tool delete_file"
    assert "new.py" not in conversations(["agent"], 0)[0].files  # each run starts afresh


def test_an_answer_with_calls_enters_the_history_as_openai_sends_it():
    answer = {"text": "", "tool_calls": [{"id": "", "name": "read_file",
                                          "arguments": '{"path": "stats.py"}'}]}
    assert multiturn.assistant_message(answer) == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_0", "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "stats.py"}'}}]}
    assert multiturn.assistant_message({"text": "Done.", "tool_calls": []}) == \
        {"role": "assistant", "content": "Done."}


def test_the_two_servers_answers_are_compared_by_name_and_arguments():
    call = {"id": "call_a", "name": "read_file", "arguments": "{}"}
    ours = {"conversation": "c", "request": 1, "text": "", "tool_calls": [call]}
    records = [dict(ours, server=multiturn.CACHED),
               dict(ours, server=multiturn.UNCACHED, tool_calls=[dict(call, id="call_b")])]
    assert multiturn.compare_answers(records) == []
    records[1]["text"] = "other"
    assert multiturn.compare_answers(records) == ["c request 1"]


@pytest.mark.slow
def test_a_small_run_against_our_server_with_and_without_the_cache(tmp_path):
    out = tmp_path / "multiturn"
    status = multiturn.main(["--model", "smollm2", "--servers", "specdecode,specdecode-no-cache",
                             "--workloads", "chat,mt-bench", "--mt-bench", "1",
                             "--max-tokens", "8", "--out", str(out)])
    records = json.loads((out / "multiturn.json").read_text())["records"]
    assert status == 0
    cached = [r for r in records if r["server"] == "specdecode"]
    uncached = [r for r in records if r["server"] == "specdecode-no-cache"]
    assert len(cached) == len(uncached) == 8  # six chat turns, two MT-bench turns
    assert all(r["cached_tokens"] > 0 for r in cached if r["request"] > 0)
    assert all(r["cached_tokens"] == 0 for r in uncached)
    assert all(r["new_tokens"] == r["prompt_tokens"] - r["cached_tokens"] and
               r["reference_prompt_s"] > 0 for r in cached)
    assert "identical on every request" in (out / "multiturn.md").read_text()
