"""The global gradient norm of sharded parameters, and clipping by it (layer 3's grouping over
the one implementation in :mod:`sharded._norm`).

Each rank holds a shard of most gradients, so the norm is a sum over ranks: every rank adds up
``|g|^p`` over its local shards, one all-reduce per shard group adds the ranks' sums, and
replicated gradients (0-dim parameters, ignored or unsharded ones), which every rank holds
whole, are added once, locally. The result equals ``clip_grad_norm_`` on the unsharded model.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import _comm
from .._norm import all_reduce_term, norm_term, scale_by_norm_, total_norm

__all__ = ["clip_grad_norm_", "global_grad_norm"]


def global_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """Collective: the ``norm_type``-norm of all gradients of ``parameters`` over every rank
    (a 0-dim fp32 tensor, the same on every rank)."""
    norm_type = float(norm_type)
    by_group: dict[dist.ProcessGroup, list[torch.Tensor]] = {}
    whole: list[torch.Tensor] = []
    for p in parameters:
        if p.grad is None:
            continue
        group, local = _where(p.grad)
        (whole if group is None else by_group.setdefault(group, [])).append(local)
    first = next(iter(whole or [t for ts in by_group.values() for t in ts]), None)
    device = first.device if first is not None else torch.device("cpu")
    terms = [norm_term(whole, norm_type, device)]
    for group, locals_ in by_group.items():
        term = norm_term(locals_, norm_type, _comm.comm_device(group))
        terms.append(all_reduce_term(term, group, norm_type).to(device))
    return total_norm(terms, norm_type)


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their global norm is at most
    ``max_norm``; returns the global norm before clipping (as ``torch.nn.utils.clip_grad_norm_``
    would on the unsharded model). Collective: every rank calls it with the same parameters."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = global_grad_norm(params, norm_type)
    locals_ = [_where(p.grad)[1] for p in params if p.grad is not None]
    scale_by_norm_(locals_, total, max_norm, float(norm_type), error_if_nonfinite)
    return total


def _where(grad: torch.Tensor) -> tuple[Optional[dist.ProcessGroup], torch.Tensor]:
    """(the group whose ranks hold disjoint shards of ``grad``, or None if each rank holds it
    whole; this rank's part)."""
    if not isinstance(grad, DTensor):
        return None, grad
    shard_dims = [dim for dim, placement in enumerate(grad.placements) if placement.is_shard()]
    group = grad.device_mesh.get_group(shard_dims[-1]) if shard_dims else None
    return group, grad.to_local()
