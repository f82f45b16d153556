"""What a parameter costs its owner at each step: the weight the partition balances.

Layers 1-2 give every parameter whole to one owner, so the owner's step time is the sum of its
parameters' step costs. For an element-wise optimizer (SGD, Adam) that cost, like the state it
keeps, grows with the parameter's bytes. A whole-matrix optimizer is different: Muon
orthogonalises each m x n update with Newton-Schulz iterations, a few matrix products of about
``m * n * min(m, n)`` multiply-adds each, so a square matrix costs far more per byte than a tall,
thin one; balancing bytes would leave the rank holding the square ones doing most of the work.

Costs are computed from shapes (or by a user's function of the parameter), so every rank
computes the same ones and the partitions agree without communication.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.optim import Optimizer

from .._common.step_cost import checked_cost, newton_schulz_cost

__all__ = ["ParamCost", "bytes_cost", "default_param_cost", "param_costs"]

ParamCost = Callable[[torch.Tensor], float]


def bytes_cost(param: torch.Tensor) -> int:
    """The parameter's bytes: what an element-wise optimizer's state and step scale with."""
    return param.numel() * param.element_size()


def default_param_cost(optim: type[Optimizer]) -> ParamCost:
    """The cost ``OSS`` balances when the user gives none: Newton-Schulz cost for (a subclass
    of) ``torch.optim.Muon``, bytes for every other optimizer."""
    if issubclass(optim, torch.optim.Muon):
        return lambda param: newton_schulz_cost(param.shape)
    return bytes_cost


def param_costs(
    param_groups: Sequence[Sequence[torch.Tensor]], cost: ParamCost, group_rank: int, first_group: int = 0
) -> tuple[float, ...]:
    """``cost`` of every parameter of ``param_groups``, in order, each checked to be a finite
    number >= 0. ``first_group`` is the index of ``param_groups[0]`` among all the optimizer's
    groups, for messages; ``group_rank`` is the rank that raises."""
    return tuple(
        checked_cost(cost(p), f"param_cost's result for param group {first_group + g}, parameter {i} (shape {tuple(p.shape)})", group_rank)
        for g, group in enumerate(param_groups)
        for i, p in enumerate(group)
    )
