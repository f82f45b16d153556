"""What an optimizer step costs per parameter, and the one way whole parameters are placed on
owner ranks by it.

An element-wise optimizer (SGD, Adam) costs about as much per element as it holds, so balancing
bytes balances its step. A whole-matrix optimizer does not: Muon's Newton–Schulz iteration on an
``m x n`` matrix is a handful of matrix products of ``min(m, n)``-sized Gram matrices, about
``m * n * min(m, n)`` multiply-adds, so one 4096 x 4096 matrix costs as much as 64 of size
1024 x 1024 though it holds only 16 times the bytes. Layers 1-2 (``OSS``'s partition) and layer
3 (the owner placement, ``sharded.fsdp.Owned``) balance by these costs, both with
:func:`place_greedily`: sorted greedy ("longest processing time first"), costliest first onto the
least-loaded rank, which keeps the busiest rank within one parameter of the mean.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

from .errors import on_rank

__all__ = ["newton_schulz_cost", "checked_cost", "place_greedily"]


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """The relative cost of orthogonalising an update of ``shape`` by Newton–Schulz (Muon).

    An ``m x n`` matrix costs ``m * n * min(m, n)`` (each iteration multiplies by the Gram matrix
    of the shorter side); a tensor of more dims is a stack of matrices over its last two, so the
    product of its leading dims times that (as a batched Muon steps stacked experts); a 0-dim or
    1-dim tensor, which such optimizers step element-wise, its number of elements. Only ratios
    matter: the constant (iterations, multiply-adds per product) is the same for every matrix.
    """
    dims = [int(d) for d in shape]
    if len(dims) < 2:
        return math.prod(dims)
    *leading, m, n = dims
    return math.prod(leading) * m * n * min(m, n)


def checked_cost(value: object, what: str, group_rank: Optional[int] = None) -> float:
    """``value`` as a float, if it is a finite number >= 0; otherwise an error on this rank
    (``group_rank`` in its group, if given) that says ``what`` gave it (which function, for which
    parameter) and what a cost must be."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(on_rank(f"{what} is {value!r}; a cost must be a number (an int or float)", group_rank))
    if not math.isfinite(value) or value < 0:
        raise ValueError(on_rank(f"{what} is {value!r}; a cost must be a finite number >= 0", group_rank))
    return float(value)


def place_greedily(costs: Sequence[float], loads: list[float]) -> list[int]:
    """The rank each of ``costs`` goes to, costliest first (ties: the earlier), each onto the
    least-loaded rank of ``loads`` (ties: the lower rank), which this adds it to."""
    ranks = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(len(loads)), key=loads.__getitem__)
        ranks[i] = rank
        loads[rank] += costs[i]
    return ranks
