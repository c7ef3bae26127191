"""``specdecode train data``: target-written conversations at the native runner's speed, into
a resumable JSON-lines shard.

Like :mod:`specdecode.training.self_data`, the target writes the user turn itself (sampled at
temperature 1, top-p 0.95, after the chat template's user header and an opener) and answers
it (greedy or at temperature 0.7, half and half). Unlike it, no ``transformers.generate``: the
conversations decode together on the native runner, one replica (KV cache) each, all in one
:meth:`~specdecode.models.llama.LlamaRunner.run_packed` forward a token (``--batch`` rows of
16 to 64 a forward, a new conversation's prompt packed beside the others' decode rows), and a
finished conversation's slot takes the next one at once, so every forward stays full.

Openers are composed from task templates, topics and languages (over two thousand
combinations, the twelve openers of ``self_data`` among them), so the self-written prompts
vary; none is a benchmark question. A share of the conversations (``PASSAGE_SHARE``, where
``--passage-tokens`` > 0) reads a long input instead, as summarization, QA over a document and
retrieval-style prompts do: the target first writes a passage (an article, a report, a story on
a topic, answering a writing request), then answers an instruction about it (summarise, answer
from it, list its points...) with the passage in the user's message.

Conversation ``i`` draws from a generator seeded by (``--seed``, ``i``) and the runner's rows
do not depend on what shares their forward, so a conversation is the same whatever batch wrote
it: a run appends each finished conversation as one line and a later run with the same
settings skips the ids already in the file.

``--features KINDS`` keeps what the named draft-head kinds read of every position of each
conversation (the final hidden states and their layers'), captured in the forwards that write
it (its answer's prompt in one prefill, then a row a token), beside the shard
(:mod:`specdecode.training.feature_store`): ``train heads`` on the shard then reads no
conversation again, where on a CPU that read costs about what writing it did.

On a CUDA GPU (``--runner hf``, the default there) :class:`GenerateWriter` writes the same kind
of shard with ``transformers``' batched ``generate``, hundreds of conversations at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode import kernels
from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.heads.networks import NETWORKS, feature_layers
from specdecode.models.base import NOTHING, ForwardOutput, Needs, PrefillCall, VerifyCall
from specdecode.training.feature_store import FeatureStore, reader_name, stacked
from specdecode.training.runs import training_device
from specdecode.training.self_data import (OPENERS, Conversation, answer_prompt, chat_prompt,
                                           generate, user_header)

#: user-turn templates; the target writes the rest of the turn
TASKS = ("Write a short story about {topic}", "Explain {topic} to a beginner",
         "Summarize the following article about {topic}:", "Question about {topic}:",
         "Solve this math problem about {topic} step by step:",
         "Write an email to a colleague about {topic}", "Give me practical tips on {topic}",
         "Compare two different views on {topic}", "Write a poem about {topic}",
         "Read the passage about {topic} and answer the question.",
         "What are the pros and cons of {topic}?", "Describe the history of {topic}",
         "Rewrite this paragraph about {topic} in simpler words:",
         "Create a short quiz about {topic}", "Write a dialogue about {topic}",
         "Give step-by-step instructions related to {topic}", "Why is {topic}",
         "Write a product description for something related to {topic}",
         "List five facts about {topic}", "Plan a week of activities around {topic}",
         "Write a persuasive paragraph about {topic}", "Answer briefly: how does {topic}")
TOPICS = ("photosynthesis", "the Roman Empire", "climate change", "machine learning", "cooking "
          "pasta", "personal finance", "the solar system", "football", "jazz music",
          "healthy sleep", "electric cars", "the French Revolution", "volcanoes", "gardening",
          "learning a language", "prime numbers", "the human heart", "social media",
          "ancient Egypt", "job interviews", "renewable energy", "coffee", "chess",
          "the internet", "vaccines", "mountain hiking", "probability", "city planning",
          "honeybees", "the stock market", "public speaking", "recycling", "black holes",
          "painting", "time management", "the ocean", "video games", "democracy",
          "bread baking", "earthquakes", "friendship", "Python programming", "geometry",
          "the Renaissance", "birds", "running a small business", "nutrition", "rain forests",
          "space travel", "photography", "world trade", "the printing press", "cats",
          "volunteering", "fractions", "weather forecasts", "traffic safety", "libraries")
LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese", "Dutch")
#: requests for the passage the target writes first, in a passage conversation
PASSAGE_REQUESTS = ("Write an informative article about {topic}.",
                    "Write a news report about {topic}.", "Write an encyclopedia entry on {topic}.",
                    "Write a short story about {topic}.", "Write a blog post about {topic}.",
                    "Write a detailed explanation of {topic}.",
                    "Write a letter to a friend about {topic}.")
#: what the user then asks of the passage (placed before or after it in their message)
PASSAGE_TASKS = ("Summarize the following text in a few sentences.",
                 "Summarize the article.", "What is the main idea of this text?",
                 "List the key points of the passage.", "Write a title for this text.",
                 "Answer using only the passage: what does it say about {topic}?",
                 "Rewrite the text in simpler words.", "Which facts in the passage are the most "
                 "surprising, and why?", "Write three questions a reader could answer from "
                 "this text, with their answers.", "Continue the text with one more paragraph.",
                 "Explain the passage to a child.", "Translate the first two sentences into "
                 "{language}.")
#: the share of passage conversations (where the settings allow passages)
PASSAGE_SHARE = 0.3
#: temperature of a passage (fluent text on the topic, not the greedy one every time)
PASSAGE_TEMPERATURE = 0.7
#: top-p of every sampled token, as self_data's
TOP_P = 0.95
#: uniforms a sampled row takes for one draw (each lands in the nucleus with chance >= TOP_P)
DRAW_TRIES = 4


def opener(rng: random.Random) -> str:
    """The start of a user turn: a template on a topic, a translation request, or one of
    self_data's openers."""
    draw = rng.random()
    if draw < 0.15:
        return rng.choice(OPENERS)
    if draw < 0.25:
        return f"Translate {rng.choice(LANGUAGES)} to English: a sentence about {rng.choice(TOPICS)}:"
    return rng.choice(TASKS).format(topic=rng.choice(TOPICS))


