"""Layer 3 (``fully_shard``, the FSDP wrapper): each unit's gradients go through the canonical
exchange as the unit's backward ends, in place of the reduce-scatter, and land once, after the
last micro-batch.

The ranks compute the micro-batches of one time step side by side (rank ``b`` index
``t * W + b``), so what arrives for a unit is the subtree over those ``W`` leaves, this rank's rows
of it (and the whole of the owned parameters it owns); each unit adds that to a local tree over
time steps, holding shard-sized partial sums only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .._common import comm
from .._common.errors import on_rank
from .._common.flat import pack_with_used_flags, used_anywhere
from ._exchange import PendingExchange, start_exchange, sum_across_replicas
from ._norm import RowsHeld, row_count
from .._common.dtensors import local_tensor_of
from ._stage import Stage
from ._tree import TreeAccumulator

__all__ = ["ShardedStage"]


class ShardedStage(Stage):
    """``fully_shard`` units (or the FSDP wrapper's): each unit's gradients go through the
    canonical exchange as its backward ends, and land once, after the last micro-batch."""

    def __init__(self, model: nn.Module, units: list[Any]) -> None:
        self._model = model
        self._units = units
        info = units[0].mesh_info
        for unit in units:
            _check_unit(unit, info)
        self.group = info.shard_group
        self.replicas = info.replicate_group
        rows = comm.group_size(self.replicas) if self.replicas is not None else 1
        self.world = info.shard_world * rows
        self.block = (comm.group_rank(self.replicas) if self.replicas is not None else 0) * info.shard_world + info.shard_rank
        self._sums = {unit: _UnitSum(unit, self.group, self.replicas) for unit in units}

    def indices(self, micro_batches: int, block: int) -> list[int]:
        """Interleaved: at time step ``t`` the ranks compute the ``W`` consecutive micro-batches
        ``t * W ... t * W + W - 1``, one subtree, which each unit's exchange then adds."""
        return [t * self.world + block for t in range(micro_batches // self.world)]

    def params(self) -> list[torch.Tensor]:
        return [p for p in self._model.parameters() if p.requires_grad]

    def begin(self) -> None:
        super().begin()
        for unit_sum in self._sums.values():
            unit_sum.reset()

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[None]:
        previous = {unit: unit.settings.reduction_override for unit in self._units}
        for unit in self._units:
            unit.settings.reduction_override = self._sums[unit].reduce
        try:
            yield
        finally:
            for unit, override in previous.items():
                unit.settings.reduction_override = override

    def collect(self) -> None:
        kept = [sp.fqn for unit in self._units for sp in unit.params if sp.unsynced_grad is not None]
        if kept:
            raise RuntimeError(on_rank(
                f"MicroBatches: parameter {kept[0]} kept its gradient locally (no_sync() or "
                "set_requires_gradient_sync(False) inside the loop); the loop sums every micro-batch itself: "
                "leave gradient sync on inside it"
            ))
        for unit_sum in self._sums.values():
            unit_sum.end_micro_batch()

    def finish(self, micro_batches: int) -> None:
        for unit_sum in self._sums.values():
            unit_sum.land(micro_batches)

    def rows_held(self) -> tuple[list[RowsHeld], int, Optional[dist.ProcessGroup]]:
        located = {id(sp.sharded): sp for unit in self._units for sp in unit.params}
        rows, offset = [], 0
        for p in self.params():
            sp = located.get(id(p))
            if p.grad is not None and sp is not None:
                held = _rows_this_rank_answers_for(sp, offset)
                if held is not None:
                    rows.append((held, local_tensor_of(p.grad)))
            offset += row_count(p.shape)
        return rows, offset, self.group

    def mean_group_order(self) -> list[dist.ProcessGroup]:
        return [group for group in (self.group, self.replicas) if group is not None]


def _rows_this_rank_answers_for(sp: Any, offset: int) -> Optional[int]:
    """Where the rows of ``sp`` this rank holds start among all rows, or ``None`` if another rank
    answers for them: an owned parameter's owner; a 0-dim one, which every rank holds whole, the
    shard group's rank 0; an element-sharded one's rows, each rank its own."""
    if sp.owner is not None:
        return offset if sp.held_here else None
    if sp.geometry.replicated:
        return offset if sp.shard_rank == 0 else None
    return offset + sp.shard_rank * sp.geometry.rows_per_shard


def _check_unit(unit: Any, info: Any) -> None:
    """What the canonical exchange replaces must not also be asked for another way."""
    settings, where = unit.settings, f"MicroBatches: fully_shard({unit.module_name})"
    if unit.mesh_info.mesh != info.mesh:
        raise NotImplementedError(on_rank(f"{where} shards over another mesh than the model's first unit"))
    reduce_dtype = settings.mp_policy.reduce_dtype
    refused = [what for what, asked in (
        (f"MixedPrecisionPolicy(reduce_dtype={reduce_dtype}): the canonical sum is taken in fp32", reduce_dtype not in (None, torch.float32)),
        ("set_gradient_divide_factor / set_force_sum_reduction_for_comms: the mean is the sum divided by the micro-batch count",
         settings.gradient_divide_factor is not None or settings.force_sum_reduction),
        ("set_custom_reduce_scatter", settings.custom_reduce_scatter is not None),
        ("set_all_reduce_hook", settings.all_reduce_hook is not None),
        ("Shard(dim) other than 0: the norm's rows are dim 0", any(sp.geometry.dim != 0 for sp in unit.params if sp.owner is None)),
        ("tensor-parallel (DTensor) parameters", any(sp.layout is not None for sp in unit.params)),
        (f"lowbit={settings.lowbit!r}: the invariant promise is bits, and low-bit communication rounds",
         settings.lowbit is not None),
    ) if asked]
    if refused:
        raise NotImplementedError(on_rank(f"{where}: {refused[0]}"))


class _UnitSum:
    """One unit's canonical sum over the step's micro-batches: each micro-batch's gradients are
    exchanged as its backward ends (this rank's rows of the element-sharded ones, the whole of
    the owned ones it owns), and added to a tree over time steps."""

    def __init__(self, unit: Any, group: dist.ProcessGroup, replicas: Optional[dist.ProcessGroup]) -> None:
        self.unit = unit
        self.group = group
        self.replicas = replicas
        self.tree = TreeAccumulator()
        self._in_flight: Optional[_InFlight] = None  # this micro-batch's exchange
        self._this_micro_batch: Optional[torch.Tensor] = None
        self._layout: Optional[tuple[Any, list[Any], list[Any]]] = None

    def reset(self) -> None:
        self.tree = TreeAccumulator()
        self._in_flight = None
        self._this_micro_batch = None

    def reduce(self, params: list[Any], grads: list[Optional[torch.Tensor]]) -> Any:
        """The unit's reduction, replaced: exchange now, land after the last micro-batch."""
        from ..fsdp._reduction import UnitReduction  # layer 3 is imported: its units exist

        if self._in_flight is not None:
            raise NotImplementedError(on_rank(
                f"MicroBatches: fully_shard({self.unit.module_name}) reduced its gradients twice in one micro-batch (some "
                "arrived after it had sent them); the canonical sum needs one reduction per unit and micro-batch"
            ))
        pending, self._layout = self._start_exchange(params, grads)
        grads.clear()
        self._in_flight = _InFlight(pending, self)
        return UnitReduction([self._in_flight])

    def received(self, summed: torch.Tensor) -> None:
        """This micro-batch's exchange has arrived and been summed over the shard group."""
        if self.replicas is not None:
            summed = sum_across_replicas(summed, self.replicas)
        self._this_micro_batch = summed

    def _start_exchange(self, params: list[Any], grads: list[Optional[torch.Tensor]]) -> tuple[PendingExchange, Any]:
        from ..fsdp._gradient_rows import pack_gradients

        info = self.unit.mesh_info
        world, me = info.shard_world, info.shard_rank
        cut = [(sp, g) for sp, g in zip(params, grads) if sp.owner is None]
        owned = [(sp, g) for sp, g in zip(params, grads) if sp.owner is not None]
        device = info.device
        sent, layout, row = torch.zeros(0, device=device), None, 0
        if cut:  # rank-major, as for the reduce-scatter: row d is what rank d keeps
            sent, layout = pack_gradients([sp for sp, _ in cut], [g for _, g in cut], world,
                                          lambda n: torch.empty(n, dtype=torch.float32, device=device))
            row = sent.numel() // world
        owned_by = [[(sp, g) for sp, g in owned if sp.owner == rank] for rank in range(world)]
        if owned:  # each destination's row, then its owned parameters' gradients and flags
            sent, splits = _with_owned_gradients(sent, row, owned_by, device)
            pending = start_exchange(sent, splits, splits[me], self.group)
        else:
            pending = start_exchange(sent, [row] * world, row, self.group)
        return pending, (layout, [sp for sp, _ in owned_by[me]], row)

    def end_micro_batch(self) -> None:
        """Commit this micro-batch's exchanged sum as the next leaf of the tree over time (an
        exchange the root left in flight, ``set_is_last_backward(False)``, is finished first)."""
        if self._in_flight is not None:
            self._in_flight.finish()
            self._in_flight = None
        if self._this_micro_batch is not None:
            self.tree.add(self._this_micro_batch)
            self._this_micro_batch = None

    def land(self, micro_batches: int) -> None:
        total = self.tree.total()
        if total is None or self._layout is None:
            return
        total.div_(micro_batches)
        layout, mine, cut_numel = self._layout
        every = self.unit.settings.reduce_scatter_unused_params
        if layout is not None:
            for sp, local in layout.unpack(total[:cut_numel], every=every):
                sp.add_to_sharded_grad(local)
        owned = total[cut_numel:]
        if mine:
            n = len(mine)
            used = [True] * n if every else used_anywhere(owned[-n:])
            for sp, piece, is_used in zip(mine, owned[:-n].split([sp.geometry.numel for sp in mine]), used):
                if is_used:
                    sp.add_to_sharded_grad(piece.view(sp.geometry.shape))


class _InFlight:
    """A unit's exchange in flight, driven by its root like a reduce-scatter: finished when the
    root's bound on reductions in flight or the end of backward says so."""

    hybrid = False  # the sum across replica rows follows the exchange in finish()

    def __init__(self, pending: PendingExchange, unit_sum: _UnitSum) -> None:
        self._pending = pending
        self._unit_sum = unit_sum
        self._done = False

    def advance(self) -> None:
        """Nothing to start early: the exchange is one collective."""

    def finish(self) -> None:
        """Sum what arrived into the unit's leaf for this micro-batch (once; the root and the
        end of the micro-batch may both ask)."""
        if not self._done:
            self._done = True
            self._unit_sum.received(self._pending.sum())

    def abandon(self) -> None:
        self._pending.wait()


def _with_owned_gradients(
    rows: torch.Tensor, row: int, owned_by: list[list[tuple[Any, Optional[torch.Tensor]]]], device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """The exchange's send buffer and its splits: for each destination rank ``d``, row ``d`` of
    the element-sharded gradients (``rows``, rank-major), then the full gradients (fp32; zeros
    where none) of the parameters ``d`` owns, then a "used" flag each."""
    numels = [[sp.geometry.numel for sp, _ in owned] for owned in owned_by]
    splits = [row + sum(n) + len(n) for n in numels]
    sent = torch.empty(sum(splits), dtype=torch.float32, device=device)
    for d, (piece, owned) in enumerate(zip(sent.split(splits), owned_by)):
        piece[:row].copy_(rows[d * row : (d + 1) * row])
        pack_with_used_flags(piece[row:], [g for _, g in owned], numels[d])
    return sent, splits
