"""Reference models for the benchmark and the tests (the GPT stack of the design notes).

Pre-LN transformer blocks: LayerNorm, fused qkv Linear, causal ``scaled_dot_product_attention``,
output projection, LayerNorm, 4x MLP with GELU; a final LayerNorm. Inputs are hidden states of
shape (batch, time, dim). ``sync="item"`` / ``"nonzero"`` builds blocks with one host sync
between attention and MLP (the op-safety demo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "Attention", "MLP", "Block", "SyncBlock", "GPT", "WORKLOADS",
           "model_and_input"]


@dataclass(frozen=True)
class GPTConfig:
    dim: int = 768
    heads: int = 12
    layers: int = 12
    batch: int = 1
    seq: int = 16
    dtype: torch.dtype = torch.bfloat16


# The workloads of the design notes (A, B, C).
WORKLOADS = {
    "A": GPTConfig(768, 12, 12, 1, 16, torch.bfloat16),
    "B": GPTConfig(256, 4, 24, 1, 8, torch.float32),
    "C": GPTConfig(2048, 16, 8, 8, 512, torch.bfloat16),
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class SyncBlock(Block):
    """A block with one host sync between attention and MLP (``.item()`` or ``nonzero``)."""

    def __init__(self, dim: int, heads: int, sync: str = "item"):
        super().__init__(dim, heads)
        self.sync = sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        if self.sync == "item":
            scale = 1.0 if x.abs().amax().item() < 1e4 else 0.5  # data-dependent, on the host
        else:
            scale = 1.0 + 0.0 * (x.flatten()[:8] > 0).nonzero().numel()
        return x + self.mlp(self.ln2(x)) * scale


class InlineSyncBlock(SyncBlock):
    """A ``.item()`` block that computes attention and MLP inline: its children are only the
    Linear and LayerNorm layers, one kernel each (``sync="item-inline"``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        attn = self.attn
        q, k, v = attn.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, attn.heads, d // attn.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.proj(a.transpose(1, 2).reshape(b, t, d))
        scale = 1.0 if x.abs().amax().item() < 1e4 else 0.5  # data-dependent, on the host
        return x + self.mlp.out(F.gelu(self.mlp.fc(self.ln2(x)))) * scale


class GPT(nn.Module):
    def __init__(self, dim: int = 768, heads: int = 12, layers: int = 12, dropout: float = 0.0,
                 sync: str | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(
            (InlineSyncBlock(dim, heads, "item") if sync == "item-inline"
             else SyncBlock(dim, heads, sync) if sync else Block(dim, heads, dropout))
            for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    @classmethod
    def from_config(cls, cfg: GPTConfig, device: str | torch.device = "cpu",
                    sync: str | None = None) -> "GPT":
        return cls(cfg.dim, cfg.heads, cfg.layers, sync=sync).to(device=device,
                                                                  dtype=cfg.dtype).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def model_and_input(cfg: GPTConfig, device: str | torch.device = "cpu",
                    sync: str | None = None) -> tuple[GPT, torch.Tensor]:
    """A workload's GPT (built right after ``torch.manual_seed(0)``) and an input of its shape."""
    torch.manual_seed(0)
    model = GPT.from_config(cfg, device, sync)
    return model, torch.randn(cfg.batch, cfg.seq, cfg.dim, device=device, dtype=cfg.dtype)
