"""The draft-head networks: small modules that read the target's own final hidden states (its
*features*, what its LM head reads) and propose the tokens after the next one.

Every network works in the target's feature space and scores tokens with a frozen shortlist of
the target's LM head (FR-Spec), so a drafted token costs a few small matrix products. One
interface serves training and drafting:

    state = net.ingest(features, next_tokens, positions)   # committed positions, appended to
                                                             # the network's own cache
    out   = net.expand(parent_states, tokens, ...)           # one tree level: the feature that
                                                             # scores each node's children

- :class:`HydraHeads` (Ankner et al., 2024): head k reads the last feature and the embeddings of
  the k tokens after it (the root and the drafted ones): sequentially dependent heads, each an
  MLP (a projection and a residual SiLU block, Medusa's block).
- :class:`CloverHeads` (Xiao et al., 2024): an augmenting block (a causal transformer layer over
  the features, run once per committed token) and one regressive block applied per depth: the
  previous state fused with the drafted token's embedding, cross-attention to the augmented
  features of the context, an MLP.
- :class:`EagleHead` (Li et al., 2024, EAGLE; EAGLE-2's dynamic tree is in the proposer): one
  decoder layer autoregressing on features: (feature at t, embedding of token t + 1) -> the
  feature at t + 1, attending to its own cache of the context and to the node's ancestors.
  With ``feature_layers`` (EAGLE-3, Li et al., 2025, the default of ``train heads``) its first
  input is not the final feature but a low, a middle and a high layer's hidden states of the
  target, normed and fused by a linear map to the width; its later inputs are its own outputs.
- :class:`DeerDrafter` (DEER, Cheng et al., 2025, conditioned as in DFlash): a block diffusion
  drafter: the root's embedding and ``block`` mask rows go through one or two decoder layers in
  one forward, bidirectional inside the block, attending to keys and values of the context made
  from the target's features of several layers; row k scores the token k + 1 after the root.

Output projections start at zero, so an untrained network predicts "the next token again" (the
identity on the feature); training moves it from there. The layers the networks are built of
are in :mod:`.layers`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import require
from specdecode.heads.layers import (HEAD_DIM, MLP, Attention, Block, KVCache, PartNorm, RMSNorm,
                                     causal_after, fusing_map, rope)
from specdecode.heads.packing import packed_rows, segments


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers of a target of ``num_layers``: the hidden states
    after layers 2, L // 2 and L - 3 (the EAGLE-3 code's choice: the inputs of its layers 2,
    L // 2 and L - 3, counted from 0), clamped into the layers a runner returns (1 .. L - 1)
    and deduplicated, so a tiny model gets fewer than three (a one-layer model none: the
    network then reads the final features)."""
    if num_layers < 2:
        return ()
    return tuple(sorted({min(max(layer, 1), num_layers - 1)
                         for layer in (2, num_layers // 2, num_layers - 3)}))


def deer_layers(num_layers: int) -> tuple[int, ...]:
    """The low and middle layers deer reads besides the final hidden states (with them,
    DFlash's low / middle / high fusion): after layers L // 10 and L // 2."""
    if num_layers < 2:
        return ()
    return tuple(sorted({max(1, num_layers // 10), max(1, num_layers // 2)}))


def feature_layers(kind: str, num_layers: int) -> tuple[int, ...]:
    """The target layers a new network of ``kind`` reads (``train heads``' choice): EAGLE-3's
    for eagle, deer's, none (the final hidden states) for the others."""
    return {"eagle": eagle3_layers, "deer": deer_layers}.get(kind, lambda n: ())(num_layers)


class HeadNetwork(nn.Module):
    """What the drafter needs of every network (see the module docstring)."""

    kind = "?"
    #: deepest node whose children the network can score (None: any depth)
    max_depth: int | None = None
    #: the target layers whose hidden states (concatenated, in this order) the network reads
    #: per committed position; () = the final hidden states (what the LM head reads)
    feature_layers: tuple[int, ...] = ()
    #: with ``feature_layers``: the final hidden states follow those layers' (deer's fusion)
    reads_final: bool = False

    def __init__(self, size: int, embed: torch.Tensor):
        super().__init__()
        self.size = size
        # the target's embedding table, frozen and not saved (it is the target's)
        self.embed = embed.detach()

    def settings(self) -> dict:
        return {"size": self.size}

    def reset(self) -> None:
        """Forget the committed positions (a new request)."""

    def embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens].float()


class HydraHeads(HeadNetwork):
    kind = "hydra"

    def __init__(self, size: int, embed: torch.Tensor, heads: int = 4):
        super().__init__(size, embed)
        self.max_depth = heads
        self.fuse = nn.ModuleList(fusing_map(size, k + 2) for k in range(heads))
        self.res = nn.ModuleList(nn.Linear(size, size) for _ in range(heads))
        for layer in self.res:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.last_feature: torch.Tensor | None = None

    def settings(self) -> dict:
        return {"size": self.size, "heads": self.max_depth}

    def head(self, k: int, feature: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Head k (0-based) on a feature [..., H] and k + 1 embeddings [..., k + 1, H]."""
        x = self.fuse[k](torch.cat([feature, embeds.flatten(-2)], -1))
        return x + F.silu(self.res[k](x))

    # drafting: a node's state is the embeddings of the tokens from the root to it
    def ingest(self, features, next_tokens, positions):
        self.last_feature = features[-1]
        root = self.embeddings(next_tokens[-1:])  # [1, H]
        return [root], self.head(0, self.last_feature, root)[None]

    def expand(self, parent_states, tokens, depths, ancestors):
        """Nodes ``tokens`` (at ``depths``, 1 = a child of the root) under parents whose states
        are ``parent_states``: (the nodes' states, features scoring their children [n, H]).
        Nodes at one depth share a head: one call each."""
        embeds = self.embeddings(tokens)
        states = [torch.cat([state, embeds[j:j + 1]]) for j, state in enumerate(parent_states)]
        out = torch.empty(len(states), self.size)
        for depth in sorted(set(depths)):
            group = [j for j, d in enumerate(depths) if d == depth]
            paths = torch.stack([states[j] for j in group])  # [g, depth + 1, H]
            out[group] = self.head(depth, self.last_feature.expand(len(group), -1), paths)
        return states, out

    def train_outputs(self, features, tokens, depth_limit: int, starts=None):
        """Training, teacher forcing over one sequence: {k: feature scoring token t + k + 2 from
        position t} for k < heads, rows t = 0 .. T - k - 2. ``starts``: conversations packed
        one after another (:func:`.packing.packed`); the heads see no other position than their
        row's, so nothing to do but leave out the rows :func:`.packing.packed_rows` drops."""
        emb = self.embeddings(tokens)
        n = len(tokens)
        out = {}
        for k in range(min(self.max_depth, depth_limit)):
            rows = n - k - 1
            if rows <= 0:
                break
            window = torch.stack([emb[1 + j: 1 + j + rows] for j in range(k + 1)], 1)
            out[k] = self.head(k, features[:rows], window)
        return out


class _BlockNetwork(HeadNetwork):
    """A network built of transformer blocks whose MLPs are ``inner`` wide (default 2 x size:
    narrower than the target's, the block is drafted through a few times a step)."""

    def __init__(self, size: int, embed: torch.Tensor, inner: int | None = None):
        super().__init__(size, embed)
        self.inner = inner or 2 * size

    def settings(self) -> dict:
        return {"size": self.size, "inner": self.inner}


class CloverHeads(_BlockNetwork):
    kind = "clover"

    def __init__(self, size: int, embed: torch.Tensor, inner: int | None = None):
        super().__init__(size, embed, inner)
        inner = self.inner
        self.augment = Block(size, inner)
        self.fuse = fusing_map(size, 2)
        self.cross_norm = RMSNorm(size)
        self.cross = Attention(size)
        self.mlp_norm = RMSNorm(size)
        self.mlp = MLP(size, inner)
        self.reset()

    def reset(self) -> None:
        self.cache = KVCache()  # the augmenting block's self-attention
        self.memory = KVCache()  # the regressive block's cross-attention keys
        self.length = 0

    def regress(self, state, embeds, positions, keys, values, allowed):
        x = self.fuse(torch.cat([state, embeds], -1))
        x = self.cross(self.cross_norm(x), positions, keys, values, allowed, residual=x)
        return self.mlp(self.mlp_norm(x), residual=x)

    def ingest(self, features, next_tokens, positions):
        normed = self.augment.attn_norm(features)
        k, v = self.augment.attn.keys_values(normed, positions)
        past = len(self.cache)
        self.cache.append(k, v)
        n = len(features)
        allowed = causal_after(past, n)
        augmented = self.augment(features, positions, self.cache.keys, self.cache.values, allowed,
                                 normed)
        self.memory.append(*self.cross.keys_values(augmented, positions))
        self.length = past + n
        state = augmented[-1:]
        out = self._step(state, next_tokens[-1:], 0)
        return [out[0]], out

    def _step(self, states, tokens, depth):
        """The regressive block for nodes at ``depth`` (an int or one per node; 0: the root)
        after the context."""
        positions = (self.length - 1 + torch.as_tensor(depth)).expand(len(states))
        # every node sees the whole context's memory
        return self.regress(states, self.embeddings(tokens), positions, self.memory.keys,
                            self.memory.values, None)

    def expand(self, parent_states, tokens, depths, ancestors):
        out = self._step(torch.stack(list(parent_states)), tokens, torch.tensor(depths))
        return list(out), out

    def train_outputs(self, features, tokens, depth_limit: int):
        """Teacher forcing over one sequence: {k: feature scoring token t + k + 2 from
        position t}: the augmenting block runs causally, then the regressive block k + 1 times."""
        n = len(tokens)
        positions = torch.arange(n)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        k, v = self.augment.attn.keys_values(self.augment.attn_norm(features), positions)
        augmented = self.augment(features, positions, k, v, causal)
        mk, mv = self.cross.keys_values(augmented, positions)
        emb = self.embeddings(tokens)
        state, out = augmented, {}
        for depth in range(depth_limit):
            rows = n - depth - 1
            if rows <= 0:
                break
            state = self.regress(state[:rows], emb[1 + depth: 1 + depth + rows],
                                 positions[:rows] + depth, mk, mv, causal[:rows])
            out[depth] = state
        return out


class EagleHead(_BlockNetwork):
    """EAGLE's layer; with ``feature_layers`` EAGLE-3's: the context's hidden states of those
    layers, each normed, fused by a linear map (``fc``) into the first step's input, the
    layer's own outputs fed back at later steps (both through ``hidden_norm``), and a final
    norm before the shortlist scores them (the loss then needs no feature regression).
    Without, EAGLE-1's: final features in, predicted final features out (old artifacts)."""

    kind = "eagle"

    def __init__(self, size: int, embed: torch.Tensor, inner: int | None = None,
                 feature_layers: tuple[int, ...] | list[int] = ()):
        super().__init__(size, embed, inner)
        self.feature_layers = tuple(feature_layers)
        if self.feature_layers:
            parts = len(self.feature_layers)
            self.part_norm = PartNorm(size, parts)
            self.fc = fusing_map(size, parts)
            with torch.no_grad():  # at the start the highest layer passes through
                self.fc.weight.copy_(self.fc.weight.roll(size * (parts - 1), 1))
            self.hidden_norm = RMSNorm(size)
            self.out_norm = RMSNorm(size)
        self.fuse = fusing_map(size, 2)
        self.layer = Block(size, self.inner)
        self.reset()

    def settings(self) -> dict:
        extra = {"feature_layers": list(self.feature_layers)} if self.feature_layers else {}
        return {**super().settings(), **extra}

    def reset(self) -> None:
        # the context's pairs, then (while drafting) the tree's rows, dropped at the next ingest
        self.cache = KVCache()
        self.committed = 0

    def _first(self, features: torch.Tensor) -> torch.Tensor:
        """The first step's input state from the committed positions' features."""
        return self.fc(self.part_norm(features)) if self.feature_layers else features

    def _scored(self, states: torch.Tensor) -> torch.Tensor:
        """What the shortlist scores of the layer's outputs."""
        return self.out_norm(states) if self.feature_layers else states

    def _inputs(self, states, tokens):
        if self.feature_layers:
            states = self.hidden_norm(states)
        return self.fuse(torch.cat([states, self.embeddings(tokens)], -1))

    def ingest(self, features, next_tokens, positions):
        x = self._inputs(self._first(features), next_tokens)
        normed = self.layer.attn_norm(x)
        k, v = self.layer.attn.keys_values(normed, positions)
        past = self.committed
        self.cache.truncate(past)
        self.cache.append(k, v)
        self.committed = len(self.cache)
        n = len(x)
        allowed = causal_after(past, n)
        out = self.layer(x, positions, self.cache.keys, self.cache.values, allowed, normed)
        return [out[-1]], self._scored(out[-1:])

    def expand(self, parent_states, tokens, depths, ancestors):
        """``ancestors[j]``: tree rows (earlier expand calls of this step, in order) that node j
        descends from; the node attends to the context, those rows and itself."""
        x = self._inputs(torch.stack(list(parent_states)), tokens)
        context = self.committed
        positions = torch.tensor([context - 1 + d for d in depths])
        normed = self.layer.attn_norm(x)
        k, v = self.layer.attn.keys_values(normed, positions)
        old = len(self.cache) - context  # tree rows of earlier calls
        self.cache.append(k, v)
        n = len(x)
        allowed = torch.zeros(n, len(self.cache), dtype=torch.bool)
        allowed[:, :context] = True
        # every node's ancestors and itself in one indexed write (not one a node)
        cells = [(j, context + r) for j, rows in enumerate(ancestors)
                 for r in [*rows, old + j]]
        allowed[tuple(torch.tensor(cells).T)] = True
        out = self.layer(x, positions, self.cache.keys, self.cache.values, allowed, normed)
        return list(out), self._scored(out)

    def train_outputs(self, features, tokens, depth_limit: int, starts=None):
        """Teacher forcing, then ``depth_limit - 1`` steps unrolled on its own predictions (the
        drafting-time inputs: EAGLE-3's training-time test): {k: the output scoring token
        t + k + 2 from position t}, each row attending to the true pairs up to t and its own
        chain's earlier steps. ``starts``: where each of several conversations packed one
        after another begins (:func:`.packing.packed`; None: one); a row sees its own
        conversation only, at positions counted from its start, and rows whose token t + k + 1
        is another conversation's are not meant to be scored (:func:`.packing.packed_rows`)."""
        n = len(tokens) - 1
        positions = torch.arange(n, device=features.device)
        if starts is not None:
            segment = segments(len(tokens), starts, features.device)[:n]
            positions = positions - torch.tensor(starts, device=features.device)[segment]
        x = self._inputs(self._first(features[:n]), tokens[1:])
        k0, v0 = self.layer.attn.keys_values(self.layer.attn_norm(x), positions)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        if starts is not None:
            causal &= segment[:, None] == segment[None, :]
        pred = self.layer(x, positions, k0, v0, causal)
        out = {0: self._scored(pred)}
        keys, values = [k0], [v0]
        for depth in range(1, depth_limit):
            rows = n - depth
            if rows <= 0:
                break
            x = self._inputs(pred[:rows], tokens[1 + depth: 1 + depth + rows])
            pos = positions[:rows] + depth
            k, v = self.layer.attn.keys_values(self.layer.attn_norm(x), pos)
            keys.append(k)
            values.append(v)
            # row t: the true pairs 0..t, then its own chain's earlier predictions and itself
            allowed = [causal[:rows]] + [torch.eye(n, dtype=torch.bool, device=x.device)
                                         [:rows, :kk.shape[-2]] for kk in keys[1:]]
            pred = self.layer(x, pos, torch.cat(keys, -2), torch.cat(values, -2),
                              torch.cat(allowed, 1))
            out[depth] = self._scored(pred)
        return out


class DeerDrafter(_BlockNetwork):
    """One forward drafts a block: rows [root, mask x block] at positions r .. r + block after
    the context's features (0 .. r - 1); output row 1 + k scores the token at r + 1 + k. The
    block's rows attend to each other both ways and to every context row, whose keys and values
    come from the fused features through each layer's own projections (DFlash's conditioning)."""

    kind = "deer"
    reads_final = True

    def __init__(self, size: int, embed: torch.Tensor, inner: int | None = None, layers: int = 1,
                 block: int = 8, feature_layers: tuple[int, ...] | list[int] = (),
                 anchor_input: bool = False, row_inputs: bool = False):
        super().__init__(size, embed, inner)
        self.layers, self.max_depth, self.anchor_input = layers, block, anchor_input
        self.row_inputs = row_inputs
        self.feature_layers = tuple(int(layer) for layer in feature_layers)
        parts = len(self.feature_layers) + 1
        # intermediate layers' outputs are un-normed residual streams: each part gets a norm
        self.part_norms = nn.ModuleList(RMSNorm(size) for _ in range(parts))
        self.fuse = nn.Linear(parts * size, size, bias=False)
        self.context_norm = RMSNorm(size)
        # anchor_input: the anchor's own fused row added to every block row, so the block's
        # inputs hold what the target knows of the next tokens before any attention (zero at
        # first: the untrained path changes nothing, and learns from the first step).
        # Artifacts written before it came have none.
        self.anchor_in = _silent_map(size) if anchor_input else None
        # row_inputs: each block row its own mask vector, and the root's embedding through its
        # own map added to every row (zero at first), as the anchor's: with one or two layers,
        # a mask row otherwise learns the root only through attention, and which row it is only
        # from the rotary embedding (a row's top-1 agreement stayed far below a Hydra head's
        # reading the same two inputs). Artifacts written before it came have neither.
        mean = self.embed.float().mean(0)
        self.mask = nn.Parameter((mean.expand(block, size) if row_inputs else mean).clone())
        self.root_in = _silent_map(size) if row_inputs else None
        self.blocks = nn.ModuleList(Block(size, self.inner) for _ in range(layers))
        self.out_norm = RMSNorm(size)
        self.reset()

    def settings(self) -> dict:
        return {"size": self.size, "inner": self.inner, "layers": self.layers,
                "block": self.max_depth, "feature_layers": list(self.feature_layers),
                "anchor_input": self.anchor_input, "row_inputs": self.row_inputs}

    def reset(self) -> None:
        self.caches = [KVCache() for _ in self.blocks]

    def _context(self, features: torch.Tensor) -> torch.Tensor:
        parts = features.float().split(self.size, -1)
        return self.context_norm(self.fuse(torch.cat(
            [norm(part) for norm, part in zip(self.part_norms, parts)], -1)))

    def _blocks(self, roots: torch.Tensor, anchors: torch.Tensor, anchor_rows: torch.Tensor,
                context, context_allowed) -> torch.Tensor:
        """Blocks after roots [A] at the positions after ``anchors`` [A] (their last context
        rows' positions from their conversation's start, whose fused features are
        ``anchor_rows`` [A, H]): ``context`` per layer (keys,
        values) [heads, n, D]; ``context_allowed`` [A, n]. Returns the mask rows' features
        [A, block, H]."""
        a, rows = len(roots), self.max_depth + 1
        root_rows = self.embeddings(roots)
        x = torch.cat([root_rows[:, None], self.mask.expand(a, self.max_depth, self.size)], 1)
        if self.anchor_in is not None:
            x = x + self.anchor_in(anchor_rows)[:, None]
        if self.root_in is not None:
            x = x + self.root_in(root_rows)[:, None]
        positions = anchors[:, None] + 1 + torch.arange(rows)
        for block, (keys, values) in zip(self.blocks, context):
            x = x + _block_attention(block.attn, block.attn_norm(x), positions, keys, values,
                                     context_allowed)
            x = x + block.mlp(block.mlp_norm(x))
        return self.out_norm(x[:, 1:])

    def ingest(self, features, next_tokens, positions):
        """Appends the context's keys and values, then drafts the block after the root
        ``next_tokens[-1]``: its state is the block's features [block, H]."""
        memory = self._context(features)
        for block, cache in zip(self.blocks, self.caches):
            cache.append(*block.attn.keys_values(memory, positions))
        n = len(self.caches[0])
        out = self._blocks(next_tokens[-1:], positions[-1:], memory[-1:],
                           [(c.keys, c.values) for c in self.caches],
                           torch.ones(1, n, dtype=torch.bool))[0]
        return [out], out[:1]

    def expand(self, parent_states, tokens, depths, ancestors):
        """The block does not read drafted tokens: a node at depth d is scored by block row d."""
        out = torch.stack([state[d] for state, d in zip(parent_states, depths)])
        return list(parent_states), out

    def train_outputs(self, features, tokens, depth_limit: int, anchors=None, starts=None):
        """Positions t as anchors (``anchors``, ascending; default every one): {k: block row
        k after root t + 1, scoring token t + k + 2}, each block attending to the context rows
        0 .. t. Row i of depth k is ``anchors[i]``'s (those with a token t + k + 1 to score).
        ``starts``: where each of several conversations packed one after another begins; a
        block then sees its own conversation only, at positions from its start (the rows that
        would score another conversation's token are ``packed_rows``'s to leave out)."""
        n = len(tokens)
        index = torch.arange(n)
        anchors = index[:n - 1] if anchors is None else anchors
        allowed = index[None, :] <= anchors[:, None]
        positions = index
        if starts is not None:
            segment = segments(n, starts, features.device)
            positions = index - torch.tensor(starts, device=features.device)[segment]
            allowed = allowed & (segment[None, :] == segment[anchors][:, None])
        memory = self._context(features)
        context = [block.attn.keys_values(memory, positions) for block in self.blocks]
        out = self._blocks(tokens[anchors + 1], positions[anchors], memory[anchors], context,
                           allowed)
        return {k: out[anchors < n - k - 1, k] for k in range(min(depth_limit, self.max_depth))
                if bool((anchors < n - k - 1).any())}


def _silent_map(size: int) -> nn.Linear:
    """A map added to a network's input that starts at zero: the untrained path changes
    nothing, and learns from the first step."""
    map_ = nn.Linear(size, size, bias=False)
    nn.init.zeros_(map_.weight)
    return map_


def _block_attention(attn: Attention, x: torch.Tensor, positions: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Blocks x [A, B, H] at ``positions`` [A, B] attend to the shared context (keys, values
    [heads, n, D], where ``allowed`` [A, n]) and to every row of their own block; one softmax
    over both (the context is not copied per block)."""
    q = rope(attn.q(x).unflatten(-1, (attn.heads, attn.head_dim)), positions).transpose(-2, -3)
    own_keys, own_values = attn.keys_values(x, positions)  # [A, heads, B, D]
    scale = attn.head_dim ** -0.5
    to_context = (q @ keys.transpose(-1, -2) * scale).masked_fill(~allowed[:, None, None],
                                                                  float("-inf"))
    weights = torch.cat([to_context, q @ own_keys.transpose(-1, -2) * scale], -1).softmax(-1)
    n = keys.shape[-2]
    out = weights[..., :n] @ values + weights[..., n:] @ own_values
    return attn.o(out.transpose(-2, -3).flatten(-2))


NETWORKS: dict[str, type[HeadNetwork]] = {n.kind: n for n in (HydraHeads, CloverHeads, EagleHead,
                                                               DeerDrafter)}


def make_network(kind: str, size: int, embed: torch.Tensor, **settings) -> HeadNetwork:
    require(kind in NETWORKS, f"unknown head kind {kind!r}; known: {', '.join(NETWORKS)}")
    require(size % max(1, size // HEAD_DIM) == 0 and size % 2 == 0,
            f"{kind} heads need an even hidden size that splits into {HEAD_DIM}-wide attention "
            f"heads, got {size}")
    settings.pop("size", None)
    return NETWORKS[kind](size, embed, **settings)


def parameter_count(net: HeadNetwork) -> int:
    return sum(p.numel() for p in net.parameters())
