"""auto: a proposer made of proposers that, each step, sends the target the draft with the most
expected committed tokens per second of the step (SmartSpec's goodput, Liu et al., 2024,
"Optimizing Speculative Decoding for Serving Large Language Models Using Goodput",
arXiv 2406.14066, applied per step to a choice between drafters rather than to one draft length;
the choice between a model-free and a learned drafter by recent acceptance follows
SuffixDecoding's hybrid with EAGLE, Oliaro et al., 2024, arXiv 2411.04975).

The parts (default ``suffix`` and ``hydra``, or ``suffix`` and ``draft_model`` where ``draft``
names a draft model) are registered exact proposers, each with its own state. Every verify step
is fed to every part (``observe``), drafted or not, so a suffix tree sees every committed token
and a head drafter every committed feature; ``needs`` is the union of the parts' ``needs``.

What a step costs: the forward over ``1 + nodes`` rows (the runner's row-cost curve,
:func:`specdecode.models.row_costs.cached_row_costs`, measured once on a replica), the seconds
of the step besides the forward and the drafting (learnt from the time between two ``propose``
calls, as a fixed part and a part per draft row: the verify pass's LM head rows, the
verification and the parts' bookkeeping grow with the rows, which the forward's curve does not
see; a line through the median seconds of the recent steps by row count, so that a step the
machine stalled does not price every row after it), and the drafting seconds of each part
that drafted: a line in its depth, timed per part, and for a draft model (``draft_model``,
``dyspec``: ``auto:draft=...``) the reading of the tokens it
skipped while other parts drafted, by its own row-cost curve and spread over the request's
steps left, as one draft model alone is priced (:mod:`specdecode.sizing`). What a step gains:
1 + the expected accepted tokens, from the arm's recent acceptance per depth
(:class:`specdecode.estimates.Acceptance`, the server's estimator: the chance that depth k is
accepted, given a draft that deep).

Each step, cheapest drafting first, a part drafts only if its best draft (the depth and nodes
that maximise its expected tokens per second, :func:`specdecode.sizing.allocate` on its
acceptance, its drafting included) beats the best draft already in hand, whose drafting is
already paid; so the suffix tree's nearly free draft is made first, and a head or a draft
model drafts only where the suffix draft is poor, to the depth its acceptance pays for (a draft
model's token costs a forward of its own). A part whose drafts do not pay still drafts a token
for a request's first ``FIRST_DRAFTS`` drafts, where one would pay at the upper confidence bound
of its first-token acceptance (sure to be accepted before its first draft), and after that a
small draft after ``explore_every`` steps without drafting (twice or four times as many after
drafts missed in a row: :func:`specdecode.sizing.explore_due`), where it
costs at most ``EXPLORE_SHARE`` of those steps, so its estimate follows the text
(:func:`specdecode.sizing.learning_cap`, as in the server). Of the drafts in hand (and their
merged prefix tree, with ``merge``), the one with the most expected tokens per second of its
forward is sent, cut to the depth and nodes its arm's acceptance pays for. No sizer caps it from
outside (:attr:`~specdecode.proposer.Proposer.prices_own_drafting`).

Every draft made, sent or not, is scored against the tokens the target commits (walking its
tree along them, across steps where needed), so the estimates of parts and of the merged tree
stay current; greedy, and at T > 0 for a coupled draft, that walk is the acceptance the
verifier would have given. The sent draft is scored by what the verifier accepted.

Exactness is the verifier's. Every draft is sent without probabilities (a sampled head draft
loses its ``Draft.probs``), so at T > 0 the verifier takes its deterministic walk: it samples
each token from the target with ``ar``'s uniforms and descends where a child holds it, so it
commits ``ar``'s tokens whatever was drafted. That keeps seeded runs repeatable although the
choices depend on measured seconds (with probabilities, the rejection rule's draws would depend
on which draft was sent). So the parts draw coupled to the verifier (their ``coupled``
setting; drafting/session.py): a draft model's chain tokens, and each node's first child in a
tree, with the uniform the verifier's walk will draw at that depth, so where the drafter and
the target nearly agree so do their draws (nearly as often as the rejection rule would
accept, where tokens drawn apart from the verifier would be accepted with p(x) only), and an
unsent draft's walk scores it as the verifier would have.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from specdecode import registry
from specdecode.control import Budget, Controller
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import Needs, Runner
from specdecode.models.row_costs import cached_row_costs
from specdecode.proposer import Feedback, Proposer
from specdecode.registry import param, register
from specdecode.estimates import DECAY, Acceptance, AnswerLengths, RowCosts, StepOverhead
from specdecode.sizing import (EXPLORE_LEVELS, FIRST_DRAFTS, Candidate, DraftTime, allocate,
                               catch_up_share, deepened, explore_due, learning_cap)

#: config fields handed on to every part whose config has them
SHARED_FIELDS = ("heads", "min_path_prob", "corpus", "draft")


@dataclass(frozen=True)
class AutoConfig:
    # startup only: which proposers one request builds, and so the memory it takes
    parts: str = param("auto", "the proposers to choose between, registered exact methods "
                               "(model-free and learned) separated by ',' or '+' (a bench "
                               "variant: auto:parts=suffix+eagle); auto: suffix and "
                               "draft_model where `draft` names a draft, else suffix and hydra",
                       startup_only=True)
    heads: str = param("auto", "trained heads for the parts that take them ('auto': the newest "
                               "for this target, or the one shipped for the default model)")
    min_path_prob: float = param(0.35, "handed to the parts that grow trees by path "
                                       "probability (hydra's default)", bounds=(0.0, 1.0))
    corpus: str = param("none", "target-written text for the parts that draft from one "
                                "(suffix's corpus: a file, 'auto' or 'none')")
    draft: str = param("distilled", "the draft of the parts that draft with a model "
                                    "(draft_model, dyspec): as their own 'draft', e.g. "
                                    "qwen2.5-coder-0.5b (with the default parts: suffix and "
                                    "draft_model)")
    merge: bool = param(True, "also consider the merged prefix tree of the drafts in hand")
    explore_every: int = param(16, "a part that has not drafted for this many steps drafts "
                                   "anyway, so its acceptance estimate stays current (up to "
                                   "four times as many after drafts missed in a row)",
                               bounds=(1, 1024))

    def __post_init__(self):
        names = self.part_names
        require(len(names) >= 2, f"auto chooses between two or more parts, got {self.parts!r} "
                                 "(one part alone: use that method)")
        require(len(set(names)) == len(names), f"auto's parts repeat a method: {self.parts!r}")
        require(self.explore_every >= 1, f"explore_every must be >= 1, got {self.explore_every}")

    @property
    def part_names(self) -> list[str]:
        parts = self.parts
        if parts == "auto":  # a draft named is a draft the user wants drafting
            parts = "suffix,hydra" if self.draft == "distilled" else "suffix,draft_model"
        return [name.strip() for name in re.split(r"[,+]", parts) if name.strip()]


class _Record:
    """One arm's (a part's, or the merged tree's) recent verify steps: acceptance per depth,
    and a decayed count of steps, so that expectations per step count empty drafts too."""

    def __init__(self):
        self.acceptance = Acceptance()
        self.steps = 0.0

    def observe(self, draft: Draft, accepted: int) -> None:
        self.acceptance.observe(draft, accepted)
        self.steps = self.steps * DECAY + 1.0

    def expected(self) -> tuple[float, float]:
        """(committed tokens, draft rows) of an average step, before drafting."""
        acceptance = self.acceptance
        return (1.0 + sum(acceptance.reached) / self.steps,
                sum(acceptance.rows) / self.steps)

    def tokens_for(self, draft: Draft) -> float:
        """Expected committed tokens of a step that sends ``draft``."""
        return 1.0 + sum(chance for chance, _ in self.acceptance.levels(draft.max_depth))


class _Price(NamedTuple):
    """A part's drafting after a context (:meth:`AutoProposer._priced`)."""

    fixed_s: float
    level_s: float
    #: the reading of the tokens it skipped, first
    catch_up_s: float
    #: whether a token costs a forward of its own (a draft model's, by its row-cost curve)
    per_token: bool

    @property
    def one_level_s(self) -> float:
        """The seconds of a one-token draft, its catch-up included."""
        return self.fixed_s + self.level_s + self.catch_up_s


