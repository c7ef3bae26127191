"""The Python API: decode with any method from a model you already hold.

    import specdecode
    result = specdecode.generate(model, tokenizer, "Summarize: ...", method="suffix")
    result.text, result.token_ids, result.stats.mean_accepted

    decoder = specdecode.Decoder(model, tokenizer, method="recycling")   # keeps proposer state
    for piece in decoder.stream("Tell me a story", max_new_tokens=64):   # text as it is produced
        print(piece, end="")

``model`` is a ``transformers`` causal LM or a :class:`specdecode.models.base.Runner`. Keyword
arguments are split by name: sampling options (temperature, top_k, ..., logprobs) go to
:class:`SamplingParams`, constraints (``json_schema``, ``regex``, ``grammar``, ``json_object``,
``banned``; docs/structured-output.md) to :func:`specdecode.constraints.make_constraint`,
everything else to the method's frozen config.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from specdecode import registry
from specdecode.constraints import Vocabulary, make_constraint
from specdecode.detokenize import IncrementalText, special_tokens, token_id
from specdecode.drafting.caches import NativeDraftLM
from specdecode.engine import Generation, GenerationStats, TokenLogprob, check_ids
from specdecode.errors import SpecDecodeError, require
from specdecode.fim import fim_tokens
from specdecode.models.base import Runner
from specdecode.models.kv_cache import common_prefix, held_ids
from specdecode.models.prompt_cache_file import PromptCacheFile, rows_key
from specdecode.sampling import SamplingParams
from specdecode.sizing import method_sizing

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
#: keyword arguments that build the request's constraint (:func:`make_constraint`)
CONSTRAINT_FIELDS = frozenset(("json_schema", "regex", "grammar", "json_object", "banned",
                               "jump_forward"))


@dataclass
class GenerationResult:
    text: str
    #: the new tokens only
    token_ids: list[int]
    method: str
    stats: GenerationStats
    #: "stop" (end-of-sequence, a stop string, a finished grammar) or "length"
    finish_reason: str
    #: one per new token when the request asked for ``logprobs``
    logprobs: list[TokenLogprob] | None = None
    #: the method's output differs from ``ar``'s on purpose (docs/lossy.md)
    lossy: bool = False
    #: one per prompt token (the first None) when the request asked for ``prompt_logprobs``
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: the stop string that ended the text, if one did (vLLM's ``stop_reason``)
    stop_string: str | None = None

    def as_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "method": self.method,
               "lossy": self.lossy, "finish_reason": self.finish_reason,
               "stats": self.stats.as_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [dataclasses.asdict(p) for p in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [p and dataclasses.asdict(p) for p in self.prompt_logprobs]
        if self.stop_string is not None:
            out["stop_string"] = self.stop_string
        return out


class Piece(str):
    """A streamed text piece; ``logprobs`` holds the log-probabilities of the tokens committed
    since the last piece (when the request asked for them), and the first piece the prompt's
    (``prompt_logprobs``, when asked for)."""

    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def as_runner(model) -> Runner:
    if isinstance(model, Runner):
        return model
    from specdecode.models.hf import HFRunner

    return HFRunner(model)


#: tokens that end an assistant's turn whatever the tokenizer's end of sequence: gpt-oss's
#: (harmony's) end of an answer and of a tool call, as its own generation config lists them
TURN_ENDS = ("<|return|>", "<|call|>")


def turn_ends(tokenizer) -> list[int]:
    """The ids of :data:`TURN_ENDS` that are special tokens of ``tokenizer`` (none for one that
    lists no special tokens: a stand-in of a few methods)."""
    if not hasattr(tokenizer, "all_special_ids") or not hasattr(tokenizer, "added_tokens_decoder"):
        return []
    special = special_tokens(tokenizer)
    return [special[t] for t in TURN_ENDS if t in special]


#: texts of the tokens that end generation in a GGUF file's vocabulary, as llama.cpp reads them
#: (llama-vocab.cpp's end-of-generation list, its common part): a GGUF file names one end of
#: sequence where a model's generation config lists several (Llama 3's <|eot_id|>, <|eom_id|>
#: and <|end_of_text|>; Phi-3's <|endoftext|> and <|end|>; Qwen2.5's <|im_end|> and
#: <|endoftext|>, and the tags that end a filled-in middle)
GGUF_ENDS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>",
             "<|end|>", "<end_of_turn>", "<EOT>", "<｜end▁of▁sentence｜>", "<|fim_pad|>",
             "<|repo_name|>", "<|file_sep|>")


def gguf_ends(tokenizer) -> list[int]:
    """The ids of :data:`GGUF_ENDS` the vocabulary holds; harmony's ``<|end|>`` left out (it
    ends one message of an answer, which ``<|return|>`` ends)."""
    harmony = token_id(tokenizer, "<|return|>") is not None
    found = (token_id(tokenizer, t) for t in GGUF_ENDS if not (harmony and t == "<|end|>"))
    return [i for i in found if i is not None]


def eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids as ``transformers.generate`` would use them: the generation config's,
    else the tokenizer's; for a GGUF file (one end of sequence, where a generation config may
    list several) also the :func:`gguf_ends` llama.cpp stops at; and the tokenizer's
    :func:`turn_ends`."""
    config = (getattr(model, "generation_config", None)
              or getattr(getattr(model, "model", None), "generation_config", None))
    eos = getattr(config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    found = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    if getattr(model, "gguf_path", None) is not None and tokenizer is not None:
        found += [i for i in gguf_ends(tokenizer) if i not in found]
    return with_turn_ends(found, tokenizer)


def with_turn_ends(eos: Sequence[int], tokenizer) -> list[int]:
    """``eos`` and the tokenizer's :func:`turn_ends` not among them."""
    return list(eos) + [i for i in turn_ends(tokenizer) if i not in eos]


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sampling and constraint options (given to :meth:`Decoder.start`) apart from the method
    config; the sampling options are checked here."""
    request = {k: v for k, v in options.items()
               if k in SAMPLING_FIELDS | CONSTRAINT_FIELDS and v is not None}
    config = {k: v for k, v in options.items() if k not in SAMPLING_FIELDS | CONSTRAINT_FIELDS}
    SamplingParams(**{k: v for k, v in request.items() if k in SAMPLING_FIELDS})
    return request, config


def encode_prompt(tokenizer, prompt, chat: bool = True, tools: list[dict] | None = None,
                  template_kwargs: dict[str, Any] | None = None,
                  add_special_tokens: bool = True) -> list[int]:
    """Token ids of a prompt: text (chat-templated when ``chat`` and the tokenizer has a
    template), chat messages, or ids as they are. ``tools``: OpenAI function definitions the
    chat template shows the model, and ``template_kwargs`` its other variables (Qwen3's
    ``enable_thinking``; messages only). ``add_special_tokens``: False leaves out the BOS (or
    other tokens) the tokenizer puts around plain text. Needs no model, so a server front end
    that only routes requests (``specdecode serve --replicas``) encodes with it too."""
    if isinstance(prompt, str):
        require(prompt.strip() != "", "the prompt is empty; give some text")
        require(tokenizer is not None, "a text prompt needs a tokenizer")
        if chat and getattr(tokenizer, "chat_template", None):
            return _template(tokenizer, [{"role": "user", "content": prompt}])
        plain = {} if add_special_tokens else {"add_special_tokens": False}  # stand-ins take none
        return list(tokenizer(prompt, **plain)["input_ids"])
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        require(tokenizer is not None, "chat messages need a tokenizer")
        return _template(tokenizer, list(prompt), tools, template_kwargs or {})
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise SpecDecodeError("prompt must be text, a list of chat messages or a list of token ids")


def _template(tokenizer, messages: list[dict], tools: list[dict] | None = None,
              template_kwargs: dict[str, Any] | None = None) -> list[int]:
    try:
        # the template's variables may continue the last message instead of opening a turn
        options = {"add_generation_prompt": True, **(template_kwargs or {})}
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, **options)
    except Exception as exc:  # jinja errors: malformed messages
        missing = re.search(r"has no attribute '(\w+)'", str(exc))
        fix = (f"; the template reads a field {missing.group(1)!r} that the request does not give "
               "(gpt-oss's reads every function's 'description'): give it" if missing else "")
        raise SpecDecodeError(f"cannot apply the chat template to these messages: {exc}{fix}"
                              ) from None
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


class Decoder:
    """A target, a tokenizer and one method's proposer, reused across requests (so proposers
    that learn across requests, such as the suffix tree, keep what they learnt)."""

    def __init__(self, model, tokenizer=None, method: str | None = None,
                 eos_token_ids: Sequence[int] | None = None, *, make_proposer=None,
                 vocabulary: Vocabulary | None = None, draft_budget: str = "goodput",
                 reuse_prompt: bool = True, **config):
        """``draft_budget``: ``goodput`` (each step's draft capped where expected tokens per
        second of the runner's row costs is highest, down to none where drafts do not pay:
        specdecode/sizing.py) or ``full`` (drafts as the proposer makes them).
        ``reuse_prompt``: a prompt that starts with the last request's prompt and answer (a
        conversation's next turn) prefills only what follows them, where the runner's rows
        allow it (the native runner's int4 and int8: the same logits, bitwise).
        ``make_proposer(method name, config, runner)``: builds the proposer instead of the
        method's class (the server hands shared state, such as the global suffix tree, this
        way). ``vocabulary``: the tokens as constraints see them (default: built from
        ``tokenizer`` on the first constrained request). A lossy method's (``self.method.lossy``,
        see docs/lossy.md) ``proposer`` is its :class:`specdecode.lossy.base.LossyMethod`, and its
        output differs from ``ar``'s."""
        self.runner = as_runner(model)
        self.tokenizer = tokenizer
        self.method = registry.get(method or registry.DEFAULT_METHOD)
        self.config = self.method.make_config(config)
        if make_proposer is None:
            self.proposer = self.method.proposer(self.config, self.runner)
        else:
            self.proposer = make_proposer(self.method.name, self.config, self.runner)
        self.eos_token_ids = list(eos_ids(model, tokenizer) if eos_token_ids is None else eos_token_ids)
        self._vocabulary = vocabulary
        #: the method's draft sizing on this runner (None: drafts as the proposer makes them)
        self.sizing = method_sizing(self.method, self.runner, draft_budget)
        self.reuse_prompt = reuse_prompt

    @property
    def vocabulary(self) -> Vocabulary:
        if self._vocabulary is None:
            require(self.tokenizer is not None, "constraints need a tokenizer (or a vocabulary)")
            self._vocabulary = Vocabulary(self.tokenizer, self.runner.vocab_size,
                                          self.eos_token_ids)
        return self._vocabulary

    def encode(self, prompt, chat: bool = True) -> list[int]:
        """Text (chat-templated when the tokenizer has a template), chat messages, or ids."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def start(self, prompt, max_new_tokens: int = 128, chat: bool = True,
              suffix: str | None = None, ignore_eos: bool = False,
              stop_token_ids: Sequence[int] = (), **sampling) -> Generation:
        """A :class:`Generation` over token chunks (the lowest level of streaming); a lossy
        method's :class:`specdecode.lossy.base.LossyGeneration`, iterated the same way.
        ``suffix``: fill in the middle (specdecode/fim.py): ``prompt`` is the text (or token
        ids) before the insertion point, ``suffix`` the text after it, framed by the model's
        tags instead of a chat template, and the tokens that end a middle end the answer.
        ``ignore_eos``: the model's end tokens do not end the answer (it runs to
        ``max_new_tokens``); ``stop_token_ids``: tokens that end it beside them.
        ``sampling``: :class:`SamplingParams` fields and the constraint options
        (``json_schema``, ``regex``, ``grammar``, ``json_object``, ``banned``)."""
        asked = {k: sampling.pop(k) for k in CONSTRAINT_FIELDS & sampling.keys()}
        if any(v not in (None, False, (), []) for k, v in asked.items() if k != "jump_forward"):
            require(sampling.get("constraint") is None,
                    "give constraint options or a built constraint, not both")
            sampling["constraint"] = make_constraint(self.vocabulary, **asked)
        params = SamplingParams(**sampling)
        if suffix is None:
            ids, ends = self.encode(prompt, chat), self.eos_token_ids
        else:
            ids, ends = self.fill_in(prompt, suffix)
        check_ids(stop_token_ids, self.runner.vocab_size, "stop_token_ids")
        ends = list(dict.fromkeys([*([] if ignore_eos else ends), *stop_token_ids]))
        if self.method.lossy:  # its own decode loop (specdecode/lossy/)
            return self.proposer.generation(ids, max_new_tokens, params, ends)
        sizer = None if self.sizing is None else self.sizing.sequence(params)
        return Generation(self.runner, self.proposer, ids, max_new_tokens, params, ends,
                          sizer=sizer, reuse_prefix=self.reuse_prompt)

    def fill_in(self, prefix, suffix: str) -> tuple[list[int], list[int]]:
        """The fill-in-the-middle prompt between ``prefix`` (text or ids) and ``suffix``, and
        the ids that end its answer (the model's and the tokens that end a middle)."""
        require(self.tokenizer is not None, "filling in a middle needs a tokenizer")
        fim = fim_tokens(self.tokenizer)
        ends = self.eos_token_ids + [e for e in fim.ends if e not in self.eos_token_ids]
        return fim.prompt(self.tokenizer, prefix, suffix), ends

    def save_prompt_cache(self, path: str | os.PathLike) -> int:
        """Write the rows the runner holds (the last request's prompt and answer, which
        ``reuse_prompt`` reuses in this process) to the safetensors file ``path`` in place of
        what it held, for :meth:`load_prompt_cache` in a later process; the tokens written (a
        failed write is logged, not raised; where the runner holds no known rows, as after a
        lossy method's request, the file is left as it was). A draft model read from a file
        (``draft_model``, ``dyspec``, ... with ``draft=FILE.gguf``) has its own rows written
        beside them. A SpecDecodeError where the rows cannot be kept: only the native runner's
        int4 and int8 weights read from a model file keep them."""
        file = PromptCacheFile(path, rows_key(self.runner))
        ids = self.runner.held_tokens()
        if len(ids):
            draft = self._kept_draft()
            kept = None if draft is None else draft[1].kept_rows()
            file.write([(ids, self.runner.saved_rows(len(ids)))],
                       (draft[0], *kept) if kept and kept[0] else None)  # a draft that read
        return len(ids)

    def load_prompt_cache(self, path: str | os.PathLike, prompt=None, chat: bool = True) -> int:
        """Hold the rows the file ``path`` keeps (written by :meth:`save_prompt_cache`, or by a
        server's ``--prompt-cache-file``, for the same weights file, format and kernels), so
        that a next prompt starting with their tokens prefills only what follows, with bitwise
        the same answer (``reuse_prompt`` on). Of several entries, the one that shares the
        longest start with ``prompt`` (as :meth:`start` encodes it; None: the most recent).
        A draft model of the same file, format and kernels holds the draft rows written with
        them (the draft then reads only what follows too). The tokens held: 0 where the file
        is missing, or unreadable or written for other rows (a warning says which)."""
        file = PromptCacheFile(path, rows_key(self.runner))
        entries = file.read()
        if not entries:
            return 0
        ids, rows = entries[-1]
        if prompt is not None:
            wanted = held_ids(self.encode(prompt, chat))
            ids, rows = max(reversed(entries), key=lambda entry: common_prefix(entry[0], wanted))
        length = min(len(ids), self.runner.max_context)
        self.runner.load_rows(rows, length)
        self.runner.note_held(ids[:length])
        draft = self._kept_draft()
        kept = None if draft is None else file.read_draft(draft[0])
        if kept is not None:
            draft[1].hold_rows(*kept)
        return length

    def _kept_draft(self) -> tuple[str, NativeDraftLM] | None:
        """(its rows' key, the draft cache) of a draft model read from a file on the native
        runner (``draft_model``, ``dyspec``, ...), whose rows a prompt cache file keeps beside
        the target's, so that a later process's draft does not read the prompt again; else
        None."""
        lm = getattr(getattr(self.proposer, "session", None), "lm", None)
        if not isinstance(lm, NativeDraftLM):
            return None
        try:
            return rows_key(lm.runner.runner), lm
        except SpecDecodeError:  # a draft whose rows cannot be kept: it reads the prompt
            return None

    def stream(self, prompt, max_new_tokens: int = 128, chat: bool = True,
               stop: Sequence[str] = (), **sampling) -> TextStream:
        return TextStream(self, self.start(prompt, max_new_tokens, chat, **sampling), stop)

    def generate(self, prompt, max_new_tokens: int = 128, chat: bool = True,
                 stop: Sequence[str] = (), **sampling) -> GenerationResult:
        stream = self.stream(prompt, max_new_tokens, chat, stop, **sampling)
        for _ in stream:
            pass
        return stream.result


class TextStream:
    """Iterates text pieces as tokens are committed; ``result`` is set when it ends.

    Stop strings end the generation as soon as they appear; the returned text stops before
    the stop string, as in the OpenAI API.
    """

    def __init__(self, decoder: Decoder, generation: Generation, stop: Sequence[str] = (),
                 kept_tokens: Sequence[int] = (), limits=None):
        self.decoder = decoder
        self.generation = generation
        self.stop = [s for s in stop if s]
        #: ends the text where a stop string would not (llama.cpp's ``n_indent`` and
        #: ``t_max_predict_ms``: server/infill.py): ``limits.cut(text)`` the length the text
        #: keeps (None: go on), ``limits.held(text)`` characters at its end not to send yet
        self.limits = limits
        self._limited = False
        self.text = ""
        self.result: GenerationResult | None = None
        self._stop_found = False
        self._stop_string: str | None = None
        #: log-probabilities handed out with pieces so far, and whether the prompt's were
        self._reported = 0
        self._prompt_reported = False
        #: ``kept_tokens``: special tokens whose text stays in the text (a tool-call format's
        #: tags, :attr:`specdecode.server.tools.ToolFormat.kept_tokens`)
        self._tail_decoder = (None if decoder.tokenizer is None
                              else IncrementalText(decoder.tokenizer, kept_tokens))

    def __iter__(self) -> Iterator[str]:
        steps = self.steps()
        try:
            for piece in steps:
                if piece:
                    yield piece
        finally:
            steps.close()

    def steps(self) -> Iterator[str]:
        """One text piece per committed token chunk, possibly empty (text held back, special
        tokens), so a caller interleaving several generations gets control back every step."""
        chunks = iter(self.generation)
        try:
            for _ in chunks:
                yield self.feed()
                if self.stopped:
                    break
        finally:
            chunks.close()
        self.finish()

    @property
    def stopped(self) -> bool:
        """A stop string has appeared: the generation must end here."""
        return self._stop_found

    def feed(self) -> str:
        """The new text after the generation committed a chunk (a server stepping the
        generation itself calls this after each :meth:`Generation.advance`)."""
        if self._tail_decoder is None:  # no tokenizer
            return ""
        tokens, generation = self.generation.tokens, self.generation
        if generation.finish_reason == "stop" and tokens and tokens[-1] in generation.eos_token_ids:
            # the end token is not text, special or not (a middle's <|file_sep|> is not)
            tokens = tokens[:-1]
        full = self._tail_decoder.text(tokens)
        cut, stop = min(((i, s) for s in self.stop if (i := full.find(s)) >= 0),
                        default=(-1, None))
        limit = self.limits.cut(full) if self.limits is not None and cut < 0 else None
        if cut >= 0:
            full, self._stop_found, self._stop_string = full[:cut], True, stop
        elif limit is not None:
            full, self._stop_found, self._limited = full[:max(limit, len(self.text))], True, True
        elif self.generation.finish_reason is None:
            full = full[:len(full) - self._unsettled(full)]
        piece, self.text = Piece(full[len(self.text):]), full
        logprobs = self.generation.logprobs
        if piece and logprobs is not None:  # the tokens' log-probabilities ride with the text
            piece.logprobs, self._reported = logprobs[self._reported:], len(logprobs)
        if piece and not self._prompt_reported:
            piece.prompt_logprobs = getattr(self.generation, "prompt_logprobs", None)
            self._prompt_reported = True
        return piece

    def finish(self) -> GenerationResult:
        """The result, once the generation has ended (closed or finished)."""
        gen = self.generation
        finish = ("length" if self._limited else "stop" if self._stop_found
                  else gen.finish_reason or "stop")
        method = self.decoder.method
        self.result = GenerationResult(self.text, list(gen.tokens), method.name, gen.stats,
                                       finish,
                                       None if gen.logprobs is None else list(gen.logprobs),
                                       method.lossy, getattr(gen, "prompt_logprobs", None),
                                       self._stop_string)
        return self.result

    def _unsettled(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change, held back until they settle:
        half a multi-byte character (decoded as U+FFFD), what the limits hold, or the beginning
        of a stop string (a streamed piece must never carry part of a stop string that
        completes later)."""
        held = len(text) - len(text.rstrip("\ufffd"))
        if self.limits is not None:
            held = max(held, self.limits.held(text))
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held


def generate(model, tokenizer=None, prompt="", method: str | None = None,
             max_new_tokens: int = 128, chat: bool = True, stop: Sequence[str] = (),
             **options) -> GenerationResult:
    """One request: returns the text, the new token ids and the statistics. Options: sampling
    (``temperature``, ..., ``logprobs``), constraints (``json_schema``, ``regex``, ``grammar``,
    ``json_object``, ``banned``) and the method's config."""
    request, config = split_options(options)
    decoder = Decoder(model, tokenizer, method, **config)
    return decoder.generate(prompt, max_new_tokens, chat, stop, **request)


def stream(model, tokenizer=None, prompt="", method: str | None = None,
           max_new_tokens: int = 128, chat: bool = True, stop: Sequence[str] = (),
           **options) -> TextStream:
    """Like :func:`generate`, but iterate it for text pieces; ``.result`` holds the rest."""
    request, config = split_options(options)
    decoder = Decoder(model, tokenizer, method, **config)
    return decoder.stream(prompt, max_new_tokens, chat, stop, **request)
