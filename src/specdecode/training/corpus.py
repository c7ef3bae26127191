"""``specdecode train corpus``: a corpus for suffix's global tree (:mod:`specdecode.suffix_corpus`)
from the conversations ``specdecode train data`` wrote, tied to the fingerprint of the target
that wrote them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode.errors import require
from specdecode.suffix_corpus import save_corpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, nargs="+", metavar="SHARD",
                        help="JSON-lines shards written by `specdecode train data`")
    parser.add_argument("--out", required=True, metavar="FILE", help="the corpus artifact")
    parser.add_argument("--model", default="smollm2",
                        help="the target that wrote the shards: 'smollm2' (default), a .gguf "
                             "file or a checkpoint folder (its fingerprint goes in the file)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="stop after this many tokens, whole conversations (0: all)")


def run(args: argparse.Namespace) -> int:
    from specdecode.models.hf import HFRunner
    from specdecode.models.loading import load_model
    from specdecode.training.target_data import read_shard

    require(args.max_tokens >= 0, "--max-tokens must be at least 0 (0: every conversation)")
    started = time.monotonic()
    sequences: list[list[int]] = []
    total = 0
    for shard in args.data:
        require(Path(shard).is_file(), f"shard {shard} does not exist; write one with "
                                       f"`specdecode train data --out {shard}`")
        conversations = read_shard(Path(shard))
        for index in sorted(conversations):
            ids = conversations[index][0]
            if args.max_tokens and total + len(ids) > args.max_tokens:
                break
            sequences.append(ids)
            total += len(ids)
    require(bool(sequences), f"the shards {' '.join(args.data)} hold no conversations"
                             + (f" within --max-tokens {args.max_tokens}" if args.max_tokens else ""))
    loaded = load_model(args.model)
    vocab = len(loaded.tokenizer)
    require(max(max(s) for s in sequences) < vocab,
            f"the shards hold token ids beyond {args.model}'s vocabulary ({vocab}): they were "
            f"written by another model; give that model with --model")
    path = save_corpus(args.out, sequences, HFRunner(loaded.model).fingerprint(),
                       {"shards": [Path(s).name for s in args.data]})
    print(json.dumps({"out": str(path), "conversations": len(sequences), "tokens": total,
                      "bytes": path.stat().st_size,
                      "seconds": round(time.monotonic() - started, 1)}))
    return 0