class _Arm(NamedTuple):
    """A draft in hand: as made (scored whole when not sent), cut where it pays most (what is
    sent), the expected tokens per second of sending the cut, and whose it is."""

    draft: Draft
    cut: Draft
    rate: float
    name: str
    record: _Record
    controller: Controller | None


class _Walk:
    """A draft scored against the tokens committed after its root, step after step."""

    def __init__(self, record: _Record, draft: Draft, controller: Controller | None):
        self.record, self.draft, self.controller = record, draft, controller
        self.node, self.matched = -1, 0

    def advance(self, tokens: Sequence[int]) -> bool:
        """Follow ``tokens``; True once the walk has left the tree (the draft is scored)."""
        for token in tokens:
            child = next((c for c in self.draft.children(self.node)
                          if self.draft.tokens[c] == token), None)
            if child is None:
                self.close(self.matched)
                return True
            self.node, self.matched = child, self.matched + 1
            if not self.draft.children(child):
                self.close(self.matched)
                return True
        return False

    def close(self, accepted: int) -> None:
        self.record.observe(self.draft, accepted)
        if self.controller is not None:
            self.controller.observe(len(self.draft), accepted)


def merged(drafts: Sequence[Draft]) -> Draft:
    """The prefix tree of every root-to-leaf path of ``drafts`` (the first draft's nodes first,
    so a truncation keeps it whole); no probabilities."""
    paths = []
    for draft in drafts:
        leaves = [i for i in range(len(draft)) if not draft.children(i)]
        paths.extend([draft.tokens[n] for n in draft.path_to(leaf)] for leaf in leaves)
    return Draft.from_paths(paths)


