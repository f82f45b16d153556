"""How each stage's gradients reach the canonical sum, and where the result lands.

One class per stage, each behind the same small surface that :class:`~.micro_batches.MicroBatches`
drives: which micro-batches this rank computes, the context one micro-batch runs in, what to do
after its backward, and at the end where the mean lands and which gradient rows this rank holds
(for the norm).

- :class:`ReplicatedStage` (DDP, ``OSS`` + DDP): every micro-batch runs under ``no_sync``; after
  each backward the rank moves its gradients into a flat fp32 leaf of its local tree; after the
  last one, one canonical all-reduce; every rank gets every gradient, as from DDP.
- :class:`OwnersStage` (``ShardedDataParallel``): the same, the leaf laid out owner by owner; one
  exchange gives each owner the ranks' sums of its parameters, and only owners keep a gradient.
- :class:`ShardedStage` (``fully_shard``, the FSDP wrapper): a unit's gradients leave as its
  backward ends, as usual, but through a canonical exchange in place of the reduce-scatter: the
  ranks compute the micro-batches of one time step side by side (rank ``b`` index
  ``t * W + b``), so what arrives is the subtree over those ``W`` leaves, this rank's rows of it;
  each unit adds it to a local tree over time steps and lands the mean once, after the last.

Both layouts reach the same tree: ranks that take consecutive blocks of micro-batches (layers
0-2) and ranks that take interleaved ones (layer 3) each add aligned subtrees.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._common import comm
from .._common.errors import on_rank
from .._common.flat import used_anywhere, used_flags
from ..sharded_ddp import ShardedDataParallel
from ._exchange import PendingExchange, all_reduce_canonically, exchange_and_sum, start_exchange, start_exchange_of, sum_across_replicas
from ._norm import RowsHeld, row_count
from ._tree import TreeAccumulator

__all__ = ["Stage", "stage_of"]


class Stage:
    """What :class:`~.micro_batches.MicroBatches` asks of a stage."""

    group: Optional[dist.ProcessGroup]  # the ranks whose blocks the tree combines
    world: int  # data-parallel ranks (every replica row's, for hybrid sharding)
    block: int  # this rank's block: its position among them

    def indices(self, micro_batches: int) -> list[int]:
        """The micro-batches this rank computes, in the order it must compute them."""
        per_rank = micro_batches // self.world
        return [self.block * per_rank + t for t in range(per_rank)]

    def micro_batch(self) -> ContextManager[None]:
        """The context one micro-batch's forward and backward run in."""
        raise NotImplementedError

    def begin(self) -> None:
        """A step's micro-batches start: every gradient must be empty."""
        check_no_gradients(self.params())

    def collect(self) -> None:
        """One micro-batch's backward has run."""
        raise NotImplementedError

    def finish(self, micro_batches: int) -> None:
        """The last micro-batch's backward has run: land the mean of the canonical sum."""
        raise NotImplementedError

    def params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def rows_held(self) -> tuple[list[RowsHeld], int, Optional[dist.ProcessGroup]]:
        """The gradient rows this rank holds (offset among all rows, gradient), the number of
        rows in all, and the group whose ranks hold the others (``None``: this rank holds all)."""
        raise NotImplementedError

    def mean_group_order(self) -> list[dist.ProcessGroup]:
        """Groups to gather per-micro-batch values over, innermost first (blocks in order)."""
        return [self.group] if self.group is not None else []


def stage_of(model: nn.Module) -> Stage:
    """The stage ``model`` trains at, from what wraps it."""
    if isinstance(model, DistributedDataParallel):
        return ReplicatedStage(model, model.module, model.process_group)
    if isinstance(model, ShardedDataParallel):
        return OwnersStage(model)
    units = _units_under(model)
    if units:
        return ShardedStage(model, units)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise TypeError(on_rank(
            f"MicroBatches: the model is a plain {type(model).__name__} on {dist.get_world_size()} ranks; wrap it in "
            "DistributedDataParallel (with OSS for ZeRO-1), ShardedDataParallel, or shard it with fully_shard first"
        ))
    return ReplicatedStage(None, model, None)


def check_no_gradients(params: list[torch.Tensor]) -> None:
    """A step's canonical sum starts from nothing: ``zero_grad()`` must have run."""
    held = [_local(g) for g in (p.grad for p in params) if g is not None]
    # ``!= 0`` and not ``abs().amax() > 0``: a NaN left by a step the scaler skipped counts as held
    if held and bool(torch.stack([(g != 0).any() for g in held]).any()):
        raise RuntimeError(on_rank(
            "MicroBatches: parameters hold gradients as the micro-batch loop starts; call optimizer.zero_grad() "
            "before it (the loop sums the micro-batches' gradients in its own order and lands their mean)"
        ))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


def _units_under(model: nn.Module) -> list[Any]:
    unit_module = sys.modules.get("sharded.fsdp._unit")  # no unit exists unless layer 3 was imported
    return unit_module.units_under(model) if unit_module is not None else []


# ------------------------------------------------------------------------ layers 0-2


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


# -------------------------------------------------------------------------- layer 3


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

    def indices(self, micro_batches: int) -> list[int]:
        """Interleaved: at time step ``t`` the ranks compute the ``W`` consecutive micro-batches
        ``t * W ... t * W + W - 1``, one subtree, which each unit's exchange then adds."""
        return [t * self.world + self.block for t in range(micro_batches // self.world)]

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
                    rows.append((held, _local(p.grad)))
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
    if unit.mesh_info.mesh is not info.mesh and unit.mesh_info.mesh != info.mesh:
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
        from ..fsdp._flat_buffers import pack_gradients

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
        if owned:  # each destination's row, then its owned parameters' gradients
            pieces = [torch.cat([sent[d * row : (d + 1) * row], _owned_piece(owned_by[d], device)]) for d in range(world)]
            pending = start_exchange(pieces, pieces[me].numel(), self.group)
        else:
            pending = start_exchange_of(sent, [row] * world, row, self.group)
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


def _owned_piece(pairs: list[tuple[Any, Optional[torch.Tensor]]], device: torch.device) -> torch.Tensor:
    """One owner's owned parameters' full gradients (zeros where none), then a flag each."""
    if not pairs:
        return torch.zeros(0, dtype=torch.float32, device=device)
    values = [g.reshape(-1).float() if g is not None else torch.zeros(sp.geometry.numel, device=device) for sp, g in pairs]
    flags = torch.tensor([float(g is not None) for _, g in pairs], device=device)
    return torch.cat(values + [flags])
