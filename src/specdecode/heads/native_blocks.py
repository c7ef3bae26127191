"""The drafters built of decoder layers on the kernels: a drafter call is one kernel call, not
forty torch ops.

:class:`~specdecode.heads.networks.EagleHead` is one decoder layer with a few maps around it,
:class:`~specdecode.heads.networks.DeerDrafter` one or two decoder layers over a block of rows.
Drafting reads one to ten rows a call, where torch's dispatch of each small operation (the
rotary embedding, a masked softmax, every norm and projection) costs more than its arithmetic:
measured, 1.1 ms for a one-row step of the default model's EAGLE head, against 0.3 ms of
linear layers. Here the same networks run as

- their decoder layers as a ``LayerStack`` (cpu_kernels.cpp: RMSNorm, fused q/k/v, rotary
  embedding with the cache write, attention, o + residual, RMSNorm, SwiGLU, down + residual,
  every layer in one call), over their own blocked KV cache of the committed context's rows
  and, after them, this step's draft rows, which attend to the context and to the rows the
  slot tables name: EAGLE's tree rows their ancestors and themselves (the target's tree verify
  tables, ``AttentionPlan.tree_rows``), DEER's block rows every row of the block;
- the maps around them (the per-part norms and the linear map fusing the target's layers, the
  norm of a fed-back state, the fusion with a token's embedding, the output norm), the attention
  plans and rotary rows in the same C++ call (cpu_kernels.cpp ``EagleHead``, ``DeerDrafter``):
  after a target forward has flushed the caches, each small operation left in Python cost
  several microseconds (docs/draft-heads.md).

Weights are int4 (Q4_1's blocks), int8 (Q8_0's) or bf16, like
:func:`~specdecode.heads.native.to_native`; the drafts may differ slightly from the torch
network's (4- or 8-bit weights, int8 activations per 32 inputs; the
attention scale folded into q's weights, an exact power of two for 64-wide heads). Exactness
is the verifier's; the agreement of the two is tested (tests/test_draft_heads.py,
tests/test_deer.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specdecode import kernels
from specdecode.heads.layers import Block, rope_table
from specdecode.heads.native import scoring_layer
from specdecode.heads.networks import CloverHeads, DeerDrafter, EagleHead
from specdecode.models.kv_cache import AttentionPlan, BlockedKVCache

#: context rows the cache holds at first; it doubles when a longer context comes
INITIAL_ROWS = 1024


def _linear(weight: torch.Tensor, fmt: str):
    return scoring_layer(weight.detach(), fmt)


def _weight(norm) -> torch.Tensor:
    return norm.weight.detach().float().contiguous()


class _LayersOnKernels:
    """What the drafters share: ``blocks`` (each a :class:`Block`, or anything naming its parts
    as a Block does) as one ``LayerStack`` over a blocked cache of their own that grows as the
    context does, and the kernels' norm."""

    def __init__(self, net, blocks: list[Block], fmt: str):
        attn = blocks[0].attn
        self.size, self.max_depth, self.embed = net.size, net.max_depth, net.embed
        self.heads, self.head_dim, self.eps = attn.heads, attn.head_dim, blocks[0].attn_norm.eps
        self.layers = len(blocks)
        linears = {name: [] for name in ("qkv", "o", "gate_up", "down")}
        for block in blocks:
            # the attention's 1 / sqrt(D) folded into q, as the runner folds it (models/llama.py)
            qkv = torch.cat([block.attn.q.weight * self.head_dim ** -0.5, block.attn.kv.weight])
            for name, w in zip(linears, (qkv, block.attn.o.weight, block.mlp.gate_up.weight,
                                         block.mlp.down.weight)):
                linears[name].append(_linear(w, fmt).kernel())
        self.stack = kernels.layer_stack(
            [_weight(b.attn_norm) for b in blocks], linears["qkv"], linears["o"],
            [_weight(b.mlp_norm) for b in blocks], linears["gate_up"], linears["down"],
            [0] * self.layers, self.heads, self.heads, self.head_dim, self.size, self.eps)
        self.cache = BlockedKVCache(self.layers, self.heads, self.head_dim, None, torch.float32,
                                    initial=INITIAL_ROWS)
        self._rope_halves: tuple = (None, None, None)

    def reset(self) -> None:
        self.cache.reset()

    def _room(self, rows: int) -> None:
        """Slots for ``rows`` rows after the context (the cache grows where they do not fit)."""
        self.cache.reserve(self.cache.length + rows)

    def packed(self, plan: AttentionPlan):
        """``plan`` on this cache as the kernels take it."""
        cache = self.cache
        return kernels.packed_plan([cache.keys], [cache.values], [plan.past], [plan.slots],
                                   [plan.keys], [plan.lengths])

    def forward(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """The layers over rows ``x`` [n, H] where ``plan`` puts them (one kernel call)."""
        cos, sin = self._rope_tables()
        return self.stack.forward(x.contiguous(), 0, self.layers, self.packed(plan),
                                  cos[plan.positions], sin[plan.positions], kernels.isa())

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, cos) and (-sin, sin) [slots, D] of every position the cache has a slot
        for (a row's position is below its slot's), the table's two halves kept apart."""
        table = rope_table(self.head_dim, self.cache.slots)
        if self._rope_halves[0] is not table:
            self._rope_halves = (table, table[:, 0].contiguous(), table[:, 1].contiguous())
        return self._rope_halves[1:]


