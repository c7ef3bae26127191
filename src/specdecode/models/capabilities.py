"""What a runner may offer beside the runner protocol, each a small object that the methods
using it hold instead of the whole runner:

- :class:`EarlyExit` (``runner.early_exit``): draft chains through the target's first layers on
  its own cache, and its final norm and LM head at any layer (``early_exit``, ``del``; draft
  heads and the shortlist checks read the head of the final hidden states);
- :class:`Tables` (``runner.tables``): its input embedding table and LM head weight (draft
  heads and distilled drafts share them).

A runner without one raises a :class:`SpecDecodeError` naming the runner that has it when it is
asked for. The native runner's layer loop (``models/layer_loop.py``) is a third, of that runner
alone, for the methods that run its layers in an order of their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from specdecode.errors import require


def check_layer(layer: int, num_layers: int, what: str) -> None:
    """``layer`` must be an intermediate layer's output: 1 .. num_layers - 1."""
    require(isinstance(layer, int) and 1 <= layer < num_layers,
            f"{what} {layer} is outside the model: it has {num_layers} layers, so it must be in "
            f"1..{num_layers - 1}")


class EarlyExit(ABC):
    """A runner's early exit: chains of draft tokens through its first layers (LayerSkip,
    Elhoushi et al., 2024: the committed tokens' KV entries in those layers are exactly what a
    draft pass computes, so the chain shares the target's cache), and its final norm and LM
    head applied to any layer's hidden states."""

    num_layers: int

    def chain(self, layer: int) -> ExitChain:
        """A draft chain through the first ``layer`` layers, used as a context manager:
        ``with exits.chain(layer) as chain: hidden = chain.extend([token])``."""
        check_layer(layer, self.num_layers, "exit layer")
        require(self.pending_rows == 0, "an early-exit chain was opened between forward and commit")
        return ExitChain(self, layer)

    @abstractmethod
    def norm(self, hidden: torch.Tensor, adapter=None) -> torch.Tensor:
        """Normed states [n, H] for the LM head from a layer's hidden states [n, H]: the final
        norm, or ``adapter`` (a trained module mapping hidden states to normed ones)."""

    @abstractmethod
    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, V] from normed states [n, H]. One call for many rows costs about
        what one row does (the head's weights are read once), so callers batch rows."""

    def logits(self, hidden: torch.Tensor, adapter=None) -> torch.Tensor:
        """float32 logits [n, V] at an exit: :meth:`norm` then :meth:`head`."""
        return self.head(self.norm(hidden, adapter))

    @property
    @abstractmethod
    def pending_rows(self) -> int:
        """The runner's rows a forward left for its commit (a chain opens only at 0)."""

    @abstractmethod
    def run_chain(self, tokens: list[int], layer: int, offset: int) -> torch.Tensor:
        """Run ``tokens`` as a chain through the first ``layer`` layers, their KV rows at
        ``offset`` rows past the cache; that layer's output hidden states [n, H]."""

    @abstractmethod
    def drop_chain(self) -> None:
        """Forget the KV rows a chain wrote past the cache."""


class ExitChain:
    """Draft tokens run through the target's first ``layer`` layers after the cache. Its rows
    lie past the committed ones and are dropped when the ``with`` block ends: nothing of it
    reaches the next verify forward, which stays the plain full pass."""

    def __init__(self, exits: EarlyExit, layer: int):
        self.exits = exits
        self.layer = layer
        self.rows = 0

    def __enter__(self) -> ExitChain:
        return self

    def __exit__(self, *exc) -> None:
        self.exits.drop_chain()

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Run ``tokens`` as the chain's next rows (the first call's first token is the root);
        the exit layer's output hidden states [n, H] (before any norm)."""
        hidden = self.exits.run_chain(list(tokens), self.layer, self.rows)
        self.rows += len(tokens)
        return hidden


class Tables(ABC):
    """A runner's embedding tables, which draft heads and distilled drafts share."""

    @abstractmethod
    def input_embeddings(self) -> torch.Tensor:
        """The input embedding table [V, H]."""

    @abstractmethod
    def output_embeddings(self) -> torch.Tensor:
        """The LM head's weight [V, H] in float (draft heads score a shortlist of its rows)."""
