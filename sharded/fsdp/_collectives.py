"""A unit's collectives as free functions: the all-gather of its shards and the reduce-scatter
of its gradients, both asynchronous, returning objects to finish them with.

The reduce-scatter buffer is rank-major: row ``r`` is what rank ``r`` receives, and inside a
row each trainable parameter has its padded slot, then one "used" flag per parameter. Every
rank writes its full gradient spread over the rows (zeros where it has none) and a 1 in every
row's flag for each gradient it has, so after averaging a flag is positive exactly when some
rank produced that gradient. A parameter no rank used then keeps ``grad = None``, as with DDP,
instead of getting a zero gradient that would still move it through momentum or weight decay.
A 0-dim (replicated) parameter's gradient is written into every row, so every rank receives the
average.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from .. import _comm
from .._flat import column_blocks
from ._param import ShardedParam
from ._reduce_ops import DivisionPlan
from ._streams import CommStreams

__all__ = ["ProfilerLabels", "PendingGather", "start_all_gather", "ReduceSettings", "Reduction", "start_reduce_scatter"]


@dataclass(frozen=True)
class ProfilerLabels:
    """A unit's ``record_function`` labels (``sharded::all_gather(layers.3)``), built once per
    name rather than on every call."""

    all_gather: str
    reduce_scatter: str
    land_gradients: str

    @classmethod
    def naming(cls, unit_name: str) -> "ProfilerLabels":
        return cls(*(f"sharded::{what}({unit_name})" for what in ("all_gather", "reduce_scatter", "land_gradients")))


@dataclass
class PendingGather:
    """An all-gather in flight: ``output`` is valid once ``work`` is waited for."""

    work: Optional[dist.Work]
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
    label: str,
    comm: Optional[Any] = None,
) -> PendingGather:
    """Start gathering every rank's ``shard`` (cast to ``dtype`` on ``device`` first: a narrow
    ``dtype`` halves the bytes sent) into one rank-major buffer. ``label``: the profiler's name
    for it. ``comm``: a user's ``torch.distributed.fsdp.AllGather`` (``set_custom_all_gather``)
    allocates and gathers."""
    with record_function(label):
        sent = shard.to(device=device, dtype=dtype, non_blocking=True)
        if world == 1:
            return PendingGather(None, sent, sent)
        size = world * sent.numel()
        if comm is not None:
            output = comm.allocate((size,), dtype=dtype, device=device)
            return PendingGather(comm(output, sent, group, async_op=True), output, sent)
        output = torch.empty(size, dtype=dtype, device=device)
        work = _comm.all_gather_into_tensor(output, sent, group, async_op=True)
        return PendingGather(work, output, sent)


@dataclass(frozen=True)
class ReduceSettings:
    """How a unit reduces this backward's gradients (FSDP2's per-module settings)."""

    plan: DivisionPlan
    all_reduce_now: bool = True  # hybrid: False keeps the scattered sum for a later all-reduce
    carried: Optional[torch.Tensor] = None  # scattered sums kept from earlier backwards
    keep_partial: Optional[Callable[[torch.Tensor], None]] = None  # takes the output when deferring
    hook: Optional[Callable[[torch.Tensor], None]] = None  # ``set_all_reduce_hook``
    land_unused: bool = False  # ``set_reduce_scatter_unused_params``: zeros, not None
    comm: Optional[Any] = None  # a user's ``ReduceScatter`` (``set_custom_reduce_scatter``)


@dataclass
class Reduction:
    """A unit's gradient reduce-scatter in flight (then, for hybrid sharding, the all-reduce
    across replicas); :meth:`finish` lands the averaged shards in ``param.grad``."""

    params: list[ShardedParam]
    had_grad_here: list[bool]
    output: torch.Tensor
    work: Optional[dist.Work]  # the reduce-scatter (None with a single shard)
    replicate_group: Optional[dist.ProcessGroup]
    streams: CommStreams
    sent: Optional[torch.Tensor]
    settings: ReduceSettings
    land_label: str
    _replica_work: Optional[dist.Work] = field(default=None)
    _scattered: bool = field(default=False)

    def advance(self) -> None:
        """Wait for the reduce-scatter and start the all-reduce across replicas, if any."""
        if self._scattered:
            return
        with self.streams.on_reduce_scatter():
            if self.work is not None:
                self.work.wait()
            self.work, self.sent, self._scattered = None, None, True
            settings = self.settings
            if settings.carried is not None:
                self.output.add_(settings.carried)
            if self.replicate_group is not None and settings.all_reduce_now:
                self._replica_work = _comm.start_all_reduce(self.output, self.replicate_group, settings.plan.replica_op)

    def finish(self) -> None:
        """Wait for everything, then add each received shard to its parameter's ``.grad`` (or,
        hybrid with the all-reduce deferred, hand the scattered sum back to the unit)."""
        self.advance()
        settings = self.settings
        with self.streams.on_reduce_scatter(), record_function(self.land_label):
            if self.replicate_group is not None and not settings.all_reduce_now and settings.keep_partial is not None:
                settings.keep_partial(self.output)
                return
            if self._replica_work is not None:
                self._replica_work.wait()
            if settings.hook is not None:
                settings.hook(self.output)
            if settings.plan.post_divide is not None:
                self.output.div_(settings.plan.post_divide)
            used = [True] * len(self.params) if settings.land_unused else self._used_anywhere()
            slots = self.output.split([sp.geometry.slot_numel for sp in self.params] + [len(self.params)])
            for sp, slot, is_used in zip(self.params, slots, used):
                if is_used:
                    _land_gradient(sp, sp.local_part(slot))

    def _used_anywhere(self) -> list[bool]:
        """Which parameters got a gradient on some rank. Reading the flags costs a device sync,
        so they are read only when this rank lacked a gradient (else the answer is yes)."""
        if all(self.had_grad_here):
            return self.had_grad_here
        return [flag > 0 for flag in self.output[-len(self.params) :].tolist()]


def start_reduce_scatter(
    params: Sequence[ShardedParam],
    grads: Sequence[Optional[torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
    world: int,
    replicate_group: Optional[dist.ProcessGroup],
    streams: CommStreams,
    settings: ReduceSettings,
    labels: ProfilerLabels,
) -> Reduction:
    """Start reducing ``grads`` (full gradients of ``params``, ``None`` where this rank has
    none) over ``group`` as ``settings`` say (by default averaging), each rank receiving its
    shard of every parameter."""
    present = [g for g in grads if g is not None]
    streams.reduce_scatter_after_compute(present)
    widths = [sp.geometry.slot_numel for sp in params] + [len(params)]
    plan, comm = settings.plan, settings.comm
    with streams.on_reduce_scatter(), record_function(labels.reduce_scatter):
        size = world * sum(widths)
        sent = comm.allocate((size,), dtype=dtype, device=device) if comm is not None else torch.empty(size, dtype=dtype, device=device)
        blocks = column_blocks(sent, world, widths)
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        zeros: list[torch.Tensor] = []
        for sp, grad, block in zip(params, grads, blocks):
            _spread_rows(sp, grad, block, targets, sources, zeros)
        had_grad = [g is not None for g in grads]
        flags = torch.tensor(had_grad, dtype=dtype).to(device, non_blocking=True)
        targets.append(blocks[-1])
        sources.append(flags.view(1, -1).expand(world, -1))
        torch._foreach_copy_(targets, sources)
        if zeros:
            torch._foreach_zero_(zeros)
        if plan.pre_multiply is not None:
            sent.mul_(plan.pre_multiply)
        if plan.pre_divide is not None:
            sent.div_(plan.pre_divide)
        if world == 1:
            output, work = sent, None
        elif comm is not None:
            output = comm.allocate((sum(widths),), dtype=dtype, device=device)
            work = comm(output, sent, group, plan.scatter_op, async_op=True)
        else:
            output = torch.empty(sum(widths), dtype=dtype, device=device)
            work = _comm.reduce_scatter_tensor(output, sent, group, plan.scatter_op, async_op=True)
    reduction = Reduction(list(params), had_grad, output, work, replicate_group, streams, sent, settings, labels.land_gradients)
    if world == 1:
        reduction.advance()
    return reduction


def _spread_rows(
    sp: ShardedParam,
    grad: Optional[torch.Tensor],
    block: torch.Tensor,
    targets: list[torch.Tensor],
    sources: list[torch.Tensor],
    zeros: list[torch.Tensor],
) -> None:
    """Plan copying the full ``grad`` of ``sp`` into ``block`` (``world x slot``): rank ``r``'s
    rows into row ``r``, zeros in the padding (and everywhere if ``grad`` is ``None``)."""
    g = sp.geometry
    if grad is None or g.slot_numel == 0:
        zeros.append(block)
        return
    if g.replicated:
        targets.append(block)
        sources.append(grad.reshape(1, 1).expand(block.shape[0], 1))
        return
    world, per_rank = block.shape[0], g.rows_per_shard
    rows = block.view(world, per_rank, g.row_numel)
    flat_grad = grad.reshape(g.shape[0], g.row_numel)
    full_ranks, remainder = divmod(g.shape[0], per_rank)
    if full_ranks:
        targets.append(rows[:full_ranks])
        sources.append(flat_grad[: full_ranks * per_rank].view(full_ranks, per_rank, g.row_numel))
    if remainder:
        targets.append(rows[full_ranks, :remainder])
        sources.append(flat_grad[full_ranks * per_rank :])
        zeros.append(rows[full_ranks, remainder:])
        full_ranks += 1
    if full_ranks < world:
        zeros.append(rows[full_ranks:])


def _land_gradient(sp: ShardedParam, local_grad: torch.Tensor) -> None:
    """Add ``local_grad`` (this rank's rows, in the reduce dtype) to ``sp``'s sharded ``.grad``."""
    master = sp.local_shard()
    local_grad = local_grad.to(device=master.device, dtype=master.dtype, non_blocking=True)
    grad = sp.sharded.grad
    if grad is None:
        sp.sharded.grad = sp.as_dtensor(local_grad)
    else:
        cast(DTensor, grad).to_local().add_(local_grad)
