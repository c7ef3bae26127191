"""The runner protocol: what the engine needs from a target model.

The KV cache holds every committed token except the last one, the *root* (pending token). One
verify step feeds the root plus every draft node in one forward:

    out = runner.forward(root, draft, needs)   # out.logits [1 + n, V]: row 0 = next-token
                                               # logits after the root, row 1 + i = after node i
    runner.commit(accepted)                    # keep the root's and the accepted nodes' KV rows

Plain autoregressive decoding is the same call with an empty draft, so the reference decoder
and every speculative method compute each token through the same code path.

What a proposer reads from the target's pass besides the logits (the final hidden states for
draft heads, chosen layers' outputs for DEL) it declares as :class:`Needs`; the runner returns
exactly that in the :class:`ForwardOutput` and keeps nothing of it (vLLM's
``target_hidden_states``, transformers' ``requires_model_outputs``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.models.capabilities import EarlyExit, Tables, check_layer
from specdecode.models.kv_cache import held_ids


@dataclass(frozen=True)
class Needs:
    """What a proposer reads from the target's forward besides the logits."""

    #: the hidden states after the final norm (what the LM head reads), one row per fed token
    final_hidden: bool = False
    #: layers (1 .. num_layers - 1) whose output hidden states it reads, one row per fed token
    layers: tuple[int, ...] = ()


#: the logits only
NOTHING = Needs()