class NativeEagleHead(_LayersOnKernels):
    """An :class:`EagleHead`'s drafting interface (``reset`` / ``ingest`` / ``expand``) on the
    kernels (see the module docstring), one kernel call each (cpu_kernels.cpp ``EagleHead``: the
    maps around the layer and the layer); ``fmt``: int4, int8 or bf16 weights."""

    def __init__(self, net: EagleHead, fmt: str = "int8"):
        super().__init__(net, [net.layer], fmt)
        fc = _linear(net.fc.weight, fmt).kernel() if net.feature_layers else None
        norms = ((_weight(net.part_norm), _weight(net.hidden_norm), _weight(net.out_norm))
                 if net.feature_layers else (torch.empty(0),) * 3)  # EAGLE-1: no norms
        self.head = kernels.eagle_head(self.stack, _linear(net.fuse.weight, fmt).kernel(), fc,
                                       *norms, self.embed, self.eps)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.tree_rows = 0  # the draft tree's rows written after the context this step

    def ingest(self, features, next_tokens, positions):
        """EagleHead.ingest: the committed positions' rows appended to the cache (the last
        step's tree rows forgotten); the root's state and its scored output. The call builds
        its attention plan (a chain after the cache) and rotary rows itself."""
        n = len(features)
        self.tree_rows = 0
        self._room(n)
        cache = self.cache
        out, scored = self.head.ingest(features.float(), next_tokens, cache.keys, cache.values,
                                       cache.length, *self._rope_tables(), kernels.isa())
        cache.append(n)
        return [out[-1]], scored

    def expand(self, parent_states, tokens, depths, ancestors):
        """EagleHead.expand: tree rows after this step's earlier ones, each attending to the
        context, ``ancestors[j]`` (earlier tree rows) and itself (the plan of
        ``AttentionPlan.tree_rows``, built in the call)."""
        self._room(self.tree_rows + len(tokens))
        cache = self.cache
        out, scored = self.head.expand(list(parent_states), tokens, ancestors, cache.keys,
                                       cache.values, cache.length, self.tree_rows,
                                       *self._rope_tables(), kernels.isa())
        self.tree_rows += len(tokens)
        return list(out), scored


