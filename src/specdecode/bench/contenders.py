"""What the benchmark times: our methods through the engine, and the peers, behind one call.

    outcome = contender.run(prompt_ids, max_new_tokens, sampling)

Every contender gets the same prompt token ids and the same token budget, and its output is
counted the same way: the new token ids up to and including the first end-of-sequence id, at
most ``max_new_tokens`` of them - which is what the engine commits. Wall time is taken around
the whole request (prefill included) by the same clock for everyone; tokenisation stays outside.

Peers (measured in the same run, on the same weights):

- ``hf``: plain ``transformers`` ``generate`` (greedy or sampled, as the run is);
- ``hf-pld``: its assisted generation with ``prompt_lookup_num_tokens=10`` (transformers'
  documented value; ``max_matching_ngram_size`` left at its default, 2);
- ``llama.cpp`` / ``llama.cpp-pld``: ``llama-cpp-python`` on the same GGUF file, plain and with
  ``LlamaPromptLookupDecoding`` (its default ``num_pred_tokens=10``, which needs
  ``logits_all=True``), 2 threads, fed token ids so it sees the same chat-template tokens;
  each in a process of its own (``peer_process``: a crash there fails the peer, not the run).
  Its weights stay Q4_1; the native runner's int4 format (its default) re-quantises the
  dequantised weights in the same scheme (float16 scale and minimum per 32; a runner read with
  ``from_gguf`` keeps the file's blocks) and, like llama.cpp, multiplies them by int8
  activations; the ``hf`` peers run the dequantised fp32 weights.

Target forwards of a peer are counted by a hook on the model call (transformers) or on
``Llama.eval`` (llama.cpp): one per verify step, the prefill included, as the engine counts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.engine import Generation
from specdecode.models.base import Runner
from specdecode.sampling import SamplingParams
from specdecode.sizing import method_sizing

PEERS = ("hf", "hf-pld", "llama.cpp", "llama.cpp-pld")
#: transformers' documented example value and llama-cpp-python's default
PROMPT_LOOKUP_TOKENS = 10
#: llama.cpp threads: the same 2 cores torch uses on the reference machine
LLAMA_CPP_THREADS = 2


@dataclass
class Outcome:
    #: new token ids, cut at the first end-of-sequence id (kept) and at max_new_tokens
    tokens: list[int]
    wall_s: float
    #: target forward passes, the prefill included
    target_forwards: int
    #: tokens committed by each verify step; None where a peer does not expose them
    accepted_lengths: list[int] | None
    #: draft nodes sent to the target, and the time spent making them (our methods only)
    draft_tokens: int | None = None
    propose_s: float | None = None
    #: the prompt's prefill (the first token's time; our methods, and llama-server's own
    #: seconds on the prompt)
    prefill_s: float | None = None


def cut(tokens: Sequence[int], eos: frozenset[int], max_new_tokens: int) -> list[int]:
    out: list[int] = []
    for t in tokens[:max_new_tokens]:
        out.append(int(t))
        if t in eos:
            break
    return out


class MethodContender:
    """One registered method: its proposer lives across requests, as in a ``Decoder``. A lossy
    method (kind ``lossy``) runs its own decode loop (specdecode/lossy/)."""

    def __init__(self, name: str, method, config, runner: Runner, eos: Sequence[int],
                 draft_budget: str = "goodput"):
        self.name = name
        self.method = method
        self.config = config
        self.runner = runner
        self.eos = list(eos)
        self.proposer = method.proposer(config, runner)
        self.kind = "lossy" if method.lossy else "method"
        self.draft_budget = draft_budget
        #: its drafts' sizing by the runner's row costs (specdecode/sizing.py), as a Decoder's
        self.sizing = method_sizing(method, runner, draft_budget)

    def unsupported(self, sampling: SamplingParams) -> str | None:
        return None

    def fresh(self) -> MethodContender:
        """A contender with a new proposer (for the warm-up and each repeat pass)."""
        return MethodContender(self.name, self.method, self.config, self.runner, self.eos,
                               self.draft_budget)

    def run(self, prompt_ids, max_new_tokens, sampling) -> Outcome:
        start = time.perf_counter()
        if self.method.lossy:
            gen = self.proposer.generation(prompt_ids, max_new_tokens, sampling, self.eos)
        else:
            sizer = None if self.sizing is None else self.sizing.sequence(sampling)
            gen = Generation(self.runner, self.proposer, prompt_ids, max_new_tokens,
                             sampling, self.eos, sizer=sizer)
        gen.run()
        wall = time.perf_counter() - start
        s = gen.stats
        return Outcome(list(gen.tokens), wall, s.target_forwards, list(s.accepted_lengths),
                       s.draft_tokens, s.propose_s, s.prefill_s)


class _CallCounter:
    """Counts calls of a torch module while installed (one per target forward)."""

    def __init__(self, module: torch.nn.Module):
        self.count = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.count += 1

    def remove(self):
        self.handle.remove()


class HFGenerate:
    """``transformers`` ``generate``, plain or with prompt lookup."""

    kind = "peer"

    def __init__(self, model, eos: Sequence[int], prompt_lookup: bool):
        self.name = "hf-pld" if prompt_lookup else "hf"
        self.model = model
        self.eos = frozenset(eos)
        self.eos_list = list(eos)
        self.prompt_lookup = prompt_lookup

    def unsupported(self, sampling: SamplingParams) -> str | None:
        if sampling.presence_penalty or sampling.frequency_penalty:
            return "transformers has no presence/frequency penalty"
        return None

    def fresh(self):
        return self

    def config(self, max_new_tokens: int, sampling: SamplingParams):
        from transformers import GenerationConfig

        options = dict(max_new_tokens=max_new_tokens, eos_token_id=self.eos_list or None,
                       pad_token_id=self.eos_list[0] if self.eos_list else None,
                       bos_token_id=getattr(self.model.generation_config, "bos_token_id", None),
                       do_sample=not sampling.greedy,
                       repetition_penalty=sampling.repetition_penalty)
        if not sampling.greedy:
            options.update(temperature=sampling.temperature, top_k=sampling.top_k or None,
                           top_p=sampling.top_p, min_p=sampling.min_p or None)
        if sampling.logit_bias:
            options["sequence_bias"] = {(token,): bias for token, bias in sampling.logit_bias}
        if self.prompt_lookup:
            options["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        return GenerationConfig(**options)

    def run(self, prompt_ids, max_new_tokens, sampling) -> Outcome:
        config = self.config(max_new_tokens, sampling)
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        mask = torch.ones_like(input_ids)
        counter = _CallCounter(self.model)
        try:
            # transformers samples from the global generator: seed it inside a fork so the
            # caller's random state is left as it was
            with torch.random.fork_rng(devices=[]):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                start = time.perf_counter()
                out = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                          generation_config=config)
                wall = time.perf_counter() - start
        finally:
            counter.remove()
        tokens = cut(out[0, input_ids.shape[1]:].tolist(), self.eos, max_new_tokens)
        return Outcome(tokens, wall, counter.count, None)


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_unsupported(sampling: SamplingParams) -> str | None:
    if sampling.repetition_penalty != 1.0:
        return ("llama.cpp's repeat penalty looks at the last 64 tokens only, not the whole "
                "context")
    return None


class IsolatedLlamaCpp:
    """The llama.cpp contender as the bench sees it: :class:`LlamaCpp` in a process of its own
    (``peer_process``), so a crash in llama.cpp fails this peer, not the run."""

    kind = "peer"

    def __init__(self, gguf_path: Path, eos: Sequence[int], prompt_lookup: bool, n_ctx: int):
        from specdecode.bench.peer_process import PeerProcess

        self.name = "llama.cpp-pld" if prompt_lookup else "llama.cpp"
        self.process = PeerProcess(self.name, "specdecode.bench.contenders:LlamaCppServed",
                                   gguf_path=str(gguf_path), eos=list(eos),
                                   prompt_lookup=prompt_lookup, n_ctx=n_ctx)

    def unsupported(self, sampling: SamplingParams) -> str | None:
        return llama_cpp_unsupported(sampling)

    def fresh(self):
        return self

    def run(self, prompt_ids, max_new_tokens, sampling) -> Outcome:
        answer = self.process.call("run", list(prompt_ids), max_new_tokens,
                                   dataclasses.asdict(sampling))
        return Outcome(**answer)

    def close(self) -> None:
        self.process.close()


class LlamaCppServed:
    """What the peer's child process holds: :class:`LlamaCpp`, JSON in and out."""

    def __init__(self, gguf_path: str, eos: list[int], prompt_lookup: bool, n_ctx: int):
        self.peer = LlamaCpp(Path(gguf_path), eos, prompt_lookup, n_ctx)

    def run(self, prompt_ids: list[int], max_new_tokens: int, sampling: dict) -> dict:
        outcome = self.peer.run(prompt_ids, max_new_tokens, SamplingParams(**sampling))
        return dataclasses.asdict(outcome)


