"""The layers the draft-head networks (:mod:`.networks`) are built of: rotary positions, RMSNorm,
a SwiGLU MLP, attention over keys the caller assembles, a pre-norm transformer block, the
linear maps that fuse several vectors into one, and a growing cache of keys and values.

Output projections start at zero, so a network built of them starts as the identity on its
input feature; training moves it from there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: attention head width (one head spans a narrower model: the tests' tiny ones)
HEAD_DIM = 64
ROPE_BASE = 10000.0


_ROPE_TABLES: dict[int, torch.Tensor] = {}


def rope_table(d: int, positions: int) -> torch.Tensor:
    """[positions, 2, D]: (cos, cos) and (-sin, sin) for head width ``d``, grown by doubling
    and kept: a draft step rotates a few rows, and computing the angles each time cost more
    than rotating."""
    table = _ROPE_TABLES.get(d)
    if table is None or table.shape[0] < positions:
        size = max(4096, 2 * positions)
        inv = ROPE_BASE ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.arange(size, dtype=torch.float32)[:, None] * inv
        cos, sin = angles.cos(), angles.sin()
        table = _ROPE_TABLES[d] = torch.stack([torch.cat([cos, cos], -1),
                                               torch.cat([-sin, sin], -1)], 1)
    return table


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (half-split layout) of x [..., n, heads, D] at ``positions``
    [..., n] (broadcast): (a, b) -> (a cos - b sin, b cos + a sin), written as x (cos, cos) +
    (b, a) (-sin, sin), the same numbers in fewer operations."""
    d = x.shape[-1]
    table = rope_table(d, int(positions.max()) + 1)[positions].unsqueeze(-3)  # [..., n, 1, 2, D]
    return x * table[..., 0, :] + x.roll(d // 2, -1) * table[..., 1, :]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    """SwiGLU, its output projection zero at the start."""

    def __init__(self, size: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(size, 2 * inner, bias=False)
        self.down = nn.Linear(inner, size, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate) * up), plus ``residual`` where given."""
        gate, up = self.gate_up(x).chunk(2, -1)
        return _plus(self.down, F.silu(gate) * up, residual)


def _plus(linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``residual`` + linear(x): the sum inside the kernel where the layer was converted
    (heads/native.py), which takes the residual."""
    if residual is None or isinstance(linear, nn.Linear):
        y = linear(x)
        return y if residual is None else residual + y
    return linear(x, residual)


class Attention(nn.Module):
    """Multi-head attention with rotary positions; ``keys_from`` given = cross-attention."""

    def __init__(self, size: int):
        super().__init__()
        self.heads = max(1, size // HEAD_DIM)
        self.head_dim = size // self.heads
        self.q = nn.Linear(size, size, bias=False)
        self.kv = nn.Linear(size, 2 * size, bias=False)
        self.o = nn.Linear(size, size, bias=False)
        nn.init.zeros_(self.o.weight)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor):
        """Rotated keys and values [..., heads, n, D] of rows x [..., n, H]."""
        k, v = self.kv(x).unflatten(-1, (2, self.heads, self.head_dim)).unbind(-3)
        return rope(k, positions).transpose(-2, -3), v.transpose(-2, -3)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, allowed: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Rows x [..., n, H] at ``positions`` attend to ``keys``/``values`` [..., heads, m, D]
        where ``allowed`` [n, m] (or [..., n, m]; None: everywhere) is true; plus ``residual``
        where given."""
        q = rope(self.q(x).unflatten(-1, (self.heads, self.head_dim)), positions)
        if allowed is None:  # one call where nothing is masked
            out = F.scaled_dot_product_attention(q.transpose(-2, -3), keys, values)
            return _plus(self.o, out.transpose(-2, -3).flatten(-2), residual)
        # written out rather than scaled_dot_product_attention: with a boolean mask its CPU
        # path spends longer on the mask than on the product for the few rows of a draft
        scores = q.transpose(-2, -3) @ keys.transpose(-1, -2)
        scores = scores * self.head_dim ** -0.5
        scores = scores.masked_fill(~allowed.unsqueeze(-3), float("-inf"))
        out = scores.softmax(-1) @ values
        return _plus(self.o, out.transpose(-2, -3).flatten(-2), residual)


class Block(nn.Module):
    """A pre-norm transformer layer whose attention reads keys the caller assembles (its own
    cache, the context's memory, a draft tree's ancestors)."""

    def __init__(self, size: int, inner: int):
        super().__init__()
        self.attn_norm = RMSNorm(size)
        self.attn = Attention(size)
        self.mlp_norm = RMSNorm(size)
        self.mlp = MLP(size, inner)

    def forward(self, x, positions, keys, values, allowed, normed=None):
        """``normed``: attn_norm(x), where the caller has it (it made the rows' keys)."""
        normed = self.attn_norm(x) if normed is None else normed
        x = self.attn(normed, positions, keys, values, allowed, residual=x)
        return self.mlp(self.mlp_norm(x), residual=x)


def fusing_map(size: int, parts: int) -> nn.Linear:
    """A projection of ``parts`` concatenated vectors of ``size`` to one: at the start, the
    first part (the feature) passes through unchanged."""
    fuse = nn.Linear(parts * size, size, bias=False)
    with torch.no_grad():
        fuse.weight.zero_()
        fuse.weight[:, :size] = torch.eye(size)
    return fuse


class PartNorm(RMSNorm):
    """RMSNorm of each of ``parts`` concatenated vectors of ``size`` on its own: the residual
    stream grows by orders of magnitude from a low layer to a high one, and a linear map fusing
    them learns faster from inputs of one scale."""

    def __init__(self, size: int, parts: int):
        super().__init__(parts * size)
        self.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(-1, (self.parts, -1))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.flatten(-2) * self.weight


def causal_after(past: int, n: int) -> torch.Tensor | None:
    """Where n new rows after ``past`` cached ones may attend (the cache, then causally among
    themselves); None where that is everywhere (one row: a verify step's usual read)."""
    if n == 1:
        return None
    allowed = torch.ones(n, past + n, dtype=torch.bool)
    allowed[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
    return allowed


class KVCache:
    """Keys and values [heads, m, D] a block attends to, in a buffer grown by doubling (a
    draft step appends a few rows; copying the whole cache each time would cost more)."""

    def __init__(self):
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[-2]
        if self.buffers is None or self.length + n > self.buffers[0].shape[-2]:
            size = max(256, 2 * (self.length + n))
            grown = []
            for new, old in zip((keys, values), self.buffers or (None, None)):
                buffer = new.new_empty(new.shape[0], size, new.shape[-1])
                if old is not None:
                    buffer[:, :self.length] = old[:, :self.length]
                grown.append(buffer)
            self.buffers = tuple(grown)
        self.buffers[0][:, self.length:self.length + n] = keys
        self.buffers[1][:, self.length:self.length + n] = values
        self.length += n

    def truncate(self, length: int) -> None:
        self.length = length

    @property
    def keys(self) -> torch.Tensor:
        return self.buffers[0][:, :self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.buffers[1][:, :self.length]
