"""Which draft model drafts, and loading it: a distilled artifact of ``specdecode train draft``
(a few of the target's own layers sharing its embedding table, with a frequency-ranked
shortlist as LM head, as in FR-Spec, Zhao et al., 2025) or a local Hugging Face checkpoint
folder with the target's vocabulary, run by the native runner (default) or ``transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.control import AcceptanceHead
from specdecode.drafting.caches import DraftLM, NativeDraftLM
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import Runner
from specdecode.models.quant import check_format
from specdecode.registry import param

#: artifact kind written by ``specdecode train draft``
ARTIFACT_KIND = "draft_model"


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


@dataclass
class LoadedDraft:
    model: torch.nn.Module
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
    from specdecode.training.artifacts import load_artifact, newest_artifact

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
        loaded = build_distilled(artifact.config, artifact.tensors, runner.input_embeddings())
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


def open_draft(source: DraftSource, runner: Runner,
               draft_model: torch.nn.Module | None = None) -> tuple[DraftLM | NativeDraftLM, LoadedDraft]:
    """The draft ``source`` names (or ``draft_model``, a causal LM module), checked against
    the target, in the draft cache of its ``draft_runner``."""
    if draft_model is None:
        loaded = load_draft(source.draft, runner)
    else:
        check_vocabulary(draft_model, runner)
        loaded = LoadedDraft(draft_model.eval(), None, None, type(draft_model).__name__)
    if source.draft_runner == "hf":
        return DraftLM(loaded.model, loaded.head_ids), loaded
    from specdecode.models.llama import LlamaRunner, LlamaShape, runs
    from specdecode.models.llama_drafter import LlamaDrafter

    config = loaded.model.config
    require(runs(config), f"the native runner does not run the draft {loaded.source} "
                          f"({config.model_type}); use -c draft_runner=hf")
    weights = source.draft_weights
    if weights == "auto":
        weights = "int4" if LlamaShape.from_config(config).fits_int4 else "fp32"
    drafter = LlamaDrafter(LlamaRunner.from_transformers(loaded.model, weights))
    return NativeDraftLM(drafter, loaded.head_ids), loaded
