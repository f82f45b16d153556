"""Layer 3 (ZeRO-3): full parameter sharding.

``fully_shard`` shards a module in place, FSDP2's way; ``FullyShardedDataParallel`` is the
FSDP1/fairscale-shaped wrapper built on it; ``sharded.fsdp.wrap`` holds the auto-wrap policies.
Names are imported on first use: the mechanism needs DTensor, which is slow to import, and
``import sharded`` should stay fast.

Modules, FSDP2's split of API / state / param / group / collectives:

- ``api.py`` (``fully_shard``, thin: checks and wiring), ``_arguments`` (its arguments in torch's
  spellings), ``_collect`` (which parameters a new unit takes), ``_registry`` (what was taken);
  ``fully_sharded_data_parallel.py`` (the FSDP1 wrapper) with ``_fsdp1_options`` (its three argument
  dialects as one options object); ``policies.py``, ``wrap.py``; ``_torch_route`` (torch's
  ``fully_shard`` routed to ours).
- ``_param`` (one parameter's sharded and unsharded forms), ``_flat_buffers`` (a unit's flat storage
  and its gradients' packing) and ``_extension`` (the all-gather extension point), both implementing
  ``_gather``'s one gather protocol; ``_collectives`` (bytes only), ``_reduce_ops`` and ``_reduction``
  (how a reduction divides; one in flight and its set-up), ``_streams``.
- ``_settings`` (a unit's settings), ``_unit`` (a unit's lifecycle), ``_hooks`` (autograd plumbing,
  the backward tracker), ``_state`` (drives a unit from its module's hooks and reaches the root),
  ``_root`` (model-wide duties: order, prefetch, end of backward), ``_finalization`` (manual
  backward finalization's mode and handle), ``_fsdp_module`` (``FSDPModule``'s
  methods), ``_full_params``, ``_grad_norm`` (and ``_torch_clip``: torch's ``clip_grad_norm_``
  routed to it for owner-placed parameters).
- ``_placement/``: the mesh a unit shards over and the DTensor layout of its shards; ``owned``
  (``Owned``: a parameter kept whole on one rank), whose storage, broadcasts and reduces onto the
  owner are ``_owned``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "fully_shard": ".api",
    "FSDPModule": ".api",
    "UnshardHandle": ".api",
    "GradientReductionHandle": "._finalization",
    "register_fsdp_forward_method": ".api",
    "MixedPrecisionPolicy": ".policies",
    "OffloadPolicy": ".policies",
    "CPUOffloadPolicy": ".policies",
    "BackwardPrefetch": ".policies",
    "Owned": "._placement.owned",
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
