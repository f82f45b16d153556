"""How one parameter's sharded and unsharded tensors are shown as DTensors.

A parameter that is a DTensor already (tensor parallelism: ``parallelize_module`` on a ``"tp"``
mesh dim) is sharded the same way, but what gets cut is its *local* tensor, the TP shard this
rank computes with: the all-gather over the data-parallel ranks gives that local tensor back,
and the module computes with it as the original DTensor (same mesh, same placements). At rest
the parameter is one DTensor over both meshes, placements ``(data-parallel, *tensor-parallel)``;
where both cut dim 0 the data-parallel one is a ``_StridedShard`` (it cuts each TP shard, not
the whole), the placements torch's ``fully_shard`` gives, so checkpoints and ``full_tensor()``
agree with it. Gradients come back as TP DTensors; they are brought to the parameter's own TP
placements (a ``Partial`` sum is all-reduced over the TP ranks) before their local tensors are
reduce-scattered over the data-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from ..._common.errors import on_rank

__all__ = ["DTensorLayout", "layout_for", "contiguous_stride", "shard_as_dtensor"]


def shard_as_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: torch.Size, stride: tuple[int, ...]
) -> DTensor:
    """``local`` (this rank's piece, where it lies) as a DTensor of global ``shape``, not differentiable.

    ``DTensor.from_local`` copies a local tensor that is not on its mesh's device type onto it: a
    CPU-offloaded shard of a CUDA mesh would become a CUDA copy that no longer views the unit's
    CPU buffer (seen on the first GPU run: the shards and gradients of
    ``CPUOffloadPolicy`` lived on the GPU). torch's FSDP2 builds its shards from a spec for the
    same reason; so does this.
    """
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=local.requires_grad)  # type: ignore[call-arg]


@dataclass(frozen=True)
class DTensorLayout:
    """The sharded form's mesh, placements and global shape; and for a tensor-parallel
    parameter, the mesh and placements it computes with (``compute_mesh``; ``None``: plain)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    compute_mesh: Optional[DeviceMesh] = None
    compute_placements: tuple[Placement, ...] = ()
    grad_kept_dims: frozenset[int] = frozenset()  # mesh dims a gradient keeps its placement on

    def sharded(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's rows) as the sharded DTensor."""
        return shard_as_dtensor(local, self.mesh, self.placements, self.shape, self.stride)

    def unsharded(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (the gathered local tensor) as what the module computes with."""
        if self.compute_mesh is None:
            return full
        with torch.no_grad():
            return DTensor.from_local(
                full, self.compute_mesh, self.compute_placements, run_check=False, shape=self.shape, stride=self.stride
            )

    @property
    def may_sum_grads_over_tp(self) -> bool:
        """Whether a gradient may come as a ``Partial`` sum over a mesh dim that is not data
        parallel (the parameter is ``Replicate()`` there), which :meth:`local_grad` all-reduces."""
        return any(isinstance(p, Replicate) for i, p in enumerate(self.compute_placements) if i not in self.grad_kept_dims)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The unsharded gradient as a plain tensor shaped like the gathered local tensor."""
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(g if i in self.grad_kept_dims else p for i, (g, p) in enumerate(zip(grad.placements, self.compute_placements)))
        if tuple(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        return grad.to_local()


def layout_for(param: torch.Tensor, name: str, dp_mesh: DeviceMesh) -> Optional[DTensorLayout]:
    """The layout of parameter ``name`` sharded on dim 0 over ``dp_mesh``'s last dim, if it is a
    DTensor (``None`` for a plain parameter: :class:`~._param.ShardedParam` knows that one)."""
    if not isinstance(param, DTensor):
        return None
    replicated = param.dim() == 0
    dp = tuple(Replicate() for _ in range(dp_mesh.ndim - 1))
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    _check_tensor_parallel(name, tp_mesh, tp_placements, dp_mesh)
    dim0_shards = math.prod(tp_mesh.size(i) for i, p in enumerate(tp_placements) if isinstance(p, Shard) and p.dim == 0)
    own: Placement = Replicate() if replicated else _StridedShard(0, split_factor=dim0_shards) if dim0_shards > 1 else Shard(0)
    try:
        spmd_mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except RuntimeError as error:
        raise ValueError(on_rank(
            f"fully_shard: parameter {name} is a DTensor on {tp_mesh}, which does not combine with the data-parallel "
            f"mesh {dp_mesh} ({error}); take both as dims of one DeviceMesh (mesh['dp'], mesh['tp'])"
        )) from None
    return DTensorLayout(
        spmd_mesh, dp + (own,) + tp_placements, param.shape, contiguous_stride(param.shape), tp_mesh, tp_placements
    )


def _check_tensor_parallel(name: str, tp_mesh: DeviceMesh, placements: tuple[Placement, ...], dp_mesh: DeviceMesh) -> None:
    if tp_mesh.mesh_dim_names is None or dp_mesh.mesh_dim_names is None:
        raise ValueError(on_rank(
            f"fully_shard: parameter {name} is a DTensor; its mesh and the data-parallel mesh need mesh_dim_names "
            "(slices of one named DeviceMesh, e.g. mesh['dp'] and mesh['tp'])"
        ))
    shared = set(tp_mesh.mesh_dim_names) & set(dp_mesh.mesh_dim_names)
    if shared:
        raise ValueError(on_rank(
            f"fully_shard: parameter {name} is a DTensor on mesh dims {tp_mesh.mesh_dim_names}, which overlap the "
            f"data-parallel mesh dims {dp_mesh.mesh_dim_names}: pass mesh=mesh['dp'] for parameters on mesh['tp'], "
            "or, for parameters on the whole SPMD mesh, mesh=<that mesh> with dp_mesh_dims=DataParallelMeshDims(shard='dp')"
        ))
    if len(placements) > 2:
        raise NotImplementedError(on_rank(
            f"fully_shard: parameter {name} is a DTensor on a {len(placements)}-D mesh; sharded supports "
            "1-D tensor parallelism or 2-D (expert + tensor parallelism), as torch's fully_shard does"
        ))
    odd = [p for p in placements if not (type(p) is Replicate or type(p) is Shard)]
    if odd:
        raise NotImplementedError(on_rank(
            f"fully_shard: parameter {name} is a DTensor with placement {odd[0]!r}; sharded shards DTensor "
            "parameters placed with Shard(d) or Replicate() only"
        ))


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
