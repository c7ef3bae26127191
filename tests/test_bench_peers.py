"""Peers in processes of their own: a crash, an illegal instruction or an exception in a peer
fails that peer, named with its cause, and the bench keeps everything else. The crashing peers
are fakes (a child that kills itself with SIGSEGV), not a real fault of llama.cpp."""

from __future__ import annotations

import signal
import sys
import textwrap

import pytest

from specdecode.bench import cli as bench_cli
from specdecode.bench.contenders import Outcome
from specdecode.bench.llama_tools import find_tool, parse_llama_bench, parse_llama_perplexity
from specdecode.bench.peer_process import PeerFailed, PeerProcess, describe_exit, run_tool
from test_bench import bench_args, tiny_target

FAKE_PEER = textwrap.dedent('''
    import os
    import signal
    import sys

    print("a C library printing to stdout")  # must not corrupt the answers


    class FakePeer:
        """Answers ``crash_after`` calls, then dies the way it is told to."""

        def __init__(self, crash_after, how="segv"):
            self.calls = 0
            self.crash_after = crash_after
            self.how = how

        def run(self, prompt_ids, max_new_tokens, sampling):
            self.calls += 1
            if self.calls > self.crash_after:
                sys.stderr.write("ggml_compute_forward: about to fail\\n")
                sys.stderr.flush()
                if self.how == "raise":
                    raise ValueError("n_ctx too small")
                os.kill(os.getpid(), signal.SIGSEGV)
            return {"tokens": list(prompt_ids[:max_new_tokens]), "wall_s": 0.01,
                    "target_forwards": 1, "accepted_lengths": None}
''')


@pytest.fixture
def fake_peer_module(tmp_path, monkeypatch):
    (tmp_path / "fake_peer_mod.py").write_text(FAKE_PEER)
    monkeypatch.syspath_prepend(str(tmp_path))  # the child imports with the parent's path
    return "fake_peer_mod:FakePeer"


def test_a_peer_answers_until_it_segfaults_then_fails_with_its_cause(fake_peer_module):
    peer = PeerProcess("fake", fake_peer_module, crash_after=1)
    try:
        assert peer.call("run", [5, 6, 7], 2, {})["tokens"] == [5, 6]
        with pytest.raises(PeerFailed) as failure:
            peer.call("run", [5], 2, {})
    finally:
        peer.close()
    message = str(failure.value)
    assert message.startswith("peer fake failed: killed by SIGSEGV (exit 139 in a shell)")
    assert "last stderr line: ggml_compute_forward: about to fail" in message
    with pytest.raises(PeerFailed, match="closed"):
        peer.call("run", [5], 2, {})


def test_an_exception_in_the_peer_is_a_failure_naming_it(fake_peer_module):
    peer = PeerProcess("fake", fake_peer_module, crash_after=0, how="raise")
    try:
        with pytest.raises(PeerFailed, match="peer fake failed: raised ValueError: n_ctx too small"):
            peer.call("run", [5], 2, {})
    finally:
        peer.close()


def test_a_peer_that_cannot_be_built_fails_at_start():
    with pytest.raises(PeerFailed, match="raised ModuleNotFoundError"):
        PeerProcess("fake", "no_such_module_here:Peer")


def test_a_binary_killed_by_an_illegal_instruction_is_named():
    crash = ("import os, signal, sys; sys.stderr.write('illegal instruction in ggml_vec_dot\\n');"
             " sys.stderr.flush(); os.kill(os.getpid(), signal.SIGILL)")
    with pytest.raises(PeerFailed) as failure:
        run_tool("llama-bench", [sys.executable, "-c", crash])
    assert str(failure.value) == ("peer llama-bench failed: killed by SIGILL (exit 132 in a "
                                  "shell); last stderr line: illegal instruction in ggml_vec_dot")
    assert run_tool("echo", [sys.executable, "-c", "print('fine')"]) == "fine\n"
    with pytest.raises(PeerFailed, match="cannot start"):
        run_tool("nope", ["/nonexistent/llama-bench"])


