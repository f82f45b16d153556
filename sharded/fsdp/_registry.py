"""Which tensors ``fully_shard`` took: the sharded parameters each unit owns, and the original
parameters it replaced.

The originals matter because an optimizer built *before* sharding still holds them: they no
longer take part in forward, get no gradient, and the optimizer would silently train nothing.
A global optimizer step pre-hook turns that into a clear error at the first step.
Identity-keyed weak maps, so nothing here keeps a tensor alive.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from .._common.errors import on_rank
from .._common.step_checks import install_step_check

__all__ = ["register_sharded", "unit_owning", "retire", "replaced_as", "retired_by", "install_optimizer_guard"]

_owners: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
# id(original) -> (original, the unit that took it, the ShardedParam replacing it, by what)
_retired: dict[int, tuple["weakref.ref[torch.Tensor]", "weakref.ref[Any]", Any, str]] = {}


def register_sharded(param: torch.Tensor, unit: Any) -> None:
    """Record that ``unit`` owns the sharded parameter ``param``."""
    _owners[id(param)] = unit


def unit_owning(param: torch.Tensor) -> Optional[Any]:
    """The unit owning ``param`` if it is a sharded parameter of one."""
    unit = _owners.get(id(param))
    return unit if unit is not None and any(sp.sharded is param for sp in unit.params) else None


def retire(original: torch.Tensor, unit: Any, replacement: Any, before: str = "sharding") -> None:
    """Record that ``original`` was replaced by ``replacement`` (a ShardedParam of ``unit``);
    ``before`` says by what, for the optimizer's error ("... as it was before sharding"). Names
    are read when a message needs them: the unit's and parameter's paths are known only once the
    model has run a forward."""
    key = id(original)
    _retired[key] = (weakref.ref(original, lambda _ref: _retired.pop(key, None)), weakref.ref(unit), replacement, before)


def replaced_as(param: torch.Tensor) -> Optional[str]:
    """What replaced ``param``, if ``fully_shard`` replaced it: its name (the full path once the
    model has run a forward) and the unit that took it (by its module path, likewise)."""
    entry = _retired.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    _, unit_ref, replacement, _ = entry
    unit = unit_ref()
    taken_by = f" (taken by fully_shard({unit.module_name}))" if unit is not None else ""
    return f"{replacement.fqn}{taken_by}"


def retired_by(param: torch.Tensor) -> str:
    """What replaced ``param`` in its module (``retire``'s ``before``)."""
    entry = _retired.get(id(param))
    return entry[3] if entry is not None else ""


def install_optimizer_guard() -> None:
    """Make every optimizer check, before each step, that it holds no replaced parameter."""
    install_step_check(_refuse_replaced_params)


def _refuse_replaced_params(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    if not _retired:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            replacement = replaced_as(param)
            if replacement is not None:
                raise RuntimeError(on_rank(
                    f"{type(optimizer).__name__} holds parameter {replacement} as it was before "
                    f"{retired_by(param)}; it gets no gradient, so this optimizer would train nothing. "
                    "Build the optimizer after fully_shard / FullyShardedDataParallel (and after a "
                    "load_state_dict(assign=True)), from model.parameters()"
                ))
