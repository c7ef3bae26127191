"""llama-server's sampling fields, as its ``/completion`` and ``/infill`` requests carry them
(server/infill.py): its defaults, and ``samplers``, its chain, read in its order.

The chain names samplers (llama.cpp's names, their aliases such as ``top-k``, ``nucleus`` and
``temp``, or one letter each in a string such as ``"kpt"``). This server applies
``penalties``, then ``top_k``, ``top_p``, ``min_p`` and ``infill`` (specdecode/infill_sampler.py)
in that order, with ``temperature`` before or after them all (after, as llama-server's default
chain has it: ``SamplingParams.temperature_last``); the penalties count the last
``repeat_last_n`` tokens of prompt and answer, as llama.cpp counts them
(``SamplingParams.penalty_last_n``). Clients send every field of llama-server's, most at the
value that turns a sampler off: ``dry``, ``typ_p``, ``xtc`` and ``top_n_sigma`` are taken in a
chain where their fields leave them off, and ``mirostat``, ``dynatemp_range`` and ``min_keep``
at their off values; a sampler turned on that this server does not apply, or a chain in
another order, is a 400 naming it. ``logit_bias`` takes llama-server's forms: ``[[token,
bias], ...]`` or ``{"token": bias}``, a token an id or a text (each of its tokens biased), a
bias a number or ``false`` (-100 here: all but banned).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field

from specdecode.infill_sampler import MAX_CANDIDATES, InfillSampler
from specdecode.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from specdecode.server.frontend import Frontend
from specdecode.server.protocol import ApiError, Strict

#: llama-server's sampler names, and its one-letter names
NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
         "temperature", "infill", "adaptive_p")
LETTERS = dict(zip("edskypmxtia", NAMES))
#: the other names llama.cpp reads as them
ALIASES = {**{name.replace("_", "-"): name for name in NAMES},
           **{name.replace("_", ""): name for name in NAMES},
           "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
#: llama-server's default chain
DEFAULT_CHAIN = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                 "temperature")
#: the samplers this server applies, in the order it applies them (``temperature`` may come
#: first instead)
APPLIED = ("penalties", "top_k", "top_p", "min_p", "infill", "temperature")
#: the samplers whose cut temperature changes
SHAPED = ("top_p", "min_p", "infill")
#: the whole context, for ``repeat_last_n`` -1
WHOLE_CONTEXT = 2**31 - 1


class LlamaSampling(Strict):
    """llama-server's sampling fields, with its defaults."""

    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = Field(default_factory=list)
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: int = 0
    seed: int = -1
    samplers: list[str] | str | None = None
    logit_bias: list[Any] | dict[str, Any] | None = None
    ignore_eos: bool = False
    #: each token's log-probability and its ``n_probs`` most likely alternatives in
    #: ``completion_probabilities``: the model's own, or with ``post_sampling_probs`` the
    #: probabilities of the distribution sampled from
    n_probs: int = 0
    post_sampling_probs: bool = False

    def off(self, name: str) -> bool:
        """Whether a sampler this server does not apply is left off by the request's fields
        (llama.cpp's own tests for each)."""
        return {"dry": self.dry_multiplier == 0 or self.dry_penalty_last_n == 0,
                "top_n_sigma": self.top_n_sigma <= 0,
                "typ_p": self.typical_p >= 1,
                "xtc": self.xtc_probability <= 0 or self.xtc_threshold > 0.5}.get(name, False)

    @property
    def chain(self) -> tuple[str, ...]:
        """The samplers applied, in their order (those left off dropped), checked against
        the order this server applies them in (a 400 naming the difference)."""
        named = (DEFAULT_CHAIN if self.samplers is None else
                 [LETTERS.get(c, c) for c in self.samplers] if isinstance(self.samplers, str)
                 else [ALIASES.get(n.lower(), n.lower()) for n in self.samplers])
        for name in named:
            if name not in NAMES:
                raise ApiError(400, f"sampler {name!r} is not one of llama-server's ("
                                    f"{', '.join(NAMES)})", param="samplers")
            if name not in APPLIED and not self.off(name):
                raise ApiError(400, f"sampler {name!r} is not served; this server applies "
                                    f"{', '.join(APPLIED)}: leave it out of samplers or turn "
                                    "it off", param="samplers")
        chain = tuple(name for name in named if name in APPLIED)
        self._check_order(chain)
        self._check_fields(chain)
        return chain

    def _check_order(self, chain: tuple[str, ...]) -> None:
        if len(set(chain)) < len(chain):
            raise ApiError(400, "samplers names a sampler twice; name each once",
                           param="samplers")
        cuts = [name for name in chain if name != "temperature"]
        if cuts != sorted(cuts, key=APPLIED.index):
            raise ApiError(400, f"samplers in the order {', '.join(cuts)}: this server applies "
                                f"{', '.join(APPLIED[:-1])} in that order (temperature before "
                                "or after them all)", param="samplers")
        if "temperature" in chain:
            here = chain.index("temperature")
            if any(name in SHAPED for name in chain[:here]) and \
                    any(name in SHAPED for name in chain[here + 1:]):
                raise ApiError(400, "temperature between the cuts: this server applies it "
                                    "before or after all of top_p, min_p and infill",
                               param="samplers")

    def _check_fields(self, chain: tuple[str, ...]) -> None:
        if self.mirostat != 0:
            raise ApiError(400, f"mirostat {self.mirostat} is not served; send mirostat 0",
                           param="mirostat")
        if "temperature" in chain and self.dynatemp_range > 0:
            raise ApiError(400, "dynamic temperature is not served; send dynatemp_range 0",
                           param="dynatemp_range")
        if self.min_keep > 1 and {"top_p", "min_p"} & set(chain):
            raise ApiError(400, "min_keep above 1 is not served; send 0 or 1",
                           param="min_keep")
        if "infill" in chain and not ("top_k" in chain and 0 < self.top_k <= MAX_CANDIDATES):
            raise ApiError(400, "the infill sampler compares every pair of candidates: put "
                                f"top_k before it, with top_k between 1 and {MAX_CANDIDATES} "
                                "(llama.vim sends 40)", param="samplers")
        if not 0 <= self.n_probs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"n_probs must be in [0, {MAX_TOP_LOGPROBS}] (the alternatives "
                                f"reported per token), got {self.n_probs}", param="n_probs")
        if self.repeat_last_n < -1:
            raise ApiError(400, "repeat_last_n must be -1 (the whole context), 0 (no "
                                f"penalties) or more, got {self.repeat_last_n}",
                           param="repeat_last_n")

    def openai_fields(self, encode: Callable[[str], list[int]]) -> dict[str, Any]:
        """The request's sampling in an OpenAI completion's fields (``encode``: a text's
        token ids, for ``logit_bias`` by text)."""
        chain = self.chain
        body: dict[str, Any] = {
            "temperature": max(self.temperature, 0.0) if "temperature" in chain else 1.0,
            "top_k": self.top_k if "top_k" in chain and self.top_k > 0 else None,
            "top_p": self.top_p if "top_p" in chain else None,
            "min_p": self.min_p if "min_p" in chain else None,
            "seed": self.seed if self.seed >= 0 else None, "ignore_eos": self.ignore_eos,
            "logprobs": self.n_probs or None, "logit_bias": self._bias(encode)}
        if "penalties" in chain and self.repeat_last_n != 0:
            body.update(repetition_penalty=self.repeat_penalty,
                        presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty)
        return body

    def _bias(self, encode: Callable[[str], list[int]]) -> dict[str, float] | None:
        """``logit_bias`` in OpenAI's form, from llama-server's."""
        given = self.logit_bias
        if given is None:
            return None
        pairs = given.items() if isinstance(given, dict) else given
        out: dict[str, float] = {}
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ApiError(400, "logit_bias takes [[token, bias], ...] or {\"token\": "
                                    f"bias}}, got the entry {pair!r}", param="logit_bias")
            token, bias = pair
            if bias is False:
                bias = -MAX_LOGIT_BIAS
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ApiError(400, f"a logit_bias is a number or false, got {bias!r}",
                               param="logit_bias")
            if token == "":
                raise ApiError(400, "a logit_bias token text is empty", param="logit_bias")
            numeric = (isinstance(token, int) and not isinstance(token, bool)) or (
                isinstance(token, str) and token.isdigit())
            ids = [int(token)] if numeric else encode(token) if isinstance(token, str) else None
            if ids is None:
                raise ApiError(400, f"a logit_bias token is an id or a text, got {token!r}",
                               param="logit_bias")
            out.update((str(t), float(bias)) for t in ids)
        return out

    def chain_sampling(self, server: Frontend, ends: tuple[int, ...]) -> dict[str, Any]:
        """The SamplingParams fields of the chain beside OpenAI's: temperature after the cuts,
        the penalties' window, the infill sampler (``ends``: the tokens that end this
        answer) and which log-probabilities ``n_probs`` reports."""
        chain = self.chain
        out: dict[str, Any] = {"raw_logprobs": not self.post_sampling_probs}
        if "penalties" in chain and self.repeat_last_n != 0:
            out["penalty_last_n"] = (WHOLE_CONTEXT if self.repeat_last_n == -1
                                     else self.repeat_last_n)
        if "temperature" in chain:
            here = chain.index("temperature")
            out["temperature_last"] = any(name in SHAPED for name in chain[:here])
        if "infill" in chain:
            if server.tokenizer is None:
                raise ApiError(400, "this server has no tokenizer, so it cannot apply the "
                                    "infill sampler (it reads the tokens' text)",
                               param="samplers")
            model_ends = server.eos_token_ids
            out["infill"] = InfillSampler(server.vocabulary.token_bytes,
                                          frozenset((*model_ends, *ends)), model_ends[0])
        return out
