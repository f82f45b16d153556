"""Where each gradient goes: the reduce buckets of layer 2 and each parameter's place in them.

The router's parameters are numbered once (their index, stable for the router's life); the
buckets come from :func:`~sharded._owners.reduce_plan.plan_reduce_buckets` and are planned twice:
first from a guess of the order in which gradients become ready (the reverse of definition),
then once from the order the first backward really produced them, as DDP rebuilds its buckets.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._common import comm
from .reduce_plan import ReduceBucket, plan_reduce_buckets

__all__ = ["BucketIndex"]


class BucketIndex:
    """The buckets, and for each parameter index its bucket and slot in it.

    Args:
        params: the parameters, in expected gradient-ready order; their positions are the
            indices every other part of the router uses.
        owner_of: parameter -> owner rank.
        bucket_numel: most elements per bucket; larger gradients travel alone.
        reduce_fp16: reduce fp32/fp64 gradients in fp16.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], owner_of: dict[torch.Tensor, int], bucket_numel: int, reduce_fp16: bool
    ) -> None:
        self.params = tuple(params)
        self.owner_of = owner_of
        self._bucket_numel = bucket_numel
        self._reduce_fp16 = reduce_fp16
        self.index_of = {p: i for i, p in enumerate(self.params)}
        self.from_observed_order = False  # True once re-planned from a real backward's order
        self._plan(self.params)

    def _plan(self, ready_order: Sequence[torch.Tensor]) -> None:
        self.buckets: tuple[ReduceBucket, ...] = plan_reduce_buckets(
            ready_order, self.owner_of, self._bucket_numel, self._reduce_fp16
        )
        self.members = [[self.index_of[p] for p in bucket.params] for bucket in self.buckets]
        self.location = [(0, 0)] * len(self.params)
        for b, members in enumerate(self.members):
            for slot, index in enumerate(members):
                self.location[index] = (b, slot)

    def replan_from(self, completed_at: Sequence[int], group: comm.ProcessGroup) -> None:
        """Re-plan from the order in which a backward completed the gradients (``completed_at``:
        per index, the arrival clock of its last arrival, 0 if it never arrived). Rank 0's order
        is broadcast, so every rank plans the same buckets. Collective."""
        position = {index: i for i, index in enumerate(i for members in self.members for i in members)}
        never = len(self.params) + 1
        order = sorted(range(len(self.params)), key=lambda i: (completed_at[i] or never, position[i]))
        agreed = torch.tensor(order, dtype=torch.int64, device=comm.comm_device(group))
        comm.broadcast(agreed, 0, group, async_op=False)
        self._plan([self.params[i] for i in agreed.tolist()])
        self.from_observed_order = True

    def wire_dtype_of(self, index: int) -> torch.dtype:
        """The dtype the gradient of parameter ``index`` travels in."""
        return self.buckets[self.location[index][0]].wire_dtype
