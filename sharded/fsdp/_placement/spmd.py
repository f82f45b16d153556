"""``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)``: parameters that are DTensors on one N-D SPMD
mesh (data-parallel dims and model-parallel ones alike, e.g. ``("dp", "tp")``), sharded on the
data-parallel dim named by torch's ``DataParallelMeshDims``.

Each parameter must be ``Replicate()`` on the data-parallel dims (as torch requires). What gets
cut over the ``shard`` dim is its local tensor; at rest it stays a DTensor on the SPMD mesh with
``Shard(0)`` (``_StridedShard`` when a later dim cuts dim 0 too) on that dim, as torch places it;
it computes as the original DTensor. Gradients keep whatever placement autograd gave them on
the data-parallel dims (a ``Partial`` sum is what the reduce-scatter and the all-reduce across
replicas reduce) and are brought to the parameter's own placements on the others, as torch does.

Several names in a field are flattened into one dim, as torch does (several ``shard`` names must be
consecutive dims; the sharded parameters then live on the mesh with those dims replaced by the
flattened one, as torch places them). Replicate-only (DDP) units raise ``NotImplementedError``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..._common.errors import on_rank
from .dtensor import DTensorLayout, contiguous_stride
from .mesh import MeshInfo, SpmdDims

__all__ = ["resolve_spmd_mesh", "spmd_layout"]


def resolve_spmd_mesh(mesh: Optional[DeviceMesh], dp_mesh_dims: Any) -> MeshInfo:
    """The unit's data-parallel mesh (``mesh[shard]``, or ``(replicate, shard)`` for hybrid
    sharding) with the SPMD mesh's dims recorded, checked as torch checks them."""
    shard_names, replicate_names = _names(dp_mesh_dims)
    if mesh is None or mesh.mesh_dim_names is None:
        raise ValueError(on_rank("fully_shard(dp_mesh_dims=...) needs mesh=, the SPMD DeviceMesh, with mesh_dim_names"))
    names = mesh.mesh_dim_names
    for name in shard_names + replicate_names:
        if name not in names:
            raise ValueError(on_rank(f"fully_shard(dp_mesh_dims=...): mesh dim name '{name}' not found in mesh.mesh_dim_names {names}"))
    shard = tuple(names.index(n) for n in shard_names)
    if not shard or list(shard) != list(range(shard[0], shard[0] + len(shard))):
        raise NotImplementedError(on_rank(
            f"fully_shard(dp_mesh_dims=DataParallelMeshDims(shard={dp_mesh_dims.shard!r}, replicate="
            f"{dp_mesh_dims.replicate!r})): sharded needs one shard dim name, or several consecutive ones "
            "(replicate-only units are not implemented)"
        ))
    dp_mesh = _flattened(mesh, shard_names)
    if replicate_names:
        dp_mesh = DeviceMesh._concatenate([_flattened(mesh, replicate_names), dp_mesh])
    replicate = tuple(names.index(n) for n in replicate_names)
    sharded_mesh, sharded_dims = _sharded_mesh(mesh, shard, replicate, dp_mesh)
    return MeshInfo(dp_mesh, spmd=SpmdDims(mesh, shard, replicate, sharded_mesh, sharded_dims))


def _flattened(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``mesh[names]`` as one dim (a new process group when there are several), as torch does."""
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


def _sharded_mesh(
    mesh: DeviceMesh, shard: tuple[int, ...], replicate: tuple[int, ...], dp_mesh: DeviceMesh
) -> tuple[DeviceMesh, tuple[Optional[int], ...]]:
    """Where sharded parameters live. One shard dim: ``mesh`` itself. Several: ``mesh`` with
    them replaced by the flattened data-parallel mesh (for hybrid sharding the replicas too, as
    its first dim), so a parameter has one placement for its data-parallel shards (torch's
    layout)."""
    if len(shard) == 1:
        return mesh, tuple(range(mesh.ndim))
    names = mesh.mesh_dim_names or ()
    parts: list[DeviceMesh] = []
    dims: list[Optional[int]] = []
    for i in range(mesh.ndim):
        if i == shard[0]:
            parts.append(dp_mesh)
            dims.extend(([None] if replicate else []) + [i])
        elif i not in shard and not (replicate and i in replicate):
            parts.append(mesh[names[i]])
            dims.append(i)
    return DeviceMesh._concatenate(parts), tuple(dims)


def _names(dp_mesh_dims: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    try:
        shard, replicate = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
    except AttributeError:
        raise TypeError(on_rank(
            f"fully_shard(dp_mesh_dims=...) takes a torch.distributed.fsdp.DataParallelMeshDims, got {type(dp_mesh_dims).__name__}"
        )) from None
    if not shard and not replicate:
        raise ValueError(on_rank("fully_shard(dp_mesh_dims=...): at least one of shard or replicate must be set"))
    return shard, replicate


def spmd_layout(param: Any, name: str, dims: SpmdDims) -> DTensorLayout:
    """The layout of parameter ``name``, a DTensor on ``dims.mesh``."""
    if not isinstance(param, DTensor):
        raise ValueError(on_rank(
            "fully_shard(dp_mesh_dims=...): every parameter must be a DTensor on the SPMD mesh (e.g. via "
            f"distribute_module); got a plain tensor for parameter {name}"
        ))
    if param.device_mesh != dims.mesh:
        raise ValueError(on_rank(
            f"fully_shard(dp_mesh_dims=...): parameter {name} is a DTensor on {param.device_mesh}, not on the mesh "
            f"passed to fully_shard ({dims.mesh})"
        ))
    placements = tuple(param.placements)
    dim_names = dims.mesh.mesh_dim_names or ()
    for dim in sorted(dims.data_parallel):
        if not isinstance(placements[dim], Replicate):
            raise ValueError(on_rank(
                f"fully_shard(dp_mesh_dims=...): parameter {name} must be Replicate() on data-parallel dim "
                f"'{dim_names[dim]}' (index {dim}) but is {placements[dim]}"
            ))
    odd = [p for p in placements if not (type(p) is Replicate or type(p) is Shard)]
    if odd:
        raise NotImplementedError(on_rank(
            f"fully_shard(dp_mesh_dims=...): parameter {name} has placement {odd[0]!r}; sharded shards DTensor "
            "parameters placed with Shard(d) or Replicate() only"
        ))
    sharded = list(placements)
    sharded[dims.shard[0]] = _shard_placement(param, placements, dims)
    return DTensorLayout(
        dims.sharded_mesh,
        tuple(Replicate() if d is None else sharded[d] for d in dims.sharded_dims),
        param.shape,
        contiguous_stride(param.shape),
        dims.mesh,
        placements,
        grad_kept_dims=dims.data_parallel,
    )


def _cuts_dim0(placement: Placement) -> bool:
    return isinstance(placement, Shard) and placement.dim == 0


def _shard_placement(param: DTensor, placements: tuple[Placement, ...], dims: SpmdDims) -> Placement:
    """``Shard(0)``, or ``_StridedShard(0)`` when later mesh dims cut dim 0 too (it then cuts
    their pieces, not the whole); a 0-dim parameter stays replicated."""
    if param.dim() == 0:
        return Replicate()
    later = range(dims.shard[-1] + 1, dims.mesh.ndim)
    split = math.prod([dims.mesh.size(j) for j in later if _cuts_dim0(placements[j])])
    return _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
