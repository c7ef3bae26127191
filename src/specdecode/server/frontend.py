"""The state behind the routes, whatever generates the tokens: the server's settings, what the
routes know of the model, and the checks that turn a request into sequence specs before it
queues (model and method names, the method's config against its fields' limits, sampling
options, token limits, prompt length against the context). :class:`Server` is the
single-process front end over a local :class:`~.scheduler.Scheduler`; :mod:`.ray_serve` puts
the same front end before Ray Serve replicas.
"""

from __future__ import annotations

import contextlib
import copy
import queue
from dataclasses import dataclass, field
from typing import Any

from specdecode import registry
from specdecode.api import encode_prompt, with_turn_ends
from specdecode.constraints import Vocabulary, make_constraint
from specdecode.engine import check_ids, check_request
from specdecode.errors import SpecDecodeError
from specdecode.fim import fim_tokens
from specdecode.models.base import Runner
from specdecode.models.prompt_cache_file import PromptCacheFile, rows_key
from specdecode.sampling import SamplingParams
from specdecode.server import limits
from specdecode.server.artifacts import ARTIFACT_FIELDS, Catalogue
from specdecode.server.diffusion import Dllm, is_diffusion, make_factory, served_method
from specdecode.server.diffusion import check_request as check_diffusion
from specdecode.server.goodput import Batching
from specdecode.server.harmony import Harmony, harmony_of, in_final_message
from specdecode.server.memory import SharedMemory
from specdecode.server.metrics import Metrics
from specdecode.server.prompt_cache import PromptCache
from specdecode.server.protocol import ApiError, ChatRequest, SamplingFields, now
from specdecode.server.reasoning import Thinking, left_open, thinking_of
from specdecode.server.scheduler import Scheduler, SequenceSpec
from specdecode.server.tools import ToolError, ToolFormat, check_template

#: Host header names a server bound to loopback answers by default (DNS rebinding: a web page's
#: own name that resolves to 127.0.0.1 must not reach it)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: tokenizer copies, so one long prompt being encoded holds no other request up
TOKENIZER_COPIES = 4
#: largest seed + 1 (SamplingParams); choice i of a seeded request uses seed + i, wrapped
SEED_END = 2**64
#: the prompt's last tokens read for an open reasoning block (Qwen3's empty block, written when
#: thinking is off, is "<think>\n\n</think>\n\n": a few tokens)
PROMPT_TAIL = 16


@dataclass
class Settings:
    #: the name clients put in ``model`` (``default`` is always accepted too)
    model_id: str = "smollm2"
    #: the method used when a request names none
    method: str = registry.DEFAULT_METHOD
    #: config overrides of the default method (strings are coerced, as from the CLI)
    config: dict[str, Any] = field(default_factory=dict)
    #: sequences that may wait for a slot before requests get 429
    max_queue: int = 32
    #: largest accepted request body (bytes); larger ones get 413
    max_body_bytes: int = 2 * 1024 * 1024
    #: most choices per request
    max_n: int = 8
    #: max_tokens when the request gives none (capped by the context left)
    default_max_tokens: int = 256
    #: Host header names answered (others get 421); None = any (a server on a public address
    #: behind its own names)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS
    #: origins whose web pages may call the API (CORS); empty = none, no CORS headers at all
    cors_origins: tuple[str, ...] = ()
    #: proposer memory each slot may keep (its cache of per-config proposers); a request whose
    #: config alone needs more gets a 400
    proposer_memory_bytes: int = 128 * 2**20
    #: artifacts offered to requests by name (``--artifact NAME=PATH``), besides those found
    #: for the model in the package and the user cache
    artifacts: dict[str, str] = field(default_factory=dict)
    #: how sequences share forwards: draft budgets, draft rows and prompt rows a step
    batching: Batching = field(default_factory=Batching)
    #: memory for earlier prompts' rows that the slots wrote over (:mod:`.prompt_cache`);
    #: 0 = no prompt cache at all
    prompt_cache_bytes: int = 1024 * 2**20
    #: where the prompt cache is read from at start and written to on shutdown (None: kept in
    #: memory only)
    prompt_cache_file: str | None = None
    #: Responses API responses kept for ``previous_response_id`` (:mod:`.responses`)
    responses_kept: int = 256


@dataclass(frozen=True)
class ModelInfo:
    """What the routes need to know of the model without running it: the limits every request
    is checked against before it queues (``check_request`` reads these two fields of a runner)
    and the fingerprint clients see."""

    max_context: int
    vocab_size: int
    fingerprint: str
    #: prompt rows the runner prefills per part between other sequences' steps (0: in one call)
    prefill_granule: int = 0

    @classmethod
    def of(cls, runner: Runner) -> ModelInfo:
        return cls(runner.max_context, runner.vocab_size, runner.fingerprint(),
                   runner.prefill_granule)