@register("auto", AutoConfig,
          paper="goodput per step (SmartSpec, Liu et al., 2024, arXiv 2406.14066) between "
                "SuffixDecoding (Oliaro et al., 2024) and a learned drafter (Hydra)",
          summary="each step sends the draft (suffix tree, heads, or both merged) with the most "
                  "expected tokens per second of forward and drafting")
class AutoProposer(Proposer):
    #: the head kind the default learned part (hydra) loads ``heads`` for
    head_kind = "hydra"
    prices_own_drafting = True
    #: its drafts go without their parts' probabilities (see the module docstring)
    samples_drafts = False

    def __init__(self, config: AutoConfig, runner: Runner, parts: Sequence[Proposer] | None = None,
                 row_costs: RowCosts | None = None):
        """``parts`` and ``row_costs``: given ones instead of building ``config.parts`` and
        measuring ``runner`` (tests, callers that measured the curve already)."""
        super().__init__(config, runner)
        self.names = config.part_names
        self.parts = list(parts) if parts is not None else [self._build(n) for n in self.names]
        require(len(self.parts) == len(self.names),
                f"auto got {len(self.parts)} parts for the {len(self.names)} named in "
                f"{config.parts!r}")
        self.needs = Needs(any(p.needs.final_hidden for p in self.parts),
                           tuple(sorted({layer for p in self.parts for layer in p.needs.layers})))
        self.costs = row_costs or RowCosts(cached_row_costs(runner))
        self.controllers = [p.make_controller() for p in self.parts]
        self.records = [_Record() for _ in self.parts]
        self.merged_record = _Record()
        #: each part's drafting seconds as a line in its depth (steps that read skipped
        #: tokens left out: their catch-up is priced by the part's own curve)
        self.draft_times = [DraftTime() for _ in self.parts]
        self.idle = [config.explore_every] * len(self.parts)  # steps since each part drafted
        #: drafts each part has made in the current request (its first ones are learning_cap's)
        self.made = [0] * len(self.parts)
        #: the recent answers' lengths, for the tokens a request has left to repay a catch-up
        self.lengths = AnswerLengths()
        self._prompt_len = 0
        #: a step's seconds besides its forward and drafting, as a line in its draft rows
        self.overhead = StepOverhead()
        #: arms sent in the current request, by name ("suffix", "hydra", "suffix+hydra", "none")
        self.choices: Counter[str] = Counter()
        self._walks: list[_Walk] = []
        self._sent: tuple[_Record, Controller | None] | None = None
        self._step: tuple[float, int, float] | None = None  # (started, rows, drafting seconds)

    def _build(self, name: str) -> Proposer:
        require(name in registry.names(lossy=False) and name not in ("ar", "auto"),
                f"auto's part {name!r} must be a registered exact method other than ar and "
                f"auto; known: {', '.join(registry.names(lossy=False))}")
        method = registry.get(name)
        fields = {f for f, _, _ in method.defaults()}
        shared = {f: getattr(self.config, f) for f in SHARED_FIELDS if f in fields}
        if "coupled" in fields:  # its drafts go without probabilities: drawn coupled
            shared["coupled"] = True
        try:
            return method.proposer(method.make_config(shared), self.runner)
        except SpecDecodeError as exc:
            if self.config.parts != "auto" or self.config.draft != "distilled":
                raise  # (the default heads are what was missing only without a draft)
            raise SpecDecodeError(f"{exc}; or give auto a draft model to choose instead "
                                  "(-c draft=NAME or FILE.gguf, e.g. qwen2.5-coder-0.5b) or "
                                  "other parts (-c parts=suffix,ngram)") from None

    def make_controller(self) -> Controller:
        limits = [c.budget() for c in self.controllers]
        return Controller(max(b.max_depth for b in limits), max(b.max_nodes for b in limits))

    def set_sampling(self, sampling) -> None:
        super().set_sampling(sampling)
        for part in self.parts:
            part.set_sampling(sampling)

    def couple(self, generator) -> None:
        for part in self.parts:
            part.couple(generator)

    def start(self, prompt: Sequence[int]) -> None:
        self.choices = Counter()
        self.made = [0] * len(self.parts)
        self._prompt_len = len(prompt)
        self._walks, self._sent, self._step = [], None, None
        for part in self.parts:
            part.start(prompt)

    def use_reference(self, tokens: Sequence[int]) -> None:
        for part in self.parts:
            part.use_reference(tokens)

    def finish(self, output: Sequence[int]) -> None:
        self.lengths.observe(len(output))
        for part in self.parts:
            part.finish(output)

    # ---- choosing ---------------------------------------------------------------------------

    def _seconds(self, nodes: float, drafting_s: float = 0.0) -> float:
        """Seconds of a step whose forward reads the root and ``nodes`` draft rows."""
        fixed, per_row = self.overhead.line
        return self.costs(1.0 + nodes) + fixed + per_row * nodes + drafting_s

    def _none_rate(self) -> float:
        """Tokens per second of a step that sends no draft (one committed token)."""
        return 1.0 / self._seconds(0)

    def _rate(self, record: _Record, draft: Draft) -> float:
        """Expected committed tokens per second of a step that sends ``draft`` (drafted)."""
        if not len(draft):
            return self._none_rate()
        return record.tokens_for(draft) / self._seconds(len(draft))

    def _cut(self, record: _Record, draft: Draft) -> Draft:
        """``draft`` cut to the depth and nodes whose expected tokens per second, by its arm's
        acceptance by depth (the drafting paid), is highest (:func:`~specdecode.sizing.allocate`,
        the sizer's cap of one method's drafts, here per arm); empty where no draft pays."""
        if not len(draft):
            return draft
        levels = record.acceptance.levels(draft.max_depth)
        depth, rows = deepened(allocate([Candidate(levels)], self.costs, 1,
                                        *self.overhead.line)[0],
                               record.acceptance, draft.max_depth, len(draft))
        return draft.truncated(depth, rows) if depth else Draft.empty()

    def _priced(self, i: int, context: Sequence[int]) -> _Price:
        """Part ``i``'s drafting after ``context``, timed where its drafting has been timed,
        else by its drafter's own row-cost curve (a draft model's; nothing for lookups and
        heads)."""
        catch_up_s, curve_level_s = self.parts[i].draft_seconds(context)
        fixed_s, level_s = self.draft_times[i].priced(curve_level_s)
        return _Price(fixed_s, level_s, catch_up_s, curve_level_s > 0)

    def _sized(self, i: int, budget: Budget, priced: _Price,
               best_rate: float, in_hand: int) -> Budget | None:
        """The budget part ``i`` drafts within this step, or None. It drafts where its best
        draft (:func:`~specdecode.sizing.allocate` on its acceptance by depth, its drafting
        priced by ``priced`` with the catch-up spread over the request's steps left) is
        expected to beat ``best_rate``, that of the best draft in hand (of ``in_hand`` nodes,
        or of the two merged), or while its estimate must learn (it has drafted fewer than
        FIRST_DRAFTS times, or not for ``explore_every`` steps). A drafter whose tokens cost a
        forward each (a draft model) drafts to the depth and nodes of that best draft, and
        where none pays, a small draft while its estimate must learn
        (:func:`~specdecode.sizing.learning_cap`: a token for a request's first drafts where
        one would pay at the upper bound of the part's first-token acceptance, after them a few
        after ``explore_every`` steps where they cost at most EXPLORE_SHARE of those steps); a
        lookup or heads, whose
        drafting costs about the same at any depth, to its own budget (what is sent is chosen
        after)."""
        own = self.controllers[i].budget()
        most_depth = min(budget.max_depth, own.max_depth)
        most_nodes = min(budget.max_nodes, own.max_nodes)
        if min(most_depth, most_nodes) <= 0:
            return None
        fixed_s, level_s, catch_up_s, per_token = priced
        acceptance = self.records[i].acceptance
        levels = acceptance.levels(min(most_depth, most_nodes,
                                       len(acceptance.offered) + EXPLORE_LEVELS))
        left = budget.tokens_left or 1
        draft_s = fixed_s + catch_up_share(catch_up_s, left, levels)
        depth, rows = deepened(allocate([Candidate(levels, draft_s, level_s)], self.costs, 1,
                                        *self.overhead.line)[0],
                               acceptance, most_depth, most_nodes)
        learning = (acceptance.drafts < FIRST_DRAFTS
                    or explore_due(self.idle[i], acceptance.missed, self.config.explore_every))
        if not per_token:
            sized = Budget(most_depth, most_nodes, own.keep_drafting)
        elif depth:
            sized = Budget(depth, min(rows, most_nodes), own.keep_drafting)
        else:  # no draft of it pays: a small one while its estimate must learn
            small = learning_cap(self.costs, 1, most_depth, most_nodes, self.made[i],
                                 acceptance, self.idle[i], left, fixed_s, level_s, catch_up_s,
                                 every=self.config.explore_every, row_s=self.overhead.line[1],
                                 missed=acceptance.missed)
            return None if small is None else Budget(*small, own.keep_drafting)
        if learning:
            return sized
        if not depth:
            return None
        drafting_s = draft_s + level_s * depth
        rate = (1.0 + sum(chance for chance, _ in levels[:depth])) / self._seconds(rows,
                                                                                   drafting_s)
        if self.config.merge and in_hand and self.merged_record.steps:
            tokens, merged_rows = self.merged_record.expected()
            rate = max(rate, tokens / self._seconds(merged_rows, drafting_s))
        return sized if rate > best_rate else None

    def _draft_part(self, i: int, context: Sequence[int], capped: Budget,
                    timed: bool) -> Draft:
        started = time.perf_counter()
        made = self.parts[i].propose(context, capped).truncated(capped.max_depth,
                                                                capped.max_nodes)
        # sent without probabilities: see the module's docstring (seeded runs repeat)
        draft = Draft(made.tokens, made.parents) if made.probs is not None else made
        if timed and len(draft):  # a draft that first read skipped tokens is no sample
            self.draft_times[i].observe(draft.max_depth, time.perf_counter() - started)
        self.idle[i] = 0
        self.made[i] += len(draft) > 0
        return draft

    def propose(self, context, budget):
        now = time.perf_counter()
        self._learn_overhead(now)
        drafts: dict[int, Draft] = {}
        cuts: dict[int, Draft] = {}  # each draft cut where it pays most (what would be sent)
        rates: dict[int, float] = {}
        best_rate, best_nodes = self._none_rate(), 0
        if budget.max_depth > 0 and budget.max_nodes > 0:
            priced = [self._priced(i, context) for i in range(len(self.parts))]
            if budget.tokens_left and any(p.catch_up_s for p in priced):
                # what a catch-up is spread over (sizing.catch_up_share)
                budget = replace(budget, tokens_left=self.lengths.expected_left(
                    len(context) - self._prompt_len, budget.tokens_left))
            for i in sorted(range(len(self.parts)), key=lambda i: priced[i].one_level_s):
                self.idle[i] += 1
                capped = self._sized(i, budget, priced[i], best_rate, best_nodes)
                if capped is None:
                    continue
                drafts[i] = self._draft_part(i, context, capped, timed=not priced[i].catch_up_s)
                cuts[i] = self._cut(self.records[i], drafts[i])
                rates[i] = self._rate(self.records[i], cuts[i])
                if rates[i] > best_rate:
                    best_rate, best_nodes = rates[i], len(cuts[i])
        draft, name, record, controller = self._choose(drafts, cuts, rates, budget)
        self._sent = (record, controller) if record is not None else None
        self.choices[name] += 1
        self._step = (now, len(draft), time.perf_counter() - now)
        return draft

    def _choose(self, drafts: dict[int, Draft], cuts: dict[int, Draft],
                rates: dict[int, float], budget: Budget):
        """(draft, arm name, its record, its part's controller) of the best arm in hand, from
        the parts' ``drafts``, each ``cuts`` where it pays most (:meth:`_cut`) and its
        expected tokens per second ``rates``, and their merged tree; every other arm's draft is
        scored whole against the committed tokens as they come."""
        arms = [_Arm(drafts[i], cuts[i], rates[i], self.names[i], self.records[i],
                     self.controllers[i]) for i in sorted(drafts)]
        made = [arm for arm in arms if len(arm.draft)]
        if self.config.merge and len(made) >= 2:
            name = "+".join(arm.name for arm in made)  # in the order of config.parts
            made.sort(key=lambda arm: -arm.rate)  # the most promising kept whole
            tree = merged([arm.draft for arm in made]).truncated(budget.max_depth,
                                                                 budget.max_nodes)
            cut = self._cut(self.merged_record, tree)
            arms.append(_Arm(tree, cut, self._rate(self.merged_record, cut), name,
                             self.merged_record, None))
        best = max(arms, key=lambda arm: arm.rate, default=None)
        if best is not None and (not len(best.cut) or best.rate <= self._none_rate()):
            best = None
        self._walks.extend(_Walk(arm.record, arm.draft, arm.controller)
                           for arm in arms if arm is not best)
        if best is None:
            return Draft.empty(), "none", None, None
        return best.cut, best.name, best.record, best.controller

    # ---- learning -----------------------------------------------------------------------

    def _learn_overhead(self, now: float) -> None:
        """The last step's seconds besides its forward's rows and its drafting, into the
        overhead line."""
        if self._step is None:
            return
        started, nodes, drafting_s = self._step
        self.overhead.observe(nodes, now - started - self.costs(1.0 + nodes) - drafting_s)

    def observe(self, feedback: Feedback) -> None:
        for part in self.parts:
            part.observe(feedback)
        if feedback.prefill:
            return
        if self._sent is not None:
            record, controller = self._sent
            _Walk(record, feedback.draft, controller).close(len(feedback.accepted))
            self._sent = None
        self._walks = [w for w in self._walks if not w.advance(feedback.tokens)]


