"""Which parameters a new unit takes, with the checks that make a wrong ``fully_shard`` call fail
clearly (naming the parameter and the rank) instead of training wrong numbers or hanging."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from .._common.checks import check_dense, check_no_sparse_grad_modules
from .._common.errors import on_rank
from ._registry import replaced_as, unit_owning
from ._unit import unit_of

__all__ = ["UnitParam", "AlreadySharded", "collect_unit_params", "check_not_sharded", "modules_outside_units"]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# (name relative to the sharded module, the parameter, every (module, attribute) holding it)
UnitParam = tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]


class AlreadySharded(ValueError, AssertionError):
    """``fully_shard`` applied to a module twice. A ``ValueError`` (bad input), and an
    ``AssertionError`` as torch raises for it, so code catching either catches ours."""


def check_not_sharded(module: nn.Module) -> None:
    unit = unit_of(module)
    if unit is not None:
        raise AlreadySharded(on_rank(
            f"fully_shard was already applied to this module (fully_shard({unit.module_name})). "
            "Each distinct composable distributed API can only be applied to a module once. Call fully_shard once "
            "per module"
        ))


def collect_unit_params(modules: list[nn.Module], ignored: set[int]) -> list[UnitParam]:
    """The parameters of ``modules`` and their submodules that no unit below owns and that are
    not ``ignored`` (by id), in registration order, each with every (module, name) it is registered under.
    (Names are relative to the module; with several modules, prefixed by its list index.)"""
    found: dict[int, UnitParam] = {}
    where = type(modules[0]).__name__ if len(modules) == 1 else f"[{', '.join(type(m).__name__ for m in modules)}]"
    seen: set[int] = set()
    for index, module in enumerate(modules):
        start = "" if len(modules) == 1 else f"{index}."
        for prefix, sub in modules_outside_units(module, start, seen):
            if id(getattr(sub, "weight", None)) not in ignored:  # an ignored embedding is the user's to reduce
                check_no_sparse_grad_modules([(prefix.rstrip(".") or where, sub)], f"fully_shard({where})")
            for attr, param in sub._parameters.items():
                if param is None or id(param) in ignored:
                    continue
                name = prefix + attr
                _check_can_take(param, name, where)
                found.setdefault(id(param), (name, param, []))[2].append((sub, attr))
    params = list(found.values())
    _check_one_dtype(params, where)
    return params


def modules_outside_units(module: nn.Module, prefix: str = "", seen=None) -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, submodule)`` for ``module`` and every descendant not inside a lower unit."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None and unit_of(child) is None:
            yield from modules_outside_units(child, f"{prefix}{name}.", seen)


def _check_can_take(param: nn.Parameter, name: str, where: str) -> None:
    owner = unit_owning(param)
    if owner is not None:
        raise ValueError(on_rank(
            f"fully_shard({where}): parameter {name} is already sharded by {owner.module_name}'s fully_shard, "
            "which must have been applied to a module containing this one. Apply fully_shard bottom-up: "
            "submodules first, then their parents, the root last"
        ))
    replacement = replaced_as(param)
    if replacement is not None:
        raise ValueError(on_rank(
            f"fully_shard({where}): parameter {name} is shared with {replacement}, which sharded it already "
            "(it is already managed by another unit). "
            "A shared (tied) parameter must belong to one unit: call fully_shard on a module holding every "
            "use of it (their common ancestor), not on the submodule alone"
        ))
    check_dense([(f"parameter {name}", param)], f"fully_shard({where})")
    if param.dtype not in SUPPORTED_DTYPES:
        raise TypeError(on_rank(
            f"fully_shard({where}): parameter {name} has dtype {param.dtype}; supported are "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}. Pass it in ignored_params to leave it unsharded"
        ))


def _check_one_dtype(params: list[UnitParam], where: str) -> None:
    first: dict[torch.dtype, str] = {}
    for name, param, _ in params:
        first.setdefault(param.dtype, name)
    if len(first) > 1:
        listing = ", ".join(f"{name} is {dtype}" for dtype, name in first.items())
        raise TypeError(on_rank(
            f"fully_shard({where}): one unit gathers its parameters in one buffer, so they need one dtype, "
            f"but {listing}. Shard those modules in separate fully_shard calls"
        ))