class Frontend:
    """The state behind the routes, whatever generates the tokens: settings, the tokenizer
    (encoding only), metrics, and a backend that takes jobs (:class:`~.scheduler.Job`).

    The backend is the local :class:`Scheduler` (:class:`Server`) or a pool of Ray Serve engine
    replicas (:mod:`.ray_serve`); both offer ``start()``, ``submit(job)`` (raising a 429/503
    :class:`ApiError` when it cannot take the job), ``stop()``, ``alive``, ``parallel`` (sequences
    generated at once) and ``load()``, and post the same events to the job. ``memory`` is the
    cross-request memory, saved on shutdown (``save()``; ``path`` is where).
    """

    def __init__(self, backend, model: ModelInfo, tokenizer, settings: Settings,
                 metrics: Metrics, memory, catalogue: Catalogue | None = None,
                 dllm: Dllm | None = None):
        self.settings = settings
        #: the dLLM ``diffusion:POLICY`` requests decode (:mod:`.diffusion`); None: refused
        self.dllm = dllm
        method = registry.get(settings.method)
        method.make_config(settings.config)  # reject a bad default before serving
        self.backend = backend
        self.memory = memory
        self.metrics = metrics
        self.runner_info = model
        self.max_context = model.max_context
        self.catalogue = catalogue or Catalogue.for_target(model.fingerprint, settings.artifacts)
        # requests are encoded on the event loop's worker threads and (locally) decoded on the
        # scheduler thread; a fast tokenizer used from two threads at once can fail ("Already
        # borrowed"), so each encoding thread borrows a copy of its own from this pool
        self._tokenizers: queue.Queue = queue.Queue()
        for _ in range(TOKENIZER_COPIES):
            self._tokenizers.put(copy.deepcopy(tokenizer))
        #: the most characters one token stands for: a text of n characters has at least
        #: n / this many tokens, so an over-long prompt is refused before it is tokenized
        self.chars_per_token = max(1, max((len(t) for t in tokenizer.get_vocab()), default=1)
                                   if tokenizer is not None else 1)
        self.started = now()
        self.fingerprint = model.fingerprint
        self.tokenizer = tokenizer
        #: how the model's answers hold their reasoning (sent as reasoning_content): a block
        #: (Thinking), harmony's channels (Harmony, which hold its tool calls too), or not at all
        self.thinking: Thinking | Harmony | None = None
        if tokenizer is not None:
            self.thinking = harmony_of(tokenizer) or thinking_of(tokenizer)
        #: the ids ending a generation (a finished grammar allows them); the tokenizer's by
        #: default, and its turn ends
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = with_turn_ends([] if eos is None else [eos], tokenizer)
        self._vocabulary: Vocabulary | None = None

    @property
    def vocabulary(self) -> Vocabulary:
        """The tokens as constraints see them (grammars, bans, tool choices): built by
        :meth:`prepare`, else on the first request that needs them."""
        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.tokenizer, self.runner_info.vocab_size,
                                          self.eos_token_ids)
        return self._vocabulary

    def prepare(self) -> None:
        """Before serving: the vocabulary, so that the first constrained request does not wait
        for it (1.4 s for Qwen2.5's 151,936 tokens on a 2-core Zen 3, a first token 1.4 s late).
        A tokenizer it cannot be built for is told at the request that needs it."""
        if self.tokenizer is None:
            return
        try:
            self.vocabulary
        except SpecDecodeError:
            pass

    # ---- request -> sequence specs ---------------------------------------------------------

    def resolve_method(self, req: SamplingFields) -> tuple[registry.Method, Any, int]:
        """(method, its config, its proposer's estimated bytes) for a request; a request's
        config fields are checked against their limits (:mod:`.limits`) and its artifact
        names looked up in the catalogue (:mod:`.artifacts`) before the config is built."""
        base, plus, alias = req.model.partition("+")
        if base not in (self.settings.model_id, "default"):
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves "
                                f"'{self.settings.model_id}' (or '{self.settings.model_id}+METHOD', "
                                "see GET /v1/models)", param="model", code="model_not_found")
        if plus and not alias:
            raise ApiError(400, f"model '{req.model}' names no method after '+'", param="model")
        chosen = req.specdecode.method if req.specdecode else None
        if chosen and alias and chosen != alias:
            raise ApiError(400, f"the model alias names method '{alias}' but specdecode.method "
                                f"is '{chosen}'; give one of them", param="specdecode.method")
        name = chosen or alias or self.settings.method
        try:
            method = served_method(name)
        except SpecDecodeError as exc:
            raise ApiError(400, str(exc), param="specdecode.method" if chosen else "model",
                           code="unknown_method") from None
        overrides = dict(self.settings.config) if name == self.settings.method else {}
        asked = dict(req.specdecode.config) if req.specdecode else {}
        limits.check_overrides(method, asked)
        for field in ARTIFACT_FIELDS:
            if field in asked:
                asked[field] = self.catalogue.resolve(method, field, asked[field])
        overrides.update(asked)
        try:
            config = method.make_config(overrides)
        except (SpecDecodeError, TypeError) as exc:
            raise ApiError(400, str(exc), param="specdecode.config") from None
        limits.check_ranges(method, config, asked)
        artifact_bytes = sum(self.catalogue.loaded_bytes(method, f, getattr(config, f))
                             for f in ARTIFACT_FIELDS if hasattr(config, f))
        needed = limits.proposer_bytes(config, self.runner_info.vocab_size, artifact_bytes)
        budget = self.settings.proposer_memory_bytes
        if needed > budget:
            raise ApiError(400, f"this config of method '{name}' needs about {needed / 2**20:.0f} "
                                f"MiB of proposer memory; this server allows {budget / 2**20:.0f} "
                                "MiB per slot (--proposer-memory-mb): ask for a smaller one",
                           param="specdecode.config")
        return method, config, needed

    def sampling(self, req: SamplingFields) -> dict[str, Any]:
        options = req.sampling()
        try:
            params = SamplingParams(**options)
        except SpecDecodeError as exc:
            param = next((k for k in options if str(exc).startswith(k)), None)
            raise ApiError(400, str(exc), param=param) from None
        vocab = self.runner_info.vocab_size
        if params.max_biased_id >= vocab:
            raise ApiError(400, f"logit_bias names token {params.max_biased_id}, outside this "
                                f"model's vocabulary (ids 0..{vocab - 1})", param="logit_bias")
        top = req.top_logprobs_count()
        if top is not None:
            options["logprobs"] = top
            if getattr(req, "echo", False):  # the prompt's too (server/echo.py), as many
                options["prompt_logprobs"] = max(top, req.prompt_logprobs or 0)  # as asked
        if req.prompt_logprobs is not None and req.stream:  # vLLM's field (checked above)
            raise ApiError(400, "prompt_logprobs is returned with whole responses only; send "
                                "stream false", param="prompt_logprobs")
        asked = req.constraint()
        if isinstance(self.thinking, Harmony) and isinstance(req, ChatRequest):
            asked = in_final_message(asked, self.thinking)
        if asked:
            if self.tokenizer is None:
                raise ApiError(400, "this server has no tokenizer, so it cannot constrain the "
                                    "output", param="response_format")
            try:
                options["constraint"] = make_constraint(self.vocabulary, **asked)
            except SpecDecodeError as exc:  # the grammar engine's own message
                param = ("specdecode.ban" if set(asked) == {"banned"} else
                         "response_format" if req.response_format is not None else
                         "tools" if getattr(req, "tool_request", None) is not None
                         and (req.tool_request.constrains or req.tool_request.guards) else
                         f"specdecode.{next(iter(asked))}")
                raise ApiError(400, str(exc), param=param) from None
        return options

    def max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        context = self.max_context
        if prompt_len >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens, but "
                                f"the prompt has {prompt_len} tokens; shorten the prompt",
                           param=param, code="context_length_exceeded")
        left = context - prompt_len
        if requested is None:
            return min(self.settings.default_max_tokens, left)
        if requested < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {requested}",
                           param="max_tokens")
        if requested > left:
            raise ApiError(400, f"max_tokens ({requested}) plus the prompt ({prompt_len} tokens) "
                                f"exceeds the model's context of {context} tokens; lower "
                                f"max_tokens to at most {left}", param="max_tokens",
                           code="context_length_exceeded")
        return requested

    def specs(self, req: SamplingFields, prompts: list[list[int]], requested: int | None,
              param: str, reference: tuple[int, ...] = (),
              ends: tuple[int, ...] = ()) -> list[SequenceSpec]:
        """The sequences of a request (``reference``: its predicted output's token ids;
        ``ends``: tokens that end its answers beside the model's, unless it ignores them)."""
        if not 1 <= req.n <= self.settings.max_n:
            raise ApiError(400, f"n must be between 1 and {self.settings.max_n}, got {req.n}",
                           param="n")
        method, config, proposer_bytes = self.resolve_method(req)
        sampling = self.sampling(req)
        if is_diffusion(method.name):
            check_diffusion(method.name, self.dllm, sampling)
        stop = tuple(req.stop_list())
        ends = self.ends(req, ends)
        kept = req.kept_tokens()
        if isinstance(self.thinking, Harmony) and isinstance(req, ChatRequest):
            kept += tuple(t for t in self.thinking.kept_tokens if t not in kept)
        specs = []
        for ids in prompts:
            limit = self.max_tokens(len(ids), requested, param)
            try:
                check_request(self.runner_info, ids, limit)
            except SpecDecodeError as exc:
                raise ApiError(400, str(exc), param=param) from None
            for i in range(req.n):
                options = dict(sampling)
                if options.get("seed") is not None:
                    # n seeded choices: distinct, each repeatable, each a valid seed
                    seed = options["seed"] + i
                    options["seed"] = seed - SEED_END if seed >= SEED_END else seed
                specs.append(SequenceSpec(ids, limit, stop, options, method, config,
                                          proposer_bytes, kept, reference, ends,
                                          req.ignore_eos))
        return specs

    def ends(self, req: SamplingFields, model_ends: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens that end the request's answers beside the model's end of sequence:
        ``model_ends`` (a middle's) unless it ignores the model's ends, and its
        ``stop_token_ids``."""
        stop_ids = req.stop_token_ids or []
        try:
            check_ids(stop_ids, self.runner_info.vocab_size, "stop_token_ids")
        except SpecDecodeError as exc:
            raise ApiError(400, str(exc), param="stop_token_ids") from None
        kept = () if req.ignore_eos else model_ends
        return tuple(dict.fromkeys([*kept, *stop_ids]))

    def check_size(self, prompt, chat: bool) -> None:
        """Refuse a text prompt whose length in characters already proves it longer than the
        context, before any tokenizing: a 2 MB prompt costs nothing."""
        if isinstance(prompt, str):
            texts = [prompt]
        else:  # chat messages, or token ids (counted exactly later, without tokenizing)
            texts = [m.get("content") or "" for m in prompt if isinstance(m, dict)]
        chars = sum(len(t) for t in texts)
        at_least = -(-chars // self.chars_per_token)
        if at_least >= self.max_context:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} "
                                f"tokens, but the prompt has at least {at_least} ({chars} "
                                f"characters, at most {self.chars_per_token} per token); shorten "
                                "the prompt", param="messages" if chat else "prompt",
                           code="context_length_exceeded")

    @contextlib.contextmanager
    def _borrowed(self):
        """A tokenizer copy of this worker thread's own for the block (a tokenizer is not to be
        used by two threads at once)."""
        tokenizer = self._tokenizers.get()
        try:
            yield tokenizer
        finally:
            self._tokenizers.put(tokenizer)

    def tool_format(self) -> ToolFormat:
        """The format the model's chat template writes tool calls in (read once per template,
        on a worker thread); a 400 where tools cannot be served."""
        with self._borrowed() as tokenizer:
            try:
                return check_template(tokenizer)
            except ToolError as exc:
                raise ApiError(400, str(exc), param=exc.param) from None

    def answers(self, prompt_ids: list[int]) -> Thinking | Harmony | None:
        """How a chat prompt's answer holds its reasoning (on a worker thread): the model's
        way (:attr:`thinking`), a thinking template's block open or not as this prompt leaves
        it (a request's template variables may close it: Qwen3's ``enable_thinking: false``
        writes an empty block into the prompt)."""
        if not isinstance(self.thinking, Thinking):
            return self.thinking
        with self._borrowed() as tokenizer:  # the block's tags: the prompt's last tokens tell
            tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL:])
        return Thinking(opened=left_open(tail))

    def reference(self, text: str | None) -> tuple[int, ...]:
        """Token ids of a predicted output's text (on a worker thread; none for none); a 400
        for one longer than the context, which no answer could repeat."""
        if not text:
            return ()
        too_long = ApiError(400, f"the prediction is longer than this model's context of "
                                 f"{self.max_context} tokens; shorten it", param="prediction")
        if len(text) // self.chars_per_token >= self.max_context:
            raise too_long
        with self._borrowed() as tokenizer:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_context:
            raise too_long
        return tuple(ids)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included (on a worker thread)."""
        with self._borrowed() as tokenizer:
            return tokenizer.decode(ids)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (on a worker thread)."""
        with self._borrowed() as tokenizer:
            return [tokenizer.decode([i]) for i in ids]

    def fill_in(self, prefix, suffix: str) -> tuple[list[int], tuple[int, ...]]:
        """A fill-in-the-middle prompt between ``prefix`` (text or ids) and ``suffix`` (on a
        worker thread), and the tokens beside the model's ends that end its middle; a 400
        where the model has no such tokens (specdecode/fim.py)."""
        self.check_size(prefix + suffix if isinstance(prefix, str) else suffix, False)
        return self._fim("suffix", lambda fim, tokenizer: fim.prompt(tokenizer, prefix, suffix))

    def fill_in_repository(self, files: list[tuple[str, str]], prefix: str, suffix: str,
                           typed: str, window: int, files_budget: int
                           ) -> tuple[list[int], bool, tuple[int, ...]]:
        """llama.cpp's ``/infill`` prompt (:meth:`~specdecode.fim.FimTokens.in_repository`:
        other ``files`` before it, cut to fit), whether it was cut, and the tokens that end
        its middle as :meth:`fill_in` gives them. No size check: it is cut to fit, and the
        body's limit bounds the text to read."""
        (ids, cut), ends = self._fim("input_prefix", lambda fim, tokenizer: fim.in_repository(
            tokenizer, files, prefix, suffix, typed, window, files_budget))
        return ids, cut, ends

    def _fim(self, param: str, build) -> tuple[Any, tuple[int, ...]]:
        """``build(the tokenizer's fill-in-the-middle tags, a tokenizer)`` on a tokenizer copy,
        every failure a 400 naming ``param``; and the tokens beside the model's ends that end
        a middle."""
        if self.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer, so it cannot fill in a middle; "
                                f"leave out {param}", param=param)
        with self._borrowed() as tokenizer:
            try:
                fim = fim_tokens(tokenizer)
                built = build(fim, tokenizer)
            except SpecDecodeError as exc:
                raise ApiError(400, str(exc), param=param) from None
            except Exception as exc:  # the tokenizer's own errors: what it could not encode
                raise ApiError(400, f"cannot tokenize the text of the middle's prompt: "
                                    f"{type(exc).__name__}: {exc}"[:300], param=param) from None
        return built, tuple(e for e in fim.ends if e not in self.eos_token_ids)

    def encode(self, prompt, chat: bool, tools: list[dict] | None = None,
               template_kwargs: dict[str, Any] | None = None,
               add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (on a worker thread, with a tokenizer copy of its own);
        ``tools``: the function definitions the chat template shows the model, and
        ``template_kwargs`` its other variables; ``add_special_tokens`` as
        :func:`~specdecode.api.encode_prompt`'s. Every failure is a 400."""
        self.check_size(prompt, chat)
        with self._borrowed() as tokenizer:
            try:
                return encode_prompt(tokenizer, prompt, chat, tools, template_kwargs,
                                     add_special_tokens)
            except SpecDecodeError as exc:
                raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None
            except Exception as exc:  # the tokenizer's own errors: what it could not encode
                raise ApiError(400, f"cannot tokenize the {'messages' if chat else 'prompt'}: "
                                    f"{type(exc).__name__}: {exc}"[:300],
                               param="messages" if chat else "prompt") from None


class Server(Frontend):
    """The single-process server: ``len(runners)`` slots over the same weights, stepped
    together (one packed forward a step) by one :class:`Scheduler` thread, all sharing one
    suffix global tree."""

    def __init__(self, runners: list[Runner], tokenizer, eos_token_ids: list[int],
                 settings: Settings, memory: SharedMemory | None = None,
                 catalogue: Catalogue | None = None, dllm: Dllm | None = None):
        memory = memory or SharedMemory()
        metrics = Metrics()
        eos_token_ids = with_turn_ends(eos_token_ids, tokenizer)
        file = (PromptCacheFile(settings.prompt_cache_file, rows_key(runners[0]))
                if settings.prompt_cache_file and settings.prompt_cache_bytes else None)
        prompt_cache = (PromptCache(settings.prompt_cache_bytes, metrics, file)
                        if settings.prompt_cache_bytes else None)
        scheduler = Scheduler(runners, tokenizer, eos_token_ids,
                              make_factory(memory.make_proposer, dllm), settings.max_queue,
                              metrics, settings.proposer_memory_bytes, settings.batching,
                              prompt_cache)
        super().__init__(scheduler, ModelInfo.of(runners[0]), tokenizer, settings, metrics,
                         memory, catalogue, dllm)
        self.eos_token_ids = list(eos_token_ids)
