"""The reduce plan of layer 2: which gradients travel together, to which owner, in what order.

Pure: tensors in, frozen buckets out, no process group, so the plan can be tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ._flat import plan_buckets, wire_dtype_for

__all__ = ["ReduceBucket", "plan_reduce_buckets"]


@dataclass(frozen=True)
class ReduceBucket:
    """Parameters whose gradients are reduced together to ``owner`` in one flat message."""

    owner: int
    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    numel: int
    wire_dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device


def plan_reduce_buckets(
    params: Sequence[torch.Tensor],
    owner_of: dict[torch.Tensor, int],
    max_numel: int,
    reduce_fp16: bool,
) -> tuple[ReduceBucket, ...]:
    """Buckets for ``params`` (given in expected gradient-ready order), in launch order.

    The ready order is cut into windows of at most ``max_numel`` elements, as DDP cuts its
    buckets; each owner's share of a window (per device and dtype) is one bucket. A bucket is
    thus complete as soon as backward has passed its window, and reduces start early in
    backward, even though the greedy partition scatters each owner's parameters over the whole
    model. A parameter larger than a window has one to itself; ``max_numel <= 0`` puts every
    parameter alone.
    """
    position = {p: i for i, p in enumerate(params)}
    members: dict[tuple, list[torch.Tensor]] = {}
    for window, run in enumerate(plan_buckets(params, max_numel)):
        for p in run:
            members.setdefault((window, owner_of[p], p.device, p.dtype), []).append(p)
    buckets = [_bucket(key[1], run, reduce_fp16) for key, run in members.items()]
    buckets.sort(key=lambda b: position[b.params[-1]])
    return tuple(buckets)


def _bucket(owner: int, params: Sequence[torch.Tensor], reduce_fp16: bool) -> ReduceBucket:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    wire = wire_dtype_for(params[0].dtype, torch.float16 if reduce_fp16 else None)
    return ReduceBucket(owner, tuple(params), tuple(offsets), total, wire)
