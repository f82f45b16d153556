"""Layers 0-2 (DDP, ``OSS`` + DDP, ``ShardedDataParallel``): each micro-batch under ``no_sync``,
its gradients moved into a flat fp32 leaf of the rank's local tree, one exchange after the last.

- :class:`ReplicatedStage` (DDP, ``OSS`` + DDP): after the last micro-batch, one canonical
  all-reduce; every rank gets every gradient, as from DDP.
- :class:`OwnersStage` (``ShardedDataParallel``): the leaf laid out owner by owner; one exchange
  gives each owner the ranks' sums of its parameters, and only owners keep a gradient.

Each rank computes a block of consecutive micro-batches (:meth:`Stage.indices`), an aligned
subtree of the canonical tree, which the exchange then combines with the other ranks' blocks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._common import comm
from .._common.errors import on_rank
from .._common.flat import pack_with_used_flags, used_anywhere
from ..sharded_ddp import ShardedDataParallel
from ._exchange import all_reduce_canonically, start_exchange
from ._norm import RowsHeld, row_count
from ._stage import Stage
from ._tree import TreeAccumulator

__all__ = ["ReplicatedStage", "OwnersStage"]


class _FlatLeaves:
    """Each micro-batch's gradients moved into one flat fp32 leaf, summed up the local tree. The
    leaf is laid out group by group, one group per destination of the exchange (all parameters
    for the all-reduce, each owner's for ``ShardedDataParallel``), so the exchange sends it as it
    is: a group's gradients back to back (zeros where none), then a "used" flag per parameter."""

    def __init__(self, groups: list[list[torch.Tensor]]) -> None:
        self.groups = groups
        self.sizes = [sum(p.numel() for p in group) + len(group) for group in groups]
        self.tree = TreeAccumulator()

    def take(self) -> None:
        """Move the gradients into the next leaf (``.grad`` is emptied: autograd never adds two
        micro-batches)."""
        leaf = torch.empty(sum(self.sizes), dtype=torch.float32, device=_device_of(self.groups))
        for group, piece in zip(self.groups, leaf.split(self.sizes)):
            _move_grads_into(group, piece)
        self.tree.add(leaf)

    def total(self) -> torch.Tensor:
        total = self.tree.total()
        if total is None:
            raise RuntimeError(on_rank("MicroBatches: no micro-batch ran"))
        return total


def _move_grads_into(params: list[torch.Tensor], piece: torch.Tensor) -> None:
    """``params``' gradients into ``piece`` (then their "used" flags), leaving ``.grad`` empty."""
    pack_with_used_flags(piece, [p.grad for p in params], [p.numel() for p in params])
    for p in params:
        p.grad = None


def _land(params: list[torch.Tensor], flat: torch.Tensor, micro_batches: int) -> None:
    """``flat`` (summed gradients back to back, then their flags) divided by ``micro_batches``, in
    place, into the ``.grad`` of ``params`` that some rank had a gradient for (views of ``flat``)."""
    n = len(params)
    if not n:
        return
    used = used_anywhere(flat[-n:])
    flat.div_(micro_batches)  # the flags stay positive exactly where they were
    for p, piece, is_used in zip(params, flat[:-n].split([p.numel() for p in params]), used):
        p.grad = piece.view(p.shape).to(p.dtype) if is_used else None


def _device_of(groups: list[list[torch.Tensor]]) -> torch.device:
    return next((p.device for group in groups for p in group), torch.device("cpu"))


class ReplicatedStage(Stage):
    """DDP or ``OSS`` + DDP (or one plain process): every rank ends with every gradient."""

    def __init__(self, ddp: Optional[DistributedDataParallel], module: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
        self._ddp = ddp
        self._params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
        self.group = group
        self.world = comm.group_size(group) if group is not None else 1
        self.block = comm.group_rank(group) if group is not None else 0
        self._leaves = _FlatLeaves([self._params])

    def params(self) -> list[torch.Tensor]:
        return self._params

    def begin(self) -> None:
        super().begin()
        self._leaves = _FlatLeaves([self._params])

    def micro_batch(self) -> ContextManager[None]:
        return self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()

    def collect(self) -> None:
        self._leaves.take()

    def finish(self, micro_batches: int) -> None:
        total = self._leaves.total()
        summed = all_reduce_canonically(total, self.group) if self.group is not None else total
        _land(self._params, summed, micro_batches)

    def rows_held(self) -> tuple[list[RowsHeld], int, Optional[dist.ProcessGroup]]:
        return _whole_rows(self._params, lambda p: True), _rows_of(self._params), None


def _rows_of(params: list[torch.Tensor]) -> int:
    return sum(row_count(p.shape) for p in params)


def _whole_rows(params: list[torch.Tensor], held: Callable[[torch.Tensor], bool]) -> list[RowsHeld]:
    rows, offset = [], 0
    for p in params:
        if held(p) and p.grad is not None:
            rows.append((offset, p.grad))
        offset += row_count(p.shape)
    return rows


class OwnersStage(Stage):
    """``ShardedDataParallel`` over ``OSS`` optimizers: each owner ends with its parameters'
    gradients, the others with none."""

    def __init__(self, sdp: ShardedDataParallel) -> None:
        if sdp.reduce_fp16:
            raise NotImplementedError(on_rank("MicroBatches: ShardedDataParallel(reduce_fp16=True); the canonical sum is taken in fp32"))
        if sdp.lowbit is not None:
            raise NotImplementedError(on_rank(
                "MicroBatches: ShardedDataParallel(lowbit=...); the invariant promise is the same bits at any world size, "
                "and low-bit gradients round differently at each; pass lowbit=None", sdp.rank))
        self._sdp = sdp
        self.group = sdp.process_group
        self.world = sdp.world_size
        self.block = sdp.rank
        owner_of: dict[Any, int] = {}
        for optimizer in sdp.sharded_optimizers:
            owner_of.update(optimizer.param_to_rank)
        self._params: list[torch.Tensor] = [p for p in sdp.module.parameters() if p.requires_grad]
        self._owner: dict[torch.Tensor, int] = {p: owner_of.get(p, 0) for p in self._params}  # one no optimizer holds: rank 0's, as for clipping
        self._by_owner = [[p for p in self._params if self._owner[p] == rank] for rank in range(self.world)]
        self._leaves = _FlatLeaves(self._by_owner)

    def params(self) -> list[torch.Tensor]:
        return self._params

    def begin(self) -> None:
        super().begin()
        self._leaves = _FlatLeaves(self._by_owner)

    def micro_batch(self) -> ContextManager[None]:
        return self._sdp.no_sync()

    def collect(self) -> None:
        self._leaves.take()

    def finish(self, micro_batches: int) -> None:
        """One exchange of the leaves' total, laid out owner by owner, onto the owners."""
        sizes = self._leaves.sizes
        summed = start_exchange(self._leaves.total(), sizes, sizes[self.block], self.group).sum()
        _land(self._by_owner[self.block], summed, micro_batches)
        for p in self._params:
            if self._owner[p] != self.block:
                p.grad = None

    def rows_held(self) -> tuple[list[RowsHeld], int, Optional[dist.ProcessGroup]]:
        return _whole_rows(self._params, lambda p: self._owner[p] == self.block), _rows_of(self._params), self.group
