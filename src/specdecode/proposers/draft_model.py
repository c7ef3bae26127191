"""Draft-model speculative decoding: a separate small causal LM with the target's vocabulary
drafts a chain token by token from its own KV cache; the target verifies it in one forward
(Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al., 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"; the assisted
generation of ``transformers``).

Lossless in both modes. Greedy: the draft proposes its argmax. Sampled: the draft *samples* each
token from its own distribution processed exactly like the target's (penalties, temperature,
top-k, top-p, min-p, each node with its own context) and records that distribution in
``Draft.probs``, so the verifier's rejection rule keeps the target's distribution. The draft draws
from its own generator, seeded from the request seed (offset, so its draws are independent of
the verifier's): seeded runs repeat.

The draft's cache is kept aligned with the target: at each step the committed tokens it has not
seen (the accepted tokens it did not compute itself, and the bonus/recovered token) are fed in
one forward; the KV rows of drafted tokens that were accepted are kept, the rest dropped.

The draft runs on the native runner (``draft_runner=native``, int4 where its sizes allow:
``draft_weights=auto``), whose one-token forward costs a fraction of ``transformers``'; its
static cache is extended and rewound, and reads trees (``dyspec``) a few nodes a call.
``draft_runner=hf`` runs it through ``transformers`` (any causal LM).

Length controllers (``controller``; see :mod:`specdecode.control`): ``fixed`` (always
``num_speculative_tokens``), ``heuristic`` (transformers' +2/-1 schedule), ``confidence`` (stop
after a token whose draft probability is below ``confidence_threshold``; transformers' default
0.4) and ``specdecpp`` (SpecDec++, Huang et al., 2024: a trained acceptance head stops drafting
once P(some drafted token is rejected) > ``stop_threshold``; paper: 0.3, bounds 2..20).

The draft (``draft``): ``distilled`` (default) loads the artifact ``specdecode train draft``
wrote for this target (a few of the target's own layers, distilled; it shares the target's
embedding table and drafts over a frequency-ranked shortlist of the vocabulary, as in FR-Spec,
Zhao et al., 2025, so its LM head costs a fraction of the target's); or a path to such an
artifact; or a local Hugging Face checkpoint folder of any causal LM with the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.control import (AcceptanceHead, ConfidenceStop, Controller, DraftSignal,
                                HeuristicLength, SpecDecPlusPlus)
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import Runner
from specdecode.models.quant import check_format
from specdecode.proposers.base import Feedback, Proposer
from specdecode.registry import param, register
from specdecode.sampling import NodeDistributions, sample

#: artifact kind written by ``specdecode train draft``
ARTIFACT_KIND = "draft_model"
#: added to the request seed for the draft's generator: its draws must not repeat the
#: verifier's uniforms (the same stream would correlate drafting and acceptance)
DRAFT_SEED_OFFSET = 0x5DEECE66D


@dataclass(frozen=True)
class DraftSource:
    """Which draft and what runs it: the settings of ``draft_model`` and ``dyspec``."""

    draft: str = param("distilled", "the draft: 'distilled' (the artifact `specdecode train draft` "
                                    "made for this target), an artifact .safetensors path, or a "
                                    "local Hugging Face checkpoint folder with the same vocabulary")
    draft_runner: str = param("native", "what runs the draft: native (the native runner, see "
                                        "draft_weights; Llama-family drafts) or hf (transformers, "
                                        "float32)")
    draft_weights: str = param("auto", "the native draft's weight format: fp32 | bf16 | int8 | "
                                       "int4, or auto: int4 (the cheapest one-token forward) "
                                       "where the draft's sizes allow it, else fp32; the draft's "
                                       "numbers never change the output")

    def __post_init__(self):
        require(self.draft_runner in ("native", "hf"),
                f"unknown draft_runner {self.draft_runner!r}; known: native, hf")
        if self.draft_weights != "auto":
            check_format(self.draft_weights)


@dataclass(frozen=True)
class DraftModelConfig(DraftSource):
    num_speculative_tokens: int = param(5, "draft length of the fixed controller and the "
                                           "heuristic's starting length (transformers' heuristic "
                                           "schedule starts at 5)")
    controller: str = param("fixed", "draft length controller: fixed | heuristic | confidence | "
                                     "specdecpp")
    max_speculative_tokens: int = param(12, "longest draft the adaptive controllers allow "
                                            "(SpecDec++ uses 20 for 7B drafts; 12 bounds the "
                                            "wasted draft steps on CPU)")
    confidence_threshold: float = param(0.4, "confidence controller: stop after a token with "
                                             "draft probability below this (transformers' "
                                             "assistant_confidence_threshold default)")
    stop_threshold: float = param(0.3, "specdecpp controller: stop when the predicted P(some "
                                       "drafted token is rejected) exceeds this (paper: 0.3)")

    def __post_init__(self):
        super().__post_init__()
        require(self.num_speculative_tokens >= 1,
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens} (a draft "
                "length of 0 drafts nothing: use method 'ar' for plain decoding)")
        require(self.max_speculative_tokens >= self.num_speculative_tokens,
                f"max_speculative_tokens ({self.max_speculative_tokens}) must be >= "
                f"num_speculative_tokens ({self.num_speculative_tokens})")
        require(self.controller in CONTROLLERS,
                f"unknown controller {self.controller!r}; known: {', '.join(CONTROLLERS)}")
        require(0.0 <= self.confidence_threshold <= 1.0,
                f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")
        require(0.0 < self.stop_threshold < 1.0,
                f"stop_threshold must be in (0, 1), got {self.stop_threshold}")


def _fixed(proposer: DraftModelProposer) -> Controller:
    n = proposer.config.num_speculative_tokens
    return Controller(n, n)


def _heuristic(proposer: DraftModelProposer) -> Controller:
    c = proposer.config
    return HeuristicLength(c.num_speculative_tokens, c.max_speculative_tokens)


def _confidence(proposer: DraftModelProposer) -> Controller:
    c = proposer.config
    return ConfidenceStop(c.confidence_threshold, c.max_speculative_tokens)


def _specdecpp(proposer: DraftModelProposer) -> Controller:
    c = proposer.config
    require(proposer.acceptance_head is not None,
            f"the specdecpp controller needs an acceptance head, and the draft "
            f"{proposer.draft_source} has none; train one with `specdecode train draft` (it "
            "trains the head after the draft), or pick another controller")
    return SpecDecPlusPlus(proposer.acceptance_head, c.stop_threshold, 2,
                           c.max_speculative_tokens)


#: controller name -> factory(proposer)
CONTROLLERS: dict[str, Callable[[DraftModelProposer], Controller]] = {
    "fixed": _fixed, "heuristic": _heuristic, "confidence": _confidence, "specdecpp": _specdecpp,
}


# ---- loading a draft ---------------------------------------------------------------------


@dataclass
class LoadedDraft:
    model: torch.nn.Module
    #: vocabulary ids the draft's LM head covers (a shortlist), or None = the whole vocabulary
    head_ids: torch.Tensor | None
    acceptance_head: AcceptanceHead | None
    source: str


def target_embeddings(runner: Runner) -> torch.Tensor:
    """The target's input embedding table [V, H] (a distilled draft shares it)."""
    embed = getattr(runner, "embed", None)
    if embed is None and hasattr(runner, "model"):
        embed = runner.model.get_input_embeddings().weight
    require(embed is not None, f"the {runner.name} runner exposes no embedding table, which the "
                               "distilled draft shares; use --runner hf")
    return embed.detach()


