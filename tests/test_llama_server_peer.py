"""The llama-server peers of ``specdecode bench`` (bench/llama_server_peer.py), against a
stand-in llama-server: a small HTTP server that answers /health and /completion as
llama-server does and records the arguments it was started with."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from specdecode.bench import cli as bench_cli
from specdecode.bench.llama_server_peer import LlamaServerPeer, _lengths
from specdecode.errors import SpecDecodeError
from specdecode.sampling import GREEDY, SamplingParams

FAKE = textwrap.dedent('''\
    #!{python}
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    open({log!r}, "a").write(json.dumps(argv) + "\\n")
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            open({log!r}, "a").write(json.dumps(body) + "\\n")
            n = body["n_predict"]
            reply = {{"tokens": [7, 8, 9, 10, 11, 12][:n],
                     "timings": {{"draft_n": 6, "draft_n_accepted": 3, "prompt_ms": 42.5}}}}
            data = json.dumps(reply).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(data)))
            self.end_headers(); self.wfile.write(data)
    HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
    ''')


@pytest.fixture
def fake_server(tmp_path):
    log = tmp_path / "calls.jsonl"
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE.format(python=sys.executable, log=str(log)))
    binary.chmod(0o755)
    return binary, log


def calls(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_configuration_runs_as_llama_server_does(fake_server, tmp_path):
    binary, log = fake_server
    peer = LlamaServerPeer("llama-server-draft", binary, tmp_path / "m.gguf", eos=[10],
                           context=512, draft=tmp_path / "d.gguf")
    try:
        out = peer.run([1, 2, 3], 5, SamplingParams(temperature=0.7, seed=2**40 + 3))
    finally:
        peer.close()
    argv, body = calls(log)
    assert argv[argv.index("-md") + 1] == str(tmp_path / "d.gguf")
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    assert argv[argv.index("-c") + 1] == "512" and "--no-cache-prompt" in argv
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 5
    assert body["temperature"] == 0.7 and body["seed"] == 3 and body["cache_prompt"] is False
    assert out.tokens == [7, 8, 9, 10]  # cut after the end-of-sequence id, kept
    # 3 decoded tokens, 3 accepted drafts: one verify step committed all three
    assert out.accepted_lengths == [3] and out.target_forwards == 2 and out.draft_tokens == 6
    assert out.prefill_s == 0.0425  # its own seconds on the prompt


def test_greedy_is_temperature_zero_and_plain_has_no_speculation(fake_server, tmp_path):
    binary, log = fake_server
    peer = LlamaServerPeer("llama-server", binary, tmp_path / "m.gguf", eos=[], context=256)
    try:
        peer.run([4], 6, GREEDY)
    finally:
        peer.close()
    argv, body = calls(log)
    assert "--spec-type" not in argv and body["temperature"] == 0.0 and "seed" not in body


def test_lengths_sum_to_the_decoded_tokens():
    assert _lengths(10, 4) == [3, 3, 2, 2] and _lengths(0, 0) == []


def test_a_named_server_peer_needs_llama_server(tmp_path, monkeypatch):
    from test_bench import bench_args

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SPECDECODE_LLAMA_CPP", raising=False)
    with pytest.raises(SpecDecodeError, match="need llama-server"):
        bench_cli.plan(bench_args(tmp_path, "--peers", "llama-server-ngram"))
