"""Hydra's heads on the kernels: the network of a draft step in one call.

:class:`~specdecode.heads.networks.HydraHeads` converted by :func:`~specdecode.heads.native.to_native`
computes the same maps, but as a dozen torch operations a call (the concatenation of the
feature with a path's embeddings, the fused projection, the residual block's map, SiLU, the
sum, the rows of each depth put back in place). After a target forward has flushed the caches
each of those costs several microseconds: measured in a generation, one thread, Zen 5, the
root's head took 115 us, against 30 us in a loop of its own. Here a call is one C++ call
(cpu_kernels.cpp ``HydraHeads``): the same kernels and ATen operations on the same tensors, so
the same bits as the converted module (tested), with a node's state its path's tokens instead
of their embeddings.
"""

from __future__ import annotations

import torch

from specdecode import kernels
from specdecode.heads.native import scoring_layer
from specdecode.heads.networks import HydraHeads


def _bias(linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().float().contiguous()


class NativeHydraHeads:
    """A :class:`HydraHeads`'s drafting interface (``reset`` / ``ingest`` / ``expand``) in one
    kernel call each; ``fmt``: int4, int8 or bf16 weights (heads/native.py)."""

    def __init__(self, net: HydraHeads, fmt: str = "int4"):
        self.size, self.max_depth = net.size, net.max_depth
        self.native = kernels.hydra_heads(
            [scoring_layer(f.weight.detach(), fmt).kernel() for f in net.fuse],
            [_bias(f) for f in net.fuse],
            [scoring_layer(r.weight.detach(), fmt).kernel() for r in net.res],
            [_bias(r) for r in net.res], net.embed)
        self.last_feature: torch.Tensor | None = None

    def reset(self) -> None:
        """Nothing is kept between requests but the last feature, which ``ingest`` replaces."""

    def ingest(self, features, next_tokens, positions):
        """HydraHeads.ingest: the last committed feature kept; the root's state (its next
        token) and head 0's output [1, H]."""
        self.last_feature = features[-1].float()
        root = (int(next_tokens[-1]),)
        return [root], self.native.forward(self.last_feature, [list(root)], kernels.isa())

    def expand(self, parent_states, tokens, depths, ancestors):
        """HydraHeads.expand: each node's state is its parent's tokens and its own; its head is
        its depth's."""
        states = [(*state, token) for state, token in zip(parent_states, tokens.tolist())]
        return states, self.native.forward(self.last_feature, [list(s) for s in states],
                                          kernels.isa())
