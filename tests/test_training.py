"""Training artifacts (fingerprint checks) and the exit-adapter trainer on a tiny model."""

from __future__ import annotations

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.training.artifacts import find_artifacts, load_artifact, read_metadata, save_artifact


def test_artifact_round_trip_and_refusal(tmp_path):
    path = save_artifact(tmp_path / "a.safetensors", {"w": torch.arange(6.0).view(2, 3)},
                         "exit_adapters", {"layers": [1, 2]}, "hf:llama:96:2:1.0")
    art = load_artifact(path, "exit_adapters", "hf:llama:96:2:1.0")
    assert art.config == {"layers": [1, 2]}
    assert torch.equal(art.tensors["w"], torch.arange(6.0).view(2, 3))
    assert read_metadata(path)[0] == "exit_adapters"
    with pytest.raises(SpecDecodeError, match="trained for another target model.*hf:llama:96:2:9.0"):
        load_artifact(path, "exit_adapters", "hf:llama:96:2:9.0")
    with pytest.raises(SpecDecodeError, match="'exit_adapters' artifact, not 'draft_model'"):
        load_artifact(path, "draft_model", "hf:llama:96:2:1.0")


def test_find_artifacts_skips_other_targets_and_foreign_files(tmp_path):
    from safetensors.torch import save_file

    mine = save_artifact(tmp_path / "mine.safetensors", {"w": torch.zeros(1)}, "exit_adapters",
                         {}, "fp-a")
    save_artifact(tmp_path / "other.safetensors", {"w": torch.zeros(1)}, "exit_adapters", {}, "fp-b")
    save_file({"w": torch.zeros(1)}, str(tmp_path / "foreign.safetensors"))
    assert find_artifacts("exit_adapters", "fp-a", (tmp_path,)) == [mine]
    assert find_artifacts("draft_model", "fp-a", (tmp_path,)) == []
    with pytest.raises(SpecDecodeError, match="not a specdecode artifact"):
        load_artifact(tmp_path / "foreign.safetensors", "exit_adapters", "fp-a")
    with pytest.raises(SpecDecodeError, match="does not exist"):
        load_artifact(tmp_path / "missing.safetensors", "exit_adapters", "fp-a")
