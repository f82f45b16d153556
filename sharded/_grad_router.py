"""Layer 2 mechanism: route each gradient, as it becomes ready in backward, to the rank that owns
its parameter.

Gradients are packed into per-owner flat buckets (a fixed plan, made once per partition). As soon
as a bucket is full it is reduced asynchronously to its owner while backward continues; buckets
are launched strictly in plan order so that every rank issues the same collectives in the same
sequence. At the end of backward one callback launches what is left (zeros stand in for gradients
this rank never produced), waits for everything, and hands out the results: the owner's
``param.grad`` becomes a view of the reduced bucket, every other rank's becomes ``None``. That is
ZeRO-2: gradient memory per rank is its shard plus the buckets in flight.

Each bucket carries one extra element per parameter, 1 where the gradient was produced. After the
reduce the owner knows which parameters no rank used, and leaves their gradients alone as DDP does.
"""

from __future__ import annotations

import enum
import functools
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import _comm
from ._flat import plan_buckets, wire_dtype_for

__all__ = ["GradRouter", "Phase", "ReduceBucket", "plan_reduce_buckets"]


class Phase(enum.Enum):
    """Where the gradients are in the step."""

    IDLE = "idle"  # ready for a synced backward
    BACKWARD = "backward"  # reduces in flight
    REDUCED = "reduced"  # owners hold averaged gradients until step() or zero_grad()


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


class _Fill:
    """One bucket's buffer during one backward: gradients, then one 'used' flag per parameter."""

    def __init__(self, bucket: ReduceBucket) -> None:
        self.buffer = torch.empty(bucket.numel + len(bucket.params), dtype=bucket.wire_dtype, device=bucket.device)
        self.arrived = [False] * len(bucket.params)
        self.count = 0

    def grad_view(self, bucket: ReduceBucket, slot: int) -> torch.Tensor:
        p, offset = bucket.params[slot], bucket.offsets[slot]
        return self.buffer[offset : offset + p.numel()].view(p.shape)

    def seal(self, bucket: ReduceBucket) -> None:
        """Zero the slots of gradients that never came and write the used flags."""
        for slot, came in enumerate(self.arrived):
            if not came:
                self.grad_view(bucket, slot).zero_()
        flags = torch.tensor(self.arrived, dtype=bucket.wire_dtype)
        self.buffer[bucket.numel :].copy_(flags, non_blocking=True)


