"""Which stage a model trains at, from what wraps it (:mod:`._replicated`, :mod:`._sharded`)."""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._common.errors import on_rank
from ..sharded_ddp import ShardedDataParallel
from ._replicated import OwnersStage, ReplicatedStage
from ._sharded import ShardedStage
from ._stage import Stage

__all__ = ["stage_of"]


def stage_of(model: nn.Module) -> Stage:
    """The stage ``model`` trains at, from what wraps it."""
    if isinstance(model, DistributedDataParallel):
        return ReplicatedStage(model, model.module, model.process_group)
    if isinstance(model, ShardedDataParallel):
        return OwnersStage(model)
    units = _units_under(model)
    if units:
        return ShardedStage(model, units)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise TypeError(on_rank(
            f"MicroBatches: the model is a plain {type(model).__name__} on {dist.get_world_size()} ranks; wrap it in "
            "DistributedDataParallel (with OSS for ZeRO-1), ShardedDataParallel, or shard it with fully_shard first"
        ))
    return ReplicatedStage(None, model, None)


def _units_under(model: nn.Module) -> list[Any]:
    unit_module = sys.modules.get("sharded.fsdp._unit")  # no unit exists unless layer 3 was imported
    return unit_module.units_under(model) if unit_module is not None else []


