"""The KV cache as an object: its tensors, how many rows are committed, and its row moves.

Rows are written at explicit slots (gpt-fast's static cache, pytorch-labs/gpt-fast model.py),
so forgetting rows costs nothing: a rewind or a rejected draft just moves the length back, and
the next tokens are written over the same slots. One verify step writes the root and every draft
node after the committed rows (``pending``); :meth:`KVCache.commit` moves the accepted path's
rows next to the root's and keeps them. A drafting cache does the same with a tree it reads a
few nodes a call (:meth:`KVCache.keep_tree`).

:class:`BlockedKVCache` is the native runner's layout (keys in blocks of 16 slots, what its
attention kernel reads; storage that grows with the rows written); :class:`DynamicKVCache`
keeps the same books over a ``transformers`` ``DynamicCache``. :class:`AttentionPlan` says, for one forward, where each row goes and which
cache slots it attends to.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.draft import Draft
from specdecode.errors import require

#: slots per key block of :class:`BlockedKVCache` (16 slots fill a 512-bit register in float32)
KEY_BLOCK = 16
#: slots a :class:`BlockedKVCache` starts with (and returns to on reset): a short chat turn
INITIAL_SLOTS = 256


def held_ids(ids: Sequence[int]) -> np.ndarray:
    """Token ids as the rows' keepers hold them (a compact array that compares fast)."""
    return np.asarray(ids, dtype=np.int64)


def common_prefix(held: np.ndarray, ids: np.ndarray) -> int:
    """How many tokens ``held`` and ``ids`` share from the start."""
    n = min(len(held), len(ids))
    differ = np.flatnonzero(held[:n] != ids[:n])
    return int(differ[0]) if len(differ) else n


