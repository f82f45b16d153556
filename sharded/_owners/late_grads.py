"""Gradients that arrive after their bucket has left, reduced in a second pass.

The graph changed (a branch taken for the first time, one more reuse under checkpointing): a
gradient is complete later than the last backward taught, and its bucket is already on its way.
It is never dropped nor overwritten: kept aside here, scaled as the bucket's were, and at the
end of backward, after one small all-reduce in which the ranks agree which buckets need a
correction, sent in correction buckets whose result the owner adds to the first. Reduction is
linear, so the sum is the same. Every synced backward pays the agreement; only one with late
gradients pays the second reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._common import comm
from .bucket_index import BucketIndex
from .reduce_pass import Fill

__all__ = ["LateGradients"]


class LateGradients:
    """The late gradients of one backward, by parameter index, already scaled."""

    def __init__(self) -> None:
        self._kept: dict[int, torch.Tensor] = {}

    def keep(self, index: int, grad: torch.Tensor, scale: float, wire_dtype: torch.dtype) -> None:
        """Keep ``grad * scale`` for parameter ``index`` (added to what an earlier arrival left)."""
        if index in self._kept:
            self._kept[index].add_(grad, alpha=scale)
        else:
            self._kept[index] = grad.mul(scale).to(wire_dtype)

    def corrections(self, bucket_index: BucketIndex, group: comm.ProcessGroup) -> list[Fill]:
        """Agree with the other ranks which buckets need a correction (collective), and fill one
        for each: this rank's late gradients, zeros elsewhere, ready to send."""
        needs = torch.zeros(len(bucket_index.buckets), dtype=torch.int32)
        for index in self._kept:
            needs[bucket_index.location[index][0]] = 1
        needs = needs.to(comm.comm_device(group))
        comm.all_reduce(needs, group, dist.ReduceOp.MAX)
        fills = []
        for b in needs.nonzero().flatten().tolist():
            fill = Fill(bucket_index.buckets[b], b)
            for slot, index in enumerate(bucket_index.members[b]):
                if index in self._kept:
                    fill.add(slot, self._kept.pop(index), 1.0)
            fill.seal()
            fills.append(fill)
        return fills
