"""Prompt rows kept in a file, so that a long prompt is not prefilled again by the next process:
the server's prompt cache across restarts (``serve --prompt-cache-file PATH``: on shutdown the
store's entries and the slots' own rows, read back at start) and a command's or a
:class:`~specdecode.api.Decoder`'s last prompt and answer (``generate --prompt-cache-file PATH``,
``Decoder.save_prompt_cache`` / ``load_prompt_cache``). An agent's long system prompt (Claude
Code's is about 19,000 tokens) or a file asked about again costs minutes of prefill on two cores.

The rows are reused only where they are bitwise what this runner would write: the file names
the weights file (path, size, modification time), the weight format, the kernels' build and the
KV cache's layout it was written with (:func:`rows_key`), and a file written under anything
else is not read (a warning; the next write replaces it). A file that cannot be read is left
out the same way: the cache changes when, never what.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.base import Runner
from specdecode.models.kv_cache import SavedRows

log = logging.getLogger(__name__)


def rows_key(runner: Runner) -> str:
    """What a runner's prompt rows depend on: its weights file, format and kernels
    (``cost_key``) and its cache's layout; a SpecDecodeError where rows cannot be kept (weights
    that are not a file, or a runner that does not reuse rows)."""
    cost = runner.cost_key()
    if cost is None or not runner.reuses_prefix:
        raise SpecDecodeError(
            "a prompt cache file (--prompt-cache-file, Decoder.save_prompt_cache) keeps the rows "
            "of the native runner's int4 or int8 weights read from a model file (--model a GGUF "
            f"file or a named model); this runner's ({runner.name}) rows cannot be kept: drop "
            "--prompt-cache-file")
    empty = runner.saved_rows(0)
    return (f"{cost} keys {tuple(empty.keys.shape)} {empty.keys.dtype} "
            f"values {tuple(empty.values.shape)} {empty.values.dtype}")


class PromptCacheFile:
    """``key``: what the target's rows depend on (:func:`rows_key`). A file may also hold one
    entry of a draft model's rows (a ``draft_model`` decoder's own cache of the same prompt)
    under the draft's key: read only by a draft of that key (:meth:`read_draft`)."""

    def __init__(self, path: str | Path, key: str):
        self.path = Path(path).expanduser()
        self.key = key

    def read(self) -> list[tuple[np.ndarray, SavedRows]]:
        """The entries the file holds, least recently used first; none where it is missing,
        was written under another key or cannot be read (a warning says which)."""
        if not self.path.exists():
            return []
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path), framework="pt") as file:
                meta = file.metadata() or {}
                if meta.get("key") != self.key:
                    log.warning("prompt cache %s was written for other weights, kernels or "
                                "cache layout; going on without it", self.path)
                    return []
                entries = [_entry(file, str(i)) for i in range(int(meta["entries"]))]
        except (OSError, SafetensorError, KeyError, ValueError) as exc:
            log.warning("prompt cache %s could not be read (%s); going on without it",
                        self.path, exc)
            return []
        log.info("loaded %d prompt cache entries (%d tokens) from %s", len(entries),
                 sum(len(ids) for ids, _ in entries), self.path)
        return entries

    def read_draft(self, draft_key: str) -> tuple[np.ndarray, SavedRows] | None:
        """The draft model's entry the file holds for a draft of ``draft_key`` (and this
        file's target key); None where it holds none (quietly: :meth:`read` warns)."""
        if not self.path.exists():
            return None
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path), framework="pt") as file:
                meta = file.metadata() or {}
                if meta.get("key") != self.key or meta.get("draft_key") != draft_key:
                    return None
                return _entry(file, "draft")
        except (OSError, SafetensorError, KeyError, ValueError):
            return None

    def write(self, entries: list[tuple[np.ndarray, SavedRows]],
              draft: tuple[str, np.ndarray, SavedRows] | None = None) -> None:
        """Write ``entries`` (least recently used first), and ``draft`` (a draft model's key,
        ids and rows) where given, in place of the file's, whole or not at all (a temporary
        file renamed over it; a failure is logged, the old file kept)."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        named = [(str(i), ids, rows) for i, (ids, rows) in enumerate(entries)]
        metadata = {"key": self.key, "entries": str(len(entries))}
        if draft is not None:
            metadata["draft_key"] = draft[0]
            named.append(("draft", *draft[1:]))
        for name, ids, rows in named:
            tensors[f"{name}.ids"] = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
            tensors[f"{name}.keys"] = rows.keys.contiguous()
            tensors[f"{name}.values"] = rows.values.contiguous()
        temporary = self.path.with_name(self.path.name + ".partial")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(temporary), metadata=metadata)
            os.replace(temporary, self.path)
        except OSError as exc:  # the caller goes on: the cache is lost, not its state
            log.error("prompt cache could not be written to %s: %s", self.path, exc)
            return
        log.info("saved %d prompt cache entries (%d tokens) to %s", len(entries),
                 sum(len(ids) for ids, _ in entries), self.path)


def _entry(file, name: str) -> tuple[np.ndarray, SavedRows]:
    """The entry ``name`` of an open safetensors file: its ids and rows."""
    ids = file.get_tensor(f"{name}.ids").numpy()
    return ids, SavedRows(file.get_tensor(f"{name}.keys"), file.get_tensor(f"{name}.values"),
                          len(ids))
