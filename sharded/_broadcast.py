"""Bucketed broadcasts of tensors from the ranks that hold their true values.

After a sharded optimizer step only the owner of a parameter has its new value. These helpers
plan (once per partition) and run (every step) the broadcasts that bring every replica up to
date: small tensors of one owner, device and dtype are packed into flat buckets so that a model
of many small parameters costs a few large messages; a tensor larger than a bucket is sent in
place with no copy. All broadcasts are issued asynchronously and waited on together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from . import _comm
from ._flat import flatten, group_by_device_and_dtype, plan_buckets, unflatten_into

__all__ = ["Bucket", "PendingBroadcasts", "plan_broadcasts", "broadcast_buckets", "start_broadcasts"]


@dataclass(frozen=True)
class Bucket:
    """Tensors that travel together from rank ``src`` in one message."""

    src: int
    tensors: tuple[torch.Tensor, ...]


def plan_broadcasts(
    tensors_by_src: Sequence[Sequence[torch.Tensor]], max_numel: int
) -> tuple[Bucket, ...]:
    """Buckets for sending ``tensors_by_src[r]`` from rank ``r`` to every other rank."""
    buckets = []
    for src, tensors in enumerate(tensors_by_src):
        nonempty = [t for t in tensors if t.numel() > 0]
        for same_kind in group_by_device_and_dtype(nonempty).values():
            buckets.extend(Bucket(src, tuple(b)) for b in plan_buckets(same_kind, max_numel))
    return tuple(buckets)


def broadcast_buckets(
    buckets: Sequence[Bucket],
    group: _comm.ProcessGroup,
    wire_dtype: Optional[torch.dtype] = None,
) -> None:
    """Overwrite every rank's copy of each bucket's tensors with the values on its ``src``.

    With ``wire_dtype`` (e.g. ``torch.float16``) floating tensors of a wider type travel in that
    type: half the bytes, and receivers get the sender's values rounded to it. The sender keeps
    its exact values, so rounding never accumulates from step to step.
    """
    start_broadcasts(buckets, group, wire_dtype).wait()


class PendingBroadcasts:
    """Broadcasts in flight; :meth:`wait` completes them and unpacks what was received."""

    def __init__(self, me: int, in_flight: list[tuple[Bucket, torch.Tensor, bool, Any]]) -> None:
        self._me = me
        self._in_flight = in_flight

    def wait(self) -> None:
        for bucket, message, in_place, work in self._in_flight:
            work.wait()
            if self._me != bucket.src and not in_place:
                with torch.profiler.record_function("sharded::unpack_broadcast"):
                    unflatten_into(message, bucket.tensors)
        self._in_flight = []


def start_broadcasts(
    buckets: Sequence[Bucket],
    group: _comm.ProcessGroup,
    wire_dtype: Optional[torch.dtype] = None,
) -> PendingBroadcasts:
    """Issue the broadcasts of :func:`broadcast_buckets` without waiting for them."""
    me = _comm.group_rank(group)
    in_flight = []
    if _comm.group_size(group) > 1:
        for bucket in buckets:
            dtype = _wire_dtype_for(bucket.tensors[0].dtype, wire_dtype)
            in_place = len(bucket.tensors) == 1 and dtype == bucket.tensors[0].dtype
            if in_place:
                message = bucket.tensors[0].detach()
            elif me == bucket.src:
                message = flatten(bucket.tensors, dtype)
            else:
                numel = sum(t.numel() for t in bucket.tensors)
                message = torch.empty(numel, dtype=dtype, device=bucket.tensors[0].device)
            work = _comm.broadcast(message, bucket.src, group)
            in_flight.append((bucket, message, in_place, work))
    return PendingBroadcasts(me, in_flight)


def _wire_dtype_for(dtype: torch.dtype, wire_dtype: Optional[torch.dtype]) -> torch.dtype:
    narrower = (
        wire_dtype is not None
        and dtype.is_floating_point
        and torch.finfo(wire_dtype).bits < torch.finfo(dtype).bits
    )
    return wire_dtype if narrower else dtype
