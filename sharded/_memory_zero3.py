"""The ZeRO-3 layout for :func:`sharded.estimate_memory`: the units ``FullyShardedDataParallel``
would make (its wrap planner), each parameter's padded shard slot (its shard geometry), and
what a unit holds while it is gathered and while its gradients are reduce-scattered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._memory_estimate import ZERO3_REDUCTIONS_IN_FLIGHT, Layout
from .fsdp._param import ShardGeometry
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
    model: nn.Module, world: int, wrap: Any, mixed_precision: Any, reshard_after_forward: bool, device: torch.device
) -> Layout:
    """The busiest rank's ZeRO-3 layout (rank 0: it holds the most real rows of every parameter)."""
    param_dtype = getattr(mixed_precision, "param_dtype", None)
    units: list[UnitSize] = []
    shapes: list[tuple[torch.Size, torch.dtype]] = []
    for module, params in _units(model, wrap):
        units.append(_unit_size(params, world, param_dtype, is_root=module is model))
        shapes.extend(_rank0_shape(p, world) for p in params if p.requires_grad)
    children = sorted((u.gathered_bytes for u in units if not u.is_root), reverse=True)
    root = sum(u.gathered_bytes for u in units if u.is_root)
    largest_full = max(u.full_bytes for u in units)
    sending = max(u.gathered_bytes for u in units)  # the reduce-scatter's input: every rank's rows
    if reshard_after_forward:
        # the root, the unit computing, the one prefetched, and the prefetched one's all-gather
        # output, alive beside its unsharded buffer while it is copied out
        gathered = root + sum(children[:2]) + (children[0] if children else 0)
    else:
        gathered = root + sum(children)  # SHARD_GRAD_OP: every unit stays gathered until its backward
    # The reduce-scatters' send buffers alive at once (set_reduce_scatter_max_input_buffers).
    communication = gathered + ZERO3_REDUCTIONS_IN_FLIGHT * sending
    if device.type == "cpu" and world > 1:
        # gloo stages each collective through a full-size buffer of its own. Its all-gather
        # (ProcessGroupGloo's AsyncAllgatherWork, which all_gather_into_tensor reaches) gathers
        # into a new flat tensor shaped like the output and then copies it into the caller's:
        # one more gathered unit while a gather is in flight. Its reduce-scatter of the input's
        # chunks (the list form _comm uses on gloo) holds one more copy of the whole input:
        # measured, consistent with it flattening the chunk list into one buffer (that side not
        # read in the source). Measured peaks on the MLP and GPT of
        # tests/test_memory_estimate.py, world 2 and 3, sit these two buffers above the ones
        # above. Applied on CPU only (NCCL gathers and reduces into the caller's buffers).
        communication += sending + (children[0] if children else root)
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
        # gradients so far, the gathered units, the unit's full gradient and the send buffer
        backward_bytes=grads + communication + largest_full,
        held_in_step=0,
        build_bytes=full + shard,
        largest_unit_bytes=largest_full,
        optimizer_shapes=shapes,
        bytes_sent=int(sent),
        collectives=(gathers + len(units)) if world > 1 else 0,
        largest_share=shard / max(1, full),
    )


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
