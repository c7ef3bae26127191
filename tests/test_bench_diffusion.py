"""``specdecode bench --diffusion`` (bench/diffusion.py) on a tiny random model: the contenders'
rows, the reference's identities, the files it writes, and its refusals."""

from __future__ import annotations

import json

import pytest

from specdecode.bench import diffusion
from specdecode.questions import Question
from specdecode.diffusion.model import DiffusionModel
from specdecode.errors import SpecDecodeError
from specdecode.models.llama import LlamaRunner

from test_diffusion import MASK, ByteTokenizer, sharp_llama
from test_structured_output import EOS

QUESTIONS = [Question(1, "writing", ("hello there",)),
             Question(2, "math_reasoning", ("what is two and three",), ("so #### 5",))]


def test_the_table_puts_the_policies_beside_ar_and_suffix(tmp_path):
    runner = LlamaRunner.from_transformers(sharp_llama())
    policies = diffusion.parse_policies("freedave,threshold:threshold=0.3")
    measured = diffusion.run_contenders(DiffusionModel(runner, MASK), runner, ByteTokenizer(),
                                        [EOS], policies, QUESTIONS, 12, 4)
    assert list(measured) == ["ar", "suffix", "one_per_step", "freedave",
                              "threshold:threshold=0.3"]
    rows = diffusion.summarize(measured, QUESTIONS, ByteTokenizer().decode)
    # suffix is exact: ar's tokens; freedave is exact to the reference, in fewer steps
    assert rows["suffix"]["agrees_ar"] == 1.0 and rows["ar"]["steps_per_token"] == 1.0
    assert rows["freedave"]["agrees_one_per_step"] == 1.0
    assert rows["freedave"]["steps_per_token"] < rows["one_per_step"]["steps_per_token"] == 1.0
    assert rows["threshold:threshold=0.3"]["steps_per_token"] < 1.0
    assert all(r["math_questions"] == 1 for r in rows.values())
    report = diffusion.write(tmp_path, rows, measured, QUESTIONS, {"model": "tiny"})
    assert "| freedave | " in report and (tmp_path / "diffusion.md").read_text() == report
    records = (tmp_path / "diffusion-records.jsonl").read_text().splitlines()
    assert len(records) == 5 * len(QUESTIONS) and json.loads(records[0])["contender"] == "ar"
    assert (tmp_path / "diffusion.png").is_file()


def test_bad_policies_are_refused_before_any_model_loads():
    with pytest.raises(SpecDecodeError, match="unknown diffusion policy 'nope'"):
        diffusion.parse_policies("threshold,nope")
    with pytest.raises(SpecDecodeError, match="threshold"):
        diffusion.parse_policies("threshold:nope=1")
    names = [label for label, *_ in diffusion.parse_policies("all")]
    assert names[0] == "one_per_step" and "cfg" not in names and "learn2pd" in names
