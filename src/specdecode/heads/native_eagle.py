"""EAGLE's draft layer on the kernels: a draft step in a few kernel calls, not forty torch ops.

:class:`~specdecode.heads.networks.EagleHead` is one decoder layer with a few maps around it.
Drafting reads one to eight rows a call, where torch's dispatch of each small operation (the
rotary embedding, a masked softmax, every norm and projection) costs more than its arithmetic:
measured, 1.1 ms for a one-row step of the default model's head, against 0.3 ms of linear
layers. :class:`NativeEagleHead` runs the same network as

- its decoder layer as a one-layer ``LayerStack`` (cpu_kernels.cpp: RMSNorm, fused q/k/v,
  rotary embedding with the cache write, attention, o + residual, RMSNorm, SwiGLU, down +
  residual in one call), over its own blocked KV cache: the committed context's rows, then the
  draft tree's rows of this step, each attending to the context, its ancestors and itself
  through the slot tables of the target's tree verify (``AttentionPlan.tree_rows``);
- the maps around it (EAGLE-3's per-part norm and ``fc`` fusing the target's layers, the
  norm of a fed-back state, the fusion with the token's embedding, the output norm) as kernel
  calls of the same weights.

Weights are int8 (Q8_0's blocks) or bf16, like :func:`~specdecode.heads.native.to_native`; the
drafts may differ slightly from the torch network's (int8 activations per 32 inputs; the
attention scale folded into q's weights, an exact power of two for 64-wide heads). Exactness
is the verifier's; the agreement of the two is tested (tests/test_draft_heads.py).
"""

from __future__ import annotations

import torch

from specdecode import kernels
from specdecode.heads.networks import EagleHead, _rope_table
from specdecode.models.kv_cache import KEY_BLOCK, AttentionPlan, BlockedKVCache
from specdecode.models.quant import make_linear

#: context rows the cache holds at first; it doubles when a longer context comes
INITIAL_ROWS = 1024


def _linear(weight: torch.Tensor, fmt: str):
    return make_linear(weight.detach().float(), fmt)


class NativeEagleHead:
    """An :class:`EagleHead`'s drafting interface (``reset`` / ``ingest`` / ``expand``) on the
    kernels (see the module docstring); ``fmt``: int8 or bf16 weights."""

    kind = "eagle"

    def __init__(self, net: EagleHead, fmt: str = "int8"):
        layer, attn = net.layer, net.layer.attn
        self.size, self.max_depth = net.size, net.max_depth
        self.feature_layers, self.reads_final = net.feature_layers, net.reads_final
        self.embed = net.embed
        self.heads, self.head_dim = attn.heads, attn.head_dim
        self.eps = layer.attn_norm.eps
        self.fuse = _linear(net.fuse.weight, fmt)
        self.fc = _linear(net.fc.weight, fmt) if net.feature_layers else None
        weight = lambda norm: norm.weight.detach().float().contiguous()  # noqa: E731
        if net.feature_layers:
            self.parts = len(net.feature_layers)
            self.part_weight = weight(net.part_norm)
            self.hidden_weight, self.out_weight = weight(net.hidden_norm), weight(net.out_norm)
            self.unit = torch.ones(self.size)
        # the attention's 1 / sqrt(D) folded into q, as the runner folds it (models/llama.py)
        qkv = torch.cat([attn.q.weight * attn.head_dim ** -0.5, attn.kv.weight])
        linears = [_linear(w, fmt) for w in (qkv, attn.o.weight, layer.mlp.gate_up.weight,
                                             layer.mlp.down.weight)]
        self.stack = kernels.layer_stack(
            [weight(layer.attn_norm)], *[[linear.kernel()] for linear in linears[:2]],
            [weight(layer.mlp_norm)], *[[linear.kernel()] for linear in linears[2:]], [0],
            self.heads, self.heads, self.head_dim, self.size, self.eps)
        self.cache = self._new_cache(INITIAL_ROWS)
        self.reset()

    def _new_cache(self, rows: int) -> BlockedKVCache:
        return BlockedKVCache(1, self.heads, self.head_dim, -(-rows // KEY_BLOCK) * KEY_BLOCK,
                              torch.float32)

    def reset(self) -> None:
        self.cache.reset()
        self.tree_rows = 0  # the draft tree's rows written after the context this step

    def _room(self, rows: int) -> None:
        """Slots for ``rows`` rows after the context: a cache twice as large where they do not
        fit, the context's rows copied over."""
        need = self.cache.length + rows
        if need <= self.cache.capacity:
            return
        grown = self._new_cache(2 * need)
        grown.keys[:, :, :self.cache.keys.shape[2]] = self.cache.keys
        grown.values[:, :, :self.cache.capacity] = self.cache.values
        grown.length = self.cache.length
        self.cache = grown

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x.contiguous(), weight, self.eps)

    def _inputs(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.fc is not None:
            states = self._norm(states, self.hidden_weight)
        return self.fuse(torch.cat([states, self.embed[tokens].float()], -1))

    def _layer(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        cache = self.cache
        packed = kernels.packed_plan([cache.keys], [cache.values], [plan.past], [plan.slots],
                                     [plan.keys], [plan.lengths])
        table = _rope_table(self.head_dim, int(plan.positions.max()) + 1)[plan.positions]
        return self.stack.forward(x, 0, 1, packed, table[:, 0].contiguous(),
                                  table[:, 1].contiguous(), kernels.isa())

    def _scored(self, out: torch.Tensor) -> torch.Tensor:
        return self._norm(out, self.out_weight) if self.fc is not None else out

    def ingest(self, features, next_tokens, positions):
        """EagleHead.ingest: the committed positions' rows appended to the cache (the last
        step's tree rows forgotten); the root's state and its scored output."""
        n = len(features)
        if self.fc is not None:
            unit = self._norm(features.reshape(n * self.parts, self.size), self.unit)
            features = self.fc(unit.view(n, -1) * self.part_weight)
        x = self._inputs(features.float(), next_tokens)
        self.tree_rows = 0
        self._room(n)
        out = self._layer(x, AttentionPlan.chain(self.cache.length, n))
        self.cache.append(n)
        return [out[-1]], self._scored(out[-1:])

    def expand(self, parent_states, tokens, depths, ancestors):
        """EagleHead.expand: tree rows after this step's earlier ones, each attending to the
        context, ``ancestors[j]`` (earlier tree rows) and itself."""
        x = self._inputs(torch.stack(list(parent_states)), tokens)
        self._room(self.tree_rows + len(x))
        out = self._layer(x, AttentionPlan.tree_rows(self.cache.length, self.tree_rows,
                                                     ancestors))
        self.tree_rows += len(x)
        return list(out), self._scored(out)
