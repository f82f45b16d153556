"""DTensor's ``full_tensor()`` and ``redistribute(..., [Replicate()])`` over owner-placed
parameters: the whole tensor on every rank that asks.

An owner-placed parameter (``sharded.fsdp.Owned``), its gradient and its optimizer state are
DTensors on the owner's mesh, and DTensor gives a rank outside a tensor's mesh an empty tensor
for any op: torch's ``p.full_tensor()`` would hand every other rank a ``(0,)`` tensor, and so
would ``get_model_state_dict(full_state_dict=True)``, which takes each DTensor's
``redistribute(value.device_mesh, [Replicate()] * ndim).to_local()``. Accelerate, the HF Trainer
and torchtitan save a final model that way: the file would lack the weight, silently.

Once a model places a parameter ``Owned()``, ``DTensor.redistribute`` (which ``full_tensor``
calls) is routed here. For a DTensor held whole on its mesh, asking for ``Replicate()`` on every
dim of that mesh (or of no mesh: the default), or for any placements on the *shared mesh* (the
mesh of every rank that shares the tensor: the unit's mesh), is a collective over those ranks:
the holder broadcasts the tensor, and the answer is a DTensor on the shared mesh, replicated (then
laid out as asked by torch's own ``redistribute``), so ``to_local()`` is the whole tensor on every
rank. As for element-sharded DTensors, every rank of the unit's group calls it together. Anything
else (another mesh, ``Shard`` on the owner mesh) and every other DTensor go to torch's own, which
also runs while Dynamo traces.

It is differentiable as torch's is: the gradient of the whole tensor is made ``Replicate()`` on the
shared mesh by torch's own ``redistribute`` (a ``Partial`` one summed) and the holders keep it,
as torch's ``Replicate() -> Shard()`` keeps each rank's piece. ``forward_dtype`` and
``backward_dtype`` act as in torch; ``async_op=True`` gets the tensor already broadcast.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from .._common.dtensors import held_here, on_mesh_device, shared_mesh_of, whole_from_holder, whole_on_group

__all__ = ["route_torch_whole_for_owned"]

def route_torch_whole_for_owned() -> None:
    """Route ``DTensor.redistribute`` as the module docstring says (call it once per process:
    :func:`._owned_routes.route_torch_for_owned`)."""
    DTensor.redistribute = _routing(DTensor.redistribute)  # type: ignore[method-assign]


def _routing(torch_own: Any) -> Any:
    @functools.wraps(torch_own)
    def redistribute(
        self: DTensor,
        device_mesh: Optional[DeviceMesh] = None,
        placements: Optional[Sequence[Placement]] = None,
        *,
        async_op: bool = False,
        forward_dtype: Optional[torch.dtype] = None,
        backward_dtype: Optional[torch.dtype] = None,
    ) -> DTensor:
        options = {"async_op": async_op, "forward_dtype": forward_dtype, "backward_dtype": backward_dtype}
        shared_mesh = shared_mesh_of(self)
        if shared_mesh is None or torch.compiler.is_compiling() or not _asks_whole(self, shared_mesh, device_mesh, placements):
            return torch_own(self, device_mesh, placements, **options)
        whole = _replicated_on_shared_mesh(self, shared_mesh, forward_dtype, backward_dtype)
        if placements is not None and all(p.is_replicate() for p in placements):
            return whole
        return torch_own(whole, shared_mesh, placements, **options)

    return redistribute


def _asks_whole(value: DTensor, shared_mesh: DeviceMesh, mesh: Optional[DeviceMesh], placements: Optional[Sequence[Placement]]) -> bool:
    """Whether a ``redistribute`` of ``value`` (held whole on its mesh) asks for it whole: all
    ``Replicate()`` on its own mesh, or anything on the mesh that shares it."""
    if placements is None:
        return False  # torch's own refuses it, naming what is missing
    if mesh is None or mesh == value.device_mesh:
        return len(placements) == value.device_mesh.ndim and all(p.is_replicate() for p in placements)
    return mesh == shared_mesh and len(placements) == shared_mesh.ndim


def _replicated_on_shared_mesh(
    value: DTensor, shared_mesh: DeviceMesh, forward_dtype: Optional[torch.dtype], backward_dtype: Optional[torch.dtype]
) -> DTensor:
    value = cast(DTensor, on_mesh_device(value))
    if forward_dtype is not None:
        value = cast(DTensor, value.to(forward_dtype))
    return cast(DTensor, _WholeFromHolder.apply(value, shared_mesh, backward_dtype))


class _WholeFromHolder(torch.autograd.Function):
    """A DTensor held whole on its mesh, broadcast from its holder: a DTensor replicated on the
    shared mesh. Backward: the gradient made replicated on the shared mesh, kept by the holders."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, shared_mesh: DeviceMesh, backward_dtype: Optional[torch.dtype]) -> DTensor:  # type: ignore[override]
        ctx.spec = (value.device_mesh, value.placements, value.shape, value.stride(), value.dtype)
        ctx.shared_mesh, ctx.backward_dtype, ctx.held = shared_mesh, backward_dtype, held_here(value)
        whole = whole_from_holder(value, whole_on_group(value))
        replicated = [Replicate()] * shared_mesh.ndim
        return DTensor.from_local(whole, shared_mesh, replicated, run_check=False, shape=value.shape, stride=whole.stride())

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[Optional[DTensor], None, None]:  # type: ignore[override]
        if grad is None:
            return None, None, None
        mesh, placements, shape, stride, dtype = ctx.spec
        if ctx.backward_dtype is not None:
            grad = cast(DTensor, grad.to(ctx.backward_dtype))
        local = grad.redistribute(ctx.shared_mesh, [Replicate()] * ctx.shared_mesh.ndim).to_local().to(dtype)
        if not ctx.held:
            local = local.new_empty(0)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride), None, None
