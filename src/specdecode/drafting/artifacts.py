"""Which draft model drafts, and loading it: a distilled artifact of ``specdecode train draft``
(a few of the target's own layers sharing its embedding table, with a frequency-ranked
shortlist as LM head, as in FR-Spec, Zhao et al., 2025) or a local Hugging Face checkpoint
folder with the target's vocabulary, run by the native runner (default) or ``transformers``;
or a GGUF file (a path or a named model, as llama.cpp's ``-md``), which the native runner
reads itself, one tensor at a time, with no ``transformers`` model built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.cache import file_version
from specdecode.control import AcceptanceHead
from specdecode.drafting.caches import DraftLM, NativeDraftLM
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import Runner
from specdecode.models.quant import check_format
from specdecode.registry import param

#: artifact kind written by ``specdecode train draft``
ARTIFACT_KIND = "draft_model"
#: GGUF tokenizer metadata a GGUF draft must share with a GGUF target: what the files' headers
#: hold without parsing the vocabulary's strings (the token and merge counts, the token types)
TOKENIZER_FIELDS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens.count",
                    "tokenizer.ggml.merges.count", "tokenizer.ggml.token_type")


@dataclass(frozen=True)
class DraftSource:
    """Which draft and what runs it: the settings of ``draft_model`` and ``dyspec``. A GGUF
    draft's format and shortlist are set when a server starts: each value loads a runner of
    its own, kept for the process."""

    draft: str = param("distilled", "the draft: 'distilled' (the artifact `specdecode train draft` "
                                    "made for this target), an artifact .safetensors path, a "
                                    "local Hugging Face checkpoint folder, a .gguf file or a "
                                    "named model (`specdecode models`, e.g. qwen2.5-coder-0.5b) "
                                    "with the same vocabulary; GGUF drafts run on the native "
                                    "runner")
    draft_runner: str = param("native", "what runs the draft: native (the native runner, see "
                                        "draft_weights; Llama-family drafts) or hf (transformers, "
                                        "float32)")
    draft_weights: str = param("auto", "the native draft's weight format: fp32 | bf16 | int8 | "
                                       "int4, or auto: int4 (the cheapest one-token forward) "
                                       "where the draft's sizes allow it, else fp32, a GGUF "
                                       "draft's layers and shortlisted head requantised to it "
                                       "(int4 keeps the file's 5- to 8-bit blocks); the draft's "
                                       "numbers never change the output",
                               startup_only=True)
    draft_vocab: int = param(32768, "a GGUF draft's LM head scores only the first N token ids "
                                    "and the control tokens (FR-Spec's frequency-ranked "
                                    "shortlist, in the order a BPE vocabulary's merges give its "
                                    "ids); 0: the whole vocabulary", startup_only=True)
    draft_vocab_context: bool = param(True, "a shortlisted GGUF draft's head also scores "
                                            "every token of the request's context outside "
                                            "the shortlist (its rare words and names, read "
                                            "from the head's rows); false: the shortlist "
                                            "alone")

    def __post_init__(self):
        require(self.draft_vocab >= 0,
                f"draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")
        require(self.draft_runner in ("native", "hf"),
                f"unknown draft_runner {self.draft_runner!r}; known: native, hf")
        if self.draft_weights != "auto":
            check_format(self.draft_weights)


@dataclass
class LoadedDraft:
    #: the causal LM module; None for a GGUF draft (the native runner reads the file itself)
    model: torch.nn.Module | None
    #: vocabulary ids the draft's LM head covers (a shortlist), or None = the whole vocabulary
    head_ids: torch.Tensor | None
    acceptance_head: AcceptanceHead | None
    source: str


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
    from specdecode.artifacts import load_artifact, newest_artifact

    fingerprint = runner.fingerprint()
    if spec == "distilled":
        spec = str(newest_artifact(ARTIFACT_KIND, fingerprint,
                                   "no distilled draft model for this target yet; make one with "
                                   "`specdecode train draft` (about 30 minutes on 2 CPU cores), "
                                   "or pass -c draft=PATH (an artifact or a Hugging Face "
                                   "checkpoint folder)"))
    path = Path(spec)
    if path.suffix == ".safetensors":
        artifact = load_artifact(path, ARTIFACT_KIND, fingerprint)
        loaded = build_distilled(artifact.config, artifact.tensors, runner.tables.input_embeddings())
    elif path.is_dir():
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (ValueError, OSError) as exc:
            raise SpecDecodeError(f"cannot load draft checkpoint {path}: {exc}") from None
        loaded = LoadedDraft(model.eval(), None, None, "")
    else:
        raise SpecDecodeError(f"draft {spec!r} is neither 'distilled', a named model, a .gguf "
                              "file, an artifact .safetensors file nor a checkpoint folder")
    loaded.source = str(path)
    check_vocabulary(embedding_rows(loaded.model), runner)
    return loaded


def embedding_rows(model: torch.nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def check_vocabulary(size: int, runner: Runner) -> None:
    """A draft's vocabulary (its embedding rows, which may exceed its tokenizer's real tokens)
    must be the target's: the verifier compares their distributions id by id."""
    require(size == runner.vocab_size,
            f"the draft model's vocabulary has {size} tokens but the target's has "
            f"{runner.vocab_size}; a draft must share the target's tokenizer and vocabulary")


