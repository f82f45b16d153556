"""What the docs' Python examples take as given: a model, its batches, the usual imports.

The guides' fragments name a ``model``, a ``loader`` or a ``loss_fn`` that the reader's own
script has; tests/test_docs_code.py runs each fragment after the setup its marker names, which
builds those from here, small enough that every fragment runs in well under a second.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sharded
from examples.gpt import GPT

__all__ = ["torch", "dist", "F", "nn", "DDP", "sharded", "tiny_gpt", "tiny_mlp", "batches", "micro_batch"]

VOCAB, SEQ = 32, 8


def tiny_gpt() -> GPT:
    """The example GPT (examples/gpt.py) at its smallest: 2 blocks of dim 16, the same on every rank."""
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, dim=16, layers=2, heads=2, seq=SEQ)


def tiny_mlp() -> nn.Module:
    """Two linear layers, the same on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def batches(count: int = 2) -> list[torch.Tensor]:
    """``count`` batches of token ids for :func:`tiny_gpt`, each rank its own."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randint(VOCAB, (2, SEQ), generator=generator) for _ in range(count)]


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for :func:`tiny_mlp` drawn from (step, index) alone, whatever the rank."""
    generator = torch.Generator().manual_seed(1000 * step + index)
    inputs = torch.randn(4, 8, generator=generator)
    return inputs, inputs.flip(1)
