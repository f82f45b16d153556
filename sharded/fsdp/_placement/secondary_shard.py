"""``reshard_after_forward=k`` with ``1 < k < shard world``: ZeRO++'s secondary shard.

After forward a unit keeps its *secondary shard*, ``1/k`` of its gathered parameters, instead of
nothing, so backward all-gathers within a small group of ``k`` ranks (e.g. the GPUs of one node)
rather than over the whole shard group. The shard group's ranks are cut into secondary shard
groups of ``k`` consecutive ranks, as torch cuts its mesh (``mesh.view(-1, k)``); the rank at
position ``p`` of its group keeps rows ``p*m .. (p+1)*m`` of the rank-major all-gather output
(``m = world / k``), which are exactly the pieces an all-gather over its group puts back in order.

The module shows its ordinary sharded parameters between forward and backward (torch shows a
DTensor on the ``(world/k, k)`` mesh there); the secondary shard is internal and is used by the
next backward only (a gather outside backward drops it and gathers from the shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..._common import comm
from ..._common.errors import on_rank
from .mesh import MeshInfo

__all__ = ["SecondaryShardGroup", "secondary_shard_world", "secondary_shard_group"]

# this rank's group, per world (its default group: a world created after destroy_process_group,
# or each thread's world under a threaded process group, needs groups of its own), then per rows
_GROUPS: dict[tuple[dist.ProcessGroup, tuple[tuple[int, ...], ...]], dist.ProcessGroup] = {}


def secondary_shard_world(reshard_after_forward: object) -> Optional[int]:
    """The world of the secondary shard ``reshard_after_forward`` asks for, if it asks for one:
    an ``int`` that is not a ``bool``. (``fully_shard`` first reads the shard world as ``True``
    and 1 as ``False``, as torch does.)"""
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    return None


@dataclass(frozen=True)
class SecondaryShardGroup:
    """This rank's group of ``world`` ranks, which gathers the secondary shards in backward, and
    its position in it."""

    group: dist.ProcessGroup
    world: int
    position: int

    def cut(self, gathered: torch.Tensor, shard_world: int) -> torch.Tensor:
        """This rank's secondary shard (a copy) of a rank-major all-gather output over
        ``shard_world`` ranks."""
        per_rank = gathered.numel() // shard_world
        count = shard_world // self.world
        return gathered[self.position * count * per_rank : (self.position + 1) * count * per_rank].clone()


def secondary_shard_group(info: MeshInfo, world: int) -> SecondaryShardGroup:
    """Collective over the whole world (it may create process groups): this rank's secondary
    shard group of ``world`` ranks."""
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
    return SecondaryShardGroup(_GROUPS[key], world, row.index(me))
