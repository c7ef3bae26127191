"""The user cache folder everything specdecode keeps between runs lives in:
``$XDG_CACHE_HOME/specdecode`` (``~/.cache/specdecode``): converted tokenizers, assembled model
files, row-cost curves, trained artifacts; and what such keeps are keyed by for a file."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdecode"


def file_version(path: Path) -> tuple[Path, int, int]:
    """A file as it is on disk now (its resolved path, size and modification time in ns): what
    anything kept from reading it is keyed by, so that a file rewritten in place is read
    again."""
    stat = path.stat()
    return path.resolve(), stat.st_size, stat.st_mtime_ns
