"""Sampling options, applied to the target's logits at every draft node with that node's context.

The options keep the meanings users know from ``transformers`` and the OpenAI API, applied in
the order they use: the logit bias, then penalties, then the constraint's token mask (grammar,
banned outputs: :mod:`specdecode.constraints`), then temperature, then top-k, top-p and min-p.

- ``logit_bias`` (OpenAI): a number in [-100, 100] added to the logit of each token id it names
  (-100 all but bans a token, 100 all but forces it), at every position.
- ``repetition_penalty`` (CTRL / transformers): every token present anywhere in the context
  (prompt and output) has its logit divided by the penalty if positive, multiplied if negative.
- ``presence_penalty`` / ``frequency_penalty`` (OpenAI): subtract ``presence`` once and
  ``frequency`` per occurrence, counting the generated tokens only (as OpenAI and vLLM do).
- ``penalty_last_n`` (llama.cpp's ``repeat_last_n``): the three penalties count the last n
  tokens of the context instead, prompt and output alike, as llama.cpp counts them (0: none).
- ``top_k`` keeps every token whose logit reaches the k-th largest; ``top_p`` drops a token when
  the tokens more likely than it already hold ``top_p`` of the mass; ``min_p`` drops tokens less
  likely than ``min_p`` times the most likely one. These are ``transformers``' TopK, TopP and
  MinP warpers (tested against them).
- ``temperature_last`` applies temperature after the cuts instead (llama.cpp's default chain;
  text-generation-webui's option of that name): top-p and min-p cut the unscaled distribution,
  and temperature shapes what they keep.
- ``infill``: llama.cpp's ``infill`` sampler after the cuts (:mod:`specdecode.infill_sampler`),
  as code-completion plugins ask llama-server for it.

A draft node deep in a tree is penalised with the committed tokens *plus the path to it*, so
every node sees exactly the distribution plain decoding would have used there.

:class:`NodeDistributions` computes a node's distribution only when the verifier first asks for
it: a verify step visits the accepted path plus one node, a handful of the up to ~80 rows of a
tree, and at a 49152-token vocabulary each row costs a softmax, a top-p cut and the penalties.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.constraints import Constraint, ConstraintSpec
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError, require
from specdecode.infill_sampler import MAX_CANDIDATES, InfillSampler


#: temperatures below this decode greedily
GREEDY_BELOW = 1e-5
#: most alternatives reported per token (OpenAI's limit on top_logprobs)
MAX_TOP_LOGPROBS = 20
#: the largest logit bias either way (OpenAI's range)
MAX_LOGIT_BIAS = 100


def first_argmax(logits: torch.Tensor) -> int:
    """The index of the first maximum of a vector (a NaN counts as the maximum), as
    ``torch.argmax`` gives it: numpy's where the vector is a CPU float32 one, which measured
    5 us against torch's 86 us over a 49k vocabulary, a greedy step's cost in every method."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return int(np.argmax(logits.detach().numpy()))
    return int(logits.argmax())