@dataclass(frozen=True)
class ForwardOutput:
    """What one target pass computed: the logits, and the features asked for by :class:`Needs`."""

    #: float32 logits: [1 + n, V] after a forward (row 0 after the root, 1 + i after draft
    #: node i); [1, V] after a prefill (after the prompt's last token)
    logits: torch.Tensor
    #: float32 [fed, H] after the final norm, one row per token the pass read (the prompt's
    #: every token after a prefill); None unless asked for
    final_hidden: torch.Tensor | None = None
    #: {layer: that layer's output hidden states [fed, H]} for the layers asked for
    layers: Mapping[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillCall:
    """Rows ``start:stop`` of the prompt ``ids`` (:meth:`Runner.prefill_part`; the whole prompt
    when ``start`` is 0 and ``stop`` its length): the last part returns the logits after the
    prompt, earlier parts None."""

    ids: tuple[int, ...]
    start: int
    stop: int
    needs: Needs = NOTHING

    def run(self, runner: Runner) -> ForwardOutput | None:
        if self.start == 0 and self.stop == len(self.ids):
            return runner.prefill(self.ids, self.needs)
        return runner.prefill_part(self.ids, self.start, self.stop, self.needs)


@dataclass(frozen=True)
class VerifyCall:
    """One verify pass: the root and every draft node (:meth:`Runner.forward`)."""

    root: int
    draft: Draft
    needs: Needs = NOTHING
    #: the draft is a chain a constraint forces (jump-forward), not a proposer's guess
    forced: bool = False

    def run(self, runner: Runner) -> ForwardOutput:
        return runner.forward(self.root, self.draft, self.needs)

    @property
    def rows(self) -> int:
        return len(self.draft) + 1


#: what one sequence asks of a target pass
Call = PrefillCall | VerifyCall


class Runner(ABC):
    """A target model behind the prefill / forward(draft) / commit protocol."""

    #: short name shown in statistics and benchmark reports
    name: str = "runner"
    vocab_size: int
    max_context: int
    num_layers: int

    @abstractmethod
    def prefill(self, ids: Sequence[int], needs: Needs = NOTHING) -> ForwardOutput:
        """Reset the cache and run ``ids``: logits [1, V] after the last one, features of every
        one of them."""

    #: prompt rows per :meth:`prefill_part` (parts start at multiples of it); 0 = this runner
    #: prefills a prompt in one call only
    prefill_granule: int = 0

    def prefill_part(self, ids: Sequence[int], start: int, stop: int,
                     needs: Needs = NOTHING) -> ForwardOutput | None:
        """Prefill ``ids`` one part at a time, so a server can step other sequences between the
        parts: run rows ``start:stop`` (``start`` 0 resets the cache; a later part starts where
        the previous one stopped, at a multiple of :attr:`prefill_granule`). The last part
        (``stop == len(ids)``) returns what ``prefill(ids, needs)`` returns, bitwise, and leaves
        the runner as it would; earlier parts return None. Every part is given the same
        ``needs``."""
        raise SpecDecodeError(f"the {self.name} runner prefills a prompt in one call only")

    #: True where the KV rows an earlier prompt and answer left in the cache are bitwise the
    #: rows a prefill of the same tokens writes (the prompt and decode layers row invariant),
    #: so a prompt that starts with those tokens may start after them (a server's prompt cache:
    #: :meth:`keep_prefix`, :meth:`saved_rows`, :meth:`load_rows`)
    reuses_prefix: bool = False

    def keep_prefix(self, length: int) -> None:
        """Keep the first ``length`` committed rows as the first rows of the next prompt, which
        then starts with :meth:`prefill_part` at ``length``."""
        raise SpecDecodeError(f"the {self.name} runner cannot reuse an earlier prompt's rows")

    def saved_rows(self, length: int) -> Any:
        """A copy of the first ``length`` committed rows, for :meth:`load_rows` of this runner or
        a replica of it."""
        raise SpecDecodeError(f"the {self.name} runner cannot reuse an earlier prompt's rows")

    def load_rows(self, saved: Any, length: int) -> None:
        """Hold the first ``length`` rows of ``saved`` (:meth:`saved_rows`) as its committed rows,
        as :meth:`keep_prefix` leaves them."""
        raise SpecDecodeError(f"the {self.name} runner cannot reuse an earlier prompt's rows")

    def note_held(self, ids: Sequence[int]) -> None:
        """The committed rows hold the first :attr:`cache_len` tokens of ``ids`` (a finished
        generation's prompt and answer), for :meth:`held_tokens` to give while the cache is
        unchanged."""

    def held_tokens(self) -> np.ndarray:
        """The tokens whose rows the cache holds as :meth:`note_held` noted them
        (``kv_cache.held_ids``), where :attr:`reuses_prefix` and nothing has changed the cache
        since; none where unknown."""
        return held_ids(())

    @abstractmethod
    def forward(self, root: int, draft: Draft, needs: Needs = NOTHING) -> ForwardOutput:
        """Run the root token and every draft node in one pass with tree attention.

        Returns float32 logits [1 + len(draft), V] and the features of those rows asked for. The
        cache is left holding the new rows until :meth:`commit` decides which to keep.
        """

    @abstractmethod
    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the root's KV row and those of the accepted draft nodes (a root-to-leaf path,
        in order), drop the rest."""

    @property
    @abstractmethod
    def cache_len(self) -> int:
        """Number of committed tokens whose KV entries are in the cache."""

    @property
    @abstractmethod
    def pending_rows(self) -> int:
        """Rows the last :meth:`forward` left in the cache for :meth:`commit` (0 after it)."""

    @property
    def kv_bytes(self) -> int | None:
        """Bytes its KV cache takes now (None where the runner does not know)."""
        return None

    def replica(self) -> Runner:
        """A runner over the same weights with a cache and decoding state of its own (server
        slots share one copy of the weights)."""
        raise SpecDecodeError(f"the {self.name} runner cannot share its weights with a replica")

    def run_packed(self, work: Sequence[tuple[Runner, Call]]) -> list[ForwardOutput | None]:
        """Run every ``(runner, call)`` of ``work`` (``self`` and replicas of it, one call each,
        each on its own cache) and return the outputs in order, each bitwise what
        ``call.run(runner)`` alone returns, and each runner left as that call would leave it.
        Runners whose kernels are row invariant pack the calls' rows into one forward (a server
        decodes its users together); this default runs them one after another."""
        return [call.run(runner) for runner, call in work]

    #: True where :meth:`run_packed` shares one forward among the calls (so a scheduler
    #: should gather every active sequence's call into one ``run_packed``)
    packs_calls: bool = False

    def fingerprint(self) -> str:
        """Identifies the target's weights (for trained artifacts); runners override."""
        return f"{self.name}:{self.vocab_size}:{self.num_layers}"

    def cost_key(self) -> str | None:
        """What this runner's forward cost depends on, where its weights are a file on disk
        (its row-cost curve is then kept between processes: models/row_costs.py); None where
        they are not (the curve is measured once per process)."""
        return None

    # ---- optional: what some methods read of the target (models/capabilities.py) ----------

    @property
    def early_exit(self) -> EarlyExit:
        """Draft chains through the first layers and the head at any layer (``early_exit``,
        ``del``, draft heads)."""
        raise SpecDecodeError(f"the {self.name} runner does not support early exit; use the "
                              "native runner or the hf runner (--runner hf)")

    @property
    def tables(self) -> Tables:
        """The input embedding table and the LM head's weight (draft heads, distilled
        drafts)."""
        raise SpecDecodeError(f"the {self.name} runner exposes no embedding tables, which the "
                              "distilled draft and draft heads share; use the native runner or "
                              "the hf runner (--runner hf)")

    def _check_needs(self, needs: Needs) -> None:
        """The layers whose hidden states a pass returns (EAGLE-3's and deer's features): any
        architecture returns them, so only their range is checked (not what an exit pass
        needs)."""
        for layer in needs.layers:
            check_layer(layer, self.num_layers, "a drafter reads the hidden states after layer")