class KVCache(ABC):
    """The books of a cache: ``length`` committed rows, ``pending`` rows written by the last
    forward for :meth:`commit` to decide on. Subclasses own the tensors and move rows."""

    def __init__(self, capacity: int | None):
        #: rows the cache can hold (None: it grows)
        self.capacity = capacity
        self.length = 0
        self.pending = 0
        #: bumped by every change of the committed rows: what a runner noted they hold
        #: (``LlamaRunner.note_held``) is theirs while it is unchanged
        self.version = 0

    def reset(self) -> None:
        """Forget every row."""
        self.length = 0
        self.pending = 0
        self.version += 1

    def check_room(self, rows: int, what: str = "this draft") -> None:
        """Before writing ``rows`` rows after the committed ones."""
        require(self.capacity is None or self.length + rows <= self.capacity,
                f"the cache holds {self.capacity} rows; {self.length} are used and {what} "
                f"needs {rows}: give a smaller draft or a larger max_draft")

    def begin_forward(self, rows: int) -> None:
        """A verify pass will write ``rows`` rows after the committed ones."""
        require(self.pending == 0, "runner.forward called twice without commit")
        self.check_room(rows)

    def append(self, rows: int) -> None:
        """``rows`` rows written after the committed ones are kept (a prompt, read tokens)."""
        self.length += rows
        self.version += 1

    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the root's row and the accepted draft nodes' (a root-to-leaf path, in order)
        of the pending rows; drop the rest."""
        keep = len(accepted) + 1
        require(0 < keep <= self.pending, f"commit of {keep} rows after a forward of {self.pending}")
        self.pending = 0
        self.keep_tree([0] + [1 + i for i in accepted])

    def keep_tree(self, rows: Sequence[int]) -> None:
        """Keep the rows ``rows`` after the committed ones (offsets, in order; a root-to-node
        path of a tree) as committed rows; the other rows there are forgotten."""
        keep = len(rows)
        self.check_room(keep, "the kept path")
        if list(rows) != list(range(keep)):
            # the path is not the first rows: move its rows next to the committed ones
            self._move_after(self.length + torch.tensor(list(rows)))
        self.length += keep
        self.version += 1
        self._truncate(self.length)

    def rewind(self, length: int) -> None:
        """Forget every committed row from ``length`` on."""
        require(self.pending == 0 and 0 <= length <= self.length,
                f"cannot rewind a cache of {self.length} tokens to {length}")
        self.length = length
        self.version += 1
        self._truncate(length)

    def drop_uncommitted(self) -> None:
        """Forget rows written past the committed ones that no commit will keep (an early-exit
        chain's)."""
        self._truncate(self.length)

    # storage: what each layout does
    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes its keys and values take now."""

    @abstractmethod
    def _move_after(self, src: torch.Tensor) -> None:
        """Copy the rows at slots ``src`` (in order) to the slots right after the committed
        ones."""

    def _truncate(self, length: int) -> None:
        """Free storage past ``length`` rows, where the layout holds any (a static cache
        keeps its slots, to be written over)."""


@dataclass(frozen=True)
class SavedRows:
    """A copy of a :class:`BlockedKVCache`'s first ``length`` rows: its key blocks holding them
    [layer, kv head, blocks, D, 16] and their values [layer, kv head, length, D]."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class BlockedKVCache(KVCache):
    """The native runner's cache: keys [layer, kv head, slot / 16, D, slot % 16] (a score is one
    fma chain over D, 16 slots a register), values [layer, kv head, slot, D]. Empty, not zeros:
    attention reads only slots that were written.

    Its storage grows with the rows written (:meth:`reserve`, twice as many slots at a time, up
    to ``capacity``) and goes back to ``initial`` slots on :meth:`reset`, so a server slot holds
    the memory of its own sequence, not of the longest context it allows (vLLM's PagedAttention
    makes the same point with pages; one growing block per sequence keeps the kernels' layout)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int | None,
                 dtype: torch.dtype, initial: int = INITIAL_SLOTS):
        """``capacity``: the most rows it may hold (whole key blocks; None: no bound)."""
        require(capacity is None or capacity % KEY_BLOCK == 0,
                f"capacity {capacity} is not whole key blocks")
        super().__init__(capacity)
        self.initial = whole_blocks(initial, capacity)
        self._shape = (layers, kv_heads, head_dim)
        self._dtype = dtype
        self.keys, self.values = self._storage(self.initial)

    def _storage(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        # normal tensors even where a forward (in inference mode) grows the storage: the
        # prompt cache writes saved rows into it between forwards, outside inference mode
        layers, kv_heads, head_dim = self._shape
        with torch.inference_mode(False):
            return (torch.empty(layers, kv_heads, slots // KEY_BLOCK, head_dim, KEY_BLOCK,
                                dtype=self._dtype),
                    torch.empty(layers, kv_heads, slots, head_dim, dtype=self._dtype))

    @property
    def slots(self) -> int:
        """Slots the storage has now (at most ``capacity``)."""
        return self.values.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the storage now."""
        return self.keys.nbytes + self.values.nbytes

    def reserve(self, slots: int) -> None:
        """Storage for the first ``slots`` slots: where it has fewer, twice as many (whole key
        blocks, at most ``capacity``), the slots written so far copied over."""
        if slots <= self.slots:
            return
        require(self.capacity is None or slots <= self.capacity,
                f"the cache holds {self.capacity} rows, not {slots}")
        keys, values = self._storage(whole_blocks(max(slots, 2 * self.slots), self.capacity))
        keys[:, :, :self.keys.shape[2]] = self.keys
        values[:, :, :self.slots] = self.values
        self.keys, self.values = keys, values

    def reset(self) -> None:
        super().reset()
        if self.slots > self.initial:
            self.keys, self.values = self._storage(self.initial)

    def saved_rows(self, length: int) -> SavedRows:
        """A copy of the first ``length`` committed rows."""
        require(0 <= length <= self.length, f"the cache holds {self.length} rows, not {length}")
        blocks = -(-length // KEY_BLOCK)
        return SavedRows(self.keys[:, :, :blocks].clone(), self.values[:, :, :length].clone(), length)

    def load_rows(self, saved: SavedRows, length: int) -> None:
        """Hold the first ``length`` rows of ``saved`` as the committed rows (the rest forgotten)."""
        require(self.pending == 0 and 0 <= length <= saved.length
                and (self.capacity is None or length <= self.capacity)
                and saved.keys.shape[:2] == self.keys.shape[:2]
                and saved.keys.dtype == self.keys.dtype,
                f"{length} saved rows do not fit this cache")
        self.reserve(length)
        blocks = -(-length // KEY_BLOCK)
        self.keys[:, :, :blocks] = saved.keys[:, :, :blocks]
        self.values[:, :, :length] = saved.values[:, :, :length]
        self.length = length
        self.version += 1

    def _move_after(self, src: torch.Tensor) -> None:
        dst = torch.arange(self.length, self.length + len(src))
        k = self.keys
        k[:, :, dst // KEY_BLOCK, :, dst % KEY_BLOCK] = k[:, :, src // KEY_BLOCK, :, src % KEY_BLOCK]
        self.values[:, :, dst] = self.values[:, :, src]


def whole_blocks(slots: int, capacity: int | None = None) -> int:
    """``slots`` rounded up to whole key blocks, at most ``capacity``."""
    slots = -(-slots // KEY_BLOCK) * KEY_BLOCK
    return slots if capacity is None else min(slots, capacity)


class DynamicKVCache(KVCache):
    """The same books over a ``transformers`` ``DynamicCache`` (keys and values [1, kv heads,
    slot, D] per layer), which grows as the model writes and is cropped to what is kept."""

    def __init__(self):
        super().__init__(None)
        self.reset()

    def reset(self) -> None:
        from transformers.cache_utils import DynamicCache

        #: what the model reads and appends to (``past_key_values``)
        self.model_cache = DynamicCache()
        super().reset()

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.model_cache.layers
                   if getattr(layer, "keys", None) is not None)

    @torch.inference_mode()  # the cache tensors were made in inference mode
    def _move_after(self, src: torch.Tensor) -> None:
        end = self.length + len(src)
        for layer in self.model_cache.layers:
            layer.keys[:, :, self.length:end] = layer.keys[:, :, src]
            layer.values[:, :, self.length:end] = layer.values[:, :, src]

    @torch.inference_mode()
    def _truncate(self, length: int) -> None:
        self.model_cache.crop(length)


@dataclass(frozen=True)
class AttentionPlan:
    """Where one forward's rows go and what they see. Row i is at position ``positions[i]``,
    writes its KV at slot ``slots[i]`` and attends to every slot before ``past`` and then to
    ``keys[i, :lengths[i]]`` (slots in position order, itself last)."""

    past: int
    positions: torch.Tensor  # [n] int64
    slots: torch.Tensor  # [n] int64
    keys: torch.Tensor  # [n, K] int32
    lengths: torch.Tensor  # [n] int32

    @property
    def end(self) -> int:
        """Slots a cache needs for this forward: the past ones and every row's own."""
        return max(self.past, int(self.slots.max()) + 1)

    @classmethod
    def chain(cls, past: int, n: int) -> AttentionPlan:
        """``n`` rows after ``past`` slots, each seeing the ones before it."""
        steps, lengths, table = _chain_offsets(n)
        positions = past + steps
        return cls(past, positions, positions, past + table, lengths)

    @classmethod
    def verify(cls, past: int, draft: Draft) -> AttentionPlan:
        """The root at slot ``past`` and every draft node after it: a node sees the root's
        slot, its ancestors' and its own (a chain draft is the plain chain)."""
        if draft.is_chain:
            return cls.chain(past, len(draft) + 1)
        depths = (0,) + draft.depths
        n, width = len(depths), max(depths) + 1
        table = [[past] * width]  # a row's slots: the root's, its ancestors', its own; past after
        for node in range(n - 1):
            seen = [past] + [past + 1 + i for i in draft.path_to(node)]
            table.append(seen + [past] * (width - len(seen)))
        return cls(past, past + torch.tensor(depths), torch.arange(past, past + n),
                   torch.tensor(table, dtype=torch.int32),
                   torch.tensor([depth + 1 for depth in depths], dtype=torch.int32))

    @classmethod
    def tree_rows(cls, cached: int, start: int, paths: Sequence[Sequence[int]]) -> AttentionPlan:
        """Tree rows read a few a call after ``cached`` committed slots: row j sits at slot
        ``cached + start + j`` and its ancestors are the tree rows ``paths[j]`` (root to parent,
        offsets after the cache, all below ``start + j``; empty: a child of the last cached
        token). A row sees every cached slot, its ancestors and itself."""
        n = len(paths)
        base = cached + start
        lengths = [len(path) + 1 for path in paths]
        width = max(lengths)
        table = []  # built as lists: a tensor op per row cost more than the draft step's layer
        for j, path in enumerate(paths):
            require(all(0 <= row < start + j for row in path),
                    f"tree row {start + j}'s ancestors must be earlier rows, got {list(path)}")
            table.append([cached + row for row in path] + [base + j] + [0] * (width - len(path) - 1))
        return cls(cached, torch.tensor([cached - 1 + length for length in lengths]),
                   torch.arange(base, base + n), torch.tensor(table, dtype=torch.int32),
                   torch.tensor(lengths, dtype=torch.int32))


@functools.lru_cache(maxsize=64)
def _chain_offsets(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain of ``n`` rows after no past: its steps 0 .. n - 1 (int64), lengths 1 .. n and
    key table [n, n] (int32); a chain plan adds its past (these are shared: read only). One
    verify plan a sequence and forward is made from them, so the few tensor operations count."""
    steps = torch.arange(n)
    return steps, torch.arange(1, n + 1, dtype=torch.int32), steps.to(torch.int32).expand(n, n).contiguous()
