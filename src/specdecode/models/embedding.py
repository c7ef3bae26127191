"""The native runner's token embedding table: rows dequantised when a forward looks them up.

A forward reads one row of the table per token it runs, yet the table is the model's largest
tensor as float32 (Qwen2.5-Coder-1.5B's 151,936 x 1,536: 0.93 GB, against 131 MB as the file's
Q4_K blocks). :class:`FileRows` leaves a GGUF file's table in the file: a lookup reads the rows'
blocks with ``pread`` (through the page cache, not the process's memory) and dequantises them
with the very functions the whole table would be built with (``gguf_reader.dequantized_rows``),
so a row is bitwise the dense table's row. The whole table is dequantised only when something
asks for it (:meth:`FileRows.dense`: draft heads and drafters sharing the embedding), and the
runner does not keep it. Tensors in memory (a checkpoint's, a ``transformers`` model's) are
held as they come (:class:`DenseRows`): the table is theirs already.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from specdecode.errors import SpecDecodeError, require
from specdecode.models.gguf_reader import GGUFFile, dequantized_rows
from specdecode.models.weights import FileTensors, as_float

#: rows read and dequantised at a time by :meth:`FileRows.dense` (a few MB of temporaries)
_CHUNK_ROWS = 512


def _token_ids(tokens, rows: int) -> list[int]:
    """``tokens`` (ints or an integer tensor) as a list of ints, each checked to be a row (in
    Python: a decode step looks up one token, where tensor operations cost tens of us)."""
    ids = (tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor)
           else [int(t) for t in tokens])
    outside = next((t for t in ids if not 0 <= t < rows), None)
    if outside is not None:
        raise SpecDecodeError(f"token id {outside} is outside the vocabulary (0..{rows - 1})")
    return ids


class DenseRows:
    """A float32 table [V, H] held in memory."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.shape = tuple(table.shape)

    def rows(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """float32 [n, H]: the rows of ``tokens``."""
        return self.table[torch.tensor(_token_ids(tokens, self.shape[0]), dtype=torch.long)]

    def dense(self) -> torch.Tensor:
        """The table [V, H] float32 (this object's own tensor: read it, do not write it)."""
        return self.table

    @property
    def nbytes(self) -> int:
        """Bytes held in memory."""
        return self.table.numel() * self.table.element_size()


class FileRows:
    """A GGUF file's table [V, H], rows read from the file's blocks at each lookup (see the
    module docstring); ``blocks``: the int4 and int8 runners' values (:class:`FileTensors`)."""

    #: bytes held in memory: none (the file's pages are the page cache's)
    nbytes = 0

    def __init__(self, file: GGUFFile, name: str, blocks: bool):
        entry = file.entries[name]
        require(len(entry.shape) == 2, f"{name} is not a matrix: {entry.shape}")
        self.shape = tuple(entry.shape)
        self._entry, self._blocks = entry, blocks
        self._row_bytes = entry.nbytes // entry.shape[0]
        self._where = f"{file.path}: tensor {entry.gguf_name}"
        # opened once: a file later replaced at its path (a new download) leaves this runner
        # reading the file its layers came from
        self._file = open(file.path, "rb", buffering=0)

    def rows(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """float32 [n, H]: the rows of ``tokens``, each read and dequantised once."""
        ids = _token_ids(tokens, self.shape[0])
        unique = list(dict.fromkeys(ids))  # in order of first use
        raw = np.empty((len(unique), self._row_bytes), np.uint8)
        for row, token in zip(raw, unique):
            self._read(token, row)
        out = dequantized_rows(raw, self._entry, self._blocks)
        if len(unique) == len(ids):  # no token twice: the rows are in the tokens' order
            return out
        where = {token: i for i, token in enumerate(unique)}
        return out[torch.tensor([where[token] for token in ids], dtype=torch.long)]

    def dense(self) -> torch.Tensor:
        """The whole table [V, H] float32, dequantised now (not kept: a caller that asks twice
        gets two copies)."""
        rows = self.shape[0]
        out = torch.empty(self.shape)
        for start in range(0, rows, _CHUNK_ROWS):
            raw = np.empty((min(rows, start + _CHUNK_ROWS) - start, self._row_bytes), np.uint8)
            self._read(start, raw)
            out[start:start + len(raw)] = dequantized_rows(raw, self._entry, self._blocks)
        return out

    def _read(self, start: int, into: np.ndarray) -> None:
        """The file's bytes of ``len(into)`` rows from row ``start``, into ``into`` (uint8
        [rows, bytes a row], contiguous)."""
        count = into.nbytes
        read = os.preadv(self._file.fileno(), [memoryview(into).cast("B")],
                         self._entry.offset + start * self._row_bytes)
        require(read == count, f"{self._where} is cut short: the file is truncated or corrupt")


def embedding_table(tensors: Mapping, name: str) -> DenseRows | FileRows:
    """The table ``name`` of ``tensors``: rows from the file for a GGUF file's
    :class:`FileTensors`, else the tensor as float32, held."""
    if isinstance(tensors, FileTensors):
        return FileRows(tensors.file, name, tensors.blocks)
    return DenseRows(as_float(tensors[name]).contiguous())