def build_distilled(config: dict, tensors: dict[str, torch.Tensor],
                    embed: torch.Tensor) -> LoadedDraft:
    """A LlamaForCausalLM from a distilled artifact's layers, sharing ``embed``; its LM head is
    the embedding rows of the shortlist ``head_ids``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = LlamaConfig(**config["model"])
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    state = {k[len("model."):]: v.float() for k, v in tensors.items() if k.startswith("model.")}
    state["model.embed_tokens.weight"] = embed
    head_ids = tensors.get("head_ids")
    head = embed if head_ids is None else embed[head_ids]
    model.lm_head = torch.nn.Linear(arch.hidden_size, head.shape[0], bias=False, device="meta")
    state["lm_head.weight"] = head
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=arch)  # buffers left on meta
    acc = None
    acc_state = {k[len("acceptance_head."):]: v.float() for k, v in tensors.items()
                 if k.startswith("acceptance_head.")}
    if acc_state:
        acc = AcceptanceHead(arch.hidden_size, int(config["acceptance_head"]["num_blocks"]))
        acc.load_state_dict(acc_state)
    return LoadedDraft(model.eval(), head_ids, acc, "")


def load_draft(spec: str, runner: Runner) -> LoadedDraft:
    """'distilled', an artifact path or a checkpoint folder -> the draft, checked against the
    target's vocabulary."""
    from specdecode.training.artifacts import find_artifacts, load_artifact

    fingerprint = runner.fingerprint()
    if spec == "distilled":
        found = find_artifacts(ARTIFACT_KIND, fingerprint)
        require(bool(found), "no distilled draft model for this target yet; make one with "
                             "`specdecode train draft` (about 30 minutes on 2 CPU cores), or "
                             "pass -c draft=PATH (an artifact or a Hugging Face checkpoint folder)")
        spec = str(found[0])
    path = Path(spec)
    if path.suffix == ".safetensors":
        artifact = load_artifact(path, ARTIFACT_KIND, fingerprint)
        loaded = build_distilled(artifact.config, artifact.tensors, target_embeddings(runner))
    elif path.is_dir():
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (ValueError, OSError) as exc:
            raise SpecDecodeError(f"cannot load draft checkpoint {path}: {exc}") from None
        loaded = LoadedDraft(model.eval(), None, None, "")
    else:
        raise SpecDecodeError(f"draft {spec!r} is neither 'distilled', an artifact .safetensors "
                              "file nor a checkpoint folder")
    loaded.source = str(path)
    check_vocabulary(loaded.model, runner)
    return loaded


