"""Which gathers a unit is made of: a :class:`~._gather.ParamGather` per kind of storage (the
plain parameters' flat buffers, the all-gather extension's, the owner-placed parameters'
broadcasts) and per dtype the parameters compute in.

``MixedPrecisionPolicy(param_dtype_override_fn=...)`` may keep some parameters of a unit in their
own dtype (fp32 norms in a bf16 unit); a flat buffer holds one dtype, so each dtype gets its
own. The gathered values are the same as one mixed buffer's (a gather copies), at the cost of one
more collective per extra dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ._extension import ExtensionGather
from ._flat_buffers import BufferPlacement, UnitStorage
from ._gather import ParamGather
from ._owned import OwnedGather
from ._param import ShardedParam
from ._placement.mesh import MeshInfo
from ._settings import UnitSettings

__all__ = ["gathers_for"]


def gathers_for(params: list[ShardedParam], mesh_info: MeshInfo, settings: UnitSettings) -> list[ParamGather]:
    """The plain parameters' flat buffers, then the all-gather extension's, then the owner-placed
    parameters' broadcasts, each if any, each kind once per dtype its parameters compute in."""
    mp = settings.mp_policy
    gathers: list[ParamGather] = []
    for dtype, group in _by_compute_dtype(params).items():
        plain = [sp for sp in group if not sp.gather_extension and sp.owner is None]
        extended = [sp for sp in group if sp.gather_extension]
        owned = [sp for sp in group if sp.owner is not None]
        decodes = settings.lowbit is not None and settings.lowbit.params is not None
        placement = BufferPlacement(mesh_info.device, settings.offloads, settings.pins_memory, dtype, decodes)
        if plain:
            gathers.append(UnitStorage(plain, mesh_info.shard_world, placement))
        if extended:
            policy = mp if dtype == mp.param_dtype else dataclasses.replace(mp, param_dtype=dtype)
            gathers.append(ExtensionGather(extended, mesh_info.mesh, policy, mesh_info.device))
        if owned:
            gathers.append(OwnedGather(owned, mesh_info.shard_rank, mesh_info.shard_world, placement))
    return sorted(gathers, key=_gather_kind_order)


def _by_compute_dtype(params: list[ShardedParam]) -> dict[Optional[torch.dtype], list[ShardedParam]]:
    groups: dict[Optional[torch.dtype], list[ShardedParam]] = {}
    for sp in params:
        groups.setdefault(sp.compute_dtype, []).append(sp)
    return groups


def _gather_kind_order(gather: ParamGather) -> int:
    """Plain buffers first (the unit's master dtype is theirs), then the extension's, then owned."""
    return 0 if isinstance(gather, UnitStorage) else 1 if isinstance(gather, ExtensionGather) else 2
