"""What a request may ask of a method's config: the server-side ranges of every numeric field,
the fields only the operator sets, and the proposer memory a config will take.

A method's config dataclass checks that a value makes sense (``candidates >= 1``); the server
also needs it to be affordable for a stranger to ask: one request must not allocate gigabytes
(``recycling`` keeps a ``vocabulary x candidates`` matrix) or make every verify step search
thousands of nodes. ``RANGES`` holds one inclusive range per (method, numeric field); a test
fails when a registered method has a numeric field without one, so a new method cannot reach
the server unbounded. The upper bounds sit well above each paper's setting and every default.

``STARTUP_ONLY`` fields shape state that the whole server shares (the suffix global tree's depth
and size): ``specdecode serve -c`` sets them, a request naming them gets a 400.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from specdecode.server.protocol import ApiError

#: the fields every draft-head method (hydra, clover, eagle) shares
_HEAD_TREE = {"tree_nodes": (1, 128), "max_depth": (1, 32), "expand_width": (1, 64),
              "max_forwards": (1, 32), "min_path_prob": (0.0, 1.0)}

_QUANTIZED = {"num_speculative_tokens": (1, 32), "max_speculative_tokens": (1, 64),
              "confidence_threshold": (0.0, 1.0), "drafts": (1, 8)}

#: method -> numeric config field -> (lowest, highest) a request may ask for, inclusive
RANGES: dict[str, dict[str, tuple[float, float]]] = {
    "ar": {},
    "auto": {"min_path_prob": (0.0, 1.0), "explore_every": (1, 1024)},
    "arbitrage": {"threshold": (-100.0, 100.0), "max_step_tokens": (1, 128)},
    "aded": {"simulations": (1, 256), "branch": (1, 32), "c_puct": (0.0, 100.0),
             "max_depth": (1, 64)},
    "clover": _HEAD_TREE,
    "deer": _HEAD_TREE,
    "eagle": _HEAD_TREE,
    "hydra": _HEAD_TREE,
    "del": {"max_speculative_tokens": (1, 32), "confidence_threshold": (0.0, 1.0),
            "decay": (0.0, 1.0), "idle_shadow_every": (1, 1024), "prior_weight": (0.0, 1e6),
            "head_cost": (0.0, 1000.0), "verify_token_cost": (0.0, 100.0)},
    "draft_model": {"num_speculative_tokens": (1, 32), "max_speculative_tokens": (1, 64),
                    "confidence_threshold": (0.0, 1.0), "stop_threshold": (0.0, 1.0)},
    "dyspec": {"tree_nodes": (1, 128), "max_depth": (1, 32), "expand_width": (1, 64),
               "max_forwards": (1, 32), "min_path_prob": (0.0, 1.0)},
    "quantized": _QUANTIZED,
    "hierspec": {**_QUANTIZED, "tree_nodes": (1, 128)},
    "pearl": {"gamma": (1, 64), "drafter_threads": (1, 256), "target_threads": (0, 256)},
    "early_exit": {"exit_layer": (0, 1024), "num_speculative_tokens": (1, 32)},
    "jacobi": {"window": (1, 64)},
    "sjd": {"window": (1, 64)},
    "lookahead": {"window": (1, 32), "ngram": (3, 16), "guesses": (0, 64)},
    "ngram": {"max_ngram": (1, 16), "min_ngram": (1, 16), "num_speculative_tokens": (1, 64)},
    "recycling": {"candidates": (1, 64)},
    "superposed": {"n_drafts": (1, 16), "n_token_sample": (1, 64), "alpha": (0.0, 1.0)},
    "lora_drop": {"drop_cycle": (1, 64), "layer_stride": (1, 1024)},
    "lud": {"placeholders": (0, 16), "threshold": (0.0, 1.0)},
    "suffix": {"max_spec_tokens": (1, 128), "max_spec_factor": (0.0, 16.0),
               "max_spec_offset": (-64.0, 64.0), "min_token_prob": (0.0, 1.0)},
}

_CONFIDENCE = (0.0, 1.0)
#: the served diffusion policies (server/diffusion.py), by their method names
RANGES.update({
    "diffusion:one_per_step": {},
    "diffusion:threshold": {"threshold": _CONFIDENCE},
    "diffusion:freedave": {"draft_steps": (1, 32)},
    "diffusion:prophet": {"early_gap": (0.0, 100.0), "middle_gap": (0.0, 100.0),
                          "late_gap": (0.0, 100.0)},
    "diffusion:localleap": {"anchor_threshold": _CONFIDENCE, "relaxed_threshold": _CONFIDENCE,
                            "radius": (0, 64)},
    "diffusion:ete": {"threshold": _CONFIDENCE, "bits_per_round": (0.0, 64.0)},
    "diffusion:ccd": {"history": (1, 64), "threshold": _CONFIDENCE},
    "diffusion:window": {"inner": (1, 256), "outer": (1, 1024), "refresh": (1, 1024),
                         "threshold": _CONFIDENCE},
})

#: method -> fields a request may not set (they size state every request shares)
STARTUP_ONLY: dict[str, frozenset[str]] = {
    "suffix": frozenset({"max_tree_depth", "max_cached_requests"}),
    # which proposers one request builds (and so the memory it takes): the operator's choice
    "auto": frozenset({"parts"}),
    # a path the server would read: the operator picks the router; the int4 copy of
    # cheap=int4 is a second model in memory: the operator picks the cheap model
    "arbitrage": frozenset({"router", "cheap"}),
    # the threads of the server's own cores: the operator's to share out
    "pearl": frozenset({"drafter_threads", "target_threads"}),
    # trained deltas the method loads (a path would be a file the server opens): the operator's
    "lora_drop": frozenset({"adapters"}),
    "lud": frozenset({"adapters"}),
}

#: longest value of a free-text config field (``tree``, ``candidate_layers``, ...)
MAX_TEXT_FIELD = 64

#: proposer state of a method whose config does not size it (n-gram tables, small trees)
BASE_PROPOSER_BYTES = 1 << 20

#: method -> bytes its config makes the proposer allocate, given the vocabulary size
SIZED_BY_CONFIG: dict[str, Callable[[Any, int], int]] = {
    # the int64 [V, candidates] successor matrix and its [V] row flags
    "recycling": lambda config, vocab: vocab * (8 * config.candidates + 1),
}


def is_numeric(field: dataclasses.Field) -> bool:
    return isinstance(field.default, (int, float)) and not isinstance(field.default, bool)


def check_overrides(method: str, overrides: dict[str, Any]) -> None:
    """Refuse a request's config fields that only the operator sets, and over-long text, with a
    400 naming the field (before the config is built)."""
    for name, value in overrides.items():
        if name in STARTUP_ONLY.get(method, ()):
            raise ApiError(400, f"config field '{name}' of method '{method}' is set when the "
                                f"server starts (`specdecode serve -c {name}=...`), not per "
                                "request; leave it out", param=f"specdecode.config.{name}")
        if isinstance(value, str) and len(value) > MAX_TEXT_FIELD:
            raise ApiError(400, f"config field '{name}' is longer than {MAX_TEXT_FIELD} "
                                "characters", param=f"specdecode.config.{name}")


def check_ranges(method: str, config, asked) -> None:
    """Refuse a built config whose fields the request ``asked`` for are outside the server's
    ranges, with a 400 naming the field. It reads the config, not the request, so a number
    sent as a string (which the config coerces, as from the command line) is checked too;
    building a config allocates nothing, its proposer does."""
    ranges = RANGES.get(method, {})
    for name in asked:
        if name not in ranges:
            continue
        value = getattr(config, name)
        low, high = ranges[name]
        if not (math.isfinite(value) and low <= value <= high):
            raise ApiError(400, f"config field '{name}' of method '{method}' must be in "
                                f"{_number(low)}..{_number(high)} on this server, got {value!r}",
                           param=f"specdecode.config.{name}")


def proposer_bytes(method: str, config, vocab_size: int, artifact_bytes: int = 0) -> int:
    """An upper estimate of the memory one proposer of ``config`` holds: what its config sizes
    (``SIZED_BY_CONFIG``) plus the artifact it loads (``artifact_bytes``, from the server's
    catalogue, :mod:`.artifacts`)."""
    sized = SIZED_BY_CONFIG.get(method, lambda _config, _vocab: 0)(config, vocab_size)
    return BASE_PROPOSER_BYTES + sized + artifact_bytes


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