@dataclass(frozen=True)
class SamplingParams:
    #: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature); below 1e-5 is
    #: greedy too (vLLM's rule: logits / temperature would overflow float32 to inf, and the
    #: distribution is all but the argmax anyway)
    temperature: float = 0.0
    #: keep the k most likely tokens; 0 = off
    top_k: int = 0
    #: nucleus: keep the smallest set whose probability reaches top_p; 1.0 = off
    top_p: float = 1.0
    #: drop tokens less likely than min_p times the most likely one; 0.0 = off
    min_p: float = 0.0
    #: > 1 discourages tokens already in the context; 1.0 = off
    repetition_penalty: float = 1.0
    #: subtracted once from the logit of every token already generated; 0.0 = off
    presence_penalty: float = 0.0
    #: subtracted per occurrence of a token already generated; 0.0 = off
    frequency_penalty: float = 0.0
    #: seeds this request's own random generator; None = nondeterministic
    seed: int | None = None
    #: report each committed token's log-probability and this many most likely alternatives
    #: (0..20, OpenAI's top_logprobs); None = no log-probabilities
    logprobs: int | None = None
    #: report each prompt token's log-probability under the model (its own, before these
    #: processors) and this many most likely alternatives (0..20; vLLM's prompt_logprobs,
    #: specdecode/prompt_logprobs.py); None = none
    prompt_logprobs: int | None = None
    #: grammar and banned outputs (:func:`specdecode.constraints.make_constraint`); None = none
    constraint: ConstraintSpec | None = None
    #: token id -> number added to its logit (a mapping, or (id, bias) pairs; ids may be
    #: decimal strings, as JSON keys are); stored as pairs ascending by id; None = none
    logit_bias: Mapping[int | str, float] | Sequence[tuple[int, float]] | None = None
    #: temperature after top-k, top-p, min-p and the infill cut, which then read the unscaled
    #: distribution (llama.cpp's default chain); False: temperature first (transformers')
    temperature_last: bool = False
    #: llama.cpp's infill sampler after the other cuts (specdecode/infill_sampler.py); needs
    #: top_k; None = none
    infill: InfillSampler | None = None
    #: the log-probabilities reported (``logprobs``) are the model's own (log-softmax of its
    #: logits, before any processing: llama-server's ``n_probs``, vLLM's raw_logprobs mode),
    #: not those of the distribution sampled from
    raw_logprobs: bool = False
    #: the penalties count only the last n tokens of the context, prompt included (llama.cpp's
    #: repeat_last_n); None = OpenAI's counting (repetition: the whole context; presence and
    #: frequency: the output)
    penalty_last_n: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(
                isinstance(value, numbers.Real) and not isinstance(value, bool)
                and math.isfinite(value),
                f"{name} must be a finite number, got {value!r}",
            )
            object.__setattr__(self, name, float(value))
        require(self.temperature >= 0,
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        require(isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool)
                and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        require(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        require(self.repetition_penalty > 0,
                f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty}")
        require(-2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2] (OpenAI's range), got {self.presence_penalty}")
        require(-2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2] (OpenAI's range), got {self.frequency_penalty}")
        require(self.seed is None or (isinstance(self.seed, numbers.Integral)
                                      and not isinstance(self.seed, bool)
                                      and -2**63 <= self.seed < 2**64),
                f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, numbers.Integral)
                                      and not isinstance(value, bool)
                                      and 0 <= value <= MAX_TOP_LOGPROBS),
                    f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives "
                    f"reported per token), got {value!r}")
            if value is not None:
                object.__setattr__(self, name, int(value))
        require(self.constraint is None or isinstance(self.constraint, ConstraintSpec),
                "constraint must be built by specdecode.constraints.make_constraint")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        require(self.penalty_last_n is None or (
            isinstance(self.penalty_last_n, numbers.Integral)
            and not isinstance(self.penalty_last_n, bool) and self.penalty_last_n >= 0),
            f"penalty_last_n must be an integer >= 0 (0: no penalties), got "
            f"{self.penalty_last_n!r}")
        for name in ("temperature_last", "raw_logprobs"):
            require(isinstance(getattr(self, name), bool),
                    f"{name} must be true or false, got {getattr(self, name)!r}")
        require(self.infill is None or isinstance(self.infill, InfillSampler),
                "infill must be a specdecode.infill_sampler.InfillSampler")
        require(self.infill is None or 0 < self.top_k <= MAX_CANDIDATES,
                "the infill sampler compares every pair of candidates: give top_k between 1 "
                f"and {MAX_CANDIDATES} with it (llama.vim sends 40), got {self.top_k}")
        # numpy integers pass the checks above; store plain ints (hashable, JSON-friendly)
        object.__setattr__(self, "top_k", int(self.top_k))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def repeats(self) -> bool:
        """Sampled with a seed: its tokens must repeat whatever else runs, so nothing that
        varies between runs (timings, other requests, what a cache held before it) may size
        its drafts, which decide its random draws where drafts are sampled."""
        return not self.greedy and self.seed is not None

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or a logit bias change logits by token id before temperature:
        then no shortcut may skip the vocabulary's processing (a shortlist's own argmax or
        softmax, the raw logits' argmax)."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def reads_token_ids(self) -> bool:
        """Whether the processing reads token ids (penalties, a logit bias, the infill
        cut): then it cannot run on a shortlist's logits alone."""
        return self.adjusts_logits or self.infill is not None

    @property
    def max_biased_id(self) -> int:
        """The largest token id ``logit_bias`` names (-1: none), for the vocabulary's check."""
        return self.logit_bias[-1][0] if self.logit_bias else -1

    def generator(self) -> torch.Generator:
        """One generator per request: seeded runs repeat, whatever other requests do."""
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def _bias_pairs(bias) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` as (id, bias) pairs ascending by id, checked; None when empty."""
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, Mapping) else bias
    require(isinstance(items, Collection) and not isinstance(items, (str, bytes)),
            "logit_bias must map token ids to numbers, e.g. {\"42\": -100}, "
            f"got {type(bias).__name__}")
    pairs = {}
    for entry in items:
        require(isinstance(entry, (tuple, list)) and len(entry) == 2,
                f"logit_bias must map token ids to numbers, got the entry {entry!r}")
        token, value = entry
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        require(isinstance(token, numbers.Integral) and not isinstance(token, bool)
                and token >= 0,
                f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        require(isinstance(value, numbers.Real) and not isinstance(value, bool)
                and math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS,
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                f"got {value!r} for token {token}")
        pairs[int(token)] = float(value)
    return tuple(sorted(pairs.items())) or None


GREEDY = SamplingParams()

#: first guess at how many tokens hold top_p of the mass (SmolLM2 at temperature 0.7, top_p
#: 0.95: a median of 5 tokens, rarely over 64); multiplied by 8 until they do
_NUCLEUS_GUESS = 64


def adjust_logits(logits: torch.Tensor, params: SamplingParams, seen: Collection[int],
                  counts: Mapping[int, int]) -> torch.Tensor:
    """Penalised and biased copy of ``logits`` [V]: ``seen`` holds every token of the context
    (repetition penalty), ``counts`` each generated token's occurrences (presence/frequency
    penalties). The bias comes first, as in ``transformers`` and llama.cpp (it matters
    for the repetition penalty, which scales a logit)."""
    logits = logits.clone()
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        logits[list(ids)] += torch.tensor(values, dtype=logits.dtype)
    if params.repetition_penalty != 1.0 and seen:
        present = torch.tensor(list(seen), dtype=torch.long)
        chosen = logits[present]
        logits[present] = torch.where(chosen > 0, chosen / params.repetition_penalty,
                                      chosen * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and counts:
        ids = torch.tensor(list(counts), dtype=torch.long)
        times = torch.tensor(list(counts.values()), dtype=torch.float32)
        logits[ids] = logits[ids] - params.frequency_penalty * times - params.presence_penalty
    return logits


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token of ``probs`` [V] that the tokens more likely than it already cover to
    ``top_p``. Only the most likely tokens are sorted: once they hold ``top_p`` of the mass, every
    token outside them is dropped anyway."""
    vocab = probs.shape[-1]
    k = min(vocab, _NUCLEUS_GUESS)
    while True:
        values, order = probs.topk(k)  # [k], descending
        cumulative = values.cumsum(0)
        if k == vocab or cumulative[-1] >= top_p:
            break
        k = min(vocab, 8 * k)
    keep = order[(cumulative - values) < top_p]  # the most likely token always stays
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and the infill cut on (penalised) logits [V] ->
    probabilities [V]; with ``temperature_last`` the cuts read the unscaled distribution and
    temperature shapes what they keep."""
    scaled = logits / params.temperature
    probs = _cut(logits if params.temperature_last else scaled, params)
    if params.temperature_last and params.temperature != 1.0:
        kept = probs.nonzero().flatten()
        probs = torch.zeros_like(probs).index_copy_(0, kept, scaled[kept].softmax(-1))
    return probs / probs.sum()


def _cut(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits) [V] with what top-k, top-p, min-p and the infill cut drop zeroed (not
    renormalised)."""
    vocab = logits.shape[-1]
    kept = None  # top-k's token ids, when the rest of the work can run on those k alone
    if 0 < params.top_k < vocab:
        values, ids = logits.topk(params.top_k)  # [k]
        if int((logits >= values[-1]).sum()) == params.top_k:
            logits, kept = values, ids
        else:  # tokens tied with the k-th all stay, as in transformers
            logits = logits.masked_fill(logits < values[-1], float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    if params.min_p > 0.0:
        # relative to the most likely token, so the cut is the same before or after normalising
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if kept is not None:
        probs = torch.zeros(vocab, dtype=probs.dtype).index_copy_(0, kept, probs)
    if params.infill is not None:
        probs = params.infill.cut(probs)
    return probs


class NodeDistributions:
    """The target's next-token distribution at the root (row 0) and after each draft node
    (row 1 + i), each row processed with its own context when first asked for.

    ``logits`` [1 + n, V] come from the runner; ``context`` is the committed tokens, ending with
    the root; its first ``prompt_len`` are the prompt (penalties treat prompt and output
    differently). ``constraint`` (the generation's, following the committed output) masks each
    row with its own path's allowed tokens.
    """

    def __init__(self, logits: torch.Tensor, params: SamplingParams, context: Sequence[int],
                 prompt_len: int, draft: Draft, constraint: Constraint | None = None):
        self.logits = logits
        self.params = params
        self.draft = draft
        self.constraint = constraint
        self._probs: dict[int, torch.Tensor] = {}
        self.seen, self.counts = set(), Counter()
        #: the context's last tokens a penalty window reads (each node adds its own path)
        self.recent: list[int] = []
        window = params.penalty_last_n
        if params.has_penalties and window is not None:
            self.recent = list(context[max(0, len(context) - window):]) if window else []
        elif params.has_penalties:
            self.seen = set(context)
            # the root (committed, its KV not yet cached) counts like any output token
            self.counts = Counter(context[prompt_len:])

    def path(self, row: int) -> list[int]:
        """The draft tokens from the root down to row ``row``'s node (none for row 0)."""
        return [self.draft.tokens[i] for i in self.draft.path_to(row - 1)] if row else []

    def penalised(self, row: int) -> torch.Tensor:
        """Row ``row``'s logits [V] after the logit bias, the penalties and the constraint's
        mask (greedy decoding takes their argmax)."""
        logits = self._adjusted(row)
        if self.constraint is None:
            return logits
        allowed = self.constraint.allowed(self.path(row))
        if not bool(allowed.any()):
            raise SpecDecodeError("the constraints allow no token here (a banned output leaves "
                                  "the grammar no way on); loosen the ban or the grammar")
        return logits.masked_fill(~allowed, float("-inf"))

    def _adjusted(self, row: int) -> torch.Tensor:
        logits = self.logits[row].float()
        if not self.params.adjusts_logits:
            return logits
        path = self.path(row) if self.params.has_penalties else []
        window = self.params.penalty_last_n
        if window is not None and self.params.has_penalties:
            tokens = self.recent + path
            counts = Counter(tokens[max(0, len(tokens) - window):] if window else ())
            return adjust_logits(logits, self.params, counts.keys(), counts)
        if not path:
            return adjust_logits(logits, self.params, self.seen, self.counts)
        return adjust_logits(logits, self.params, self.seen.union(path),
                             self.counts + Counter(path))

    def argmax(self, row: int) -> int:
        if self.constraint is not None:
            # the unmasked argmax, when allowed, is the masked one (ties: the first maximum
            # either way): one token's check instead of a whole mask
            best = first_argmax(self._adjusted(row))
            if self.constraint.permits(self.path(row), best):
                return best
        return first_argmax(self.penalised(row))

    def logprobs(self, row: int) -> torch.Tensor:
        """Row ``row``'s log-probabilities [V] after the request's processors: the logit bias,
        the penalties, the constraint, and at temperature > 0 temperature, top-k, top-p and
        min-p (OpenAI's logprobs of the distribution sampled from); at temperature 0,
        log_softmax of the processed logits. Tokens the processors drop are -inf."""
        if self.params.greedy:
            return self.penalised(row).log_softmax(-1)
        return self.probs(row).log()

    def probs(self, row: int) -> torch.Tensor:
        """Row ``row``'s sampling distribution [V] (temperature > 0)."""
        if row not in self._probs:
            self._probs[row] = filtered_probs(self.penalised(row), self.params)
        return self._probs[row]


def target_probs(logits: torch.Tensor, params: SamplingParams, context: Sequence[int],
                 prompt_len: int, draft: Draft, constraint: Constraint | None = None
                 ) -> torch.Tensor:
    """Every row's sampling distribution at once [1 + n, V] (the verifier asks row by row)."""
    nodes = NodeDistributions(logits, params, context, prompt_len, draft, constraint)
    return torch.stack([nodes.probs(row) for row in range(len(draft) + 1)])


def sample(probs: torch.Tensor, generator: torch.Generator, u: float | None = None) -> int:
    """Inverse-CDF draw from probs [V] using exactly one uniform number, so a seeded run draws
    the same random stream whatever the drafts were: ``generator``'s next, or ``u`` where given
    (a coupled draft's, the verifier's own uniform for that position; drafting/session.py)."""
    return inverse_cdf(probs, uniform(generator) if u is None else u)


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token of probs [V] (not necessarily normalised) whose interval of the cumulative
    distribution, in token order, holds ``u`` in [0, 1): :func:`sample`'s draw at ``u``."""
    cdf = probs.double().cumsum(0)
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    index = min(index, probs.shape[0] - 1)
    # never land on a zero-probability token at a float boundary
    if probs[index] <= 0:
        index = int(torch.argmax(probs))
    return index


def uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))