class NativeDeerDrafter(_LayersOnKernels):
    """A :class:`DeerDrafter`'s drafting interface on the kernels: the context's keys and
    values written into every layer's cache from the fused features (each layer's own k/v
    map and rotary embedding, DFlash's conditioning), then the block's rows through the layers
    in one call, every row attending to the whole context and to every row of the block."""

    def __init__(self, net: DeerDrafter, fmt: str = "int8"):
        super().__init__(net, list(net.blocks), fmt)
        anchor_in, root_in = (None if map_ is None else _linear(map_.weight, fmt).kernel()
                              for map_ in (net.anchor_in, net.root_in))
        self.drafter = kernels.deer_drafter(
            self.stack, _linear(net.fuse.weight, fmt).kernel(),
            [_linear(block.attn.kv.weight, fmt).kernel() for block in net.blocks], anchor_in,
            root_in,
            torch.cat([_weight(norm) for norm in net.part_norms]), _weight(net.context_norm),
            _weight(net.out_norm), net.mask.detach().float(), self.embed, self.heads,
            self.max_depth, self.eps)
        self.reset()

    def ingest(self, features, next_tokens, positions):
        """DeerDrafter.ingest: the context's keys and values appended, then the block after
        the root ``next_tokens[-1]``: its state is the block's features [block, H]. One
        kernel call (cpu_kernels.cpp ``DeerDrafter``)."""
        n = len(features)
        self._room(n + self.max_depth + 1)
        cache = self.cache
        out = self.drafter.ingest(features.float(), int(next_tokens[-1]), positions, cache.keys,
                                  cache.values, cache.length, *self._rope_tables(),
                                  kernels.isa())
        cache.append(n)
        return [out], out[:1]

    def expand(self, parent_states, tokens, depths, ancestors):
        """The block does not read drafted tokens: a node at depth d is scored by block row d."""
        out = torch.stack([state[d] for state, d in zip(parent_states, depths)])
        return list(parent_states), out


class NativeCloverHeads:
    """A :class:`CloverHeads`' drafting interface on the kernels, a few kernel calls a drafter
    call in place of some forty torch operations. The augmenting block is a one-layer
    ``LayerStack`` over its own cache (the committed rows a chain after it). The regressive
    block has a decoder layer's shape too (norm, attention, o + residual, norm, SwiGLU, down +
    residual), its attention the cross-attention: so it is a second one-layer ``LayerStack``
    whose cache is the memory, the cross-attention's keys and values of the augmented context
    (written with its own k/v map and rotary embedding as rows are committed), and whose draft
    rows attend to that memory alone (no slot of their own in their key lists; the keys and
    values they write land after the memory, unread). The fusion of a state with a token's
    embedding is one kernel linear."""

    def __init__(self, net: CloverHeads, fmt: str = "int8"):
        self.size, self.max_depth, self.embed = net.size, net.max_depth, net.embed
        self.augment = _LayersOnKernels(net, [net.augment], fmt)
        regress = SimpleNamespace(attn_norm=net.cross_norm, attn=net.cross,
                                  mlp_norm=net.mlp_norm, mlp=net.mlp)  # named as a Block's
        self.regress = _LayersOnKernels(net, [regress], fmt)
        self.fuse = _linear(net.fuse.weight, fmt)
        self.memory_kv = _linear(net.cross.kv.weight, fmt)
        self.heads = net.cross.heads

    def reset(self) -> None:
        self.augment.reset()
        self.regress.reset()

    def ingest(self, features, next_tokens, positions):
        """CloverHeads.ingest: the committed rows through the augmenting block (a chain after
        its cache), their memory keys and values appended, and the root's regressive row."""
        n = len(features)
        self.augment._room(n)
        plan = AttentionPlan.chain(self.augment.cache.length, n)
        augmented = self.augment.forward(features.float(), plan)
        self.augment.cache.append(n)
        memory = self.regress
        memory._room(n)
        cos, sin = memory._rope_tables()
        qkv = torch.cat([augmented.new_zeros(n, self.size), self.memory_kv(augmented)], 1)
        memory.packed(plan).rope_store(0, qkv, cos[plan.positions], sin[plan.positions],
                                       self.heads, self.heads, kernels.isa())
        memory.cache.append(n)
        out = self._step(augmented[-1:], next_tokens[-1:], [0])
        return [out[0]], out

    def _step(self, states: torch.Tensor, tokens: torch.Tensor, depths) -> torch.Tensor:
        """The regressive block for nodes at ``depths`` (0: the root) after the memory."""
        rows = len(states)
        x = self.fuse(torch.cat([states, self.embed[tokens].float()], 1).contiguous())
        memory = self.regress
        memory._room(rows)
        past = memory.cache.length
        plan = AttentionPlan(past, past - 1 + torch.as_tensor(depths, dtype=torch.long),
                             torch.arange(past, past + rows), torch.zeros(rows, 1, dtype=torch.int32),
                             torch.zeros(rows, dtype=torch.int32))
        return memory.forward(x, plan)

    def expand(self, parent_states, tokens, depths, ancestors):
        out = self._step(torch.stack(list(parent_states)), tokens, depths)
        return list(out), out