class LlamaCpp:
    """``llama-cpp-python`` on the GGUF file, plain or with its prompt-lookup draft (in the
    peer's own process: see :class:`IsolatedLlamaCpp`)."""

    def __init__(self, gguf_path: Path, eos: Sequence[int], prompt_lookup: bool, n_ctx: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.eos = frozenset(eos)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS) if prompt_lookup else None
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=LLAMA_CPP_THREADS,
                         n_threads_batch=LLAMA_CPP_THREADS, logits_all=prompt_lookup,
                         draft_model=draft, verbose=False)
        self.forwards = 0
        inner = self.llm.eval

        def counted_eval(tokens):
            self.forwards += 1
            return inner(tokens)

        # generate() calls self.eval once per step (prefill included)
        self.llm.eval = counted_eval

    def run(self, prompt_ids, max_new_tokens, sampling) -> Outcome:
        llm = self.llm
        llm.reset()  # no prefix reuse from the previous request: every contender prefills
        if sampling.seed is not None:
            llm.set_seed(sampling.seed)
        self.forwards = 0
        tokens: list[int] = []
        start = time.perf_counter()
        stream = llm.generate(
            list(prompt_ids), temp=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p, min_p=sampling.min_p, typical_p=1.0, repeat_penalty=1.0,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty, reset=True)
        for token in stream:
            tokens.append(int(token))
            if token in self.eos or len(tokens) >= max_new_tokens:
                break
        stream.close()
        wall = time.perf_counter() - start
        return Outcome(tokens, wall, self.forwards, None)
