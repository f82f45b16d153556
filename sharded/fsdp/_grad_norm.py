"""The global gradient norm of sharded parameters, and clipping by it (layer 3's grouping over
the one implementation in :mod:`sharded._common.norm`).

Each rank holds a shard of most gradients, so the norm is a sum over ranks: every rank adds up
``|g|^p`` over its local shards, one all-reduce per shard group adds the ranks' sums, and
replicated gradients (0-dim parameters, ignored or unsharded ones), which every rank holds
whole, are added once, locally. A gradient sharded on several mesh dims (2-D FSDP + tensor
parallelism) is summed over each of them in turn. An owner-placed gradient (``Owned``) is held
whole by its owner alone: its term joins the shard group's sum, once (every rank of the group
joins that sum, whether or not it owns a gradient). The result equals ``clip_grad_norm_`` on the unsharded model.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from .._common import comm
from .._common.dtensors import local_tensor_of, whole_on_group
from .._common.norm import all_reduce_term, norm_term, scale_by_norm_, total_norm

__all__ = ["clip_grad_norm_", "global_grad_norm"]


def global_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, foreach: Optional[bool] = None
) -> torch.Tensor:
    """Collective: the ``norm_type``-norm of all gradients of ``parameters`` over every rank
    (a 0-dim fp32 tensor, the same on every rank); ``foreach`` picks the kernels as torch's does."""
    norm_type = float(norm_type)
    by_groups: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}
    whole: list[torch.Tensor] = []
    for p in parameters:
        groups = _groups_holding_parts(p)
        if groups:  # every rank joins the sum, also one holding no gradient of these (an owner's)
            by_groups.setdefault(groups, [])
        if p.grad is None:
            continue
        local = local_tensor_of(p.grad)
        (by_groups[groups] if groups else whole).append(local)
    first = next(iter(whole or [t for ts in by_groups.values() for t in ts]), None)
    device = first.device if first is not None else torch.device("cpu")
    terms = [norm_term(whole, norm_type, device, foreach)]
    for groups, locals_ in by_groups.items():
        term = norm_term(locals_, norm_type, comm.comm_device(groups[0]), foreach)
        for group in groups:
            term = all_reduce_term(term, group, norm_type)
        terms.append(term.to(device))
    return total_norm(terms, norm_type)


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their global norm is at most
    ``max_norm``; returns the global norm before clipping (as ``torch.nn.utils.clip_grad_norm_``
    would on the unsharded model, whose arguments it takes). Collective: every rank calls it with
    the same parameters."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = global_grad_norm(params, norm_type, foreach)
    locals_ = [local_tensor_of(p.grad) for p in params if p.grad is not None]
    scale_by_norm_(locals_, total, max_norm, float(norm_type), error_if_nonfinite, foreach)
    return total


def _groups_holding_parts(param: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The groups across which ranks hold disjoint parts of ``param``'s gradient: its mesh's
    sharded dims; for one held whole by one rank of a group (owner placement), that group; none
    if each rank holds it whole."""
    if not isinstance(param, DTensor):
        return ()
    owners_group = whole_on_group(param)
    if owners_group is not None:
        return (owners_group,)
    mesh = param.device_mesh
    return tuple(mesh.get_group(dim) for dim, p in enumerate(param.placements) if p.is_shard() or isinstance(p, _StridedShard))
