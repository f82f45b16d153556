"""Sparse parameters and sparse gradients are refused by every layer with an error naming the
parameter (or the module that makes them) and the rank, never torch's internal error.

torch's ZeroRedundancyOptimizer refuses sparse parameters with a ``ValueError`` too; here the
refusal comes at construction for a sparse parameter, trainable or frozen, and for a module known
to produce sparse gradients (``nn.Embedding(sparse=True)``), and at the reduce for gradients made
sparse any other way (``F.embedding(..., sparse=True)`` on a plain parameter).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from sharded import OSS, FullyShardedDataParallel, ShardedDataParallel, fully_shard
from tests._harness import run_on_ranks


def _with_sparse_table(trainable: bool) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].register_parameter("table", nn.Parameter(torch.eye(4).to_sparse(), requires_grad=trainable))
    return model


class _FunctionalSparse(nn.Module):
    """A dense parameter whose gradient is sparse: no module type says so before backward."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 4))

    def forward(self, idx):
        return F.embedding(idx, self.table, sparse=True)


def _check_refusals(rank, world):
    sparse_param = rf"rank {rank}: {{}}: {{}} is a sparse tensor \(layout torch.sparse_coo\)"
    for trainable in (True, False):
        model = _with_sparse_table(trainable)
        with pytest.raises(ValueError, match=sparse_param.format("OSS", r"param group 0, parameter 2 \(shape \(4, 4\)\)")):
            OSS(model.parameters(), torch.optim.SGD, lr=0.1)
        dense = [p for p in model.parameters() if p.layout == torch.strided]
        with pytest.raises(ValueError, match=sparse_param.format("ShardedDataParallel", r"parameter 0\.table")):
            ShardedDataParallel(model, OSS(dense, torch.optim.SGD, lr=0.1))
        with pytest.raises(ValueError, match=sparse_param.format(r"fully_shard\(Sequential\)", r"parameter 0\.table")):
            fully_shard(_with_sparse_table(trainable))
        with pytest.raises(ValueError, match=sparse_param.format(r"fully_shard\(Sequential\)", r"parameter 0\.table")):
            FullyShardedDataParallel(_with_sparse_table(trainable))

    sparse_module = rf"rank {rank}: {{}}: module 1 \(Embedding\) has sparse=True"
    model = nn.Sequential(nn.Linear(4, 4), nn.Embedding(6, 4, sparse=True))
    with pytest.raises(ValueError, match=sparse_module.format("ShardedDataParallel")):
        ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1))
    with pytest.raises(ValueError, match=sparse_module.format(r"fully_shard\(Sequential\)")):
        fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Embedding(6, 4, sparse=True)))
    model = nn.Sequential(nn.Linear(4, 4), nn.Embedding(6, 4, sparse=True))
    model[1].weight.requires_grad_(False)  # frozen: no gradient, nothing to refuse
    fully_shard(model)

    model = fully_shard(_FunctionalSparse())  # last: the failed backward leaves this model unusable
    with pytest.raises(RuntimeError, match=rf"rank {rank}: parameter table got a sparse gradient"):
        model(torch.tensor([1, 2])).sum().backward()


@pytest.mark.parametrize("world_size", [1, 2])
def test_sparse_parameters_and_gradients_are_refused_naming_them(world_size):
    run_on_ranks(_check_refusals, world_size)