def gguf_draft_file(spec: str) -> Path | None:
    """The GGUF file ``spec`` names (a named model's, or a .gguf path), or None where ``spec``
    names another kind of draft."""
    from specdecode.models.loading import NAMED_MODELS

    if spec in NAMED_MODELS:
        return Path(NAMED_MODELS[spec]())  # a named model not installed says how to install it
    if not spec.endswith(".gguf"):
        return None
    path = Path(spec)
    require(path.is_file(), f"draft GGUF file {path} does not exist; pass an existing file as "
                            "-c draft=FILE.gguf, or a named model (`specdecode models` lists them)")
    return path


def check_tokenizer(path: Path, fields: dict, runner: Runner) -> None:
    """Refuse a GGUF draft whose tokenizer metadata (``fields``: its header's) differs from a
    GGUF target's in ``TOKENIZER_FIELDS``; a target not read from a GGUF file, or a field one
    file lacks, has nothing cheap to compare."""
    from specdecode.models.gguf_reader import read_header

    source = getattr(runner, "source", "")
    if not source.endswith(".gguf"):
        return
    target = read_header(Path(source))[0]
    for key in TOKENIZER_FIELDS:
        mine, theirs = fields.get(key), target.get(key)
        if mine is None or theirs is None or mine == theirs:
            continue
        shown = ("they differ" if isinstance(mine, list) else
                 f"{mine!r} in the draft, {theirs!r} in the target")
        raise SpecDecodeError(f"the draft {path.name} has another tokenizer than the target "
                              f"{Path(source).name} ({key}: {shown}); a draft must share the "
                              "target's tokenizer and vocabulary")


def native_weights(weights: str, config) -> str:
    """``draft_weights`` for a draft of ``config``: auto is int4 (the cheapest one-token
    forward) where its sizes are whole int4 groups, else fp32."""
    from specdecode.models.native_shape import LlamaShape

    if weights != "auto":
        return weights
    return "int4" if LlamaShape.from_config(config).fits_int4 else "fp32"


def open_gguf_draft(path: Path, source: DraftSource,
                    runner: Runner) -> tuple[NativeDraftLM, LoadedDraft]:
    """A GGUF draft on the native runner, checked against the target before its weights are
    read; its cache holds the target's context (or the draft's own, when shorter)."""
    from specdecode.models.gguf_reader import GGUFFile
    from specdecode.models.native_shape import LlamaShape
    from specdecode.models.llama_drafter import LlamaDrafter

    require(source.draft_runner == "native",
            f"the GGUF draft {path.name} runs on the native runner: drop -c draft_runner=hf, or "
            "give a Hugging Face checkpoint folder to draft through transformers")
    file = GGUFFile(path)
    check_vocabulary(int(file.config.vocab_size), runner)
    check_tokenizer(path, file.fields, runner)
    longest = LlamaShape.from_config(file.config).max_context
    context = getattr(runner, "max_context", None)  # None: the native default
    weights = native_weights(source.draft_weights, file.config)
    loaded, head_ids = _gguf_draft_weights(*file_version(path), weights,
                                           None if context is None else min(context, longest),
                                           source.draft_weights == "auto" and weights == "int4",
                                           source.draft_vocab, runner.vocab_size)
    return (NativeDraftLM(LlamaDrafter(loaded.replica()), head_ids,
                          widen=source.draft_vocab_context),
            LoadedDraft(None, head_ids, None, str(path)))


