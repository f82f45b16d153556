"""Bad input to OSS raises a clear error naming the parameter and rank, on every rank, no hang."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharded import OSS
from tests._harness import run_on_ranks


def _param(*shape):
    return nn.Parameter(torch.zeros(*shape))


def _check_local_mistakes(rank, world):
    with pytest.raises(TypeError, match=rf"rank {rank}: param group 0, parameter 1 is a int"):
        OSS([_param(2), 3], torch.optim.SGD, lr=0.1)
    p = _param(3)
    with pytest.raises(ValueError, match=rf"rank {rank}: param group 0, parameter 1 is the same tensor as parameter 0"):
        OSS([p, p], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=rf"rank {rank}: param group 1, parameter 0 .* already in param group 0"):
        OSS([{"params": [p]}, {"params": [p]}], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="meta device"):
        OSS([nn.Parameter(torch.empty(2, device="meta"))], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="optim must be a torch.optim.Optimizer subclass"):
        OSS([_param(2)], "adam", lr=0.1)
    with pytest.raises(TypeError, match="LBFGS"):
        OSS([_param(2)], torch.optim.LBFGS)
    with pytest.raises(ValueError, match="empty parameter list"):
        OSS([], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="recipient_rank 7"):
        OSS([_param(2)], torch.optim.SGD, lr=0.1).consolidate_state_dict(recipient_rank=7)
    opt = OSS([_param(2)], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"param group 1, parameter 0 .* already in param group 0"):
        opt.add_param_group({"params": opt.param_groups[0]["params"]})


@pytest.mark.parametrize("world_size", [1, 3])
def test_local_mistakes_raise_before_any_collective(world_size):
    run_on_ranks(_check_local_mistakes, world_size)


def _check_mismatched_models(rank, world):
    width = 5 if rank == world - 1 else 4
    with pytest.raises(ValueError, match=rf"param group 0, parameter 0 .*rank {world - 1}: shape \(5, 4\)"):
        OSS(nn.Linear(4, width).parameters(), torch.optim.SGD, lr=0.1)
    layers = [nn.Linear(4, 4) for _ in range(2 if rank == 0 else 1)]
    with pytest.raises(ValueError, match=r"different counts \(rank 0: 4, rank 1: 2"):
        OSS(nn.Sequential(*layers).parameters(), torch.optim.SGD, lr=0.1)
    model = nn.Linear(4, 4)
    opt = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
    model.bias.requires_grad_(rank != 1)
    with pytest.raises(ValueError, match=r"parameter 1 .*requires_grad=False"):
        opt.refresh_trainable()


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_parameters_all_raise(world_size):
    run_on_ranks(_check_mismatched_models, world_size)


def test_oss_without_a_process_group_says_so():
    with pytest.raises(RuntimeError, match="init_process_group"):
        OSS([_param(2)], torch.optim.SGD, lr=0.1)
