"""Teacher-forced agreement of the shipped draft heads with the target, per dev-half task.

    PYTHONPATH=src python scripts/head_agreement.py hydra eagle [--per-task 2] [--shard FILE]
    PYTHONPATH=src python scripts/head_agreement.py hydra hydra=/tmp/hydra-passages.safetensors

For each task of the packaged Spec-Bench dev half, the target's own greedy answers (128 tokens,
native runner, int4) to the first turns of ``--per-task`` questions; and, beside them, 12
self-written conversations (the first 12 of ``--shard``, a `specdecode train data` shard, or
written now with `train data`'s writer). A kind alone reads the heads the method would
('auto'); ``KIND=PATH`` an artifact. Each row: the share of answer positions where the
head's top token at depth 1..4 is the target's greedy token (``train heads``' held-out
measure, the same code). Shows where the heads' training data is unlike what they draft for.
"""

from __future__ import annotations

import argparse
import random
import time
import types
from pathlib import Path

import torch

from specdecode.api import Decoder, eos_ids
from specdecode.heads.artifact import load_heads
from specdecode.models.loading import load_model, make_runner
from specdecode.questions import load_questions, sample_per_task, task_of
from specdecode.training.target_data import Settings, Writer, read_shard
from specdecode.training.train_heads import conversation_features, evaluate

SELF_WRITTEN = 12


def self_written(loaded, runner, shard: str | None) -> list:
    if shard is not None:
        return list(read_shard(Path(shard)).values())[:SELF_WRITTEN]
    settings = Settings(runner.fingerprint(), 64, 128, seed=random.randrange(1 << 30))
    writer = Writer(runner, loaded.tokenizer, set(eos_ids(loaded, loaded.tokenizer)), settings,
                    SELF_WRITTEN)
    todo = iter(range(SELF_WRITTEN))
    return [conversation for _, conversation in writer.write(todo, time.monotonic() + 600)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", nargs="+",
                        help="hydra, eagle or clover (the heads the method finds), or KIND=PATH")
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--shard", default=None, help="self-written conversations to read")
    args = parser.parse_args()
    loaded = load_model("smollm2")
    runner = make_runner(loaded, "native", "auto", 2048)
    decoder = Decoder(runner, loaded.tokenizer, "ar")
    by_task: dict[str, list] = {"self-written": self_written(loaded, runner.replica(), args.shard)}
    for question in sample_per_task(load_questions(), args.per_task):
        prompt = decoder.encode(question.turns[0])
        answer = decoder.generate(question.turns[0], 128).token_ids
        by_task.setdefault(task_of(question.category), []).append((prompt + answer, len(prompt)))
    embed = loaded.model.get_input_embeddings().weight.detach()
    full_head = loaded.model.get_output_embeddings().weight.detach().float()
    for named in args.kinds:
        kind, _, path = named.partition("=")
        net, head_ids, spec, _ = load_heads(path or "auto", runner, kind, embed)
        print(f"{kind}: {spec}")
        for task, conversations in by_task.items():
            data = types.SimpleNamespace(
                evaluation=conversations, full_head=full_head, head_ids=head_ids,
                head=full_head if head_ids is None else full_head[head_ids],
                features=lambda net, ids: conversation_features(runner, net, ids))
            shares = " / ".join(f"{100 * s:.1f}" for s in evaluate(net, data, 4))
            print(f"  {task:16s} {shares} %  ({len(conversations)} conversations)", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