def draw_tokens(logits: list[torch.Tensor], temperatures: list[float],
                generators: list[torch.Generator]) -> list[int]:
    """A token from each row of ``logits`` (each [V]) at its temperature with its generator:
    the argmax at temperature 0, else top-p sampling, all rows in one kernel call (one thread
    a row, so a row's token does not depend on the rows beside it). A sampled row takes
    ``DRAW_TRIES`` uniforms from its generator a call; the few whose every draw fell outside the
    nucleus take more in a call of their own."""
    tokens = [-1] * len(logits)
    rows = list(range(len(logits)))
    stacked = torch.stack([row.float() for row in logits])
    while rows:
        uniforms = torch.stack([torch.rand(DRAW_TRIES, generator=generators[i])
                                if temperatures[i] > 0 else torch.zeros(DRAW_TRIES) for i in rows])
        drawn = kernels.draw_tokens(stacked if len(rows) == len(logits) else stacked[rows],
                                    torch.tensor([float(temperatures[i]) for i in rows]),
                                    uniforms, TOP_P).tolist()
        for i, token in zip(rows, drawn):
            tokens[i] = token
        rows = [i for i in rows if tokens[i] < 0]
    return tokens


@dataclass(frozen=True)
class Settings:
    """What a shard's conversations depend on (a resumed run must repeat them)."""

    fingerprint: str
    prompt_tokens: int
    answer_tokens: int
    seed: int
    #: most tokens of a passage (0: no passage conversations)
    passage_tokens: int = 0

    @property
    def key(self) -> str:
        text = json.dumps(self.__dict__, sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    @property
    def context(self) -> int:
        """Positions a conversation can reach: its longest prompt (the user header, an opener
        and a user turn in the chat template; or an instruction and a passage) and answer."""
        return max(2 * self.prompt_tokens, self.passage_tokens + 64) + self.answer_tokens + 128


@dataclass(frozen=True)
class Plan:
    """How one conversation is written: a first stage the target writes, then its answer.
    ``instruction`` None: the first stage is a user turn written after the user header and
    ``opener``; else a passage answering the writing request ``opener``, and the user then
    gives ``instruction`` with the passage (``before``: the instruction first)."""

    opener: str
    answer_temperature: float
    instruction: str | None = None
    before: bool = True

    def first_prompt(self, tokenizer, header: str) -> list[int]:
        if self.instruction is None:
            return tokenizer(header + self.opener, add_special_tokens=False)["input_ids"]
        return chat_prompt(tokenizer, self.opener)

    @property
    def first_temperature(self) -> float:
        return 1.0 if self.instruction is None else PASSAGE_TEMPERATURE

    def first_tokens(self, settings: Settings) -> int:
        return settings.prompt_tokens if self.instruction is None else settings.passage_tokens

    def answer_prompt(self, tokenizer, written: list[int]) -> list[int]:
        """The chat prompt the answer follows, given the first stage's tokens."""
        if self.instruction is None:
            return answer_prompt(tokenizer, self.opener, written)
        passage = tokenizer.decode(written, skip_special_tokens=True).strip()
        parts = [self.instruction, passage] if self.before else [passage, self.instruction]
        return chat_prompt(tokenizer, "\n\n".join(parts))


def plan(rng: random.Random, settings: Settings) -> Plan:
    """Conversation plan from ``rng``: a passage one with chance PASSAGE_SHARE (where the
    settings allow passages), else a self-written user turn; the answer greedy or at 0.7."""
    temperature = 0.0 if rng.random() < 0.5 else 0.7
    if settings.passage_tokens <= 0 or rng.random() >= PASSAGE_SHARE:
        return Plan(opener(rng), temperature)
    topic = rng.choice(TOPICS)
    instruction = rng.choice(PASSAGE_TASKS).format(topic=topic, language=rng.choice(LANGUAGES))
    return Plan(rng.choice(PASSAGE_REQUESTS).format(topic=topic), temperature, instruction,
                rng.random() < 0.5)


@dataclass
class _Slot:
    """One conversation being written on its own replica."""

    index: int
    runner: object
    generator: torch.Generator
    plan: Plan
    stage: str = "first"  # "first": writing the user turn or passage; "answer": answering it
    prompt: list[int] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    call: object = None
    #: the answer stage's passes, where the writer captures features (its prompt's, then a
    #: row a token)
    passes: list = field(default_factory=list)

    @property
    def temperature(self) -> float:
        """Of the token being written: the first stage's, or the answer's."""
        first = self.stage == "first"
        return self.plan.first_temperature if first else self.plan.answer_temperature


class Writer:
    """Conversations ``index`` = 0, 1, ... of one shard's settings, written in one batch of
    replicas of ``runner`` (one slot each)."""

    def __init__(self, runner, tokenizer, eos: set[int], settings: Settings, batch: int,
                 needs: Needs = NOTHING):
        require(runner.packs_calls, f"the {runner.name} runner does not pack calls into one "
                                    "forward; `train data` needs the native runner (--runner native)")
        self.runner, self.tokenizer, self.eos, self.settings = runner, tokenizer, eos, settings
        #: the features captured of every answer stage's rows (NOTHING: none)
        self.needs = needs
        self.header = user_header(tokenizer)
        self.replicas = [runner] + [runner.replica() for _ in range(batch - 1)]
        self.forwards = 0
        self.rows = 0  # sequences over all forwards (decode rows and prompts)
        self.written = 0  # tokens the target wrote (user turns and answers)
        self.dropped = 0  # conversations in flight at a deadline

    def _slot(self, index: int, runner) -> _Slot:
        rng = random.Random(self.settings.seed * 1_000_003 + index)
        generator = torch.Generator().manual_seed(rng.getrandbits(62))
        slot = _Slot(index, runner, generator, plan(rng, self.settings))
        slot.prompt = slot.plan.first_prompt(self.tokenizer, self.header)
        slot.call = PrefillCall(tuple(slot.prompt), 0, len(slot.prompt))
        return slot

    def _advance(self, slot: _Slot, token: int) -> Conversation | None:
        """Append the slot's next token; the conversation once its answer ends (where features
        are captured, after one more pass reads its last token)."""
        if slot.stage == "last":
            return slot.prompt + slot.written, len(slot.prompt)
        first = slot.stage == "first"
        slot.written.append(token)
        self.written += 1
        limit = slot.plan.first_tokens(self.settings) if first else self.settings.answer_tokens
        needs = NOTHING if first else self.needs
        if token not in self.eos and len(slot.written) < limit:
            slot.call = VerifyCall(token, Draft.empty(), needs)
            return None
        if not first and needs == NOTHING:
            return slot.prompt + slot.written, len(slot.prompt)
        if not first:  # the features of the last token too: a row whose drawn token is dropped
            slot.stage, slot.call = "last", VerifyCall(token, Draft.empty(), needs)
            return None
        slot.stage, slot.prompt = "answer", slot.plan.answer_prompt(self.tokenizer, slot.written)
        slot.written = []
        slot.call = PrefillCall(tuple(slot.prompt), 0, len(slot.prompt), self.needs)
        return None

    def _most_forwards(self) -> int:
        """The most forwards a conversation takes: its longer first stage and its answer, a
        token a forward (the answer's prompt is prefilled in the forward that draws its first
        token), and the features' row of the answer's last token."""
        settings = self.settings
        return (max(settings.prompt_tokens, settings.passage_tokens) + settings.answer_tokens
                + int(self.needs != NOTHING))

    def write(self, todo, deadline: float, clock=time.monotonic):
        """Yield (index, conversation, features) for each index of the iterator ``todo``, as
        they finish (not in order), until ``todo`` is spent or ``deadline`` (``clock``'s time)
        passes; ``features``: the conversation's every row's (a ForwardOutput without logits),
        None where ``needs`` asks for none. Near the deadline the batch drains: a
        conversation is begun only where its most forwards, at the recent seconds a forward,
        end before the deadline, so the forwards spent on those in flight are kept. Those
        still in flight at the deadline are dropped (counted in ``dropped``)."""
        # replicas first: zip stops at the last replica without drawing an index it would drop
        slots = [self._slot(i, r) for r, i in zip(self.replicas, todo)]
        forward_s = None  # recent seconds a forward (a moving average)
        while slots and clock() < deadline:
            began = clock()
            outs = self.runner.run_packed([(s.runner, s.call) for s in slots])
            took = clock() - began
            forward_s = took if forward_s is None else 0.8 * forward_s + 0.2 * took
            self.forwards += 1
            self.rows += len(slots)
            following = []
            tokens = draw_tokens([out.logits[0] for out in outs],
                                 [s.temperature for s in slots],
                                 [s.generator for s in slots])
            for slot, token, out in zip(slots, tokens, outs):
                if slot.call.needs != NOTHING:  # copies: the runner may reuse its buffers
                    slot.passes.append(ForwardOutput(
                        None, out.final_hidden.clone(),
                        {n: rows.clone() for n, rows in out.layers.items()}))
                if isinstance(slot.call, VerifyCall):
                    slot.runner.commit([])
                done = self._advance(slot, token)
                if done is None:
                    following.append(slot)
                    continue
                yield slot.index, done, stacked(slot.passes) if slot.passes else None
                if clock() + self._most_forwards() * forward_s >= deadline:
                    continue  # draining: this replica stays idle
                index = next(todo, None)
                if index is not None:
                    following.append(self._slot(index, slot.runner))
            slots = following
        self.dropped += len(slots)


class GenerateWriter:
    """The shard's conversations written by ``transformers``' batched ``generate`` on a CUDA GPU
    (the native runner's kernels are the CPU's): ``batch`` at a time, the user turns sampled
    (temperature 1, top-p 0.95) and passages (0.7), each answer greedy or at 0.7 as its
    conversation's plan drew, a ``generate`` per token limit and temperature. Sampling draws
    from torch's generator, so a conversation is not the same in every run (a resumed run
    still skips the ids written)."""

    def __init__(self, model, tokenizer, eos: set[int], settings: Settings, batch: int):
        self.model, self.tokenizer, self.eos, self.settings = model, tokenizer, eos, settings
        self.batch = batch
        self.header = user_header(tokenizer)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
            tokenizer.eos_token_id
        self.forwards = 0
        self.written = 0
        self.dropped = 0  # conversations cut short by a deadline

    @property
    def rows(self) -> int:
        """Rows that wrote a token (a finished sequence's padding rows not counted)."""
        return self.written

    def _generate(self, prompts: list[list[int]], tokens: int, temperature: float,
                  deadline: float) -> list[list[int]]:
        out = generate(self.model, prompts, tokens, self.pad, self.eos, temperature,
                       deadline - time.monotonic())
        self.forwards += max(map(len, out))
        self.written += sum(map(len, out))
        return out

    def _stage(self, prompts: list[list[int]], limits: list[int], temperatures: list[float],
               deadline: float) -> list[list[int]]:
        """Each prompt's continuation, a ``generate`` per (token limit, temperature)."""
        out: dict[int, list[int]] = {}
        for limit, temperature in sorted(set(zip(limits, temperatures))):
            group = [j for j, key in enumerate(zip(limits, temperatures))
                     if key == (limit, temperature)]
            written = self._generate([prompts[j] for j in group], limit, temperature, deadline)
            out.update(zip(group, written))
        return [out[j] for j in range(len(prompts))]

    def write(self, todo, deadline: float):
        """Yield (index, conversation, None) for each index of ``todo``, a batch at a time,
        until ``todo`` is spent or ``deadline`` (time.monotonic) passes (no features: a
        ``generate`` returns none)."""
        settings = self.settings
        while time.monotonic() < deadline:
            indices = [i for _, i in zip(range(self.batch), todo)]
            if not indices:
                return
            plans = [plan(random.Random(settings.seed * 1_000_003 + i), settings)
                     for i in indices]
            firsts = self._stage([p.first_prompt(self.tokenizer, self.header) for p in plans],
                                 [p.first_tokens(settings) for p in plans],
                                 [p.first_temperature for p in plans], deadline)
            prompts = [p.answer_prompt(self.tokenizer, w) for p, w in zip(plans, firsts)]
            answers = self._stage(prompts, [settings.answer_tokens] * len(plans),
                                  [p.answer_temperature for p in plans], deadline)
            if time.monotonic() >= deadline:
                self.dropped += len(indices)
                return  # cut short by max_time: not written whole
            for index, prompt, answer in zip(indices, prompts, answers):
                yield index, (prompt + answer, len(prompt)), None


# ---- the shard ------------------------------------------------------------------------------

def read_shard(path: Path, settings: Settings | None = None,
               repair: bool = False) -> dict[int, Conversation]:
    """{index: (ids, prompt length)} of a shard, without a last line cut short (an interrupted
    run's, or one a running writer is appending). ``repair``: drop that line from the file too
    (only the writer that appends next may: a reader would cut a line being written).
    ``settings``: refuse a shard written with others."""
    if not path.is_file():
        return {}
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    if repair and len(complete) < len(raw):
        path.write_bytes(complete)
    out = {}
    for line in complete.decode().splitlines():
        record = json.loads(line)
        require(settings is None or record["settings"] == settings.key,
                f"{path} holds conversations written with other settings (model, token limits "
                "or seed); give another --out or the same settings")
        out[record["index"]] = (record["ids"], record["prompt_len"])
    return out


def write_shard(writer: Writer, path: Path, count: int, seconds: float, show=print,
                store: FeatureStore | None = None) -> int:
    """Append conversations until the shard holds ``count`` or ``seconds`` pass; the number
    written now. ``store``: where the features the writer captured are kept (before the
    conversation's line, so a line never lacks the features it was written with)."""
    done = read_shard(path, writer.settings, repair=True)
    todo = iter([i for i in range(count) if i not in done])
    path.parent.mkdir(parents=True, exist_ok=True)
    new = 0
    with path.open("a") as shard:
        for index, (ids, prompt_len), features in writer.write(todo, time.monotonic() + seconds):
            if store is not None and features is not None:
                store.save(ids, features)
            shard.write(json.dumps({"index": index, "settings": writer.settings.key,
                                    "prompt_len": prompt_len, "ids": ids}) + "\n")
            shard.flush()
            new += 1
            if new % 16 == 0:
                show(f"data {len(done) + new}/{count} conversations")
    return new


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="the JSON-lines shard (appended to; ids already in it are skipped)")
    parser.add_argument("--model", default="smollm2",
                        help="target: 'smollm2' (default), a .gguf file or a checkpoint folder")
    parser.add_argument("--weights", default="auto", help="the native runner's weight format")
    parser.add_argument("--count", type=int, default=1000, help="conversations the shard holds")
    parser.add_argument("--batch", type=int, default=32,
                        help="conversations written at once: rows of each forward (16-64)")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="most tokens of a self-written user turn")
    parser.add_argument("--answer-tokens", type=int, default=256, help="most tokens of an answer")
    parser.add_argument("--passage-tokens", type=int, default=256,
                        help=f"most tokens of a passage the target writes and is then asked "
                             f"about ({PASSAGE_SHARE * 100:.0f}%% of the conversations; 0: none)")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="wall-clock budget")
    parser.add_argument("--runner", default="auto", choices=["auto", "native", "hf"],
                        help="native: packed forwards on the CPU kernels; hf: transformers' "
                             "batched generate (on a CUDA GPU); auto: hf where torch sees a GPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--features", default="", metavar="KINDS",
                        help="keep the target's features that these draft-head kinds read "
                             "(comma-separated: hydra, eagle, deer, clover), captured in the "
                             "forwards that write the conversations, beside the shard in "
                             "FILE.features/: `train heads --shard FILE` then reads no "
                             "conversation again (native runner; float32, 6 KB a token and "
                             "layer on a 1,536-wide target)")


