"""Names that checkpoints use: the fully qualified names (FQNs) of the unwrapped model.

A checkpoint must not depend on how the model was wrapped (DDP, ShardedDataParallel,
``torch.compile``) nor on the order parameters were handed to an optimizer: keys are the names
``module.state_dict()`` of the user's own model gives, and optimizer state is filed under the
FQN of its parameter. A model that was extended or renamed then fails loudly by name instead
of loading someone else's tensors by position.

An FQN here is always a key of the unwrapped model's ``state_dict()``, as torch's
``torch.distributed.checkpoint.state_dict`` names parameters too. It differs from a
``named_parameters()`` path (a *module path*, what layer 3's errors and profiles print) where a
module's state-dict hooks rename keys, as activation-checkpoint wrappers do.

Optimizer state moves between two forms here: torch's (``Optimizer.state_dict()``: parameters
numbered across the param groups) and the FQN-keyed one checkpoints and
``torch.distributed.checkpoint.state_dict`` use (:func:`keyed_by_number`, :func:`keyed_by_fqn`).
"""

from __future__ import annotations

import sys
from itertools import chain
from typing import Any, Mapping, Sequence, Union, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from .._common.errors import on_rank
from .._common.optimizers import hyperparams
from ..oss import OSS
from ..sharded_ddp import ShardedDataParallel

__all__ = [
    "as_optimizer_list",
    "keyed_by_fqn",
    "inner_optimizer_class",
    "is_keyed_by_number",
    "keyed_by_number",
    "optimizer_fqns",
    "param_fqns",
    "unwrap",
]

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
    fqn_of: dict[torch.Tensor, str] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter):
            fqn_of.setdefault(value, key)
    return fqn_of


def optimizer_fqns(optimizer: Optimizer, fqn_of: Mapping[torch.Tensor, str]) -> list[list[str]]:
    """For each param group of ``optimizer``, the FQNs of its parameters (``fqn_of``, from
    :func:`param_fqns`), in group order."""
    fqns: list[list[str]] = []
    for g, group in enumerate(optimizer.param_groups):
        fqns.append([])
        for i, param in enumerate(group["params"]):
            if param not in fqn_of:
                raise ValueError(on_rank(
                    f"param group {g}, parameter {i} (shape {tuple(param.shape)}) of the "
                    f"{type(optimizer).__name__} optimizer is not a parameter of the model, so it has no "
                    "FQN to file its state under; pass the model the optimizer trains (an optimizer built "
                    "before fully_shard, or before a load_state_dict(assign=True), holds parameters the "
                    "model has replaced: build it after)"
                ))
            fqns[-1].append(fqn_of[param])
    return fqns


def is_keyed_by_number(optimizer_state: Mapping[str, Any]) -> bool:
    """Whether an optimizer state dict is in torch's format (its param groups list numbers)."""
    return any(isinstance(p, int) for group in optimizer_state["param_groups"] for p in group["params"])


def keyed_by_fqn(numbered: Mapping[str, Any], fqns: Sequence[Sequence[str]], what: str) -> dict[str, Any]:
    """A torch-format optimizer state dict with each parameter's number replaced by its FQN.

    ``fqns``: the FQNs of the parameters of the optimizer it belongs to, param group by param
    group (:func:`optimizer_fqns`). As ``Optimizer.load_state_dict`` does, saved numbers and
    parameters correspond by position within the groups, so the group sizes must agree; ``what``
    names the state dict in the error otherwise.
    """
    saved_sizes = [len(group["params"]) for group in numbered["param_groups"]]
    if saved_sizes != [len(group) for group in fqns]:
        raise ValueError(on_rank(
            f"{what} has param groups of sizes {saved_sizes}, but the optimizer has "
            f"{[len(group) for group in fqns]}; resume with the optimizer (and param groups) that saved it"
        ))
    saved_numbers = chain.from_iterable(group["params"] for group in numbered["param_groups"])
    fqn_of = dict(zip(saved_numbers, chain.from_iterable(fqns)))
    strays = [number for number in numbered["state"] if number not in fqn_of]
    if strays:
        raise ValueError(on_rank(f"{what} holds state for parameter(s) {strays}, which no param group lists"))
    return {
        "state": {fqn_of[number]: state for number, state in numbered["state"].items()},
        "param_groups": [{**hyperparams(g), "params": list(group)} for g, group in zip(numbered["param_groups"], fqns)],
    }


def keyed_by_number(fqn_keyed: Mapping[str, Any], fqns: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The torch format of an FQN-keyed optimizer state dict, for the optimizer whose parameters
    have ``fqns`` (param group by param group): numbered in that order, the hyperparameters of
    ``fqn_keyed``'s groups taken by position. State filed under other FQNs (another optimizer's)
    is left out."""
    number_of = {fqn: i for i, fqn in enumerate(chain.from_iterable(fqns))}
    return {
        "state": {number_of[fqn]: state for fqn, state in fqn_keyed["state"].items() if fqn in number_of},
        "param_groups": [
            {**hyperparams(g), "params": [number_of[fqn] for fqn in group]} for g, group in zip(fqn_keyed["param_groups"], fqns)
        ],
    }


def inner_optimizer_class(optimizer: Optimizer) -> str:
    """The class that computes the updates, by import path: for ``OSS``, the class it wraps.

    A ZeRO checkpoint of ``OSS(AdamW)`` and a plain ``AdamW`` one are interchangeable; an Adam
    and an SGD one are not.
    """
    cls = type(optimizer.optim) if isinstance(optimizer, OSS) else type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"
