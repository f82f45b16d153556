"""Names that checkpoints use: the fully qualified names (FQNs) of the unwrapped model.

A checkpoint must not depend on how the model was wrapped (DDP, ShardedDataParallel,
``torch.compile``) nor on the order parameters were handed to an optimizer: keys are the names
``module.state_dict()`` of the user's own model gives, and optimizer state is filed under the
name of its parameter. A model that was extended or renamed then fails loudly by name instead
of loading someone else's tensors by position.
"""

from __future__ import annotations

import sys
from typing import Sequence, Union, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from .._common.errors import on_rank
from ..oss import OSS
from ..sharded_ddp import ShardedDataParallel

__all__ = ["as_optimizer_list", "inner_optimizer_class", "optimizer_fqns", "param_fqns", "unwrap"]

Optimizers = Union[Optimizer, Sequence[Optimizer]]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP, ShardedDataParallel, FullyShardedDataParallel and
    ``torch.compile`` wrappers (``fully_shard`` wraps nothing: its module is the model)."""
    while True:
        if isinstance(model, _wrapper_classes()):
            model = cast(nn.Module, model.module)
            continue
        compiled_from = getattr(model, "_orig_mod", None)  # torch.compile's wrapper
        if not isinstance(compiled_from, nn.Module):
            return model
        model = compiled_from


def _wrapper_classes() -> tuple[type, ...]:
    """The wrappers whose ``.module`` is the user's model. The layer-3 wrapper counts only once
    it has been imported (importing it imports DTensor, which is slow), as it must be to exist."""
    fsdp = sys.modules.get("sharded.fsdp.fully_sharded_data_parallel")
    layer3 = (fsdp.FullyShardedDataParallel,) if fsdp is not None else ()
    return (DistributedDataParallel, ShardedDataParallel) + layer3


def as_optimizer_list(optimizers: Optimizers) -> list[Optimizer]:
    """``optimizers`` as a list (one optimizer, or several over disjoint parameters)."""
    listed = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
    for i, optimizer in enumerate(listed):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(on_rank(f"optimizers[{i}] is a {type(optimizer).__name__}, not a torch.optim.Optimizer"))
    return listed


def param_fqns(module: nn.Module) -> dict[torch.Tensor, str]:
    """Parameter -> its key in ``module.state_dict()``; a tied parameter gets its first key.

    Read from the state dict itself (not ``named_parameters()``) so that modules whose state-dict
    hooks rename keys, such as activation-checkpoint wrappers, agree with the model's keys.
    """
    names: dict[torch.Tensor, str] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter):
            names.setdefault(value, key)
    return names


def optimizer_fqns(optimizer: Optimizer, names: dict[torch.Tensor, str]) -> list[list[str]]:
    """For each param group of ``optimizer``, the FQNs of its parameters, in group order."""
    fqns: list[list[str]] = []
    for g, group in enumerate(optimizer.param_groups):
        fqns.append([])
        for i, param in enumerate(group["params"]):
            if param not in names:
                raise ValueError(on_rank(
                    f"param group {g}, parameter {i} (shape {tuple(param.shape)}) of the "
                    f"{type(optimizer).__name__} optimizer is not a parameter of the model, so it has no "
                    "name to file its state under; pass the model the optimizer trains (an optimizer built "
                    "before fully_shard, or before a load_state_dict(assign=True), holds parameters the "
                    "model has replaced: build it after)"
                ))
            fqns[-1].append(names[param])
    return fqns


def inner_optimizer_class(optimizer: Optimizer) -> str:
    """The class that computes the updates, by import path: for ``OSS``, the class it wraps.

    A ZeRO checkpoint of ``OSS(AdamW)`` and a plain ``AdamW`` one are interchangeable; an Adam
    and an SGD one are not.
    """
    cls = type(optimizer.optim) if isinstance(optimizer, OSS) else type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"