def check_vocabulary(model: torch.nn.Module, runner: Runner) -> None:
    size = int(model.get_input_embeddings().weight.shape[0])
    require(size == runner.vocab_size,
            f"the draft model's vocabulary has {size} tokens but the target's has "
            f"{runner.vocab_size}; a draft must share the target's tokenizer and vocabulary")


# ---- the draft's own KV cache --------------------------------------------------------------


class _DraftCache:
    """What both draft caches share: the shortlist, and finding the cached prefix to reuse."""

    head_ids: torch.Tensor | None
    vocab_size: int
    hidden_size: int
    tokens: list[int]  # committed tokens whose KV rows are cached, in order

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Shortlist logits [n, V'] -> vocabulary logits [n, V] (-inf off the shortlist)."""
        if self.head_ids is None:
            return logits
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.head_ids] = logits
        return full

    def _reusable(self, context: Sequence[int]) -> int:
        """How many cached tokens ``context`` starts with (at most all but its last, whose
        logits the caller needs)."""
        limit = min(len(self.tokens), len(context) - 1)
        if self.tokens[:limit] == list(context[:limit]):
            return limit
        n = 0
        while n < limit and self.tokens[n] == context[n]:
            n += 1
        return n


class DraftLM(_DraftCache):
    """A draft model with its own KV cache: committed tokens (a prefix of the request's
    context) plus, while drafting, *tree rows* (draft tokens, each attending to the committed
    prefix and its ancestors). After verification :meth:`prune` keeps the accepted path's rows
    as committed tokens and drops the others, so nothing accepted is computed twice."""

    def __init__(self, model: torch.nn.Module, head_ids: torch.Tensor | None = None):
        from transformers.cache_utils import DynamicCache

        self._new_cache = DynamicCache
        self.model = model.eval()
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.head_ids = head_ids
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.hidden_size = int(model.config.hidden_size)
        self.dtype = next(model.parameters()).dtype
        self.reset()

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.tokens: list[int] = []
        self._clear_tree()

    def _clear_tree(self) -> None:
        self.tree_tokens: list[int] = []
        self.tree_parents: list[int] = []  # tree row of the parent, -1 = last committed token
        self.tree_depth: list[int] = []
        self.ancestors = torch.zeros(0, 0, dtype=torch.bool)  # [S, S] ancestor-or-self

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.inference_mode()
    def catch_up(self, context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache every token of ``context``; return the logits [V'] and the last hidden state
        [H] after its last token. Reuses the longest cached prefix (from the previous step or
        an earlier request with the same prompt start)."""
        self.prune([])
        n = self._reusable(context)
        if n < len(self.tokens):
            self.cache.crop(n)
            del self.tokens[n:]
        new = list(context[n:])
        out = self.base(input_ids=torch.tensor([new]), past_key_values=self.cache, use_cache=True,
                        position_ids=torch.arange(n, n + len(new)).unsqueeze(0))
        self.tokens.extend(new)
        hidden = out.last_hidden_state[0, -1]
        return self._logits(hidden[None])[0], hidden

    @torch.inference_mode()
    def feed(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tree rows: ``tokens[j]`` is a child of tree row ``parents[j]`` (-1 = the last
        committed token). Returns logits [k, V'] and hidden states [k, H] after each."""
        committed, old, k = len(self.tokens), len(self.tree_tokens), len(tokens)
        ancestors = torch.zeros(old + k, old + k, dtype=torch.bool)
        ancestors[:old, :old] = self.ancestors
        depth = []
        for j, p in enumerate(parents):
            if p >= 0:
                ancestors[old + j, :old] = self.ancestors[p]
            ancestors[old + j, old + j] = True
            depth.append(1 if p < 0 else self.tree_depth[p] + 1)
        allowed = torch.ones(k, committed + old + k, dtype=torch.bool)
        allowed[:, committed:] = ancestors[old:]
        mask = torch.zeros(1, 1, k, committed + old + k, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        positions = torch.tensor([committed - 1 + d for d in depth]).unsqueeze(0)
        out = self.base(input_ids=torch.tensor([list(tokens)]), position_ids=positions,
                        attention_mask=mask, past_key_values=self.cache, use_cache=True)
        self.tree_tokens.extend(tokens)
        self.tree_parents.extend(parents)
        self.tree_depth.extend(depth)
        self.ancestors = ancestors
        hidden = out.last_hidden_state[0]
        return self._logits(hidden), hidden

    @torch.inference_mode()
    def prune(self, path_rows: Sequence[int]) -> None:
        """Keep the tree rows ``path_rows`` (a root-to-node path, in order) as committed
        tokens; drop every other tree row."""
        if not self.tree_tokens:
            return
        committed, keep = len(self.tokens), len(path_rows)
        if list(path_rows) != list(range(keep)):
            rows = torch.tensor([committed + r for r in path_rows], dtype=torch.long)
            for layer in self.cache.layers:
                layer.keys[:, :, committed:committed + keep] = layer.keys[:, :, rows]
                layer.values[:, :, committed:committed + keep] = layer.values[:, :, rows]
        self.tokens.extend(self.tree_tokens[r] for r in path_rows)
        self.cache.crop(len(self.tokens))
        self._clear_tree()


class NativeDraftLM(_DraftCache):
    """The draft on the native runner (models/llama.py; int4 by default, whose one-token
    forward is several times cheaper than ``transformers'``). The runner's cache holds the
    committed tokens; this step's draft rows (a chain or a tree, read a few nodes a call) lie
    after them (:meth:`LlamaRunner.read_tree`), and :meth:`prune` keeps the accepted path's
    rows, so accepted draft tokens are not computed again."""

    def __init__(self, runner, head_ids: torch.Tensor | None = None):
        self.runner = runner
        self.head_ids = head_ids
        self.vocab_size = runner.vocab_size
        self.hidden_size = runner.shape.hidden_size
        self.reset()

    def reset(self) -> None:
        self.runner.rewind(0)
        self.tokens: list[int] = []
        self._clear_tree()

    def _clear_tree(self) -> None:
        self.tree_tokens: list[int] = []
        self.tree_paths: list[list[int]] = []  # each row's ancestors, root to parent

    def catch_up(self, context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`DraftLM.catch_up`."""
        self.prune([])
        n = self._reusable(context)
        del self.tokens[n:]
        self.runner.rewind(n)
        hidden = self.runner.extend(context[n:])[-1:]
        self.tokens.extend(context[n:])
        return self.runner.lm_head(hidden)[0], hidden[0]

    def feed(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`DraftLM.feed`."""
        paths = [[] if p < 0 else self.tree_paths[p] + [p] for p in parents]
        hidden = self.runner.read_tree(tokens, paths, len(self.tree_tokens))
        self.tree_tokens.extend(tokens)
        self.tree_paths.extend(paths)
        return self.runner.lm_head(hidden), hidden

    def prune(self, path_rows: Sequence[int]) -> None:
        """As :meth:`DraftLM.prune`."""
        if self.tree_tokens:
            self.runner.keep_tree(path_rows)
            self.tokens.extend(self.tree_tokens[r] for r in path_rows)
        self._clear_tree()


# ---- the proposer --------------------------------------------------------------------------


@register("draft_model", DraftModelConfig,
          paper="Speculative decoding (Leviathan et al., 2023; Chen et al., 2023); SpecDec++ "
                "(Huang et al., 2024); OSD-style distilled draft (Liu et al., 2023)",
          summary="a small draft LM samples a chain from its own KV cache; length controllers "
                  "fixed / heuristic / confidence / specdecpp")
class DraftModelProposer(Proposer):
    def __init__(self, config: DraftModelConfig, runner: Runner,
                 draft_model: torch.nn.Module | None = None):
        """``draft_model``: a causal LM module to draft with instead of ``config.draft``."""
        super().__init__(config, runner)
        if draft_model is None:
            loaded = load_draft(config.draft, runner)
        else:
            check_vocabulary(draft_model, runner)
            loaded = LoadedDraft(draft_model.eval(), None, None, type(draft_model).__name__)
        self.lm = self._draft_cache(loaded)
        self.acceptance_head = loaded.acceptance_head
        self.draft_source = loaded.source
        self.generator = torch.Generator()
        self._prompt_len = 0
        # the last draft, for observe(): node tokens, parents, and each node's tree row
        self._nodes: tuple[list[int], list[int], list[int | None]] = ([], [], [])

    def _draft_cache(self, loaded: LoadedDraft) -> DraftLM | NativeDraftLM:
        if self.config.draft_runner == "hf":
            return DraftLM(loaded.model, loaded.head_ids)
        from specdecode.models.llama import LlamaRunner, LlamaShape, runs

        config = loaded.model.config
        require(runs(config), f"the native runner does not run the draft {loaded.source} "
                              f"({config.model_type}); use -c draft_runner=hf")
        weights = self.config.draft_weights
        if weights == "auto":
            weights = "int4" if LlamaShape.from_config(config).fits_int4 else "fp32"
        runner = LlamaRunner.from_transformers(loaded.model, weights)
        return NativeDraftLM(runner, loaded.head_ids)

    def make_controller(self) -> Controller:
        return CONTROLLERS[self.config.controller](self)

    def start(self, prompt: Sequence[int]) -> None:
        self._prompt_len = len(prompt)
        if self.sampling.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed((self.sampling.seed + DRAFT_SEED_OFFSET) % 2**63)

    def draw(self, logits: torch.Tensor, context: Sequence[int]) -> tuple[int, torch.Tensor | None, float]:
        """One draft token from shortlist logits [V'] at a node whose committed context plus
        path is ``context``: (token, the distribution it was drawn from or None when greedy,
        the draft's probability of it)."""
        full = self.lm.full_logits(logits[None])
        node = NodeDistributions(full, self.sampling, context, self._prompt_len, Draft.empty())
        if self.sampling.greedy:
            token = node.argmax(0)
            return token, None, float(full[0].softmax(-1)[token])
        q = node.probs(0)
        token = sample(q, self.generator)
        return token, q, float(q[token])

    def propose(self, context, budget):
        length = min(budget.max_depth, budget.max_nodes)
        if length <= 0:
            self._nodes = ([], [], [])
            return Draft.empty()
        logits, hidden = self.lm.catch_up(context)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        path = list(context)
        for depth in range(1, length + 1):
            token, q, confidence = self.draw(logits, path)
            tokens.append(token)
            path.append(token)
            if q is not None:
                probs.append(q)
            if depth == length or (budget.keep_drafting is not None and not budget.keep_drafting(
                    DraftSignal(depth, confidence, hidden))):
                break
            logits, hidden = self.lm.feed([token], [depth - 2])
            logits, hidden = logits[0], hidden[0]
        n = len(tokens)
        # every node but the last was fed to the draft: node i sits on tree row i
        self._nodes = (tokens, list(range(-1, n - 1)), list(range(n - 1)) + [None])
        return Draft.chain(tokens, torch.stack(probs) if probs else None)

    def observe(self, feedback: Feedback) -> None:
        """Keep the draft's KV rows of the accepted tokens it computed itself. Matched by token
        along the path, so a draft the engine truncated still lines up."""
        tokens, parents, rows = self._nodes
        children: dict[int, dict[int, int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, {}).setdefault(tokens[i], i)
        node, path_rows = -1, []
        for index in feedback.accepted:
            node = children.get(node, {}).get(feedback.draft.tokens[index], -2)
            if node < 0 or rows[node] is None:
                break
            path_rows.append(rows[node])
        self.lm.prune(path_rows)
        self._nodes = ([], [], [])
