"""The one protocol a unit all-gathers its parameters through, whatever holds their shards.

Two kinds of storage implement it: the flat buffers of plain parameters
(:class:`._flat_buffers.UnitStorage`, gathered as they are) and the parameters whose tensor
subclass defines the all-gather extension (:class:`._extension.ExtensionGather`, gathered
through the subclass's hooks). The unit drives each alike, in this order:

1. :meth:`ParamGather.prepare` on the compute stream (the shards may just have been written),
2. :meth:`ParamGather.start` on the all-gather stream, over the :class:`GatherRoute` given,
3. :meth:`ParamGather.finish` on the all-gather stream: wait, and build the unsharded parameters,
4. :meth:`ParamGather.free` at reshard; :meth:`ParamGather.discard` at a reset or the step's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from .._common.lowbit import LowBitWire
from ._param import ShardedParam
from ._placement.secondary_shard import SecondaryShardGroup

__all__ = ["GatherRoute", "ParamGather"]


@dataclass(frozen=True)
class GatherRoute:
    """Over which ranks one all-gather of a unit's parameters runs."""

    group: dist.ProcessGroup  # the shard group
    world: int
    custom: Optional[Any] = None  # set_custom_all_gather's torch.distributed.fsdp.AllGather
    # in backward, after a forward that kept the secondary shard: gather that within its group
    # instead (plain parameters only: the extension's are gathered from their shards every time)
    secondary: Optional[SecondaryShardGroup] = None
    # fully_shard(lowbit=...): the wire that gathers the plain parameters' shards in its ``params``
    # format (a message it cannot take goes exact, counted); ``unit`` names the unit in its reports
    lowbit: Optional[LowBitWire] = None
    unit: str = ""


class ParamGather(Protocol):
    """Some of a unit's parameters, all-gathered together."""

    @property
    def params(self) -> list[ShardedParam]:
        """The parameters this gathers, in the unit's order."""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype their shards are kept in."""

    def shard_from_full(self, fulls: Sequence[torch.Tensor]) -> None:
        """Build the shards from the full parameters (in :attr:`params` order)."""

    def prepare(self, where: str) -> None:
        """Before a gather: bring the shards and the unsharded parameters up to date (``where``
        names the unit in errors)."""

    def start(self, route: GatherRoute) -> None:
        """Start all-gathering (nothing when nothing needs gathering)."""

    def finish(self, keep_secondary: Optional[SecondaryShardGroup]) -> None:
        """Wait for the all-gather and fill the unsharded parameters; ``keep_secondary``: keep
        this rank's secondary shard of what arrived for the next backward."""

    def free(self) -> None:
        """Free the unsharded parameters' memory (their tensors stay, for the next gather)."""

    def discard(self) -> None:
        """Drop what is held beyond the shards: an all-gather in flight (waited for, so that the
        ranks stay in step, and not used) and a kept secondary shard."""

    def full_copies(self, route: GatherRoute, where: str) -> list[torch.Tensor]:
        """Collective: fresh full copies of the parameters, in the shards' dtype."""
