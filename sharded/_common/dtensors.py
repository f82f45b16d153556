"""DTensors (layer 3's shards, tensor-parallel pieces) told apart, unwrapped and gathered without
importing DTensor, which is slow to import and cannot be in play before something else imported
it; and the one producer of a model's full state dict built on that.

A full state dict is ``module.state_dict()`` with every DTensor gathered whole. The FSDP1
wrapper's ``state_dict()``, ``sharded.checkpoint.get_state_dict(full=True)`` and Lightning's full
checkpoints all take it from :func:`full_model_state_dict`; for a model of plain tensors (DDP,
layers 1-2) it gathers nothing.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, cast

import torch
from torch import nn

from .errors import process_rank

__all__ = ["full_copy", "full_model_state_dict", "full_tensor_of", "is_dtensor", "local_tensor_of"]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor (slow) when none can exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor_of(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local tensor, which shares its storage and
    in-place version counter, or the tensor itself."""
    return cast(torch.Tensor, tensor.to_local()) if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def full_tensor_of(value: Any) -> Any:
    """``value`` whole: a DTensor gathered from the ranks holding its pieces (collective: every
    rank of its mesh calls it), anything else as it is. A DTensor offloaded to the CPU over an
    accelerator's mesh goes to that accelerator to be gathered, as its collectives need."""
    if not is_dtensor(value):
        return value
    mesh_device = value.device_mesh.device_type
    if value.device.type != mesh_device:
        value = value.to(mesh_device)
    return value.full_tensor()


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
