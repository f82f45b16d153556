"""Gradient norms over gradients spread across ranks, and clipping by them: the one
implementation that every layer (``OSS``, ``ShardedDataParallel``, ``fully_shard``, the
Lightning strategies) uses.

A rank passes the gradients (or gradient shards) it holds; the norm equals what
``torch.nn.utils.clip_grad_norm_`` would take over the full, unsharded set. It is built from a
per-rank *term*, ``sum |g|^p`` (``max |g|`` for the inf-norm) accumulated in fp32 whatever the
gradients' dtype, combined over the ranks holding disjoint parts with one all-reduce (SUM, or
MAX for the inf-norm), and finished with the p-th root. A non-finite norm is handled alike
everywhere: with ``error_if_nonfinite`` an error naming the rank before anything is scaled,
otherwise the gradients are scaled by the (non-finite) coefficient, as torch does. ``foreach``
picks the kernels as torch's ``clip_grad_norm_`` does: its multi-tensor ones (``None``: where the
device has them; ``True`` raises where it has not), one tensor at a time otherwise.
"""

from __future__ import annotations

from typing import Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _device_has_foreach_support, _group_tensors_by_device_and_dtype

from . import comm
from .errors import on_rank

__all__ = ["norm_term", "all_reduce_term", "total_norm", "scale_by_norm_", "clip_by_global_norm"]

INF = float("inf")


def norm_term(
    tensors: Sequence[torch.Tensor], norm_type: float, device: torch.device, foreach: Optional[bool] = False
) -> torch.Tensor:
    """``max |x|`` (inf-norm) or ``sum |x|^p`` over ``tensors``: a 0-dim fp32 tensor on
    ``device``. Empty tensors (a rank past a short parameter's last row) count as 0."""
    tensors = [t.detach() for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms: list[torch.Tensor] = []
    for group, multi_tensor in _kernel_groups(tensors, foreach):
        if multi_tensor:
            norms.extend(torch._foreach_norm(group, norm_type, dtype=torch.float32))
        else:
            norms.extend(torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in group)
    stacked = torch.stack([n.to(device) for n in norms])
    return stacked.max() if norm_type == INF else stacked.pow(norm_type).sum()


def all_reduce_term(term: torch.Tensor, group: Optional[dist.ProcessGroup], norm_type: float) -> torch.Tensor:
    """Collective: the terms of ranks that hold disjoint parts, combined. A NaN on any rank
    makes the result NaN, as torch's norm of the whole would be; SUM propagates it, but MAX
    (gloo's at least) drops it, so the inf-norm sends a NaN flag beside its term."""
    if norm_type != INF:
        comm.all_reduce(term, group, dist.ReduceOp.SUM)
        return term
    is_nan = term.isnan()
    both = torch.stack([torch.where(is_nan, 0.0, term), is_nan.to(term.dtype)])
    comm.all_reduce(both, group, dist.ReduceOp.MAX)
    return torch.where(both[1] > 0, float("nan"), both[0])


def total_norm(terms: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of the union of the parts whose (combined) ``terms`` are given."""
    stacked = torch.stack(list(terms))
    return stacked.max() if norm_type == INF else stacked.sum().pow(1.0 / norm_type)


def scale_by_norm_(
    tensors: Sequence[torch.Tensor],
    total: torch.Tensor,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: Optional[bool] = False,
) -> None:
    """Scale ``tensors`` in place so that a set whose norm is ``total`` has norm at most ``max_norm``."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(on_rank(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot "
            "be clipped; pass error_if_nonfinite=False to clip anyway"
        ))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group, multi_tensor in _kernel_groups([t.detach() for t in tensors], foreach):
        scale = coefficient.to(group[0].device, group[0].dtype)
        if multi_tensor:
            torch._foreach_mul_(group, scale)
        else:
            for tensor in group:
                tensor.mul_(scale)


def _kernel_groups(tensors: Sequence[torch.Tensor], foreach: Optional[bool]) -> list[tuple[list[torch.Tensor], bool]]:
    """``tensors`` (plain, detached) by device and dtype, each group with whether torch's
    multi-tensor kernels take it (``foreach``, as the module docstring says); with ``foreach=False``
    one group, so that the norm's terms add in the given order."""
    if foreach is False:
        return [(list(tensors), False)] if tensors else []
    groups = _group_tensors_by_device_and_dtype([list(tensors)])  # type: ignore[list-item]
    kernel_groups = []
    for (device, _), ([group], _) in groups.items():
        supported = _device_has_foreach_support(device)
        if foreach and not supported:
            raise RuntimeError(on_rank(f"foreach=True was passed, but {device.type} tensors have no foreach kernels"))
        kernel_groups.append((cast(list[torch.Tensor], group), supported))
    return kernel_groups


def clip_by_global_norm(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: Optional[dist.ProcessGroup],
    error_if_nonfinite: bool = False,
    clip: Optional[Sequence[torch.Tensor]] = None,
    result_device: Optional[torch.device] = None,
    foreach: Optional[bool] = False,
) -> torch.Tensor:
    """Scale ``grads`` (this rank's disjoint part of all gradients) in place so that the global
    ``norm_type``-norm over ``group`` is at most ``max_norm``.

    ``clip``, when given, are the gradients to scale instead: the norm is taken over ``grads``
    only (fairscale's ``filter_params_fn``, which leaves out copies other ranks count), but every
    gradient is clipped by it, as torch's ``clip_grads_with_norm_`` does.

    Collective. Returns the global norm before clipping (a 0-dim fp32 tensor), as torch does, on
    the gradients' device (``result_device``: where a rank holding no gradient puts it), though the
    ranks combine it where the backend needs (gloo: the CPU).
    """
    norm_type = float(norm_type)
    term = norm_term(grads, norm_type, comm.comm_device(group), foreach)
    total = total_norm([all_reduce_term(term, group, norm_type)], norm_type)
    scaled = grads if clip is None else clip
    scale_by_norm_(scaled, total, max_norm, norm_type, error_if_nonfinite, foreach)
    device = result_device or next((g.device for g in scaled), None)
    return total if device is None else total.to(device)
