"""Which ranks a unit shards over (and, for hybrid sharding, replicates over), as a DeviceMesh.

A 1-D mesh shards over all its ranks. A 2-D mesh ``(replicate, shard)`` shards within each row
(a "node") and keeps the rows identical: gradients are reduce-scattered within a row, then
averaged across rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..._common import comm
from ..._common.errors import on_rank

__all__ = ["MeshInfo", "SpmdDims", "resolve_mesh", "hybrid_mesh", "mesh_from_groups"]


@dataclass(frozen=True)
class SpmdDims:
    """Where the data-parallel dims are in the SPMD mesh the parameters live on."""

    mesh: DeviceMesh
    shard: tuple[int, ...]  # the dims parameters are sharded over (consecutive; flattened if several)
    replicate: tuple[int, ...]  # the dims gradients are all-reduced over (hybrid), if any
    sharded_mesh: DeviceMesh  # where sharded parameters live: ``mesh``, or with the shard dims flattened
    sharded_dims: tuple[Optional[int], ...]  # per dim of it, the dim of ``mesh`` whose placement it takes
                                              # (None: Replicate(), the flattened replicas)

    @property
    def data_parallel(self) -> frozenset[int]:
        return frozenset((*self.shard, *self.replicate))


@dataclass(frozen=True)
class MeshInfo:
    """A unit's mesh and the groups, ranks and device derived from it."""

    mesh: DeviceMesh
    spmd: Optional[SpmdDims] = None  # fully_shard(dp_mesh_dims=...): the SPMD mesh around ``mesh``

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.mesh.ndim - 1)

    @property
    def replicate_group(self) -> Optional[dist.ProcessGroup]:
        """The group gradients are averaged over after the reduce-scatter (hybrid only)."""
        return self.mesh.get_group(0) if self.mesh.ndim == 2 and self.mesh.size(0) > 1 else None

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.mesh.ndim - 1)

    @property
    def shard_world(self) -> int:
        return self.mesh.size(self.mesh.ndim - 1)

    @property
    def device(self) -> torch.device:
        """The compute device: the current CUDA device for a CUDA mesh, else the mesh's type."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)


def resolve_mesh(process_group: Optional[dist.ProcessGroup], mesh: Optional[DeviceMesh]) -> MeshInfo:
    """The mesh a ``fully_shard`` call asked for: ``mesh``, or a 1-D mesh over
    ``process_group`` (default: the whole world) on torch's default device type (:func:`_device_type`)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(on_rank("fully_shard needs torch.distributed initialised: call dist.init_process_group first"))
    if process_group is not None and mesh is not None:
        raise ValueError(on_rank("pass process_group or mesh to fully_shard, not both"))
    if mesh is None:
        group = _group_or_world(process_group)
        mesh = DeviceMesh.from_group(group, _device_type(group))
    if mesh.ndim not in (1, 2):
        raise ValueError(on_rank(f"fully_shard takes a 1-D mesh (shard) or a 2-D mesh (replicate, shard), got {mesh.ndim}-D"))
    return MeshInfo(mesh)


def hybrid_mesh(shard_size: int, group: Optional[dist.ProcessGroup] = None) -> DeviceMesh:
    """A 2-D ``(replicate, shard)`` mesh over ``group`` (default: the world) whose rows are
    ``shard_size`` consecutive ranks, e.g. the ranks of one node. Collective: every rank calls it."""
    group = _group_or_world(group)
    world = dist.get_world_size(group)
    if shard_size < 1 or world % shard_size:
        raise ValueError(on_rank(f"hybrid sharding needs the world size ({world}) to be a multiple of the shard size ({shard_size})"))
    ranks = torch.tensor(dist.get_process_group_ranks(group)).view(world // shard_size, shard_size)
    return DeviceMesh(_device_type(group), ranks, mesh_dim_names=("replicate", "shard"))


def mesh_from_groups(shard_group: dist.ProcessGroup, replicate_group: dist.ProcessGroup) -> DeviceMesh:
    """The 2-D ``(replicate, shard)`` mesh that FSDP1's ``process_group=(shard, replicate)``
    pair describes. Collective over the world: every rank tells the others its shard group."""
    mine = torch.tensor(dist.get_process_group_ranks(shard_group), device=comm.comm_device(None))
    rows = comm.all_gather(mine, None)
    unique = list({tuple(row.tolist()): None for row in rows})
    column = dist.get_process_group_ranks(replicate_group)
    index = dist.get_rank(shard_group)
    strays = [row for row in unique if row[index] not in column]
    if strays or len(unique) != len(column):
        raise ValueError(on_rank("process_group=(shard_group, replicate_group): the groups do not form a grid of ranks"))
    unique.sort(key=lambda row: column.index(row[index]))
    return DeviceMesh.from_group(
        [replicate_group, shard_group], _device_type(shard_group), mesh=torch.tensor(unique), mesh_dim_names=("replicate", "shard")
    )


def _group_or_world(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    chosen = group or dist.group.WORLD
    if chosen is None:
        raise RuntimeError(on_rank("torch.distributed is not initialised: call dist.init_process_group first"))
    return chosen


def _device_type(group: dist.ProcessGroup) -> str:
    """The device type of the meshes built here, torch's ``fully_shard`` default: the accelerator
    when one is available, whatever the backend (gloo carries CUDA tensors too), else the CPU.
    NCCL always means CUDA."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return "cuda"
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator.type if accelerator is not None else "cpu"
