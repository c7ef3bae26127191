"""The user cache folder everything specdecode keeps between runs lives in:
``$XDG_CACHE_HOME/specdecode`` (``~/.cache/specdecode``): converted tokenizers, assembled model
files, row-cost curves, trained artifacts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdecode"
