"""A corpus of target-written text for SuffixDecoding's global tree, given before any request.

SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975) drafts from a global suffix tree over the
responses a server has already written; a fresh server, a benchmark or a one-off ``specdecode
run`` has none. The target's own earlier writing is what that tree holds, and ``specdecode train
data`` writes such text at kernel speed (self-written prompts, none a benchmark question), so a
corpus built from its shards stands in for the history until there is one: the same phrasing,
list openers and answer skeletons the model uses again and again. ADED (Liu et al., 2024) and
REST warm-start their retrieval the same way, from a corpus.

A corpus is an artifact (:mod:`specdecode.artifacts`) of kind ``suffix_corpus``: the
sequences' tokens concatenated (``tokens``, int32) and their boundaries (``offsets``, int64),
tied to the fingerprint of the target that wrote them (another model's text would draft, still
exactly, but rarely be accepted; another tokenizer's ids would draft nonsense). Its suffix tree is
built once per process and file and shared, read only, by every cache that uses it
(:meth:`specdecode.suffix_cache.SuffixCache.use_corpus`).

Made by ``specdecode train corpus --data SHARD --out FILE`` (:mod:`specdecode.training.corpus`);
``suffix`` (and ``auto``'s suffix part) drafts from it with ``corpus=FILE``, or ``corpus=auto``
for the newest one for its target.
Off by default: on the 2-core CPU runner it raised the accepted length by 8% (greedy and T=0.7)
for 1-2% of speed, small beside the seconds and memory its tree takes at start (docs/suffix.md,
"A corpus").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from specdecode.artifacts import find_artifacts, load_artifact, read_metadata, save_artifact
from specdecode.errors import require
from specdecode.suffix_tree import SuffixTree

KIND = "suffix_corpus"


def save_corpus(path: str | Path, sequences: Sequence[Sequence[int]], fingerprint: str,
                config: dict) -> Path:
    require(len(sequences) > 0, "a corpus needs at least one sequence")
    lengths = torch.tensor([0] + [len(s) for s in sequences], dtype=torch.int64)
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.int32)
    return save_artifact(path, {"tokens": tokens, "offsets": lengths.cumsum(0)}, KIND,
                         dict(config, sequences=len(sequences), tokens=len(tokens)), fingerprint)


def read_corpus(path: str | Path, fingerprint: str | None) -> list[list[int]]:
    """The sequences of a corpus file; ``fingerprint`` None skips the target check (a replay
    without a model)."""
    if fingerprint is None:
        fingerprint = read_metadata(path)[1]
    tensors = load_artifact(path, KIND, fingerprint).tensors
    tokens, offsets = tensors["tokens"].tolist(), tensors["offsets"].tolist()
    return [tokens[a:b] for a, b in zip(offsets, offsets[1:])]


@functools.lru_cache(maxsize=4)
def _tree(path: str, modified: int, fingerprint: str | None, max_depth: int) -> SuffixTree:
    tree = SuffixTree(max_depth)
    for k, sequence in enumerate(read_corpus(path, fingerprint)):
        tree.insert(k, sequence)
    return tree


def corpus_tree(spec: str, runner, max_depth: int) -> SuffixTree | None:
    """The corpus tree ``spec`` names: 'none'; 'auto' (the newest corpus for ``runner``'s
    target, if any: none without a runner); or a file. Built once per file and depth."""
    if spec == "none":
        return None
    fingerprint = None if runner is None else runner.fingerprint()
    if spec == "auto":
        found = [] if fingerprint is None else find_artifacts(KIND, fingerprint)
        if not found:
            return None
        spec = str(found[0])
    path = Path(spec).expanduser().resolve()
    require(path.is_file(), f"suffix corpus {spec} does not exist; give 'auto', 'none' or a "
                            f"file made by `specdecode train corpus`")
    return _tree(str(path), path.stat().st_mtime_ns, fingerprint, max_depth)
