"""The ZeRO-3 layout for :func:`sharded.estimate_memory`: the units ``FullyShardedDataParallel``
would make (its wrap planner), each parameter's padded shard slot (its shard geometry), and
what a unit holds while it is gathered and while its gradients are reduce-scattered; with
``set_keep_unsharded_storage(True)``, the gathered storage every unit keeps from its first gather
on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .._common.in_flight import MAX_REDUCTIONS_IN_FLIGHT, InFlight
from ..fsdp._gradient_rows import gradient_widths
from ..fsdp._param import ShardGeometry
from ..fsdp.wrap import as_wrap_policy, modules_to_wrap
from .layout import Layout
from .lowbit import LowBitCost, UnitWire, unit_wire
from .trial import ActivationProfile

__all__ = ["zero3_layout"]


@dataclass(frozen=True)
class UnitSize:
    """One unit's bytes on a rank: its shard slots, its parameters gathered, and its gradients'
    reduce-scatter send buffer (in the reduce dtype)."""

    shard_bytes: int
    grad_bytes: int
    gathered_bytes: int
    reduce_bytes: int
    full_bytes: int
    is_root: bool
    aliases_shards: bool = False  # one rank, no dtype change: the gathered parameters view the shards
    wire: UnitWire = UnitWire()  # fully_shard(lowbit=...)'s collectives (exact where it has none)

    def kept_bytes(self, keep_unsharded_storage: bool) -> int:
        """What the unit holds between uses: its gathered storage, if kept (and not the shards')."""
        return self.gathered_bytes if keep_unsharded_storage and not self.aliases_shards else 0

    @property
    def prefetch_bytes(self) -> int:
        """What a gather of the unit in flight holds: its output buffer, or its low-bit messages."""
        return self.gathered_bytes if self.wire.gather_in_flight is None else self.wire.gather_in_flight

    def reducing_bytes(self, world: int, gloo: bool) -> int:
        """What the unit's reduce-scatter holds until it completes: on gloo the other ranks'
        chunks (it copied its input), else its send buffer; or its low-bit messages."""
        if self.wire.reduce_in_flight is not None:
            return self.wire.reduce_in_flight
        return self.reduce_bytes * (world - 1) // world if gloo else self.reduce_bytes


def zero3_layout(
    model: nn.Module, world: int, wrap: Any, mixed_precision: Any, reshard_after_forward: bool, device: torch.device,
    profile: Optional[ActivationProfile], declared_activations: int, keep_unsharded_storage: bool = False,
    lowbit: Optional[LowBitCost] = None,
) -> Layout:
    """The busiest rank's ZeRO-3 layout (rank 0: it holds the most real rows of every parameter).

    The activations alive while each unit computes its gradients come from ``profile`` (the
    trial's bytes between the unit's first and last gradient) or, without one, from
    ``declared_activations`` leaving evenly unit by unit. ``keep_unsharded_storage``: every
    unit holds its gathered parameters' storage all step, the optimizer step included.
    ``lowbit``: ``fully_shard(lowbit=...)``'s costs (:func:`.lowbit.unit_wire`): each unit's
    gathers and reduce-scatter in flight hold their messages, its reduce-scatter's start
    encodes the rows, and error feedback keeps a residual of every row all step."""
    param_dtype = getattr(mixed_precision, "param_dtype", None)
    units: list[UnitSize] = []
    shapes: list[tuple[torch.Size, torch.dtype]] = []
    unit_params = _units(model, wrap)
    for module, params in unit_params:
        reduce_dtype = _reduce_dtype(mixed_precision, params)
        units.append(_unit_size(params, world, param_dtype, reduce_dtype, is_root=module is model, lowbit=lowbit))
        shapes.extend(_rank0_shape(p, world) for p in params if p.requires_grad)
    gloo = device.type == "cpu" and world > 1
    children = [params for module, params in unit_params if module is not model]
    if profile is not None:
        during = _activations_per_unit(list(model.parameters()), list(reversed(children)), profile)
    else:
        n = len(children)
        during = [declared_activations * (n - i) // n for i in range(n)] + [0]
    kept = sum(u.kept_bytes(keep_unsharded_storage) for u in units if not u.is_root)
    backward, communication = _backward_walk(units, world, reshard_after_forward, gloo, during, kept)
    residuals = sum(u.wire.residuals for u in units)
    shard = sum(u.shard_bytes for u in units)
    grads = sum(u.grad_bytes for u in units)
    full = sum(u.full_bytes for u in units)
    ring = (world - 1) / world
    gathers = len(units) + (sum(1 for u in units if not u.is_root) if reshard_after_forward else 0)
    sent = sum(_gather_sent(u, world) for u in units) + sum(_gather_sent(u, world) for u in units if not u.is_root and reshard_after_forward)
    sent += sum(_reduce_sent(u, world) for u in units)
    return Layout(
        parameters=shard,
        gradients=grads,
        communication=communication,
        backward_bytes=backward + residuals,
        held_in_step=sum(u.kept_bytes(keep_unsharded_storage) for u in units) + residuals,
        build_bytes=full + shard,
        largest_unit_bytes=max(u.full_bytes for u in units),
        optimizer_shapes=shapes,
        bytes_sent=int(sent),
        collectives=(gathers + len(units)) if world > 1 else 0,
        largest_share=shard / max(1, full),
    )


def _activations_per_unit(
    all_params: list[nn.Parameter], backward_units: list[list[nn.Parameter]], profile: ActivationProfile
) -> list[int]:
    """The most bytes the trial held while each child unit (in backward order) made its
    gradients, then at the end of backward (the root's reduction): the stretches from the
    previous unit's last gradient to this unit's last.

    The walk counts a unit's full gradients itself, so each stretch is taken less the unit's
    gradients that complete in it or after: those may already be computed and waiting (a
    ``nn.Linear``'s weight gradient exists when its bias's completes)."""
    position = {all_params[i]: k for k, i in enumerate(profile.ready_order)}
    completing = [all_params[i].numel() * all_params[i].element_size() for i in profile.ready_order]
    peaks = profile.stretch_peaks
    during, start = [], 0
    for params in backward_units:
        reached = [position[p] for p in params if p in position]
        end = max(reached) if reached else start - 1
        pending = sum(completing[start : end + 1])
        worst = 0
        for k in range(start, end + 1):
            worst = max(worst, peaks[k] - pending)
            pending -= completing[k]
        during.append(worst if end >= start else peaks[min(start, len(peaks) - 1)])
        start = max(start, end + 1)
    during.append(peaks[-1])
    return during


def _backward_walk(
    units: list[UnitSize], world: int, reshard_after_forward: bool, gloo: bool, activations: list[int], kept: int = 0,
) -> tuple[int, int]:
    """The most bytes of gradients and communication buffers alive at once during backward, and
    the communication part of that moment, walking the units in backward order (children last
    to first, the root's reduction at the end).

    While a unit computes its gradients, a rank holds: the sharded gradients of the units done,
    the root's parameters and gradients (gathered all backward), the unit's gathered parameters
    and its full gradients, the next unit's parameters being prefetched, and what the reductions
    of the units before it still hold (at most ``MAX_REDUCTIONS_IN_FLIGHT`` of them, the
    wrapper's own limit: the oldest is finished before the next unit packs). The unit then frees
    its gathered parameters before it packs its gradients into the send buffer, so packing holds
    no more than computing did. ``activations[i]``: the
    activations alive while the ``i``-th unit of the walk computes; the last, at the root's
    reduction.

    A prefetch in flight holds its output buffer only (on gloo ``comm.all_gather_into_tensor``
    broadcasts into it rather than through a buffer of gloo's own). ``gloo`` (CPU): a
    reduce-scatter copies its input before the call returns (the send buffer is freed then)
    and holds the other ranks' chunks, ``(world - 1) / world`` of it, until it completes. With
    NCCL the send buffer itself stays until the reduction is waited for. ``kept``: the
    gathered storage the child units keep (``set_keep_unsharded_storage``), held all backward
    in place of what each unit's gather and prefetch would hold.

    Low-bit (``UnitSize.wire``): a prefetch and a reduction in flight hold their messages instead;
    the wait for a unit's gather, before it computes, decodes them into a float32 output;
    packing is then a moment of its own, the packed gradients beside the rows' encoding
    (everything the reductions before it and the prefetch hold, the unit's gathered parameters
    freed, its full gradients copied in and let go).
    """
    children = [u for u in units if not u.is_root]
    root = next(u for u in units if u.is_root)
    order = list(reversed(children))

    reducing: InFlight[UnitSize] = InFlight()

    def held_by_reductions() -> int:
        return sum(u.reducing_bytes(world, gloo) for u in reducing)

    held_root = root.gathered_bytes + root.full_bytes
    peak, comm_at_peak, done_grads = (activations[0], 0, 0) if not order else (0, 0, 0)
    for i, unit in enumerate(order):
        if kept:
            gathered = kept
        elif reshard_after_forward:
            gathered = unit.gathered_bytes + (order[i + 1].prefetch_bytes if i + 1 < len(order) else 0)
        else:  # SHARD_GRAD_OP: every unit not yet reached stays gathered
            gathered = sum(u.gathered_bytes for u in order[i:])
        if unit.wire.gather_finish and reshard_after_forward and not kept:  # its low-bit gather decoded and copied out
            decoding = done_grads + held_root + held_by_reductions() + unit.wire.gather_finish + activations[i]
            if decoding > peak:
                peak, comm_at_peak = decoding, held_by_reductions() + unit.wire.gather_finish + root.gathered_bytes
        comm = gathered + held_by_reductions()
        moment = done_grads + held_root + unit.full_bytes + comm + activations[i]
        if moment > peak:
            peak, comm_at_peak = moment, comm + root.gathered_bytes
        reducing.beyond(MAX_REDUCTIONS_IN_FLIGHT - 1)  # finished before this unit's reduction starts
        if unit.wire.encoding:  # low-bit: its gradients packed and encoded, its gathered parameters freed
            comm = gathered - (unit.gathered_bytes if reshard_after_forward and not kept else 0) + held_by_reductions()
            # its backward is done: what activations are left are the next stretch's at its start
            moment = done_grads + held_root + comm + unit.wire.encoding + min(activations[i], activations[i + 1])
            if moment > peak:
                peak, comm_at_peak = moment, comm + unit.wire.encoding + root.gathered_bytes
        done_grads += unit.grad_bytes
        reducing.add(unit)
    # the root's reduction, last: its gathered parameters and its send buffer
    comm = 2 * root.gathered_bytes + held_by_reductions() + kept
    moment = done_grads + root.full_bytes + comm + activations[-1]
    if root.wire.encoding:  # low-bit: the send buffer and its gradients give way to their encoding
        comm = root.gathered_bytes + held_by_reductions() + kept + root.wire.encoding
        moment = max(moment, done_grads + comm + activations[-1])
    if moment > peak:
        peak, comm_at_peak = moment, comm
    return peak, comm_at_peak


def _units(model: nn.Module, wrap: Any) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, its unit's parameters), children first, the root last, as the wrapper builds them."""
    policy = as_wrap_policy(wrap)
    chosen = modules_to_wrap(model, policy) if policy is not None else []
    taken: set[int] = set()
    units = []
    for module in [*chosen, model]:
        params = []
        for p in module.parameters():
            if id(p) not in taken:
                taken.add(id(p))
                params.append(p)
        units.append((module, params))
    return units


def _reduce_dtype(mixed_precision: Any, params: list[nn.Parameter]) -> Optional[torch.dtype]:
    """The dtype a unit of ``params`` reduces its gradients in (``None``: the parameters'):
    ``reduce_dtype`` if set; else, for a ``fully_shard`` policy on a torch whose ``fully_shard``
    follows ``grad_dtype`` (2.15 on), the parameters' gradient dtypes promoted; else (FSDP1's
    ``MixedPrecision``, or an earlier torch) ``param_dtype``."""
    if mixed_precision is None or getattr(mixed_precision, "reduce_dtype", None) is not None:
        return getattr(mixed_precision, "reduce_dtype", None)
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from ..fsdp._grad_dtypes import grad_dtype_of, grads_follow_grad_dtype, promoted
    from ..fsdp.policies import MixedPrecisionPolicy

    fully_shard_policy = isinstance(mixed_precision, (MixedPrecisionPolicy, TorchPolicy))
    if not fully_shard_policy or not grads_follow_grad_dtype() or not params:
        return getattr(mixed_precision, "param_dtype", None)
    return promoted([grad_dtype_of(p) or p.dtype for p in params if p.requires_grad], params[0].dtype)


def _unit_size(params: list[nn.Parameter], world: int, param_dtype: Any, reduce_dtype: Optional[torch.dtype], is_root: bool,
               lowbit: Optional[LowBitCost] = None) -> UnitSize:
    if not params:
        return UnitSize(0, 0, 0, 0, 0, is_root)
    itemsize = params[0].element_size()
    gathered_itemsize = torch.empty((), dtype=param_dtype).element_size() if param_dtype else itemsize
    reduce_itemsize = torch.empty((), dtype=reduce_dtype).element_size() if reduce_dtype else itemsize
    slots = sum(ShardGeometry(p.shape, world).slot_numel for p in params)
    trainable = [p for p in params if p.requires_grad]
    grad_slots = sum(ShardGeometry(p.shape, world).slot_numel for p in trainable) + len(trainable)
    wire = UnitWire()
    if lowbit is not None:
        slots_only: Any = [_Slot(ShardGeometry(p.shape, world)) for p in trainable]  # all gradient_widths reads of a ShardedParam
        widths = gradient_widths(slots_only, lowbit.policy.block_size) if trainable else []
        wire = unit_wire(lowbit, slots, params[0].dtype, world * slots * gathered_itemsize, sum(widths), reduce_dtype or params[0].dtype)
    return UnitSize(
        aliases_shards=world == 1 and param_dtype in (None, params[0].dtype) and wire.gather_message is None,
        wire=wire,
        shard_bytes=slots * itemsize,
        grad_bytes=grad_slots * itemsize if trainable else 0,
        gathered_bytes=world * slots * gathered_itemsize,
        reduce_bytes=world * slots * reduce_itemsize,
        full_bytes=sum(p.numel() for p in params) * gathered_itemsize,
        is_root=is_root,
    )


class _Slot:
    """A parameter as ``gradient_widths`` reads it: its shard geometry."""

    def __init__(self, geometry: ShardGeometry) -> None:
        self.geometry = geometry


def _gather_sent(unit: UnitSize, world: int) -> float:
    """This rank's bytes in one gather of ``unit``: ``W - 1`` copies of its shard, exact or its message."""
    if unit.wire.gather_message is not None:
        return (world - 1) * unit.wire.gather_message
    return (world - 1) / world * unit.gathered_bytes


def _reduce_sent(unit: UnitSize, world: int) -> float:
    """This rank's bytes in ``unit``'s reduce-scatter: ``W - 1`` rows, exact or their messages."""
    if unit.wire.reduce_message is not None:
        return (world - 1) * unit.wire.reduce_message
    return (world - 1) / world * unit.reduce_bytes


def _rank0_shape(p: nn.Parameter, world: int) -> tuple[torch.Size, torch.dtype]:
    """Rank 0's rows of ``p``: what its optimizer state is shaped like."""
    geometry = ShardGeometry(p.shape, world)
    if geometry.replicated:
        return p.shape, p.dtype
    return torch.Size((geometry.rows_held_by(0), *p.shape[1:])), p.dtype
