"""What every lossy method shares: a decode loop of its own behind the :class:`Generation`
surface (iterate for committed token chunks; ``tokens``, ``stats``, ``finish_reason``), so the
API, the CLI, the bench and the server's text streaming read a lossy method's output as they
read a speculative one's.

A lossy method yields token chunks from :meth:`LossyMethod.decode`; :class:`LossyGeneration`
cuts them at end-of-sequence and the token limit exactly as the engine does. The statistics
keep the engine's words: ``target_forwards`` counts the passes of the model the method stands
in for (its cheap passes are in ``draft_tokens``), ``accepted_lengths`` the tokens each of them
produced.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path

from specdecode.engine import GenerationStats, check_request, cut_chunk
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import Runner
from specdecode.registry import param
from specdecode.sampling import GREEDY, SamplingParams


class LossyMethod(ABC):
    """A lossy method bound to a target runner; subclasses set ``method_name`` through
    ``registry.register(..., lossy=True)``. State that outlives a request (a loaded router,
    trained adapters) stays on the instance."""

    method_name: str = "?"

    def __init__(self, config, runner: Runner):
        self.config = config
        self.runner = runner

    def make_controller(self):
        """Reached only when something builds the engine's ``Generation`` around a lossy
        method (a server scheduler that steps generations): refuse with the fix."""
        raise SpecDecodeError(f"the lossy method '{self.method_name}' runs a decode loop of its "
                              "own: start it with its generation(...) (Decoder.start does) and "
                              "iterate it, not with the engine's Generation")

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Refuse sampling options the method does not implement (default: greedy only)."""
        require(sampling.temperature == 0 and not sampling.adjusts_logits,
                f"the lossy method '{self.method_name}' decodes greedily only; leave temperature "
                "at 0 and the penalties and logit_bias unset, or use an exact method")
        require(sampling.prompt_logprobs is None,
                f"the lossy method '{self.method_name}' does not score the prompt; leave "
                "prompt_logprobs unset, or use an exact method")

    @abstractmethod
    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
               eos: frozenset[int], stats: GenerationStats) -> Iterator[list[int]]:
        """Yield the new tokens in chunks (at least one token each) until ``max_new_tokens``
        or a token of ``eos`` (the caller cuts there and stops iterating); count passes in
        ``stats``."""

    def generation(self, prompt_ids: Sequence[int], max_new_tokens: int,
                   sampling: SamplingParams = GREEDY,
                   eos_token_ids: Sequence[int] = ()) -> LossyGeneration:
        return LossyGeneration(self, prompt_ids, max_new_tokens, sampling, eos_token_ids)


class LossyGeneration:
    """One request of a lossy method; iterate for the committed chunks."""

    def __init__(self, method: LossyMethod, prompt_ids: Sequence[int], max_new_tokens: int,
                 sampling: SamplingParams = GREEDY, eos_token_ids: Sequence[int] = ()):
        check_request(method.runner, prompt_ids, max_new_tokens)
        method.check_sampling(sampling)
        self.method = method
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokens: list[int] = []
        self.stats = GenerationStats()
        self.finish_reason: str | None = None
        #: lossy methods report no log-probabilities
        self.logprobs = None

    def __iter__(self) -> Iterator[list[int]]:
        started = time.perf_counter()
        chunks = self.method.decode(self.prompt_ids, self.max_new_tokens, self.sampling,
                                    self.eos_token_ids, self.stats)
        try:
            for chunk in chunks:
                out = self._emit(chunk)
                if out:
                    yield out
                if self.finish_reason is not None:
                    return
            self.finish_reason = self.finish_reason or "length"
        finally:
            chunks.close()
            self.stats.total_s = time.perf_counter() - started

    def _emit(self, chunk: Sequence[int]) -> list[int]:
        out, reason = cut_chunk(chunk, len(self.tokens), self.max_new_tokens, self.eos_token_ids)
        self.finish_reason = reason or self.finish_reason
        self.tokens.extend(out)
        self.stats.new_tokens = len(self.tokens)
        return out

    def begin(self):
        raise SpecDecodeError(f"the lossy method '{self.method.method_name}' runs a decode loop "
                              "of its own and cannot be stepped with other generations; iterate "
                              "it instead")

    next_call = advance = begin

    def close(self) -> None:
        """Nothing to release: the decode loop's state lives in the iterator."""

    def run(self) -> list[int]:
        for _ in self:
            pass
        return self.tokens


def adapters_param(what: str, command: str, otherwise: str = ""):
    """The ``adapters`` setting of a method with trained pieces (default 'auto'); set when the
    server starts, as a path would be a file the server opens."""
    return param("auto", f"{what}: 'auto' (the artifact `specdecode {command}` made for this "
                         f"target) or an artifact path{otherwise}", startup_only=True)


def trained_artifact(spec: str, runner: Runner, kind: str, command: str, fallback: str = ""):
    """The artifact of ``kind`` an ``adapters`` setting names: 'auto' (the newest trained for
    this target) or a path; refused, naming ``specdecode COMMAND`` (which makes one) and
    ``fallback`` (another choice), where there is none."""
    from specdecode.artifacts import load_artifact, newest_artifact

    fingerprint = runner.fingerprint()
    fix = f"make one with `specdecode {command}` (minutes on 2 CPU cores)"
    if spec == "auto":
        spec = str(newest_artifact(kind, fingerprint, f"no {kind} artifact for this target yet; "
                                                      f"{fix}{', ' + fallback if fallback else ''}"))
    require(Path(spec).suffix == ".safetensors" and Path(spec).is_file(),
            f"adapters {spec!r} is neither 'auto' nor an existing .safetensors file; {fix}"
            f"{', ' + fallback if fallback else ''}")
    return load_artifact(spec, kind, fingerprint)
