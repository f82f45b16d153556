"""A global gradient norm that does not depend on how the gradients are spread over the ranks.

The usual global norm (:mod:`sharded._common.norm`) adds each rank's sum of squares and then the
ranks' sums: with another world size the terms fall into other partial sums, and the norm can
differ in its last bits, and with it what clipping does. Here the norm is built from per-row
terms: for every row of every gradient (dim 0; each element of a 1-D gradient, the value of a
0-dim one) ``sum |x|**p`` taken left to right along the row (a cumulative sum: one order, whatever
else is reduced with it). A row is whole on one rank at every stage (layer 3 cuts dim 0 only), so
its term is the same on any number of ranks. Each rank writes the terms of the rows it holds into
one vector over all rows of all parameters (zeros elsewhere) and one all-reduce adds the ranks'
vectors: every entry has a single contributor, so that sum is exact in any order. The vector is
then summed left to right. The inf-norm is a maximum, which no order changes.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .._common import comm
from .._common.norm import INF, all_reduce_term

__all__ = ["RowsHeld", "row_count", "invariant_grad_norm"]

# (the offset of the rows this rank holds among all rows of all parameters, their gradient: a
# tensor whose dim 0 runs over those rows, or the value of a 0-dim parameter)
RowsHeld = tuple[int, torch.Tensor]


def row_count(shape: Sequence[int]) -> int:
    """The rows of a tensor of ``shape`` in the norm's vector: dim 0 (1 for a 0-dim tensor)."""
    return int(shape[0]) if len(shape) else 1


def invariant_grad_norm(
    held: Sequence[RowsHeld], total_rows: int, group: Optional[dist.ProcessGroup], norm_type: float, device: torch.device
) -> torch.Tensor:
    """Collective over ``group`` (``None``: every rank holds every row, nothing to exchange):
    the ``norm_type``-norm of all gradients, a 0-dim fp32 tensor, the same bits on every rank
    and at every world size."""
    norm_type = float(norm_type)
    if norm_type == INF:
        local = torch.stack([g.detach().abs().amax().float() for _, g in held if g.numel()] or [torch.zeros((), device=device)]).amax()
        return local if group is None else all_reduce_term(local.to(comm.comm_device(group)), group, INF).to(device)
    terms = torch.zeros(total_rows, dtype=torch.float32, device=device)
    for offset, grad in held:
        rows = _row_terms(grad, norm_type)
        terms[offset : offset + rows.numel()] = rows
    if group is not None:
        shared = terms.to(comm.comm_device(group))
        comm.all_reduce(shared, group, dist.ReduceOp.SUM)
        terms = shared.to(device)
    total = terms.cumsum(0)[-1] if total_rows else torch.zeros((), device=device)
    return total.pow(1.0 / norm_type)


def _row_terms(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum |x|**p`` of each row of ``grad``, each taken left to right."""
    g = grad.detach().float()
    if g.numel() == 0:  # no rows here (a shard past a short parameter's last row), or empty rows
        return torch.zeros(row_count(g.shape), dtype=torch.float32, device=g.device)
    rows = g.reshape(1, 1) if g.dim() == 0 else g.reshape(g.shape[0], -1)
    powered = rows * rows if norm_type == 2.0 else rows.abs().pow(norm_type)
    return powered.cumsum(dim=1)[:, -1]


def check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type == INF or (math.isfinite(norm_type) and norm_type > 0)):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    return norm_type
