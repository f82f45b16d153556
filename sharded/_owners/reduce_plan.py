"""The reduce plan of layer 2: which gradients travel together, to which owner, in what order.

Pure: tensors in, frozen buckets out, no process group, so the plan can be tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .._common.flat import offsets_of, plan_buckets, wire_dtype_for

__all__ = ["FIRST_BUCKET_BYTES", "ReduceBucket", "plan_reduce_buckets"]

FIRST_BUCKET_BYTES: int = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024)
"""Most bytes of parameters in the first window of the ready order (capped by the bucket size).

DDP's small first bucket (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB), kept internal because
fairscale's constructor has no argument for it. Without it, a model that one default bucket
(``reduce_buffer_size``) mostly holds sends nothing until its backward is nearly over; with it,
the first gradients ready leave at once. It is also the size of the first piece Dynamo's
DDPOptimizer cuts from a compiled graph, so under ``torch.compile`` the first bucket is complete
when the first compiled piece's backward is (see :mod:`sharded._owners.compile_split`). Reduction is
element-wise, so where the windows are cut never changes the results.
"""


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

    @property
    def grad_nbytes(self) -> int:
        """Bytes of its gradients at the parameters' dtype (without the 'used' flags)."""
        return self.numel * self.params[0].element_size()

    @property
    def buffer_nbytes(self) -> int:
        """Bytes of the buffer a reduce sends: the gradients, then one 'used' flag per
        parameter, at the wire dtype."""
        return (self.numel + len(self.params)) * self.wire_dtype.itemsize


def plan_reduce_buckets(
    params: Sequence[torch.Tensor],
    owner_of: dict[torch.Tensor, int],
    max_numel: int,
    reduce_fp16: bool,
    first_bytes: int = FIRST_BUCKET_BYTES,
) -> tuple[ReduceBucket, ...]:
    """Buckets for ``params`` (given in expected gradient-ready order), in launch order.

    The ready order is cut into windows of at most ``max_numel`` elements, as DDP cuts its
    buckets, the first one at most ``first_bytes`` of parameters (DDP's small first bucket, so
    that the first reduces leave at the very start of backward); each owner's share of a window
    (per device and dtype) is one bucket. A bucket is thus complete as soon as backward has
    passed its window, and reduces start early in backward, even though the greedy partition
    scatters each owner's parameters over the whole model. A parameter larger than a window has
    one to itself; ``max_numel <= 0`` puts every parameter alone.
    """
    position = {p: i for i, p in enumerate(params)}
    members: dict[tuple, list[torch.Tensor]] = {}
    for window, run in enumerate(_windows(list(params), max_numel, first_bytes)):
        for p in run:
            members.setdefault((window, owner_of[p], p.device, p.dtype), []).append(p)
    buckets = [_bucket(key[1], run, reduce_fp16) for key, run in members.items()]
    buckets.sort(key=lambda b: position[b.params[-1]])
    return tuple(buckets)


def _windows(params: list[torch.Tensor], max_numel: int, first_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``params``: the first of at most ``first_bytes`` (and ``max_numel``
    elements), the others of at most ``max_numel`` elements; a larger parameter is alone."""
    if max_numel <= 0 or not params:
        return plan_buckets(params, max_numel)
    first_numel = min(max_numel, max(1, first_bytes // params[0].element_size()))
    first = plan_buckets(params, first_numel)[0]
    return [first] + plan_buckets(params[len(first) :], max_numel)


def _bucket(owner: int, params: Sequence[torch.Tensor], reduce_fp16: bool) -> ReduceBucket:
    numels = [p.numel() for p in params]
    wire = wire_dtype_for(params[0].dtype, torch.float16 if reduce_fp16 else None)
    return ReduceBucket(owner, tuple(params), tuple(offsets_of(numels)), sum(numels), wire)
