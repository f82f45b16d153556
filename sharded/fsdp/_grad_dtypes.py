"""Which dtype a unit's gradients accumulate and reduce in, as the torch sharded runs with does it.

torch 2.15 changed ``fully_shard``'s default: with ``reduce_dtype=None`` each gradient follows
its parameter's ``grad_dtype`` (an autograd attribute of leaf tensors, new in 2.15: unset, the
parameter's own dtype; ``None``, whatever dtype the gradient has), so fp32 masters computing in
bf16 reduce in fp32, and a unit mixing dtypes reduces in their promoted dtype. Before 2.15 the
default was ``param_dtype``. sharded follows the torch it is installed with, found by probing
torch (never its version string), so that its numbers equal that torch's ``fully_shard``'s.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional, Sequence

import torch

__all__ = [
    "grads_follow_grad_dtype", "grad_dtype_of", "saved_grad_dtype", "restore_grad_dtype", "carry_grad_dtype",
    "accumulation_dtype", "reduce_dtype_for", "promoted", "wider",
]

_UNSET = object()  # no grad_dtype set


@functools.lru_cache(maxsize=None)
def grads_follow_grad_dtype() -> bool:
    """Whether the installed torch's ``fully_shard`` reduces in each parameter's ``grad_dtype``
    when ``reduce_dtype`` is ``None`` (torch 2.15 on): tensors carry ``grad_dtype`` and torch's
    FSDP parameter derives the unsharded gradient's dtype from it."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        return False
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return hasattr(_fsdp_param.FSDPParam, "unsharded_grad_dtype")


def grad_dtype_of(param: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype ``param``'s gradient is kept in: its ``grad_dtype`` where torch's ``fully_shard``
    follows it (its own dtype unless set; ``None``: any), else its own dtype."""
    if grads_follow_grad_dtype():
        return param.grad_dtype  # type: ignore[attr-defined,no-any-return]
    return param.dtype


def _has_override(param: torch.Tensor) -> bool:
    """Whether ``grad_dtype`` was set on ``param`` (an unset one follows its dtype)."""
    if hasattr(torch.Tensor, "_has_grad_dtype_override"):
        return bool(param._has_grad_dtype_override)  # type: ignore[attr-defined]
    return hasattr(torch.Tensor, "grad_dtype") and param.grad_dtype != param.dtype  # type: ignore[attr-defined]


def saved_grad_dtype(param: Optional[torch.Tensor]) -> Any:
    """The ``grad_dtype`` set on ``param``, to give to whatever replaces it (:func:`restore_grad_dtype`);
    nothing where it is unset, or where torch's ``fully_shard`` drops it (before 2.15)."""
    if param is None or not grads_follow_grad_dtype() or not _has_override(param):
        return _UNSET
    return param.grad_dtype  # type: ignore[attr-defined]


def restore_grad_dtype(param: Optional[torch.Tensor], saved: Any) -> None:
    """Give ``param`` the ``grad_dtype`` :func:`saved_grad_dtype` saved, unless it has its own."""
    if param is not None and saved is not _UNSET and not _has_override(param):
        param.grad_dtype = saved  # type: ignore[attr-defined]


def carry_grad_dtype(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give ``target`` (a parameter built to replace ``source``: its shard, or the shard after a
    dtype change or an assignment) the ``grad_dtype`` set on ``source``, unless ``target`` has its
    own; as torch's FSDP2 keeps it through ``fully_shard``, ``.to()`` and
    ``load_state_dict(assign=True)`` (before 2.15, where torch's drops it, so does sharded)."""
    restore_grad_dtype(target, saved_grad_dtype(source))


def accumulation_dtype(mp_policy: Any, master_dtype: torch.dtype, grad_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype a parameter's gradient is accumulated in while sync is off and reduced in
    (``None``: its own), for a parameter whose ``grad_dtype`` is ``grad_dtype``, in a unit of
    ``master_dtype`` shards under ``mp_policy``: ``reduce_dtype`` if set; else from torch 2.15
    on ``grad_dtype``; before it ``param_dtype`` (or the masters' dtype)."""
    if mp_policy.reduce_dtype is not None:
        return mp_policy.reduce_dtype  # type: ignore[no-any-return]
    if grads_follow_grad_dtype():
        return grad_dtype
    return mp_policy.param_dtype or master_dtype  # type: ignore[no-any-return]


def reduce_dtype_for(accumulation: Sequence[Optional[torch.dtype]], grads: Sequence[Optional[torch.Tensor]], default: torch.dtype) -> torch.dtype:
    """The dtype one reduction runs in: the parameters' ``accumulation`` dtypes promoted (fp32
    for bf16 and fp32), a gradient's own dtype standing for a parameter whose dtype is ``None``.
    A parameter without a gradient on this rank still counts unless its dtype is ``None``, so
    that every rank reduces in the same dtype."""
    dtypes = [d or (g.dtype if g is not None else None) for d, g in zip(accumulation, grads)]
    return promoted([d for d in dtypes if d is not None], default)


def promoted(dtypes: Iterable[torch.dtype], default: torch.dtype) -> torch.dtype:
    """The dtype that holds all of ``dtypes`` (``default`` if there are none)."""
    found = set(dtypes)
    return functools.reduce(torch.promote_types, found) if found else default


def wider(dtype: Optional[torch.dtype], than: torch.dtype) -> bool:
    """Whether floating ``dtype`` holds more bits than floating ``than`` (fp32 than bf16)."""
    return dtype is not None and dtype.is_floating_point and than.is_floating_point and dtype.itemsize > than.itemsize
