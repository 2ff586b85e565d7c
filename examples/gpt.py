"""A small GPT for the examples: pre-LN transformer blocks over hidden states (batch, time, dim).

Plain PyTorch; nothing here knows about cudagraphify. ``GPT(..., sync=True)`` puts a host sync
(``.item()``) between each block's attention and MLP, the kind of op a CUDA graph cannot hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (z.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0, sync: bool = False):
        super().__init__()
        self.sync = sync
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        if self.sync and x.abs().amax().item() > 1e4:  # the host decides: a sync per call
            x = x / 2
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """``layers`` blocks of width ``dim`` and a final LayerNorm."""

    def __init__(self, dim: int, heads: int, layers: int, dropout: float = 0.0,
                 sync: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads, dropout, sync) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)
