"""DTensors (layer 3's shards, tensor-parallel pieces) told apart, unwrapped and gathered without
importing DTensor, which is slow to import and cannot be in play before something else imported
it; and the one producer of a model's full state dict built on that.

A DTensor normally has a piece on every rank of its mesh. One on a mesh of fewer ranks that hold
it whole (layer 3's owner placement, ``sharded.fsdp.Owned``) is gathered differently: its holders
registered their mesh here (:func:`register_whole_on`) with the group of ranks that share the
tensor and the mesh of all those ranks, and the holder in that group broadcasts it to the others
(:func:`whole_from_holder`).

A full state dict is ``module.state_dict()`` with every DTensor gathered whole. The FSDP1
wrapper's ``state_dict()``, ``sharded.checkpoint.get_state_dict(full=True)`` and Lightning's full
checkpoints all take it from :func:`full_model_state_dict`; for a model of plain tensors (DDP,
layers 1-2) it gathers nothing.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .errors import process_rank

__all__ = [
    "full_copy", "full_model_state_dict", "full_tensor_of", "held_here", "is_dtensor", "local_tensor_of", "on_mesh_device",
    "register_whole_on",
    "shared_mesh_of", "whole_from_holder", "whole_on_group",
]


@dataclass(frozen=True)
class _Sharing:
    """Who shares the DTensors held whole on one mesh: the group the holder broadcasts over, and
    the mesh of every rank that shares them."""

    holders: Any  # the DeviceMesh the DTensors live on
    group: comm.ProcessGroup
    shared_mesh: Any


# id(mesh) -> how the DTensors held whole on it are shared
_whole_on: dict[int, _Sharing] = {}


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor (slow) when none can exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor_of(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local tensor, which shares its storage and
    in-place version counter, or the tensor itself."""
    return cast(torch.Tensor, tensor.to_local()) if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def register_whole_on(mesh: Any, group: comm.ProcessGroup, shared_mesh: Any) -> None:
    """DTensors on ``mesh`` are held whole by its ranks, and shared by the ranks of ``group``
    (which holds one of them): :func:`full_tensor_of` broadcasts them over ``group``.
    ``shared_mesh`` is the mesh of every rank that shares them (the unit's mesh; on a hybrid one,
    each replica row's ``group`` has its own holder)."""
    _whole_on[id(mesh)] = _Sharing(mesh, group, shared_mesh)


def _sharing(value: Any) -> Optional[_Sharing]:
    if not is_dtensor(value):
        return None
    entry = _whole_on.get(id(value.device_mesh))
    return entry if entry is not None and entry.holders is value.device_mesh else None


def whole_on_group(value: Any) -> Optional[comm.ProcessGroup]:
    """For a DTensor held whole by the ranks of its mesh (:func:`register_whole_on`), the group
    that shares it; ``None`` for anything else."""
    entry = _sharing(value)
    return entry.group if entry is not None else None


def shared_mesh_of(value: Any) -> Optional[Any]:
    """For a DTensor held whole by the ranks of its mesh, the mesh of every rank that shares it;
    ``None`` for anything else."""
    entry = _sharing(value)
    return entry.shared_mesh if entry is not None else None


def held_here(value: Any) -> bool:
    """Whether this rank holds (a piece of) ``value``: false only for a DTensor on a mesh this
    rank is not part of, such as an owner-placed parameter on another rank."""
    return not is_dtensor(value) or value.device_mesh.get_coordinate() is not None


def full_tensor_of(value: Any) -> Any:
    """``value`` whole: a DTensor gathered from the ranks holding its pieces (collective: every
    rank of its mesh calls it; for one held whole by some ranks, every rank of the group that
    shares it), anything else as it is. A DTensor offloaded to the CPU over an accelerator's mesh
    goes to that accelerator to be gathered, as its collectives need."""
    if not is_dtensor(value):
        return value
    value = on_mesh_device(value)
    group = whole_on_group(value)
    if group is not None:
        return whole_from_holder(value, group)
    return value.full_tensor()


def on_mesh_device(value: Any) -> Any:
    """A DTensor on its mesh's device type (a copy there if it was offloaded to the CPU), as its
    collectives need."""
    mesh_device = value.device_mesh.device_type
    return value if value.device.type == mesh_device else value.to(mesh_device)


def whole_from_holder(value: Any, group: comm.ProcessGroup) -> torch.Tensor:
    """Collective over ``group``: a fresh copy of ``value`` (held whole by the ranks of its mesh)
    on every rank of ``group``, from the holder in ``group``."""
    holders = set(int(r) for r in value.device_mesh.mesh.flatten().tolist())
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    source = next(i for i, r in enumerate(members) if r in holders)
    local = value.to_local()
    whole = local.detach().clone() if held_here(value) else torch.empty(value.shape, dtype=value.dtype, device=local.device)
    comm.broadcast(whole, source, group, async_op=False)
    return whole


def full_copy(value: Any, keep: bool) -> Any:
    """A CPU copy of ``value`` whole (a deep copy of what is not a tensor) where ``keep``, else
    ``None``; a DTensor is gathered on every rank either way (collective)."""
    value = full_tensor_of(value)
    if not keep:
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def full_model_state_dict(module: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, Any]:
    """Collective: ``module.state_dict()`` with every DTensor gathered whole, under the same keys.

    Args:
        rank0_only: only the global rank 0 gets the result; the others take part in the gathers
            and get ``{}``.
        cpu_offload: every value is a CPU copy (see :func:`full_copy`), which training may go on
            beside; otherwise gathered tensors stay on their device and plain ones are the
            module's own (as ``state_dict()`` gives them).
    """
    keep = not rank0_only or process_rank() == 0
    full: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        whole = full_copy(value, keep) if cpu_offload else full_tensor_of(value)
        if keep:
            full[key] = whole
    return full if keep else {}
