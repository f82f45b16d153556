"""How a unit's gradient reduction divides: the collective ops and the scalings around them.

By default a unit averages (``AVG`` in the reduce-scatter, and across replicas for hybrid
sharding), as DDP does. FSDP2's knobs change that:

* ``set_gradient_divide_factor(f)``: the gradients are summed over every data-parallel rank and
  divided by ``f`` once (``f = 1``: a plain sum, for losses already normalised by a global token
  count). In float32/bfloat16 the division happens as the reduce-scatter reads its input (NCCL's
  ``PREMUL_SUM``; gloo has none, so the input is multiplied by ``1/f`` first, which is the same
  arithmetic), or is ``AVG`` when ``f`` is the shard group's size.
* ``set_force_sum_reduction_for_comms(True)``, or a float16/float64 reduction with a factor: only
  ``SUM`` crosses the wire; the input is divided by a power of two near ``sqrt(f)`` before it
  (float16 only, against overflow) and the output by the rest after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .._common import comm

__all__ = ["DivisionPlan", "division_plan"]

_SAFE_DTYPES = (torch.float32, torch.bfloat16)  # no overflow risk from summing before dividing


@dataclass(frozen=True)
class DivisionPlan:
    """What one reduction does: scale its input, reduce-scatter, all-reduce, scale its output."""

    pre_multiply: Optional[float]  # multiply the packed gradients by this before sending
    pre_divide: Optional[float]  # divide them by this before sending
    scatter_op: dist.ReduceOp.RedOpType
    replica_op: dist.ReduceOp.RedOpType
    post_divide: Optional[float]  # divide the received shard by this, after every collective

    def scale_sent(self, sent: torch.Tensor) -> None:
        """Scale the packed gradients, in place, before they are sent."""
        if self.pre_multiply is not None:
            sent.mul_(self.pre_multiply)
        if self.pre_divide is not None:
            sent.div_(self.pre_divide)

    def scale_received(self, received: torch.Tensor) -> None:
        """Scale the reduced shard, in place, after every collective."""
        if self.post_divide is not None:
            received.div_(self.post_divide)


def division_plan(
    dtype: torch.dtype, shard_world: int, replicate_world: int, factor: Optional[float], force_sum: bool
) -> DivisionPlan:
    """The plan for reducing ``dtype`` gradients over ``shard_world x replicate_world`` ranks."""
    if factor is None and not force_sum:
        average = comm.mean_op(dtype)
        return DivisionPlan(None, None, average, average, None)
    total = float(factor if factor is not None else shard_world * replicate_world)
    summed = dist.ReduceOp.SUM
    if not force_sum and dtype in _SAFE_DTYPES:
        if total == shard_world:
            return DivisionPlan(None, None, comm.mean_op(dtype), summed, None)
        return DivisionPlan(_unless_one(1.0 / total), None, summed, summed, None)
    if dtype in _SAFE_DTYPES:
        return DivisionPlan(None, None, summed, summed, _unless_one(total))
    before = _power_of_two_near_sqrt(total)
    return DivisionPlan(None, _unless_one(before), summed, summed, _unless_one(total / before))


def _power_of_two_near_sqrt(total: float) -> float:
    """The largest power of two ``p`` dividing ``total`` with ``p * p`` not above ``total``
    (roughly), so neither division leaves float16's range."""
    p = 1.0
    while total % p == 0 and total / p > p:
        p *= 2
    return p


def _unless_one(value: float) -> Optional[float]:
    return None if value == 1 else value
