"""Small deterministic models and data for the multi-rank tests, on the device under test
(tests/_device.py: built on the CPU from fixed seeds, then moved, so every device sees the same
numbers)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from examples.gpt import GPT, next_token_loss
from tests._device import on_test_device


def gpt(seed: int = 0, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, seq: int = 16) -> GPT:
    """A small GPT (the model of the example and the benchmark) with weights fixed by ``seed``,
    identical on every rank."""
    torch.manual_seed(seed)
    return on_test_device(GPT(vocab, dim, layers, heads, seq))


def mlp(seed: int = 0) -> nn.Module:
    """A small MLP (uneven layer sizes, so partitions are uneven too)."""
    torch.manual_seed(seed)
    return on_test_device(nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 7), nn.ReLU(), nn.Linear(7, 3)))


def token_batch(rank: int, step: int, vocab: int = 64, seq: int = 16, batch: int = 4) -> torch.Tensor:
    """Tokens that differ by rank and step, the same on every run."""
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    return on_test_device(torch.randint(0, vocab, (batch, seq + 1), generator=g))


gpt_loss = next_token_loss


def mlp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20_000 + 100 * step + rank)
    return on_test_device(torch.randn(6, 12, generator=g)), on_test_device(torch.randn(6, 3, generator=g))


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)
