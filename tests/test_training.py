"""Training artifacts (fingerprint checks) and the exit-adapter trainer on a tiny model."""

from __future__ import annotations

import pytest
import torch

from specdecode.artifacts import find_artifacts, load_artifact, read_metadata, save_artifact
from specdecode.errors import SpecDecodeError


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


# ---- the exit-adapter trainer, end to end on a tiny model ----------------------------------

class StubTokenizer:
    """Characters -> ids, enough for the trainer's chat-template call."""

    pad_token_id = 0
    eos_token_id = 2

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1] + [3 + ord(c) % 90 for c in messages[0]["content"]]


def trainer_args(tmp_path, **overrides):
    import argparse
    import json

    from specdecode.training import exit_adapters

    data = tmp_path / "prompts.jsonl"
    tasks = ["writing", "qa", "translation", "summarization", "rag"]
    data.write_text("\n".join(json.dumps({"category": tasks[i % 5], "turns": [f"prompt {i} " * 3]})
                              for i in range(20)))
    parser = argparse.ArgumentParser()
    exit_adapters.add_arguments(parser)
    args = parser.parse_args(["--layers", "1,2", "--rank", "4", "--steps", "40", "--batch", "16",
                              "--gen-tokens", "12", "--train-prompts", "8", "--eval-per-task", "1",
                              "--lr", "1e-2", "--checkpoint-every", "10", "--data", str(data),
                              "--workdir", str(tmp_path / "work"),
                              "--out", str(tmp_path / "adapters.safetensors")])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_trainer_learns_saves_resumes_and_refuses(tmp_path):
    from specdecode.api import Decoder
    from specdecode.models.hf import HFRunner
    from tiny_models import tiny_llama
    from specdecode.drafting.exit_adapters import ExitAdapters
    from specdecode.training.exit_adapters import train

    model = tiny_llama(layers=3, seed=5)
    tokenizer = StubTokenizer()
    adapters, path = train(model, tokenizer, (1, 2), trainer_args(tmp_path, steps=20))
    config = adapters.config
    assert config["steps"] == 20 and set(config["agreement_after"]) == {"1", "2"}
    assert config["eval_positions"] > 0 and config["train_positions"] > 0

    with pytest.raises(SpecDecodeError, match="a checkpoint exists.*--resume"):
        train(model, tokenizer, (1, 2), trainer_args(tmp_path))
    adapters, path = train(model, tokenizer, (1, 2), trainer_args(tmp_path, resume=True))
    losses = adapters.config["losses_every_50"]
    assert adapters.config["steps"] == 40 and len(losses) == 1
    with pytest.raises(SpecDecodeError, match="checkpoint .* is for other settings"):
        train(model, tokenizer, (1,), trainer_args(tmp_path, resume=True))

    # self-distillation lowers the KL; the adapters agree with the full model more than the
    # plain exit does on held-out prompts
    state = torch.load(tmp_path / "work" / "checkpoint.pt")
    assert sum(state["losses"][-5:]) < sum(state["losses"][:5])
    for layer in ("1", "2"):
        assert adapters.config["agreement_after"][layer] >= adapters.config["agreement_before"][layer]

    loaded = ExitAdapters.load(path, HFRunner(model).fingerprint())
    assert loaded.layers == (1, 2) and loaded.agreement() == {1: adapters.config["agreement_after"]["1"],
                                                              2: adapters.config["agreement_after"]["2"]}
    ar = Decoder(model, None, "ar", eos_token_ids=[]).start([5, 6, 7, 8], 24).run()
    for method in ("early_exit", "del"):
        decoder = Decoder(model, None, method, eos_token_ids=[], adapters=str(path))
        assert decoder.start([5, 6, 7, 8], 24).run() == ar


def test_trainer_bad_input(tmp_path):
    from tiny_models import tiny_llama
    from specdecode.training.exit_adapters import parse_layers, train

    with pytest.raises(SpecDecodeError, match=r"--layers: 3 is outside the model.*1\.\.2"):
        train(tiny_llama(layers=3), StubTokenizer(), (1, 3), trainer_args(tmp_path))
    with pytest.raises(SpecDecodeError, match="comma-separated layer numbers"):
        parse_layers("x,1")
