"""Optimizer state for an optimizer that has not stepped yet, made up so a loader can fill it.

torch optimizers create their state lazily, at the first ``step()``. A template taken from a
fresh optimizer would list its parameters with empty entries, and ``torch.distributed.checkpoint.load``
fills a template in place: with nothing to fill it loads nothing, raises nothing, and the
optimizer restarts from zero moments. So the template gets placeholders instead: tensors of the
shapes and dtypes the optimizer will create (DTensors laid out like their parameter under ZeRO-3),
found by stepping a copy of the optimizer over meta tensors, so no real memory is spent finding
them. Each placeholder remembers its in-place version counter: a loader that filled it bumped the
counter, one that did not left it, which is how :func:`unfilled_params` tells a template that was
never loaded from one that was. :func:`without_placeholders` keeps them out of saved checkpoints,
where they would stand for state the optimizer never had.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

import torch
from torch.optim import Optimizer

from .._common.dtensors import local_tensor_of
from .._common.optimizers import constructor_kwargs

__all__ = ["is_unfilled", "mark_unfilled", "placeholder_states", "unfilled_params", "without_placeholders"]

_log = logging.getLogger(__name__)
_VERSION_AT_CREATION = "_sharded_placeholder_version"
_NOT_ON_META = {"fused": False, "foreach": False, "capturable": False}  # kernels that need a real device


def placeholder_states(optimizer: Optimizer, params: Iterable[torch.Tensor]) -> dict[torch.Tensor, dict[str, Any]]:
    """Parameter -> the state ``optimizer`` would create for it, as fresh placeholder values.

    ``optimizer`` is the one that steps ``params`` (for ``OSS``, its inner optimizer). Only
    parameters that require a gradient get state, as a real step gives it. An optimizer that
    cannot step on meta tensors is stepped over zero tensors instead; one that cannot step on
    those either gets no placeholders (logged), and then a loader has nothing to fill.
    """
    wanted = [p for p in params if p.requires_grad]
    if not wanted:
        return {}
    for on_meta in (True, False):
        try:
            shadow_state = _step_a_copy(optimizer, wanted, on_meta)
        except Exception as error:  # any optimizer may refuse a fake step; the next way is tried
            _log.debug("stepping a copy of %s (meta=%s) failed: %r", type(optimizer).__name__, on_meta, error)
            continue
        return {p: {key: _placeholder(value, p) for key, value in shadow_state[p].items()} for p in wanted}
    _log.warning(
        "%s cannot take a trial step, so the checkpoint template lists its parameters without "
        "optimizer state; load it with sharded.checkpoint.load, which builds the state from the files",
        type(optimizer).__name__,
    )
    return {}


def unfilled_params(optim_state: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The FQNs in the ``"optim"]["state"]`` part of a template whose placeholders nothing filled."""
    return [fqn for fqn, held in optim_state.items() if any(is_unfilled(v) for v in held.values())]


def without_placeholders(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (shallow copies along the way) without the optimizer entries still holding
    placeholders: what the optimizer really has, for saving."""
    optim = state.get("optim")
    if not isinstance(optim, Mapping):
        return dict(state)
    unfilled = set(unfilled_params(optim.get("state", {})))
    if not unfilled:
        return dict(state)
    kept = {fqn: {} if fqn in unfilled else held for fqn, held in optim["state"].items()}
    return {**state, "optim": {**optim, "state": kept}}


# ------------------------------------------------------------------------------- helpers


def _step_a_copy(optimizer: Optimizer, params: list[torch.Tensor], on_meta: bool) -> dict[torch.Tensor, Mapping[str, Any]]:
    """Step a new optimizer of the same class and hyperparameters over stand-ins of ``params``
    with zero gradients; return its state by the real parameter."""
    stand_in = {p: _stand_in(p, on_meta) for p in params}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        if on_meta:
            hyper.update({k: v for k, v in _NOT_ON_META.items() if k in hyper})
        groups.append({**hyper, "params": [stand_in[p] for p in group["params"] if p in stand_in]})
    copy = type(optimizer)([g for g in groups if g["params"]], **constructor_kwargs(type(optimizer), optimizer.defaults))
    with torch.no_grad():
        copy.step()
    return {p: copy.state.get(s, {}) for p, s in stand_in.items()}


def _stand_in(param: torch.Tensor, on_meta: bool) -> torch.Tensor:
    """A leaf with ``param``'s (global) shape and dtype and a zero gradient."""
    if on_meta:
        tensor = torch.empty(param.shape, dtype=param.dtype, device="meta")
    else:
        tensor = torch.zeros_like(param.detach())
    tensor.requires_grad_(True)
    tensor.grad = torch.zeros_like(tensor)
    return tensor


def _placeholder(value: Any, param: torch.Tensor) -> Any:
    """A fresh value shaped like ``value`` (from the stepped copy), marked as not yet filled.

    Element-wise state is made like its parameter (a DTensor with its placements under ZeRO-3),
    anything else as a plain tensor; non-tensor values are kept as they are.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if tuple(value.shape) == tuple(param.shape):
        tensor = torch.zeros_like(param.detach(), dtype=value.dtype)
    else:
        device = local_tensor_of(param).device if value.device.type == "meta" else value.device
        tensor = torch.zeros(value.shape, dtype=value.dtype, device=device)
    mark_unfilled(tensor)
    return tensor


def mark_unfilled(tensor: torch.Tensor) -> None:
    """Remember ``tensor`` as a placeholder nothing has filled yet (again, after a failed load)."""
    setattr(tensor, _VERSION_AT_CREATION, local_tensor_of(tensor)._version)


def is_unfilled(value: Any) -> bool:
    """Whether ``value`` is a placeholder that nothing wrote into since it was marked. One
    holding nothing on this rank (a DTensor whose shard here has no rows: a parameter of fewer
    rows than ranks) has nothing to fill, and no loader writes into it."""
    created = getattr(value, _VERSION_AT_CREATION, None)
    local = local_tensor_of(value)
    return created is not None and local._version == created and local.numel() > 0

