"""The owner placement: a parameter kept whole on one rank of its shard group, not cut.

``fully_shard(shard_placement_fn=...)`` may answer :class:`Owned` for a parameter. Such a
parameter stays whole on one *owner* rank at rest; before its unit computes, the owner broadcasts
it to the others; after backward its gradient is reduced to the owner alone, and only the owner
holds its optimizer state and steps it. An optimizer that needs whole matrices (Muon's
Newton–Schulz, Shampoo, SOAP) then steps exactly the matrix DDP's would, with no collective
inside ``optimizer.step()``; an element-wise one steps it as well.

At rest the parameter is a DTensor on the *owner mesh*: a 1-D mesh over the rank(s) holding it
whole, ``Replicate()`` on it (one rank for a 1-D shard mesh; on a hybrid ``(replicate, shard)``
mesh, the owner in each replica row). Every rank sees its global shape; on the owner its local
tensor is the whole value, elsewhere it is empty, and DTensor runs any op on it (an optimizer
step included) as a no-op on the ranks outside the mesh; asked for whole (``full_tensor()``, a
full state dict), it comes whole on every rank (``.._torch_whole``, ``.._torch_state_dict``).
``torch.distributed.checkpoint``
writes it once, from the owner, as one chunk covering the whole tensor, so it loads into any
other layout (element-sharded, another owner, DDP) and back.

Owners are chosen per shard group: an explicit ``Owned(rank)`` takes that rank, ``Owned()`` goes
to the least-loaded rank, largest step cost first (``sharded.newton_schulz_cost`` unless the
placement gives ``cost``). The loads carry over every ``fully_shard`` call over the same ranks,
so units of one matrix each still spread over the ranks; every rank makes the same calls in the
same order and so reaches the same owners without communication (the root checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..._common.dtensors import register_whole_on
from ..._common.errors import on_rank
from ..._common.step_cost import checked_cost, newton_schulz_cost, place_greedily
from .mesh import MeshInfo

__all__ = ["Owned", "OwnerRequest", "choose_owners", "owner_meshes", "prepare_dtensor_rng"]


@dataclass(frozen=True)
class Owned:
    """``shard_placement_fn``'s answer for a parameter to keep whole on one rank.

    Args:
        rank: the owner, as a rank of the shard group (the mesh's shard dim); ``None``: the
            balancer chooses the least-loaded rank.
        cost: what stepping this parameter costs, relative to the others the balancer places
            (``None``: :func:`sharded.newton_schulz_cost` of its shape, Muon's ``m*n*min(m,n)``).
    """

    rank: Optional[int] = None
    cost: Optional[float] = None


@dataclass(frozen=True)
class OwnerRequest:
    """One parameter asking for an owner: its name (for errors), shape and placement."""

    fqn: str
    shape: torch.Size
    placement: Owned

    @property
    def cost(self) -> object:
        """What it asks to be weighed by (checked by :func:`choose_owners`)."""
        return self.placement.cost if self.placement.cost is not None else newton_schulz_cost(self.shape)


# The step cost placed so far on each rank of a shard group, by the group's global ranks: the
# balance carries over units (and models) sharded over the same ranks.
_loads: dict[tuple[int, ...], list[float]] = {}
# The owner meshes of each shard mesh, by its device type and global ranks (made once: making a
# DeviceMesh creates process groups, collectively).
_meshes: dict[tuple[str, tuple[tuple[int, ...], ...]], tuple[DeviceMesh, ...]] = {}


def choose_owners(requests: Sequence[OwnerRequest], info: MeshInfo) -> list[int]:
    """The owner (a shard-group rank) of each request: explicit ranks first, then the rest
    largest cost first onto the least-loaded rank (ties: the lowest rank)."""
    world = info.shard_world
    costs = [_checked_request(r, world) for r in requests]
    loads = _loads.setdefault(_group_key(info), [0.0] * world)
    owners = [r.placement.rank for r in requests]
    for cost, owner in zip(costs, owners):
        if owner is not None:
            loads[owner] += cost
    balanced = [i for i, owner in enumerate(owners) if owner is None]
    for i, rank in zip(balanced, place_greedily([costs[i] for i in balanced], loads)):
        owners[i] = rank
    return [int(owner) for owner in owners if owner is not None]


def owner_meshes(info: MeshInfo) -> tuple[DeviceMesh, ...]:
    """For each rank ``k`` of the shard group, the 1-D mesh of the ranks that hold what ``k``
    owns whole: ``k`` itself, or on a hybrid mesh the rank at ``k`` in every replica row.
    Collective the first time for a mesh: every rank makes every owner mesh, in order."""
    ranks = info.mesh.mesh.reshape(-1, info.shard_world)  # rows of the shard dim (one unless hybrid)
    key = (info.mesh.device_type, tuple(tuple(row) for row in ranks.tolist()))
    if key not in _meshes:
        meshes = tuple(DeviceMesh(info.mesh.device_type, ranks[:, k].tolist(), mesh_dim_names=("owner",)) for k in range(info.shard_world))
        for mesh in meshes:
            register_whole_on(mesh, info.shard_group, info.mesh)
        _meshes[key] = meshes
    return _meshes[key]


def prepare_dtensor_rng(info: MeshInfo) -> None:
    """Start DTensor's random-number tracker now, on every rank, if it would start at all.

    On an accelerator mesh, DTensor starts its tracker at the first random op on a DTensor
    (``reset_parameters`` after meta-device init) with a broadcast from rank 0 over the whole
    world. Run first on an owned parameter, that op would reach only its owner's rank, which
    would wait in that broadcast alone; so the tracker is started here, where every rank is.
    Only for a mesh over the whole world (else the ranks outside it are not here); a no-op on
    the CPU, where DTensor keeps no tracker."""
    from torch.distributed.tensor import _random

    on_accelerator = info.mesh.device_type != "cpu"  # asked first: the check below warns on the CPU
    if on_accelerator and _random._rng_tracker is None and _random.is_rng_supported_mesh(info.mesh) and info.mesh.size() == dist.get_world_size():
        _random._rng_tracker = _random.OffsetBasedRNGTracker(info.mesh)


def _group_key(info: MeshInfo) -> tuple[int, ...]:
    return tuple(int(r) for r in info.mesh.mesh.flatten().tolist())


def _checked_request(request: OwnerRequest, world: int) -> float:
    """The request's cost, once its owner (if given) is a rank of the shard group and its cost
    (if given) a finite number >= 0."""
    placement = request.placement
    what = f"fully_shard(shard_placement_fn=...) returned {placement!r} for parameter {request.fqn}"
    if placement.rank is not None and not (isinstance(placement.rank, int) and 0 <= placement.rank < world):
        raise ValueError(on_rank(f"{what}: the owner must be a rank of the shard group, 0..{world - 1}"))
    return checked_cost(request.cost, f"{what}: its cost")
