"""The target's features of a shard's conversations, kept beside the shard by the forwards
that wrote them (``specdecode train data --features``), so ``train heads`` trains on them
without reading any conversation again.

Draft heads learn from the target's own hidden states at every position of a conversation
(heads/drafter.py, ``target_features``). The forwards that write a conversation compute them
anyway: its answer's prompt in one prefill, then one decode row per answer token. Asked for
(:class:`~specdecode.models.base.Needs`), those rows come back with the logits, and the runner's
rows do not depend on what shares their forward, so they are the bits a prefill of the whole
conversation would give (tests/test_target_data.py). On two CPU cores reading a 1.5B
target's conversation again costs about as much as writing it.

One safetensors file a conversation, named by a hash of its token ids, in ``SHARD.features/``:
``final`` [T, H] (after the final norm) and ``layer.N`` [T, H] for each layer captured, float32,
with the runner that computed them (its fingerprint and weight format) in the metadata: a
trainer reading features of another runner would learn from rows drafting never sees, so
those are read again instead.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdecode.models.base import ForwardOutput


def store_dir(shard: Path) -> Path:
    """Where the features of ``shard``'s conversations are kept."""
    return shard.with_name(shard.name + ".features")


def reader_name(runner) -> str:
    """What computed a runner's features: its name and weight format (``native-int4``)."""
    return f"{runner.name}-{getattr(runner, 'weights', 'fp32')}"


def _name(ids) -> str:
    data = ",".join(map(str, ids)).encode()
    return hashlib.sha1(data).hexdigest()[:20] + ".safetensors"


def stacked(outputs: list[ForwardOutput]) -> ForwardOutput:
    """The features of consecutive passes over one sequence as one pass's: rows in order."""
    layers = outputs[0].layers.keys()
    return ForwardOutput(None, torch.cat([out.final_hidden for out in outputs]),
                         {layer: torch.cat([out.layers[layer] for out in outputs])
                          for layer in layers})


class FeatureStore:
    """The features of one shard's conversations computed by one runner."""

    def __init__(self, shard: Path, reader: str, fingerprint: str):
        self.root = store_dir(Path(shard))
        self.meta = {"reader": reader, "fingerprint": fingerprint}
        #: conversations found here and conversations not (or of another runner)
        self.found = self.missed = 0

    def save(self, ids, features: ForwardOutput) -> None:
        """Keep ``features`` [len(ids), H] of the conversation ``ids`` (written whole or not at
        all: a file is renamed into place)."""
        rows = features.final_hidden.shape[0]
        if rows != len(ids):
            raise ValueError(f"{rows} feature rows for a conversation of {len(ids)} tokens")
        tensors = {"final": features.final_hidden.float().contiguous()}
        tensors.update({f"layer.{layer}": hidden.float().contiguous()
                        for layer, hidden in features.layers.items()})
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / _name(ids)
        part = path.with_suffix(".part")
        save_file(tensors, str(part), metadata=self.meta)
        os.replace(part, path)

    def load(self, ids, layers: tuple[int, ...]) -> ForwardOutput | None:
        """The conversation's features with ``layers``, or None where none are kept for it by
        this runner (or they lack one of the layers)."""
        path = self.root / _name(ids)
        if not path.is_file():
            self.missed += 1
            return None
        with safe_open(str(path), "pt") as stored:
            names = set(stored.keys())
            if stored.metadata() != self.meta or not all(f"layer.{n}" in names for n in layers):
                self.missed += 1
                return None
            out = ForwardOutput(None, stored.get_tensor("final"),
                                {n: stored.get_tensor(f"layer.{n}") for n in layers})
        self.found += 1
        return out
