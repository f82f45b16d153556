"""The ZeRO-3 layout for :func:`sharded.estimate_memory`: the units ``FullyShardedDataParallel``
would make (its wrap planner), each parameter's padded shard slot (its shard geometry), and
what a unit holds while it is gathered and while its gradients are reduce-scattered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._memory_estimate import Layout
from .fsdp._param import ShardGeometry
from .fsdp._root import MAX_REDUCTIONS_IN_FLIGHT
from .fsdp.wrap import as_wrap_policy, modules_to_wrap

__all__ = ["zero3_layout"]


@dataclass(frozen=True)
class UnitSize:
    """One unit's bytes on a rank: its shard slots, and its parameters gathered."""

    shard_bytes: int
    grad_bytes: int
    gathered_bytes: int
    full_bytes: int
    is_root: bool


def zero3_layout(
    model: nn.Module, world: int, wrap: Any, mixed_precision: Any, reshard_after_forward: bool, device: torch.device,
    activations: int,
) -> Layout:
    """The busiest rank's ZeRO-3 layout (rank 0: it holds the most real rows of every parameter)."""
    param_dtype = getattr(mixed_precision, "param_dtype", None)
    units: list[UnitSize] = []
    shapes: list[tuple[torch.Size, torch.dtype]] = []
    for module, params in _units(model, wrap):
        units.append(_unit_size(params, world, param_dtype, is_root=module is model))
        shapes.extend(_rank0_shape(p, world) for p in params if p.requires_grad)
    staged = device.type == "cpu" and world > 1
    backward, communication = _backward_walk(units, world, reshard_after_forward, staged, activations)
    shard = sum(u.shard_bytes for u in units)
    grads = sum(u.grad_bytes for u in units)
    full = sum(u.full_bytes for u in units)
    ring = (world - 1) / world
    gathers = len(units) + (sum(1 for u in units if not u.is_root) if reshard_after_forward else 0)
    sent = ring * (sum(u.gathered_bytes for u in units) + sum(u.gathered_bytes for u in units if not u.is_root and reshard_after_forward))
    sent += ring * sum(u.gathered_bytes for u in units)  # reduce-scatter
    return Layout(
        parameters=shard,
        gradients=grads,
        communication=communication,
        backward_bytes=backward,
        held_in_step=0,
        build_bytes=full + shard,
        largest_unit_bytes=max(u.full_bytes for u in units),
        optimizer_shapes=shapes,
        bytes_sent=int(sent),
        collectives=(gathers + len(units)) if world > 1 else 0,
        largest_share=shard / max(1, full),
    )


def _backward_walk(
    units: list[UnitSize], world: int, reshard_after_forward: bool, staged: bool, activations: int
) -> tuple[int, int]:
    """The most bytes of gradients and communication buffers alive at once during backward, and
    the communication part of that moment, walking the units in backward order (children last
    to first, the root's reduction at the end).

    While a unit computes its gradients, a rank holds: the sharded gradients of the units done,
    the root's parameters and gradients (gathered all backward), the unit's gathered parameters
    and its full gradients, the next unit's parameters being prefetched, and what the previous
    unit's reduce-scatter still holds (at most ``MAX_REDUCTIONS_IN_FLIGHT``, the wrapper's own
    limit). The unit then frees its gathered parameters before it packs its gradients into the
    send buffer, so packing holds no more than computing did. The activations (the trial's peak) are all alive
    as backward starts and leave unit by unit: a share ``(n - i) / n`` at the ``i``-th of ``n``.

    ``staged`` (CPU, gloo): an all-gather in flight holds gloo's own output-sized buffer beside
    ours (it gathers into a new flat tensor, then copies out), so a prefetch counts twice; a
    reduce-scatter copies its input before the call returns (the send buffer is freed then)
    and holds the other ranks' chunks, ``(world - 1) / world`` of it, until it completes. With
    NCCL the send buffer itself stays until the reduction is waited for.
    """
    children = [u for u in units if not u.is_root]
    root = next(u for u in units if u.is_root)
    order = list(reversed(children))

    def in_flight(u: UnitSize) -> int:
        return MAX_REDUCTIONS_IN_FLIGHT * (u.gathered_bytes * (world - 1) // world if staged else u.gathered_bytes)

    def prefetching(u: UnitSize) -> int:
        return u.gathered_bytes * (2 if staged else 1)

    held_root = root.gathered_bytes + root.full_bytes
    peak, comm_at_peak, done_grads = (activations, 0, 0) if not order else (0, 0, 0)
    previous: UnitSize | None = None
    for i, unit in enumerate(order):
        if reshard_after_forward:
            gathered = unit.gathered_bytes + (prefetching(order[i + 1]) if i + 1 < len(order) else 0)
        else:  # SHARD_GRAD_OP: every unit not yet reached stays gathered
            gathered = sum(u.gathered_bytes for u in order[i:])
        comm = gathered + (in_flight(previous) if previous else 0)
        moment = done_grads + held_root + unit.full_bytes + comm + activations * (len(order) - i) // len(order)
        if moment > peak:
            peak, comm_at_peak = moment, comm + root.gathered_bytes
        done_grads += unit.grad_bytes
        previous = unit
    # the root's reduction, last: its gathered parameters and its send buffer
    comm = 2 * root.gathered_bytes + (in_flight(previous) if previous else 0)
    moment = done_grads + root.full_bytes + comm
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


def _unit_size(params: list[nn.Parameter], world: int, param_dtype: Any, is_root: bool) -> UnitSize:
    if not params:
        return UnitSize(0, 0, 0, 0, is_root)
    itemsize = params[0].element_size()
    gathered_itemsize = torch.empty((), dtype=param_dtype).element_size() if param_dtype else itemsize
    slots = sum(ShardGeometry(p.shape, world).slot_numel for p in params)
    trainable = [p for p in params if p.requires_grad]
    grad_slots = sum(ShardGeometry(p.shape, world).slot_numel for p in trainable) + len(trainable)
    return UnitSize(
        shard_bytes=slots * itemsize,
        grad_bytes=grad_slots * itemsize if trainable else 0,
        gathered_bytes=world * slots * gathered_itemsize,
        full_bytes=sum(p.numel() for p in params) * gathered_itemsize,
        is_root=is_root,
    )


def _rank0_shape(p: nn.Parameter, world: int) -> tuple[torch.Size, torch.dtype]:
    """Rank 0's rows of ``p``: what its optimizer state is shaped like."""
    geometry = ShardGeometry(p.shape, world)
    if geometry.replicated:
        return p.shape, p.dtype
    return torch.Size((geometry.rows_held_by(0), *p.shape[1:])), p.dtype