#: GGUF token types a shortlist keeps whatever their ids (CONTROL and USER_DEFINED: the end
#: of a turn, a chat template's tags)
KEPT_TOKEN_TYPES = (3, 4)


def shortlist_ids(fields: dict, size: int, vocab: int) -> torch.Tensor | None:
    """The vocabulary ids a GGUF draft's shortlisted LM head scores, ascending: the first
    ``size`` (a BPE vocabulary numbers its tokens in the order of its merges, the most frequent
    pairs first, so these are a frequency-ranked shortlist without counting any text: the first
    32,768 of Qwen2.5's 151,936 hold 93% of the tokens the 1.5B wrote on the Spec-Bench dev
    half) and the tokens of ``KEPT_TOKEN_TYPES`` (its ``fields``' token types); None where
    that is the whole vocabulary of ``vocab`` rows."""
    if not 0 < size < vocab:
        return None
    types = fields.get("tokenizer.ggml.token_type") or []
    kept = [i for i, kind in enumerate(types[:vocab]) if i >= size and kind in KEPT_TOKEN_TYPES]
    return torch.cat([torch.arange(size), torch.tensor(kept, dtype=torch.long)])


@functools.cache
def _gguf_draft_weights(path: Path, size: int, mtime_ns: int, weights: str,
                        max_context: int | None, requantise: bool, draft_vocab: int,
                        vocab: int):
    """(the native runner of a GGUF draft, its head's shortlist: :func:`shortlist_ids` of
    ``draft_vocab`` in a ``vocab``), loaded once a process for a file (as it is on disk: its
    size and modification time), weight format, context and shortlist: every proposer
    drafting with it (a server's slots, a bench's methods) gets a replica, its own KV cache
    over these weights, so ``--parallel 4`` holds one copy of the draft's weights, not four."""
    from specdecode.models.gguf_reader import GGUFFile
    from specdecode.models.llama import LlamaRunner

    head_ids = shortlist_ids(GGUFFile(path).fields, draft_vocab, vocab)
    return LlamaRunner.from_gguf(path, weights, max_context=max_context, requantise=requantise,
                                 head_ids=head_ids), head_ids


def open_draft(source: DraftSource, runner: Runner,
               draft_model: torch.nn.Module | None = None) -> tuple[DraftLM | NativeDraftLM, LoadedDraft]:
    """The draft ``source`` names (or ``draft_model``, a causal LM module), checked against
    the target, in the draft cache of its ``draft_runner``."""
    if draft_model is None:
        gguf = gguf_draft_file(source.draft)
        if gguf is not None:
            return open_gguf_draft(gguf, source, runner)
        loaded = load_draft(source.draft, runner)
    else:
        check_vocabulary(embedding_rows(draft_model), runner)
        loaded = LoadedDraft(draft_model.eval(), None, None, type(draft_model).__name__)
    if source.draft_runner == "hf":
        return DraftLM(loaded.model, loaded.head_ids), loaded
    from specdecode.models.llama import LlamaRunner
    from specdecode.models.native_shape import runs
    from specdecode.models.llama_drafter import LlamaDrafter

    config = loaded.model.config
    require(runs(config), f"the native runner does not run the draft {loaded.source} "
                          f"({config.model_type}); use -c draft_runner=hf")
    weights = native_weights(source.draft_weights, config)
    drafter = LlamaDrafter(LlamaRunner.from_transformers(loaded.model, weights))
    return NativeDraftLM(drafter, loaded.head_ids), loaded
