"""Target-written conversations: the training data of every self-distilled artifact (the
distilled draft, the draft heads), and the FR-Spec shortlist made from them.

The target writes user turns itself (sampled after the chat template's user header, from a few
openers covering the Spec-Bench tasks) and answers them (a batch greedy or at temperature 0.7,
half and half), batched. No benchmark prompt is trained on, so measurements on Spec-Bench stay
honest. Conversations are cached per target and settings in the user cache, a batch at a time,
so an interrupted run resumes and every trainer reads the same data without writing it again.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdecode.artifacts import user_dir
from specdecode.errors import require

#: user-turn openers: the target completes them, so its self-written prompts cover the tasks
#: Spec-Bench measures (chat, translation, summarization, QA, maths, retrieval-style reading)
OPENERS = ("", "Write", "Explain", "Translate German to English:", "Summarize the following "
           "article:", "Question:", "Solve this math problem step by step:", "What", "How",
           "Read the passage and answer the question.", "Can you", "Give me")

#: a conversation: its token ids (prompt then answer) and the prompt's length
Conversation = tuple[list[int], int]


def user_header(tokenizer) -> str:
    """The chat template's text before a user message's content."""
    marker = "\x00MARK\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return text[: text.index(marker)]


@torch.inference_mode()
def generate(model, prompts: list[list[int]], new_tokens: int, pad: int, eos: set[int],
             temperature: float, seconds: float | None) -> list[list[int]]:
    """Continuations of ``prompts`` (batched, left padding), each cut after end-of-sequence;
    shorter when ``seconds`` (None: no bound) run out."""
    width = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = dict(do_sample=True, temperature=temperature, top_p=0.95) if temperature else \
        dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=1, pad_token_id=pad,
                         max_time=None if seconds is None else max(seconds, 1.0), **sampling)
    result = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        result.append(row[:end])
    return result


def chat_prompt(tokenizer, message: str) -> list[int]:
    """The chat prompt of one user message, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message or "Hello"}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def answer_prompt(tokenizer, opener: str, turn: Sequence[int]) -> list[int]:
    """The chat prompt whose user message is the opener and the turn the target wrote after it."""
    turn_text = tokenizer.decode(turn, skip_special_tokens=True)
    return chat_prompt(tokenizer, (opener + turn_text).strip())


def write_conversations(model, tokenizer, count: int, prompt_tokens: int, answer_tokens: int,
                        rng: random.Random, seconds: float) -> list[Conversation]:
    """``count`` conversations the target writes within about ``seconds``."""
    from specdecode.api import eos_ids

    header = user_header(tokenizer)
    eos = set(eos_ids(model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    openers = [rng.choice(OPENERS) for _ in range(count)]
    starts = [tokenizer(header + o, add_special_tokens=False)["input_ids"] for o in openers]
    turns = generate(model, starts, prompt_tokens, pad, eos, 1.0, seconds / 3)
    out = [answer_prompt(tokenizer, opener, turn) for opener, turn in zip(openers, turns)]
    temperature = 0.0 if rng.random() < 0.5 else 0.7
    answers = generate(model, out, answer_tokens, pad, eos, temperature, seconds * 2 / 3)
    return [(p + a, len(p)) for p, a in zip(out, answers)]


def target_conversations(model, tokenizer, fingerprint: str, count: int, *, prompt_tokens: int,
                         answer_tokens: int, batch: int, seed: int, seconds: float,
                         show: Callable[[str], None] = lambda text: None,
                         folder: Path | None = None) -> list[Conversation]:
    """Up to ``count`` target-written conversations: those cached for this target and these
    settings, then new ones, a batch at a time, for at most ``seconds``."""
    settings = {"fingerprint": fingerprint, "prompt_tokens": prompt_tokens,
                "answer_tokens": answer_tokens, "seed": seed, "batch": batch}
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = (folder or user_dir()) / f"conversations-{key}.pt"
    sequences: list[Conversation] = []
    if path.is_file():
        sequences = torch.load(path)["sequences"]
    deadline = time.monotonic() + seconds
    while len(sequences) < count and time.monotonic() < deadline:
        size = min(batch, count - len(sequences))
        # one generator per batch, seeded by its place: a resumed run writes what it would have
        rng = random.Random(seed * 1_000_003 + len(sequences))
        sequences += write_conversations(model, tokenizer, size, prompt_tokens, answer_tokens,
                                         rng, deadline - time.monotonic())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"settings": settings, "sequences": sequences}, tmp)
        tmp.replace(path)
        show(f"data {len(sequences)}/{count} conversations")
    require(len(sequences) >= 10, "too little time to generate training data (fewer than 10 "
                                  "conversations); raise --max-minutes")
    return sequences[:count]


# ---- FR-Spec: a frequency-ranked shortlist of the vocabulary --------------------------------

def frequency_shortlist(sequences: Sequence[Conversation], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of the data (FR-Spec, Zhao et al., 2025), sorted by id;
    ties and the unseen rest by token id (byte-pair merges get low ids first, so low ids are the
    frequent ones)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids, _ in sequences:
        counts += torch.bincount(torch.tensor(ids), minlength=vocab)[:vocab]
    # a stable sort on -count keeps ties in id order
    order = torch.sort(-counts, stable=True).indices
    return order[:size].sort().values


def shortlist_coverage(head_ids: torch.Tensor, sequences: Sequence[Conversation]) -> float:
    """The share of answer tokens (what the target wrote) that the shortlist contains: the
    ceiling of any draft that proposes from it."""
    inside = torch.zeros(int(max(head_ids.max().item() + 1,
                                 max((max(ids) for ids, _ in sequences), default=0) + 1)),
                         dtype=torch.bool)
    inside[head_ids] = True
    answers = [t for ids, start in sequences for t in ids[start:]]
    require(bool(answers), "no answer tokens to measure the shortlist's coverage on")
    return float(inside[torch.tensor(answers)].float().mean())
