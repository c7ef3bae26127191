"""The server's prompt cache: the KV rows of earlier prompts and answers, reused by a request
whose prompt starts with the same tokens, so that it prefills only the rest.

A chat client sends the whole conversation again every turn, an agent the same system prompt
and tool definitions every request; without a cache each of them is prefilled in full, every
time. llama-server keeps each slot's cache (``cache_prompt``); vLLM's automatic prefix caching
and SGLang's RadixAttention share prefixes across requests. Here, two levels:

- **each slot's own cache**: after a sequence, a slot knows which tokens its rows hold (the
  prompt and the answer); a new request goes to the free slot sharing the longest prefix with
  its prompt, and those rows stay where they are (nothing is copied);
- **a store shared by the slots**: before a slot writes over rows that another request might
  extend, they are copied into the store; a request whose prompt matches a stored entry better
  than its slot does gets that entry's rows copied in. The store is bounded
  (``--prompt-cache-mb``) and drops the least recently used entries first; an entry that a new
  one extends is dropped (the longer one serves every prompt the shorter one served).

At least the prompt's last token is always prefilled: its logits give the first new token.
With a file (:mod:`specdecode.models.prompt_cache_file`), the store and the slots' rows outlive
the process.

Exactness: only a runner whose prompt rows are bitwise the rows its decode steps write reuses
rows (:attr:`~specdecode.models.base.Runner.reuses_prefix`: the native runner's int4 and int8
formats, whose kernels are row invariant), and only for a proposer that needs nothing of the
prompt's rows but the last row's logits (features of the reused rows would be missing). So a
request computes bitwise what a full prefill computes; the cache changes when, never what.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np

from specdecode.models.base import Runner
from specdecode.models.kv_cache import common_prefix
from specdecode.server.metrics import Metrics
from specdecode.models.prompt_cache_file import PromptCacheFile

#: rows worth copying into the store: a shorter prefix is prefilled again in a moment
MIN_SAVED_TOKENS = 64


@dataclass
class Saved:
    """An entry of the store: the rows of ``ids`` (a runner's :meth:`~Runner.saved_rows`)."""

    ids: np.ndarray
    rows: Any
    nbytes: int


class PromptCache:
    """The store of saved rows, and the placement of a prompt in a slot's cache."""

    def __init__(self, budget_bytes: int, metrics: Metrics, file: PromptCacheFile | None = None):
        """``file``: where the entries are read from now and written to by :meth:`persist`."""
        self.budget = budget_bytes
        self.metrics = metrics
        #: entries, least recently used first
        self._entries: collections.OrderedDict[int, Saved] = collections.OrderedDict()
        self._next_key = 0
        self.bytes = 0
        self.file = file
        for ids, rows in file.read() if file is not None else ():
            self._add(ids, rows)

    def __len__(self) -> int:
        return len(self._entries)

    def place(self, runner: Runner, held: np.ndarray, prompt: np.ndarray, reuse: bool) -> int:
        """Before ``prompt`` is prefilled on ``runner``, whose cache holds the rows of
        ``held``: save what is about to be written over, put the longest cached prefix of the
        prompt in the runner's cache (``reuse``: the request may use one) and return its
        length, where the prefill starts."""
        limit = len(prompt) - 1  # the last token is prefilled for its logits
        own = min(common_prefix(held, prompt), limit) if reuse else 0
        if len(held) - own >= MIN_SAVED_TOKENS:
            self.save(held, runner)
        if not reuse:
            return 0
        entry, stored = self._match(prompt)
        stored = min(stored, limit)
        if stored > own:
            runner.load_rows(entry.rows, stored)
        else:
            runner.keep_prefix(own)
        reused = max(own, stored)
        self.metrics.prompt_cache_hit_tokens.inc(reused)
        return reused

    def save(self, ids: np.ndarray, runner: Runner) -> None:
        """Copy the runner's rows of ``ids`` (its first ``len(ids)`` rows) into the store,
        unless an entry holds them already; least recently used entries make room."""
        for key, entry in list(self._entries.items()):
            shared = common_prefix(entry.ids, ids)
            if shared == len(ids):  # an entry extends these already
                self._entries.move_to_end(key)
                return
            if shared == len(entry.ids):  # these extend the entry: it is not needed any more
                self._drop(key)
        self._add(ids, runner.saved_rows(len(ids)))

    def _add(self, ids: np.ndarray, rows: Any) -> None:
        """A new entry, most recently used; least recently used entries make room."""
        if rows.nbytes > self.budget:
            return
        while self.bytes + rows.nbytes > self.budget:
            self._drop(next(iter(self._entries)))
            self.metrics.prompt_cache_evictions.inc()
        self._entries[self._next_key] = Saved(ids, rows, rows.nbytes)
        self._next_key += 1
        self.bytes += rows.nbytes
        self._observe()

    def persist(self, slots: list[tuple[np.ndarray, Runner]]) -> None:
        """Shutdown: with a file, the slots' own rows (``(held ids, runner)`` of each) join the
        store, and the store is written to it."""
        if self.file is None:
            return
        for held, runner in slots:
            if len(held) >= MIN_SAVED_TOKENS and runner.reuses_prefix:
                self.save(held, runner)
        self.file.write([(entry.ids, entry.rows) for entry in self._entries.values()])

    def _match(self, prompt: np.ndarray) -> tuple[Saved | None, int]:
        """The entry sharing the longest prefix with ``prompt`` (now the most recently used)."""
        best, length = None, 0
        for key, entry in self._entries.items():
            shared = common_prefix(entry.ids, prompt)
            if shared > length:
                best, length = key, shared
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return self._entries[best], length

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes
        self._observe()

    def _observe(self) -> None:
        self.metrics.prompt_cache_bytes.set(self.bytes)
        self.metrics.prompt_cache_entries.set(len(self._entries))
