"""A unit's collectives as free functions that only move bytes: the all-gather of its shards
and the reduce-scatter of its gradients, both asynchronous, each returning an object to wait on.

What goes in and what comes out is laid out by the unit's flat buffers
(:mod:`._flat_buffers`: the shards as they are, the gradients packed rank-major), and what a
reduction does around its collectives (scaling, the all-reduce across replicas, landing the
gradients) by :mod:`._reduction`. A user's ``torch.distributed.fsdp.AllGather`` /
``ReduceScatter`` (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) allocates the
buffers and runs the collective in place of ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
import torch.distributed as dist

from .._common import comm
from .._common.lowbit import Codec, LowBitWire, Pending

__all__ = [
    "ProfilerLabels", "new_buffer", "PendingGather", "start_all_gather", "PendingDecodedGather", "start_lowbit_all_gather",
    "PendingReduceScatter", "start_reduce_scatter",
]


@dataclass(frozen=True)
class ProfilerLabels:
    """The ``record_function`` labels a unit's communication shows under in a profile, naming the
    unit by its module path (``sharded::all_gather(layers.3)``); built once per name rather than
    on every call."""

    all_gather: str
    reduce_scatter: str
    land_gradients: str

    @classmethod
    def naming(cls, unit_name: str) -> "ProfilerLabels":
        return cls(*(f"sharded::{what}({unit_name})" for what in ("all_gather", "reduce_scatter", "land_gradients")))


def new_buffer(numel: int, dtype: torch.dtype, device: torch.device, custom: Optional[Any] = None) -> torch.Tensor:
    """An uninitialised 1-D buffer for a collective (``custom``'s own allocation, if given)."""
    if custom is not None:
        return custom.allocate((numel,), dtype=dtype, device=device)
    return torch.empty(numel, dtype=dtype, device=device)


@dataclass
class PendingGather:
    """An all-gather in flight: ``output`` is valid once ``work`` is waited for."""

    work: Optional[comm.Waitable]
    output: torch.Tensor
    sent: torch.Tensor  # kept alive until the collective has read it

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.output


def start_all_gather(
    shard: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
    world: int,
    custom: Optional[Any] = None,
) -> PendingGather:
    """Start gathering every rank's ``shard`` (cast to ``dtype`` on ``device`` first: a narrow
    ``dtype`` halves the bytes sent) into one rank-major buffer."""
    sent = shard.to(device=device, dtype=dtype, non_blocking=True)
    if world == 1:
        return PendingGather(None, sent, sent)
    output = new_buffer(world * sent.numel(), dtype, device, custom)
    if custom is not None:
        return PendingGather(custom(output, sent, group, async_op=True), output, sent)
    return PendingGather(comm.all_gather_into_tensor(output, sent, group, async_op=True), output, sent)


@dataclass
class PendingDecodedGather:
    """A low-bit all-gather in flight: ``wait`` gives every rank's shard, decoded in float32,
    rank-major (the layout of :class:`PendingGather`'s output)."""

    pending: Pending

    def wait(self) -> torch.Tensor:
        return cast(torch.Tensor, self.pending.wait())


def start_lowbit_all_gather(wire: LowBitWire, codec: Codec, shard: torch.Tensor, exact_dtype: torch.dtype) -> PendingDecodedGather:
    """Start gathering every rank's ``shard`` in ``codec``'s format through ``wire`` (this rank's
    own shard encoded and decoded too); ``exact_dtype`` is what the exact gather would send."""
    return PendingDecodedGather(wire.all_gather(codec, shard, exact_dtype))


@dataclass
class PendingReduceScatter:
    """A reduce-scatter in flight: ``output`` (this rank's row of the reduced buffer) is valid
    once ``work`` is waited for."""

    work: Optional[dist.Work]
    output: torch.Tensor
    sent: Optional[torch.Tensor]  # kept alive until the collective has read it

    def wait(self) -> torch.Tensor:
        """Wait, let the send buffer go, and return this rank's row."""
        if self.work is not None:
            self.work.wait()
        self.work, self.sent = None, None
        return self.output


def start_reduce_scatter(
    sent: torch.Tensor,
    group: dist.ProcessGroup,
    world: int,
    op: dist.ReduceOp.RedOpType,
    custom: Optional[Any] = None,
) -> PendingReduceScatter:
    """Start reducing the rank-major ``sent`` (``world`` equal rows) with ``op`` over ``group``,
    row ``r`` landing on rank ``r``. With one rank, ``sent`` is already the result."""
    if world == 1:
        return PendingReduceScatter(None, sent, sent)
    output = new_buffer(sent.numel() // world, sent.dtype, sent.device, custom)
    if custom is not None:
        return PendingReduceScatter(custom(output, sent, group, op, async_op=True), output, sent)
    work = comm.reduce_scatter_tensor(output, sent, group, op, async_op=True)
    # a send buffer the collective has already copied is not kept: the largest buffer of a
    # reduction in flight is freed as soon as it was consumed
    return PendingReduceScatter(work, output, None if comm.reduce_scatter_copies_input(group) else sent)
