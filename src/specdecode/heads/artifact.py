"""Trained draft heads as artifacts (see :mod:`specdecode.artifacts`): one kind per
network (``hydra_heads``, ``clover_heads``, ``eagle_heads``), tied to the target's fingerprint.

A file holds the network's weights (matrices in int8 with float16 row scales), the FR-Spec
shortlist ``head_ids`` whose LM-head rows score the drafts, and the trainer's settings and
measurements. The network's settings say what it reads: an eagle artifact with
``feature_layers`` is EAGLE-3's (those layers' hidden states), one without (written before
EAGLE-3 came) is EAGLE-1's (the final hidden states) and loads as such. The target's embedding table and LM head are never stored: they are the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.artifacts import int8_rows, load_artifact, newest_artifact, save_artifact
from specdecode.errors import require
from specdecode.heads.networks import HeadNetwork, make_network

#: minutes `specdecode train heads` takes by default (said in the "train one" message)
TRAIN_MINUTES = 12
#: a target file from this size on writes its training data first (``train data``): the
#: default model's trainer writes its own conversations in minutes, a 1B target's would not
LARGE_TARGET_BYTES = 300 << 20


def artifact_kind(kind: str) -> str:
    return f"{kind}_heads"


def save_heads(path: str | Path, net: HeadNetwork, head_ids: torch.Tensor | None,
               fingerprint: str, info: dict) -> Path:
    tensors = {f"net.{k}": v.detach().half() for k, v in net.state_dict().items()}
    tensors = int8_rows(tensors)
    if head_ids is not None:
        tensors["head_ids"] = head_ids
    config = {"network": net.settings(), **info}
    return save_artifact(path, tensors, artifact_kind(net.kind), config, fingerprint)


def train_advice(runner, kind: str) -> str:
    """How to train ``kind`` heads for the runner's target: the default model's take minutes
    on a CPU; a larger one's need a shard written with its features first (docs/draft-heads.md,
    the 1.5B's took hours on 2 cores)."""
    source = getattr(runner, "source", "")  # a native runner's GGUF file
    path = Path(source)
    if not (source and path.is_file() and path.stat().st_size >= LARGE_TARGET_BYTES):
        return (f"train them with `specdecode train heads --kind {kind}` (about "
                f"{TRAIN_MINUTES} minutes on 2 CPU cores for the default model)")
    return (f"train them with `specdecode train data --model {source} --out SHARD --features "
            f"{kind}`, then `specdecode train heads --model {source} --kind {kind} --shard "
            "SHARD` (hours on a CPU; docs/draft-heads.md)")


def load_heads(spec: str, runner, kind: str, embed: torch.Tensor):
    """(network, shortlist or None, source path, config) for ``spec``: 'auto' (the newest
    artifact of this kind trained for this target, user cache first, then the package) or a
    path."""
    fingerprint = runner.fingerprint()
    if spec == "auto":
        spec = str(newest_artifact(artifact_kind(kind), fingerprint,
                                   f"no trained {kind} heads for this target; "
                                   f"{train_advice(runner, kind)}, or pass -c heads=PATH"))
    artifact = load_artifact(spec, artifact_kind(kind), fingerprint)
    settings = dict(artifact.config["network"])
    require(settings["size"] == embed.shape[1],
            f"{spec} has heads {settings['size']} wide; this target's hidden size is "
            f"{embed.shape[1]}")
    layers = settings.get("feature_layers", [])
    require(all(1 <= layer < runner.num_layers for layer in layers),
            f"{spec} reads the target's layers {layers}, but this target has layers 1.."
            f"{runner.num_layers - 1}; train heads for it with `specdecode train heads --kind {kind}`")
    net = make_network(kind, settings.pop("size"), embed, **settings)
    state = {k[len("net."):]: v.float() for k, v in artifact.tensors.items() if k.startswith("net.")}
    missing, unexpected = net.load_state_dict(state, strict=False)
    require(not missing and not unexpected,
            f"{spec} does not match its own config (missing {missing}, unexpected {unexpected}); "
            f"re-create it with `specdecode train heads --kind {kind}`")
    return net.eval().requires_grad_(False), artifact.tensors.get("head_ids"), spec, artifact.config
