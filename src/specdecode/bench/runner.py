"""The timed loop of ``specdecode bench``.

Fairness, in the order things happen:

1. every contender decodes the first prompt once untimed (the warm-up pays one-off costs:
   allocations, kernel selection, lazy imports); methods warm up on a throwaway proposer so the
   timed one has learnt nothing;
2. questions run in file order and, inside a question, turn by turn; for every turn ALL
   contenders run back to back, in an order rotated by one each prompt, so machine drift and
   cache effects hit every contender alike;
3. with ``repeats`` > 1 the whole pass is repeated with new proposers, and each record keeps
   the median wall time of its repeats;
4. every record's token ids are compared with ``ar``'s for the same question and turn.

Multi-turn questions carry each contender's OWN earlier answers in the chat context, as
Spec-Bench does (in greedy decoding an exact method's answers are ``ar``'s, so its prompts are
too). Sampled runs seed every request from (seed, question, turn), the same seed for every
contender: a method with a deterministic draft then reproduces ``ar``'s tokens exactly (see
``verify.py``), and methods that sample drafts are measured, not assumed.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.bench.peer_process import PeerFailed
from specdecode.engine import check_request
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import Runner
from specdecode.questions import Question
from specdecode.sampling import SamplingParams

#: tokens decoded by each contender in the warm-up
WARMUP_TOKENS = 16


@dataclass
class Target:
    """What the harness runs on; tests pass a tiny model and a toy tokenizer."""

    runner: Runner
    tokenizer: object
    eos_token_ids: list[int]
    #: the transformers model behind the runner (the hf peers need it)
    hf_model: object | None = None
    #: the GGUF file of the weights (the llama.cpp peers need it)
    gguf_path: Path | None = None
    source: str = ""


@dataclass
class BenchOptions:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    repeats: int = 1
    #: base of the per-request seeds of sampled runs (--seed)
    seed: int = 0
    warmup: bool = True
    #: start no question but the first after this many minutes of a pass (None: every question)
    max_minutes: float | None = None
    #: how our methods' drafts are sized (specdecode/sizing.py: goodput | full)
    draft_budget: str = "goodput"


def request_seed(base: int, question_id, turn: int) -> int:
    return zlib.crc32(f"{base}:{question_id}:{turn}".encode())


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template the conversation (generation prompt added); raw text when the tokenizer
    has no template."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"])


def check_prompts(target: Target, questions: Sequence[Question], max_new_tokens: int) -> None:
    """First-turn prompts must fit the context with the token budget (later turns are checked
    as they come, since they hold the answers)."""
    for q in questions:
        ids = encode_messages(target.tokenizer, [{"role": "user", "content": q.turns[0]}])
        try:
            check_request(target.runner, ids, max_new_tokens)
        except SpecDecodeError as exc:
            raise SpecDecodeError(f"question {q.question_id}: {exc}") from None


def run_bench(target: Target, questions: Sequence[Question], contenders: list,
              options: BenchOptions, write: Callable[[dict], None],
              progress: bool = True, failed: dict[str, str] | None = None) -> list[dict]:
    """Run every contender over every question turn; ``write`` gets each record as it is
    finished (records are also returned). The first contender must be ``ar``.

    Repeats are whole passes over the questions, each with new proposers, so a proposer that
    learns across requests sees the same history in every pass (and is never timed on a prompt
    it has just answered); records come from the last pass, with the median wall time.

    A peer that fails (``PeerFailed``: its process crashed, raised or hung) is dropped from the
    rest of the run and ``failed[name]`` says why and when; the others go on."""
    require(contenders and contenders[0].name == "ar", "the first contender must be 'ar'")
    check_prompts(target, questions, options.max_new_tokens)
    failed = {} if failed is None else failed
    live = list(contenders)
    if options.warmup:
        ids = encode_messages(target.tokenizer,
                              [{"role": "user", "content": questions[0].turns[0]}])
        for c in contenders:
            try:
                c.fresh().run(ids, min(WARMUP_TOKENS, options.max_new_tokens),
                              _seeded(options.sampling, options.seed, "warmup", 0))
            except PeerFailed as exc:
                failed[c.name] = f"{exc} (in the warm-up)"
                live.remove(c)
    total = sum(len(q.turns) for q in questions) * len(live) * options.repeats
    bar = _progress(total, progress)
    walls: dict[tuple, list[float]] = {}
    records: list[dict] = []
    try:
        for rep in range(options.repeats):
            last = rep == options.repeats - 1
            live = live if rep == 0 else [c.fresh() for c in live]
            for record in _one_pass(target, questions, live, options, walls, bar, failed):
                if last:
                    records.append(record)
                    write(record)
    finally:
        bar.close()
    return records


def _one_pass(target: Target, questions: Sequence[Question], contenders: list,
              options: BenchOptions, walls: dict[tuple, list[float]], bar,
              failed: dict[str, str]):
    """Yield the records of one pass; ``walls`` collects wall times across passes. A peer that
    fails is removed from ``contenders`` (the caller's list) and named in ``failed``."""
    tokenizer, eos = target.tokenizer, frozenset(target.eos_token_ids)
    done = 0
    deadline = None if options.max_minutes is None else time.monotonic() + 60 * options.max_minutes
    for index, q in enumerate(questions):
        if index and deadline is not None and time.monotonic() > deadline:
            return  # the report covers the questions done (the bench says how many)
        histories: dict[str, list[dict]] = {c.name: [] for c in contenders}
        for turn, text in enumerate(q.turns):
            seeded = _seeded(options.sampling, options.seed, q.question_id, turn)
            rotation = (index + turn) % len(contenders)
            prompts, outcomes = {}, {}
            for c in contenders[rotation:] + contenders[:rotation]:
                bar.set_description(f"{q.task} q{q.question_id} t{turn} {c.name}")
                messages = histories[c.name] + [{"role": "user", "content": text}]
                prompts[c.name] = encode_messages(tokenizer, messages)
                try:
                    outcomes[c.name] = c.run(prompts[c.name], options.max_new_tokens, seeded)
                except PeerFailed as exc:
                    failed[c.name] = f"{exc} (after {done} question turns)"
                    contenders.remove(c)
                    continue
                walls.setdefault((c.name, q.question_id, turn), []).append(outcomes[c.name].wall_s)
                bar.update(1)
            done += 1
            ar_tokens = outcomes["ar"].tokens
            for c in contenders:
                o = outcomes[c.name]
                yield _record(c, q, turn, prompts[c.name], o, walls[(c.name, q.question_id, turn)],
                              ar_tokens, options, eos)
                answer = tokenizer.decode(o.tokens, skip_special_tokens=True)
                histories[c.name] += [{"role": "user", "content": text},
                                      {"role": "assistant", "content": answer}]


def _seeded(sampling: SamplingParams, base: int, question_id, turn: int) -> SamplingParams:
    if sampling.greedy:
        return sampling
    return dataclasses.replace(sampling, seed=request_seed(base, question_id, turn))


def _record(c, q: Question, turn: int, prompt_ids: list[int], o, walls: list[float],
            ar_tokens: list[int], options: BenchOptions, eos: frozenset[int]) -> dict:
    finish = "stop" if o.tokens and o.tokens[-1] in eos else "length"
    record = {
        "method": c.name,
        "kind": c.kind,
        "question_id": q.question_id,
        "category": q.category,
        "task": q.task,
        "turn": turn,
        "prompt_tokens": len(prompt_ids),
        "max_new_tokens": options.max_new_tokens,
        "new_tokens": len(o.tokens),
        "finish_reason": finish,
        "wall_s": statistics.median(walls),
        "wall_s_repeats": [round(w, 6) for w in walls],
        "target_forwards": o.target_forwards,
        "accepted_lengths": o.accepted_lengths,
        "draft_tokens": o.draft_tokens,
        "propose_s": o.propose_s,
        "prefill_s": o.prefill_s,
        "identical_to_ar": o.tokens == ar_tokens,
        "token_ids": o.tokens,
    }
    if c.name == "ar":
        # what `specdecode simulate` replays
        record["prompt_ids"] = list(prompt_ids)
        record["sampling"] = dataclasses.asdict(options.sampling)
    return record


class _NoBar:
    def set_description(self, _):
        pass

    def update(self, _):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="run", dynamic_ncols=True)


def jsonl_writer(path: Path) -> tuple[Callable[[dict], None], Callable[[], None]]:
    """(write, close) for a JSON-lines file flushed record by record, so an interrupted run
    keeps what it measured."""
    f = open(path, "w", encoding="utf-8")

    def write(record: dict) -> None:
        f.write(json.dumps(record) + "\n")
        f.flush()

    return write, f.close