class GradRouter:
    """Reduces gradients to their owners during backward, in buckets, overlapped with backward.

    Args:
        params: trainable parameters in expected gradient-ready order (reverse of definition).
        owner_of: parameter -> owner rank in ``group``.
        group: the process group shared with the sharded optimizers.
        bucket_numel: most elements per bucket; larger gradients travel alone.
        reduce_fp16: reduce fp32/fp64 gradients in fp16 (bf16 and fp16 stay as they are).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        owner_of: dict[torch.Tensor, int],
        group: _comm.ProcessGroup,
        bucket_numel: int,
        reduce_fp16: bool,
    ) -> None:
        self.group = group
        self.rank = _comm.group_rank(group)
        self.world_size = _comm.group_size(group)
        self.buckets = plan_reduce_buckets(params, owner_of, bucket_numel, reduce_fp16)
        self.phase = Phase.IDLE
        self.sync_enabled = True  # False: the last forward ran inside no_sync()
        self._fills: list[Optional[_Fill]] = []
        self._next_launch = 0
        self._in_flight: deque[tuple[int, _Fill, dist.Work]] = deque()
        # On one rank every gradient is already complete where autograd put it.
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, index, slot))
            for index, bucket in enumerate(self.buckets)
            for slot, p in enumerate(bucket.params)
            if self.world_size > 1
        ]

    def remove_hooks(self) -> None:
        """Detach from the parameters (before a new router replaces this one)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ----------------------------------------------------------------------- phase changes

    def mark_grads_consumed(self) -> None:
        """The optimizer stepped or the gradients were zeroed: the next backward starts afresh."""
        if self.phase is Phase.REDUCED:
            self.phase = Phase.IDLE

    def reduce_current_grads(self) -> None:
        """Reduce whatever gradients the parameters hold now (e.g. after ``no_sync`` steps)."""
        if self.world_size == 1:
            return
        self._begin_backward(current=None, queue_flush=False)
        for index, bucket in enumerate(self.buckets):
            for slot, p in enumerate(bucket.params):
                if p.grad is not None:
                    self._add(index, slot, p)
        self._flush()

    # ------------------------------------------------------------------------- hot path

    def _on_grad_ready(self, index: int, slot: int, param: torch.Tensor) -> None:
        if not self.sync_enabled:
            return
        if self.phase is not Phase.BACKWARD:
            self._begin_backward(current=param, queue_flush=True)
        self._add(index, slot, param)

    def _add(self, index: int, slot: int, param: torch.Tensor) -> None:
        """Copy ``param``'s gradient (pre-divided by the world size, as DDP does) into its bucket."""
        bucket = self.buckets[index]
        fill = self._fills[index]
        if fill is None:
            fill = self._fills[index] = _Fill(bucket)
        torch.mul(param.grad, 1.0 / self.world_size, out=fill.grad_view(bucket, slot))
        param.grad = None
        fill.arrived[slot] = True
        fill.count += 1
        while self._next_launch < len(self.buckets):
            next_fill = self._fills[self._next_launch]
            if next_fill is None or next_fill.count < len(self.buckets[self._next_launch].params):
                break
            self._launch(self._next_launch)

    # ---------------------------------------------------------------------- bucket life

    def _begin_backward(self, current: Optional[torch.Tensor], queue_flush: bool) -> None:
        if self.phase is Phase.REDUCED and not self._grads_cleared_on_every_rank(current):
            raise RuntimeError(
                f"rank {self.rank}: backward ran again after the gradients were reduced and "
                "before optimizer.step() or zero_grad(); non-owner ranks have already released "
                "theirs, so they cannot be accumulated. Accumulate inside no_sync(), or step and "
                "zero the gradients between backward passes."
            )
        self.phase = Phase.BACKWARD
        self._fills = [None] * len(self.buckets)
        self._next_launch = 0
        if queue_flush:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        fill = self._fills[index] or _Fill(bucket)
        fill.seal(bucket)
        self._fills[index] = None
        self._next_launch = index + 1
        with torch.profiler.record_function("sharded::reduce_bucket"):
            work = dist.reduce(
                fill.buffer,
                dst=_comm.global_rank(self.group, bucket.owner),
                op=dist.ReduceOp.SUM,
                group=self.group,
                async_op=True,
            )
        self._in_flight.append((index, fill, work))
        self._release_sent_buckets()

    def _release_sent_buckets(self) -> None:
        """Free the buffers of buckets this rank has finished sending to another owner.

        Owned buckets wait for the flush: reading their 'used' flags would make an accelerator
        synchronise in the middle of backward.
        """
        still_in_flight = deque()
        for entry in self._in_flight:
            index, _, work = entry
            if self.buckets[index].owner != self.rank and work.is_completed():
                self._finish(*entry)
            else:
                still_in_flight.append(entry)
        self._in_flight = still_in_flight

    def _flush(self) -> None:
        """End of backward: launch what is left, wait for every reduce, hand out the results."""
        with torch.profiler.record_function("sharded::flush_pending_reduces"):
            for index in range(self._next_launch, len(self.buckets)):
                self._launch(index)
            while self._in_flight:
                self._finish(*self._in_flight.popleft())
        self.phase = Phase.REDUCED

    def _finish(self, index: int, fill: _Fill, work: dist.Work) -> None:
        """Wait for a bucket's reduce; the owner takes the results, everyone else lets go."""
        work.wait()
        bucket = self.buckets[index]
        if bucket.owner != self.rank:
            for p in bucket.params:
                p.grad = None
            return
        used = fill.buffer[bucket.numel :].tolist()
        for slot, p in enumerate(bucket.params):
            if used[slot] > 0:
                reduced = fill.grad_view(bucket, slot)
                p.grad = reduced if reduced.dtype == p.dtype else reduced.to(p.dtype)
            elif p.grad is not None:
                p.grad.zero_()

    def _grads_cleared_on_every_rank(self, except_param: Optional[torch.Tensor]) -> bool:
        """Whether zero_grad() ran since the last reduce: every owner's gradients are gone or zero.

        Only reached when a backward starts without a step since the last one (e.g. GradScaler
        skipped it), so the one small collective that makes all ranks decide alike is cheap.
        """
        cleared = all(
            p.grad is None or not p.grad.any()
            for bucket in self.buckets
            if bucket.owner == self.rank
            for p in bucket.params
            if p is not except_param
        )
        flag = torch.tensor([float(cleared)], device=_comm.comm_device(self.group))
        _comm.all_reduce(flag, self.group, dist.ReduceOp.MIN)
        return bool(flag.item())
