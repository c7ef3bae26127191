"""The draft cache of the head proposers: a head network fed with the target's own features.

It has the interface of the draft model's caches (``catch_up`` / ``feed`` / ``prune``, see
drafting/caches.py), so the dynamic tree of DySpec / EAGLE-2 grows head drafts unchanged.
Its "context" is the target's: the proposer hands over the features of every committed
position (:func:`target_features`: the final hidden states, or the chosen layers' of EAGLE-3
and deer), the prompt's from the prefill, then each verify pass's root and accepted rows, and
:meth:`catch_up` runs the network over the positions it has not read yet.

The drafts are scored by the FR-Spec shortlist of the target's LM head, held in int4 by the
native kernels (2.4 MB for 8192 tokens of SmolLM2, against 25 MB for the whole head in int4):
a draft node costs a small fraction of a target row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode import kernels
from specdecode.errors import require
from specdecode.heads.native import scoring_layer, to_native
from specdecode.heads.native_blocks import NativeCloverHeads, NativeDeerDrafter, NativeEagleHead
from specdecode.heads.native_hydra import NativeHydraHeads
from specdecode.heads.networks import (CloverHeads, DeerDrafter, EagleHead, HeadNetwork,
                                      HydraHeads)
from specdecode.drafting.caches import DraftCache
from specdecode.models.base import ForwardOutput, Needs


def target_needs(net: HeadNetwork) -> Needs:
    """What the target's passes must return for ``net``: its layers' hidden states (and the
    final ones where it reads them too), or the final ones."""
    layers = net.feature_layers
    return (Needs(final_hidden=net.reads_final, layers=layers) if layers
            else Needs(final_hidden=True))


def target_features(net: HeadNetwork, output: ForwardOutput, rows=slice(None)) -> torch.Tensor:
    """``net``'s features [n, F] of ``rows`` of a pass made with :func:`target_needs`: the
    chosen layers' hidden states side by side (then the final ones where it reads them), or
    the final ones."""
    if isinstance(rows, list) and rows and rows == list(range(rows[0], rows[0] + len(rows))):
        # a view, not a gather: a prefill's rows (every prompt token's: 600 cost 110 us)
        rows = slice(rows[0], rows[0] + len(rows))
    parts = [output.layers[layer][rows] for layer in net.feature_layers]
    if net.reads_final or not parts:
        parts.append(output.final_hidden[rows])
    return torch.cat([part.float() for part in parts], -1) if len(parts) > 1 else parts[0]


def drafting_network(net: HeadNetwork, weights: str):
    """``net`` as it drafts with ``weights`` (heads/native.py's formats): EAGLE's, DEER's and
    Hydra's networks one kernel call a drafter call (heads/native_blocks.py,
    heads/native_hydra.py), any other network with its linear maps, norms and MLPs on the
    kernels; fp32, or kernels that do not build here: ``net`` itself."""
    on_kernels = {EagleHead: NativeEagleHead, DeerDrafter: NativeDeerDrafter,
                  HydraHeads: NativeHydraHeads, CloverHeads: NativeCloverHeads}.get(type(net))
    if on_kernels is not None and weights != "fp32" and kernels.available():
        return on_kernels(net, weights)
    return to_native(net, weights)


class HeadDraftLM(DraftCache):
    def __init__(self, net: HeadNetwork, head_ids: torch.Tensor | None, runner,
                 weights: str = "int8"):
        """``weights``: the network's format on the native kernels (heads/native.py)."""
        self.net = drafting_network(net, weights)
        self.head_ids = head_ids
        self.vocab_size = runner.vocab_size
        self.hidden_size = net.size
        head = runner.tables.output_embeddings()
        # int4 like the default runner's own LM head: reading it is most of a node's cost
        self.score = scoring_layer(head if head_ids is None else head[head_ids], "int4")
        self.reset()

    def reset(self) -> None:
        """A new request: no positions read, no features given."""
        self.net.reset()
        # the features given and not read yet (the network keeps what it needs of the others)
        self.features: list[torch.Tensor] = []
        self.given = 0
        self.read = 0
        self._clear_tree()

    def _clear_tree(self) -> None:
        self.tree_tokens: list[int] = []
        self.tree_states: list[torch.Tensor] = []
        self.tree_depth: list[int] = []
        self.tree_ancestors: list[list[int]] = []

    def add_features(self, features: torch.Tensor) -> None:
        """The target's features [n, F] (:func:`target_features`) of the next committed
        positions."""
        self.features.append(features.detach().float())
        self.given += len(features)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.score(out.float().contiguous())

    @torch.inference_mode()
    def catch_up(self, context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the committed positions not read yet; the logits [V'] of the tokens after the
        last one of ``context`` (the root), and the feature that scored them."""
        out = self._read(context)
        return self._logits(out)[0], out[0]

    def _read(self, context: Sequence[int]) -> torch.Tensor:
        """Run the network over the committed positions not read yet; its output for the root."""
        self._clear_tree()
        require(self.given == len(context) - 1,
                f"the head drafter has the target's features of {self.given} positions but the "
                f"context has {len(context) - 1} before its root")
        new = self.features[0] if len(self.features) == 1 else torch.cat(self.features)
        self.features = []
        positions = torch.arange(self.read, self.given)
        next_tokens = torch.tensor(list(context[self.read + 1:]), dtype=torch.long)
        states, out = self.net.ingest(new, next_tokens, positions)
        self.read = self.given
        self.root_state = states[0]
        return out

    @torch.inference_mode()
    def feed(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree rows: ``tokens[j]`` is a child of tree row ``parents[j]`` (-1 = the root).
        Returns logits [k, V'] and features [k, H] scoring each new row's children."""
        depths, ancestors, states = [], [], []
        for p in parents:
            depths.append(1 if p < 0 else self.tree_depth[p] + 1)
            ancestors.append([] if p < 0 else self.tree_ancestors[p] + [p])
            states.append(self.root_state if p < 0 else self.tree_states[p])
        new_states, out = self.net.expand(states, torch.tensor(list(tokens), dtype=torch.long),
                                          depths, ancestors)
        self.tree_tokens.extend(tokens)
        self.tree_states.extend(new_states)
        self.tree_depth.extend(depths)
        self.tree_ancestors.extend(ancestors)
        return self._logits(out), out

    def prune(self, path_rows: Sequence[int]) -> None:
        """Drop the tree: the accepted tokens' true features come from the verify pass."""
        self._clear_tree()


class BlockDraftLM(HeadDraftLM):
    """The draft cache of ``deer``: :meth:`catch_up` drafts the whole block in one forward and
    scores every row at once; a tree node at depth d is then scored by block row d (the block
    does not read drafted tokens), so :meth:`feed` runs nothing."""

    @torch.inference_mode()
    def catch_up(self, context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._read(context)
        self.block = self._logits(self.root_state)  # [block, V']
        return self.block[0], out[0]

    def block_logits(self) -> torch.Tensor:
        """The logits [block, V'] of every block position after the root."""
        return self.block

    def feed(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        depths = [1 if p < 0 else self.tree_depth[p] + 1 for p in parents]
        self.tree_tokens.extend(tokens)
        self.tree_depth.extend(depths)
        return self.block[depths], self.root_state[depths]
