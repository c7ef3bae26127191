"""``specdecode train heads`` end to end on a GGUF target on the CPU: the runner the heads will
draft for reads the features and gives the tables (the file's ``transformers`` model, every
weight in float32, is never built: 7 GB for a 1.5B), the features a shard keeps
(``train data --features``) are read instead of a prefill, and the artifact is that runner's."""

from __future__ import annotations

import json
import re

import torch

from specdecode.artifacts import load_artifact
from specdecode.bench.shapes import write_shape
from specdecode.cli import main
from specdecode.models.base import Needs
from specdecode.models.llama import LlamaRunner
from specdecode.models.loading import LoadedModel
from specdecode.training.feature_store import FeatureStore, reader_name

VOCAB = 512


def test_train_heads_on_a_gguf_target_reads_kept_features_and_builds_no_transformers_model(
        tmp_path, monkeypatch, capsys):
    model = write_shape(tmp_path / "target.gguf", "tiny", "Q4_1", vocab=VOCAB)
    runner = LlamaRunner.from_gguf(model, "int4")
    shard = tmp_path / "shard.jsonl"
    store = FeatureStore(shard, reader_name(runner), runner.fingerprint())
    gen = torch.Generator().manual_seed(0)
    lines = []
    for index in range(12):
        ids = torch.randint(VOCAB, (24,), generator=gen).tolist()
        if index % 2 == 0:  # half the conversations written with their features kept
            store.save(ids, runner.prefill(ids, Needs(final_hidden=True)))
        lines.append(json.dumps({"index": index, "settings": "s", "prompt_len": 8, "ids": ids}))
    shard.write_text("\n".join(lines) + "\n")

    def built(_):
        raise AssertionError("train heads built the GGUF file's transformers model")

    monkeypatch.setattr(LoadedModel, "model", property(built))
    out = tmp_path / "hydra.safetensors"
    # 36 s: 30 are kept for the evaluation, 6 train (hundreds of tiny steps: every
    # conversation is read)
    assert main(["train", "heads", "--model", str(model), "--kind", "hydra", "--shard",
                 str(shard), "--max-minutes", "0.6", "--out", str(out), "--workdir",
                 str(tmp_path / "work"), "--shortlist", "0", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"features: 6 reads from \S+shard\.jsonl\.features, 6 conversations read "
                     r"by the runner", printed), printed
    artifact = load_artifact(out, "hydra_heads", runner.fingerprint())
    assert artifact.config["features"] == "native-int4" and artifact.config["steps"] > 0
