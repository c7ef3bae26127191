"""The runner protocol: what the engine needs from a target model.

The KV cache holds every committed token except the last one, the *root* (pending token). One
verify step feeds the root plus every draft node in one forward:

    logits = runner.forward(root, draft)   # [1 + n, V]: row 0 = next-token logits after the
                                           # root, row 1 + i = after draft node i
    runner.commit(accepted)                # keep the root's and the accepted nodes' KV rows

Plain autoregressive decoding is the same call with an empty draft, so the reference decoder
and every speculative method compute each token through the same code path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError, require


class Runner(ABC):
    """A target model behind the prefill / forward(draft) / commit protocol."""

    #: short name shown in statistics and benchmark reports
    name: str = "runner"
    vocab_size: int
    max_context: int
    num_layers: int

    @abstractmethod
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Reset the cache, run ``ids`` and return the float32 logits [V] after the last one."""

    #: prompt rows per :meth:`prefill_part` (parts start at multiples of it); 0 = this runner
    #: prefills a prompt in one call only
    prefill_granule: int = 0

    def prefill_part(self, ids: Sequence[int], start: int, stop: int) -> torch.Tensor | None:
        """Prefill ``ids`` one part at a time, so a server can step other sequences between the
        parts: run rows ``start:stop`` (``start`` 0 resets the cache; a later part starts where
        the previous one stopped, at a multiple of :attr:`prefill_granule`). The last part
        (``stop == len(ids)``) returns what ``prefill(ids)`` returns, bitwise, and leaves the
        runner as it would; earlier parts return None."""
        raise SpecDecodeError(f"the {self.name} runner prefills a prompt in one call only")

    @abstractmethod
    def forward(self, root: int, draft: Draft) -> torch.Tensor:
        """Run the root token and every draft node in one pass with tree attention.

        Returns float32 logits [1 + len(draft), V]. The cache is left holding the new rows
        until :meth:`commit` decides which to keep.
        """

    @abstractmethod
    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the root's KV row and those of the accepted draft nodes (a root-to-leaf path,
        in order), drop the rest."""

    @property
    @abstractmethod
    def cache_len(self) -> int:
        """Number of committed tokens whose KV entries are in the cache."""

    def replica(self) -> Runner:
        """A runner over the same weights with a cache and decoding state of its own (server
        slots share one copy of the weights)."""
        raise SpecDecodeError(f"the {self.name} runner cannot share its weights with a replica")

    def fingerprint(self) -> str:
        """Identifies the target's weights (for trained artifacts); runners override."""
        return f"{self.name}:{self.vocab_size}:{self.num_layers}"

    # ---- optional: early exit, for self-speculative proposers (LayerSkip, DEL) -------------
    # Runners that implement these set ``supports_early_exit``; proposers check it up front.

    #: True where :meth:`exit_forward`, :meth:`exit_norm`, :meth:`lm_head` and
    #: :meth:`capture_hidden` work
    supports_early_exit: bool = False
    #: after a :meth:`forward` with :meth:`capture_hidden` on: {layer: hidden [1 + n, H]}
    captured: dict[int, torch.Tensor]

    def exit_forward(self, tokens: Sequence[int], exit_layer: int) -> torch.Tensor:
        """Run ``tokens`` through the first ``exit_layer`` layers only and return that layer's
        output hidden states [n, H] (before any norm).

        The first call of a step feeds the root; later calls continue the chain. Their KV rows
        go into layers < ``exit_layer`` of the target's own cache (shared KV: the committed
        tokens' entries there are exactly what a draft pass computes) and are dropped before
        the next :meth:`forward`, which stays the normal full pass over root and draft.
        """
        raise self._no_early_exit()

    def exit_norm(self, hidden: torch.Tensor, adapter=None) -> torch.Tensor:
        """Normed states [n, H] for the LM head from an exit layer's hidden states [n, H]: the
        final norm, or ``adapter`` (a trained module mapping hidden states to normed ones)."""
        raise self._no_early_exit()

    def lm_head(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, V] from normed states [n, H]. One call for many rows costs about
        what one row does (the head's weights are read once), so callers batch rows."""
        raise self._no_early_exit()

    def exit_logits(self, hidden: torch.Tensor, adapter=None) -> torch.Tensor:
        """float32 logits [n, V] at an exit: :meth:`exit_norm` then :meth:`lm_head`."""
        return self.lm_head(self.exit_norm(hidden, adapter))

    def capture_hidden(self, layers: Sequence[int]) -> None:
        """From now on, every :meth:`forward` keeps the output hidden states of ``layers``
        (1 .. num_layers - 1) for its rows in :attr:`captured`; ``()`` stops capturing."""
        raise self._no_early_exit()

    # ---- optional: the target's own features, for draft heads (Hydra, Clover, EAGLE) --------

    #: after :meth:`prefill` or :meth:`forward` with :meth:`keep_final_hidden` on: the final
    #: normed hidden state of every row (what the LM head reads) [rows, H], float32
    final_hidden: torch.Tensor | None = None

    def keep_final_hidden(self, on: bool) -> None:
        """From now on (``on``), every :meth:`prefill` (one row per prompt token) and
        :meth:`forward` (one row per fed token) keeps its final normed hidden states in
        :attr:`final_hidden`."""
        raise SpecDecodeError(f"the {self.name} runner does not expose its hidden states, which "
                              "draft heads read; use the native or the hf runner")

    def output_embeddings(self) -> torch.Tensor:
        """The LM head's weight [V, H] in float (draft heads score a shortlist of its rows)."""
        raise SpecDecodeError(f"the {self.name} runner does not expose its LM head; use the "
                              "native or the hf runner")

    def _check_exit_layer(self, layer: int) -> None:
        require(isinstance(layer, int) and 1 <= layer < self.num_layers,
                f"exit layer {layer} is outside the model: it has {self.num_layers} layers, so "
                f"an exit layer must be in 1..{self.num_layers - 1}")

    def _check_exit_pass(self, exit_layer: int) -> None:
        """Before a draft pass: the layer is inside the model, no verify pass is pending, and
        the chain keeps one exit layer within a step (runners keep ``_pending``,
        ``_exit_rows`` and ``_exit_layer``)."""
        self._check_exit_layer(exit_layer)
        require(self._pending == 0, "exit_forward called between forward and commit")
        require(self._exit_rows == 0 or exit_layer == self._exit_layer,
                f"exit layer changed from {self._exit_layer} to {exit_layer} within one step; "
                "the deeper layers would lack the earlier draft tokens")

    def _no_early_exit(self) -> SpecDecodeError:
        return SpecDecodeError(f"the {self.name} runner does not support early exit; "
                               "use the hf runner (--runner hf)")
