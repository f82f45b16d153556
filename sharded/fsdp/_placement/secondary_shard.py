"""``reshard_after_forward=k`` with ``1 < k < shard world``: ZeRO++'s secondary shard (hpZ).

After forward a unit keeps ``1/k`` of its gathered parameters instead of nothing, so backward
all-gathers within a small group of ``k`` ranks (e.g. the GPUs of one node) rather than over the
whole shard group. The shard group's ranks are cut into groups of ``k`` consecutive ranks, as
torch cuts its mesh (``mesh.view(-1, k)``); the rank at position ``p`` of its group keeps rows
``p*m .. (p+1)*m`` of the rank-major all-gather output (``m = world / k``), which are exactly the
pieces an all-gather over its group puts back in order.

The module shows its ordinary sharded parameters between forward and backward (torch shows a
DTensor on the ``(world/k, k)`` mesh there); the kept piece is internal and is used by the next
backward only (a gather outside backward drops it and gathers from the shards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..._common import comm
from ..._common.errors import on_rank
from .mesh import MeshInfo

__all__ = ["SecondaryShard", "secondary_shard_for"]

# this rank's group, per world (its default group: a world created after destroy_process_group,
# or each thread's world under a threaded process group, needs groups of its own), then per rows
_GROUPS: dict[tuple[dist.ProcessGroup, tuple[tuple[int, ...], ...]], dist.ProcessGroup] = {}


@dataclass(frozen=True)
class SecondaryShard:
    """This rank's group of ``world`` ranks for the backward all-gather, and its position in it."""

    group: dist.ProcessGroup
    world: int
    position: int

    def rows(self, gathered: torch.Tensor, shard_world: int) -> torch.Tensor:
        """A copy of this rank's piece of a rank-major all-gather output over ``shard_world``."""
        per_rank = gathered.numel() // shard_world
        count = shard_world // self.world
        return gathered[self.position * count * per_rank : (self.position + 1) * count * per_rank].clone()


def secondary_shard_for(info: MeshInfo, world: int) -> SecondaryShard:
    """Collective over the whole world (it may create process groups): the group of ``world``
    ranks this rank keeps its piece in."""
    rows = tuple(tuple(row) for row in info.mesh.mesh.reshape(-1, world).tolist())
    if any(list(row) != sorted(row) for row in rows):
        raise NotImplementedError(on_rank(
            f"fully_shard(reshard_after_forward={world}): the mesh's ranks are not in increasing order along its "
            "shard dim, which sharded's secondary shard groups need"
        ))
    key = (dist.distributed_c10d._get_default_group(), rows)
    if key not in _GROUPS:
        _GROUPS[key] = comm.new_group_of_this_rank(rows)
    me = dist.get_rank()
    row = next(row for row in rows if me in row)
    return SecondaryShard(_GROUPS[key], world, row.index(me))