def feature_kinds(text: str) -> list[str]:
    """The draft-head kinds ``--features`` names (comma-separated), checked."""
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    for kind in kinds:
        require(kind in NETWORKS, f"--features: unknown kind {kind!r}; choose from "
                                  f"{', '.join(sorted(NETWORKS))}")
    return kinds


def feature_needs(kinds: list[str], num_layers: int) -> Needs:
    """What the forwards capture for ``kinds``: the final hidden states and every layer one of
    them reads (NOTHING where none is named)."""
    if not kinds:
        return NOTHING
    layers = sorted({layer for kind in kinds for layer in feature_layers(kind, num_layers)})
    return Needs(final_hidden=True, layers=tuple(layers))


def run(args: argparse.Namespace) -> int:
    from specdecode.api import eos_ids
    from specdecode.models.loading import load_model, make_runner

    require(args.count > 0 and args.batch > 0 and args.max_minutes > 0,
            "--count, --batch and --max-minutes must be positive")
    require(args.prompt_tokens > 0 and args.answer_tokens > 0 and args.passage_tokens >= 0,
            "--prompt-tokens and --answer-tokens must be positive, --passage-tokens at least 0")
    kinds = feature_kinds(args.features)
    loaded = load_model(args.model)
    eos = set(eos_ids(loaded, loaded.tokenizer))
    device = training_device()
    store = None
    if args.runner == "hf" or (args.runner == "auto" and device != "cpu"):
        from specdecode.models.hf import HFRunner

        require(not kinds, "--features captures the native runner's features; on a "
                                   "GPU leave it out (`train heads` reads them there in padded "
                                   "batches) or pass --runner native")

        model = loaded.model.to(device).eval()
        settings = Settings(HFRunner(model).fingerprint(), args.prompt_tokens,
                            args.answer_tokens, args.seed, args.passage_tokens)
        writer = GenerateWriter(model, loaded.tokenizer, eos, settings, args.batch)
    else:
        limits = Settings("", args.prompt_tokens, args.answer_tokens, args.seed,
                          args.passage_tokens)
        runner = make_runner(loaded, "native", args.weights, limits.context)
        settings = dataclasses.replace(limits, fingerprint=runner.fingerprint())
        needs = feature_needs(kinds, runner.num_layers)
        writer = Writer(runner, loaded.tokenizer, eos, settings, args.batch, needs)
        if needs != NOTHING:
            store = FeatureStore(Path(args.out), reader_name(runner), runner.fingerprint())
    started = time.monotonic()
    new = write_shard(writer, Path(args.out), args.count, 60 * args.max_minutes, store=store)
    took = time.monotonic() - started
    print(json.dumps({"conversations_written": new, "conversations_dropped": writer.dropped,
                      "tokens_written": writer.written,
                      "seconds": round(took, 1),
                      "tokens_per_s": round(writer.written / took, 1) if took else None,
                      "forwards": writer.forwards,
                      "rows_per_forward": round(writer.rows / max(writer.forwards, 1), 1)}))
    return 0
