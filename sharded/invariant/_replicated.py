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
from .._common.flat import used_anywhere, used_flags
from ..sharded_ddp import ShardedDataParallel
from ._exchange import all_reduce_canonically, exchange_and_sum
from ._norm import RowsHeld, row_count
from ._stage import Stage
from ._tree import TreeAccumulator

__all__ = ["ReplicatedStage", "OwnersStage"]



class _FlatLeaves:
    """Each micro-batch's gradients of ``params`` moved into one flat fp32 leaf (then a "used"
    flag per parameter), summed up the local tree."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.tree = TreeAccumulator()

    def take(self) -> None:
        sizes = [p.numel() for p in self.params]
        leaf = torch.empty(sum(sizes) + len(self.params), dtype=torch.float32, device=_device_of(self.params))
        pieces = leaf.split(sizes + [len(self.params)])
        had = []
        for p, piece in zip(self.params, pieces):
            had.append(p.grad is not None)
            if p.grad is None:
                piece.zero_()
            else:
                piece.copy_(p.grad.reshape(-1))
                p.grad = None
        pieces[-1].copy_(used_flags(had, torch.float32, leaf.device))
        self.tree.add(leaf)

    def total(self) -> torch.Tensor:
        total = self.tree.total()
        if total is None:
            raise RuntimeError(on_rank("MicroBatches: no micro-batch ran"))
        return total


def _land(params: list[torch.Tensor], flat: torch.Tensor, micro_batches: int) -> None:
    """``flat`` (summed gradients back to back, then their flags) divided by ``micro_batches``
    into the ``.grad`` of ``params`` that some rank had a gradient for."""
    n = len(params)
    used = used_anywhere(flat[-n:]) if n else []
    pieces = flat[:-n].split([p.numel() for p in params]) if n else []
    for p, piece, is_used in zip(params, pieces, used):
        p.grad = piece.div(micro_batches).view(p.shape).to(p.dtype) if is_used else None


def _device_of(params: list[torch.Tensor]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


class ReplicatedStage(Stage):
    """DDP or ``OSS`` + DDP (or one plain process): every rank ends with every gradient."""

    def __init__(self, ddp: Optional[DistributedDataParallel], module: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
        self._ddp = ddp
        self._params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
        self.group = group
        self.world = comm.group_size(group) if group is not None else 1
        self.block = comm.group_rank(group) if group is not None else 0
        self._leaves = _FlatLeaves(self._params)

    def params(self) -> list[torch.Tensor]:
        return self._params

    def begin(self) -> None:
        super().begin()
        self._leaves = _FlatLeaves(self._params)

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
        self._sdp = sdp
        if sdp.process_group is None:
            raise RuntimeError(on_rank("MicroBatches: torch.distributed is not initialised"))
        self.group = sdp.process_group
        self._owner_group: dist.ProcessGroup = sdp.process_group
        self.world = sdp.world_size
        self.block = sdp.rank
        if sdp.reduce_fp16:
            raise NotImplementedError(on_rank("MicroBatches: ShardedDataParallel(reduce_fp16=True); the canonical sum is taken in fp32"))
        owner_of: dict[Any, int] = {}
        for optimizer in sdp.sharded_optimizers:
            owner_of.update(optimizer.param_to_rank)
        self._params: list[torch.Tensor] = [p for p in sdp.module.parameters() if p.requires_grad]
        self._owner: dict[torch.Tensor, int] = {p: owner_of.get(p, 0) for p in self._params}  # one no optimizer holds: rank 0's, as for clipping
        self._by_owner = [[p for p in self._params if self._owner[p] == rank] for rank in range(self.world)]
        self._leaves = _FlatLeaves([p for owned in self._by_owner for p in owned])

    def params(self) -> list[torch.Tensor]:
        return self._params

    def begin(self) -> None:
        super().begin()
        self._leaves = _FlatLeaves(self._leaves.params)

    def micro_batch(self) -> ContextManager[None]:
        return self._sdp.no_sync()

    def collect(self) -> None:
        self._leaves.take()

    def finish(self, micro_batches: int) -> None:
        total = self._leaves.total()
        values, flags = total[: -len(self._params)], total[-len(self._params):] if self._params else total[:0]
        value_pieces = values.split([sum(p.numel() for p in owned) for owned in self._by_owner])
        flag_pieces = flags.split([len(owned) for owned in self._by_owner])
        pieces = [torch.cat([v, f]) for v, f in zip(value_pieces, flag_pieces)]
        mine = self._by_owner[self.block]
        summed = exchange_and_sum(pieces, pieces[self.block].numel(), self._owner_group)
        _land(mine, summed, micro_batches)
        for p in self._params:
            if self._owner[p] != self.block:
                p.grad = None

    def rows_held(self) -> tuple[list[RowsHeld], int, Optional[dist.ProcessGroup]]:
        return _whole_rows(self._params, lambda p: self._owner[p] == self.block), _rows_of(self._params), self.group


