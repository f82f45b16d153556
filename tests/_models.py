"""Small deterministic models and data for the multi-rank tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style character model: token + position embeddings, blocks, a linear head."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, seq: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        return self.head(self.ln(self.blocks(x)))


def gpt(seed: int = 0, **kwargs) -> TinyGPT:
    """A TinyGPT with weights fixed by ``seed``, identical on every rank."""
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)


def mlp(seed: int = 0) -> nn.Module:
    """A small MLP (uneven layer sizes, so partitions are uneven too)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 7), nn.ReLU(), nn.Linear(7, 3))


def token_batch(rank: int, step: int, vocab: int = 64, seq: int = 16, batch: int = 4) -> torch.Tensor:
    """Tokens that differ by rank and step, the same on every run."""
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def mlp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20_000 + 100 * step + rank)
    return torch.randn(6, 12, generator=g), torch.randn(6, 3, generator=g)


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)
