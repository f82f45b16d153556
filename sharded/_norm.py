"""Gradient clipping by a norm taken over gradients spread across ranks.

Each rank passes the gradients it alone is responsible for (its shard); the ranks' partial
terms are combined with one all-reduce, so the total equals the norm that
``torch.nn.utils.clip_grad_norm_`` would compute over the full, unsharded set of gradients.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from . import _comm

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(
    grads: Sequence[torch.Tensor], max_norm: float, norm_type: float, group: _comm.ProcessGroup
) -> torch.Tensor:
    """Scale ``grads`` in place so that the global ``norm_type``-norm is at most ``max_norm``.

    Collective. Returns the global norm before clipping (a float32 scalar), as torch does.
    """
    norm_type = float(norm_type)
    device = _comm.comm_device(group)
    total = _local_norm_term(grads, norm_type, device)
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    _comm.all_reduce(total, group, op)
    if norm_type != float("inf"):
        total = total ** (1.0 / norm_type)
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.detach().mul_(clip_coef.to(grad.device, grad.dtype))
    return total


def _local_norm_term(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's contribution to the global norm: max |g| for inf, else sum |g|^p."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(
        [torch.linalg.vector_norm(g.detach(), norm_type).to(device, torch.float32) for g in grads]
    )
    if norm_type == float("inf"):
        return norms.max()
    return (norms**norm_type).sum()
