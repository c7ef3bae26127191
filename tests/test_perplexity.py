"""``bench --perplexity``: llama-perplexity's windows and scoring rule, checked against the
transformers model's own logits on a tiny random model, and the command end to end with a
stand-in for llama-perplexity."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.bench import perplexity as ppl
from specdecode.questions import Question
from specdecode.bench.runner_set import RunnerSet
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel, make_runner
from test_bench import ToyTokenizer


def reference_nll(model, window, bos):
    """The second half's negative log-likelihood from one transformers forward of the window."""
    w = list(window)
    if bos is not None:
        w[0] = bos
    first = len(w) // 2
    with torch.no_grad():
        logits = model(torch.tensor([w])).logits[0].double()  # [n, V]
    logp = torch.log_softmax(logits, -1)
    return -sum(logp[i, w[i + 1]].item() for i in range(first, len(w) - 1)), len(w) - 1 - first


def test_windows_follow_llama_perplexity():
    tokens = list(range(2050))
    parts = ppl.windows(tokens, 512)
    assert [p[0] for p in parts] == [0, 512, 1024, 1536] and all(len(p) == 512 for p in parts)
    assert len(ppl.windows(tokens, 512, chunks=2)) == 2
    with pytest.raises(SpecDecodeError, match="needs at least 1024"):
        ppl.windows(tokens[:1023], 512)
    assert ppl.tokenize(ToyTokenizer(), "ab", bos=1) == [1] + ToyTokenizer().encode("ab")
    assert ppl.tokenize(ToyTokenizer(), "ab", bos=None) == ToyTokenizer().encode("ab")
    questions = [Question(1, "summarization", ("Summarize: An article.",)),
                 Question(2, "qa", ("Who?",)), Question(3, "summarization", ("Summarize: B.",))]
    assert ppl.articles(questions) == "An article.\n\nB.\n"
    with pytest.raises(SpecDecodeError, match="no summarization questions"):
        ppl.articles(questions[1:2])


@pytest.mark.parametrize("weights,bos", [("fp32", None), ("fp32", 1), ("int4", None)])
def test_native_perplexity_matches_the_models_own_logits(tiny_model, monkeypatch, weights, bos):
    from tiny_models import tiny_llama

    model = tiny_model if weights == "fp32" else tiny_llama(hidden_size=64, seed=0)
    runner = make_runner(LoadedModel(model, ToyTokenizer(), "tiny"), "native", weights)
    monkeypatch.setattr(ppl, "FORWARD_ROWS", 5)  # several verify forwards per window
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.config.vocab_size, (70,), generator=generator).tolist()
    result = ppl.perplexity(runner, tokens, 32, bos)
    assert (result["windows"], result["tokens_scored"]) == (2, 2 * 15)
    nll = [reference_nll(model, tokens[i * 32:(i + 1) * 32], bos) for i in range(2)]
    expected = sum(n for n, _ in nll) / sum(c for _, c in nll)
    # fp32: the same function up to the order of float additions; int4 weights move it further
    tolerance = 1e-4 if weights == "fp32" else 0.05
    assert result["nll"] == pytest.approx(expected, rel=tolerance)
    assert result["perplexity"] == pytest.approx(math.exp(result["nll"]))


def test_perplexity_command_beside_a_stand_in_for_llama_perplexity(tmp_path, tiny_model,
                                                                  monkeypatch, capsys):
    runner = make_runner(LoadedModel(tiny_model, ToyTokenizer(), "tiny"), "native", "fp32")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"")

    def build(model, weights, gguf_path, with_hf=True, say=print):
        assert not with_hf and weights == "fp32"
        return RunnerSet({"native fp32": runner}, ToyTokenizer(), [2], gguf_path=gguf)

    monkeypatch.setattr("specdecode.bench.runner_set.build", build)
    monkeypatch.setattr("specdecode.bench.cli.gguf_path_for", lambda model: gguf)
    tool = tmp_path / "llama-perplexity"
    tool.write_text("#!/bin/sh\necho 'perplexity: calculating perplexity over 3 chunks, n_ctx=16'"
                    "\necho 'Final estimate: PPL = 50.0000 +/- 1.0' >&2\n")
    tool.chmod(0o755)
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 2)
    out = tmp_path / "out"
    assert main(["bench", "--perplexity", "--weights", "fp32", "--context", "16", "--text",
                 str(text), "--llama-cpp", str(tmp_path), "--out", str(out), "--no-progress"]) == 0
    report = (out / "perplexity.md").read_text()
    native = ppl.perplexity(runner, ToyTokenizer().encode(text.read_text()), 16, None)
    assert f"| native fp32 | {native['perplexity']:.4f} | 6 | {native['perplexity'] / 50:.4f} |" in report
    assert "| llama-perplexity | 50.0000 | 3 | 1.0000 |" in report
    assert (out / "perplexity-text.txt").read_text() == text.read_text()
    assert f"-f {out / 'perplexity-text.txt'} -c 16" in report
    capsys.readouterr()
