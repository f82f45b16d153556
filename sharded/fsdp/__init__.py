"""Layer 3 (ZeRO-3): full parameter sharding.

``fully_shard`` shards a module in place, FSDP2's way; ``FullyShardedDataParallel`` is the
FSDP1/fairscale-shaped wrapper built on it; ``sharded.fsdp.wrap`` holds the auto-wrap policies.
Names are imported on first use: the mechanism needs DTensor, which is slow to import, and
``import sharded`` should stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "fully_shard": ".api",
    "FSDPModule": ".api",
    "UnshardHandle": ".api",
    "register_fsdp_forward_method": ".api",
    "MixedPrecisionPolicy": ".policies",
    "OffloadPolicy": ".policies",
    "CPUOffloadPolicy": ".policies",
    "BackwardPrefetch": ".policies",
    "FullyShardedDataParallel": ".fully_sharded_data_parallel",
    "ShardingStrategy": ".fully_sharded_data_parallel",
    "CPUOffload": ".fully_sharded_data_parallel",
    "MixedPrecision": ".fully_sharded_data_parallel",
    "clip_grad_norm_": "._grad_norm",
    "summon_full_params": "._full_params",
    "use_for_torch_fsdp": "._torch_route",
    "TorchFSDPRoute": "._torch_route",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"sharded has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
