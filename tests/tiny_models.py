"""Tiny random-weight models built from a config, for tests that need no real model (test
helpers, not shipped: ``from tiny_models import tiny_llama``)."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

#: where the test fixtures save the models and artifacts they make (tiny heads are 17 MB a
#: file): one folder, removed when the run ends, so that runs leave nothing in /tmp
_SCRATCH = tempfile.TemporaryDirectory(prefix="specdecode-tests-")


def scratch_dir(prefix: str) -> Path:
    """A new folder for a fixture's files, removed with the run's scratch folder."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH.name))


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


def noisy_copy(model, scale: float = 0.3, seed: int = 1) -> torch.nn.Module:
    """A draft model that agrees with ``model`` often but not always: a copy with noise of
    ``scale`` times each parameter's standard deviation."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return draft.eval()