def test_exit_descriptions():
    assert describe_exit(-signal.SIGSEGV, "") == "killed by SIGSEGV (exit 139 in a shell)"
    assert describe_exit(139, "x") == "exit code 139 (SIGSEGV); last stderr line: x"
    assert describe_exit(1, "") == "exit code 1"


class IsolatedFake:
    """A peer contender over the fake child process, as IsolatedLlamaCpp is over llama.cpp."""

    kind = "peer"

    def __init__(self, factory, crash_after):
        self.name = "fake-peer"
        self.process = PeerProcess(self.name, factory, crash_after=crash_after)

    def unsupported(self, sampling):
        return None

    def fresh(self):
        return self

    def run(self, prompt_ids, max_new_tokens, sampling):
        return Outcome(**self.process.call("run", list(prompt_ids), max_new_tokens, {}))

    def close(self):
        self.process.close()


@pytest.mark.parametrize("crash_after,when", [(0, "in the warm-up"), (3, "after 2 question turns")])
def test_bench_keeps_everything_but_the_peer_that_crashed(tmp_path, tiny_model, monkeypatch,
                                                           fake_peer_module, crash_after, when):
    original = bench_cli.build_contenders

    def with_fake_peer(target, plan, questions):
        contenders, notes = original(target, plan, questions)
        return contenders + [IsolatedFake(fake_peer_module, crash_after)], notes

    monkeypatch.setattr(bench_cli, "build_contenders", with_fake_peer)
    plan = bench_cli.plan(bench_args(tmp_path, "--methods", "ngram", "--peers", "none",
                                     "--max-new-tokens", "8"))
    summary = bench_cli.bench(tiny_target(tiny_model), plan, progress=False)
    assert list(summary["methods"]) == ["ar", "ngram"]
    assert summary["methods"]["ngram"]["overall"]["identical_fraction"] == 1.0
    left_out = summary["meta"]["left out"]
    assert "peer fake-peer failed: killed by SIGSEGV (exit 139 in a shell)" in left_out
    assert when in left_out
    report = (tmp_path / "out" / "report.md").read_text()
    assert "peer fake-peer failed" in report and "| ngram |" in report


def test_llama_cpp_tool_outputs_are_parsed(tmp_path, monkeypatch):
    bench_json = """llama-bench: loading
    [{"n_prompt": 1, "n_gen": 0, "n_depth": 256, "samples_ns": [3000000, 2000000, 9000000]},
     {"n_prompt": 8, "n_gen": 0, "n_depth": 256, "samples_ns": [8000000]},
     {"n_prompt": 0, "n_gen": 32, "n_depth": 256, "samples_ns": [320000000, 400000000, 160000000]}]"""
    parsed = parse_llama_bench(bench_json, (1, 8))
    assert parsed["forward_ms"] == {1: 3.0, 8: 8.0}  # each test's median sample
    assert parsed["decode_tokens_per_s"] == pytest.approx(32 / 0.32)
    with pytest.raises(PeerFailed, match=r"no pp result for \[16\]"):
        parse_llama_bench(bench_json, (1, 8, 16))
    log = ("perplexity: calculating perplexity over 53 chunks, n_ctx=512, batch_size=512\n"
           "[1]22.1,[2]19.3,\nFinal estimate: PPL = 18.7812 +/- 0.41234\n")
    assert parse_llama_perplexity(log) == {"perplexity": 18.7812, "plus_minus": 0.41234,
                                           "chunks": 53}
    with pytest.raises(PeerFailed, match="no 'Final estimate'"):
        parse_llama_perplexity("main: error: unable to load model\n")
    tool = tmp_path / "build" / "bin" / "llama-bench"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.delenv("SPECDECODE_LLAMA_CPP", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert find_tool("llama-bench", str(tmp_path)) == tool
    assert find_tool("llama-bench") is None
    monkeypatch.setenv("SPECDECODE_LLAMA_CPP", str(tmp_path / "build"))
    assert find_tool("llama-bench") == tool
