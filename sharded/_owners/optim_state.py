"""Optimizer state in torch's standard format, assembled from and split into shards.

A full optimizer state dict numbers parameters globally (param group by param group, the order a
plain ``torch.optim`` optimizer uses), which does not depend on the world size: a dict
consolidated on 2 ranks loads on 3, and dicts move freely between OSS and plain optimizers.
Each rank's shard is ``{global index: per-parameter state}`` for the parameters it keeps.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Mapping, Sequence

import torch

from .._common.optimizers import hyperparams
from .partition import Partition

__all__ = ["snapshot_shard", "consolidated_state_dict", "states_by_param", "restore_state"]

ParamState = dict[str, Any]


def snapshot_shard(
    states: Mapping[torch.Tensor, ParamState], partition: Partition
) -> dict[int, ParamState]:
    """CPU copies of ``states``, keyed by the global index of each parameter."""
    index_of = {p: i for i, p in enumerate(partition.params)}
    return {
        index_of[p]: {key: _to_cpu_copy(value) for key, value in state.items()}
        for p, state in states.items()
        if state
    }


def consolidated_state_dict(
    states: Mapping[int, ParamState], param_groups: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """A state dict in ``torch.optim.Optimizer.state_dict()`` format."""
    groups, start = [], 0
    for group in param_groups:
        size = len(group["params"])
        groups.append({**hyperparams(group), "params": list(range(start, start + size))})
        start += size
    return {"state": dict(sorted(states.items())), "param_groups": groups}


def states_by_param(
    state_dict: Mapping[str, Any], partition: Partition, rank: int
) -> dict[torch.Tensor, ParamState]:
    """Validate a full state dict against ``partition`` and key its states by parameter.

    Raises ``ValueError`` naming the param group or parameter when the dict does not fit: a
    different number of groups or parameters (including a per-rank shard, which is not a full
    dict), or a per-parameter state tensor whose shape contradicts its parameter's.
    """
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(f"rank {rank}: optimizer state dict has no '{key}' entry")
    saved_sizes = [len(g["params"]) for g in state_dict["param_groups"]]
    if saved_sizes != list(partition.group_sizes):
        raise ValueError(
            f"rank {rank}: optimizer state dict has param groups of sizes {saved_sizes}, this "
            f"optimizer has {list(partition.group_sizes)}. Load a full state dict (from "
            "OSS.state_dict() after consolidate_state_dict(), or a plain torch optimizer) "
            "over the same parameters; a per-rank shard cannot be loaded"
        )
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    param_of = dict(zip(saved_ids, partition.params))
    index_of = {p: i for i, p in enumerate(partition.params)}
    states = {}
    for saved_id, state in state_dict["state"].items():
        if saved_id not in param_of:
            raise ValueError(
                f"rank {rank}: optimizer state dict has state for parameter id {saved_id!r}, "
                "which no param group lists"
            )
        param = param_of[saved_id]
        _check_state_shapes(state, param, index_of[param], rank)
        states[param] = state
    return states


def restore_state(state: Mapping[str, Any], param: torch.Tensor, group: Mapping[str, Any]) -> ParamState:
    """A copy of ``state`` next to ``param``, following torch's loading rules.

    Floating-point state takes the parameter's device and dtype; ``step`` counters stay where
    they were saved unless the group is ``capturable`` or ``fused`` (those keep them on device).
    Tensors are always copied, so stepping never writes into the caller's state dict.
    """
    return {key: _restore_value(key, value, param, group) for key, value in state.items()}


def _restore_value(key: str, value: Any, param: torch.Tensor, group: Mapping[str, Any]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(device=param.device, dtype=torch.float32, copy=True)
        return value.clone()
    if param.is_floating_point() and value.is_floating_point():
        return value.to(device=param.device, dtype=param.dtype, copy=True)
    return value.to(device=param.device, copy=True)


def _check_state_shapes(state: Mapping[str, Any], param: torch.Tensor, index: int, rank: int) -> None:
    """Element-wise state must match its parameter (or broadcast to it, as factored state does)."""
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() != param.dim() or value.dim() == 0:
            continue
        fits = all(v in (p, 1) for v, p in zip(value.shape, param.shape))
        if not fits:
            raise ValueError(
                f"rank {rank}: optimizer state '{key}' for parameter {index} has shape "
                f"{tuple(value.shape)}, but the parameter has shape {tuple(param.shape)}; "
                "the state dict was saved for a different model"
            )


def _to_cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value
