"""Optimizer state in torch's standard format, assembled from and split into shards.

A full optimizer state dict numbers parameters globally (param group by param group, the order a
plain ``torch.optim`` optimizer uses), which does not depend on the world size: a dict
consolidated on 2 ranks loads on 3, and dicts move freely between OSS and plain optimizers.
Each rank's shard is ``{global index: per-parameter state}`` for the parameters it keeps.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Mapping, Optional, Sequence

import torch

from .._common.errors import on_rank
from .._common.optimizers import hyperparams
from .partition import Partition

__all__ = [
    "Shape",
    "check_state_shapes",
    "consolidated_state_dict",
    "restore_state",
    "shapes_of",
    "snapshot_shard",
    "states_by_param",
]

ParamState = dict[str, Any]
Shape = Optional[tuple[int, ...]]  # a state value's shape; None for a value that is not a tensor


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
    dict), or a per-parameter state tensor whose shape contradicts its parameter's. ``rank`` is
    this rank in the optimizer's process group (the messages add it to the global one).
    """
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(on_rank(f"optimizer state dict has no '{key}' entry", rank))
    saved_sizes = [len(g["params"]) for g in state_dict["param_groups"]]
    if saved_sizes != list(partition.group_sizes):
        raise ValueError(on_rank(
            f"optimizer state dict has param groups of sizes {saved_sizes}, this "
            f"optimizer has {list(partition.group_sizes)}. Load a full state dict (from "
            "OSS.state_dict() after consolidate_state_dict(), or a plain torch optimizer) "
            "over the same parameters; a per-rank shard cannot be loaded",
            rank,
        ))
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    param_of = dict(zip(saved_ids, partition.params))
    states = {}
    for saved_id, state in state_dict["state"].items():
        if saved_id not in param_of:
            raise ValueError(on_rank(
                f"optimizer state dict has state for parameter id {saved_id!r}, which no param group lists", rank
            ))
        param = param_of[saved_id]
        check_state_shapes(shapes_of(state), tuple(param.shape), str(saved_id), "the optimizer state dict", group_rank=rank)
        states[param] = state
    return states


def shapes_of(state: Mapping[str, Any]) -> dict[str, Shape]:
    """The shape of each entry of ``state`` (``None`` for a value that is not a tensor)."""
    return {key: tuple(value.shape) if isinstance(value, torch.Tensor) else None for key, value in state.items()}


def check_state_shapes(
    state: Mapping[str, Shape],
    param_shape: tuple[int, ...],
    param: str,
    source: str,
    error: type[Exception] = ValueError,
    group_rank: Optional[int] = None,
) -> None:
    """Raise ``error`` unless each element-wise entry of one parameter's optimizer state (given
    by its shapes, see :func:`shapes_of`) has the parameter's shape or one that broadcasts to it,
    as factored state does (Adafactor's row and column vectors). Scalars such as ``step`` and
    values that are not tensors are free.

    The message names the parameter (``param``: its FQN, or its number in a torch-format state
    dict), the rank, and ``source``, the state dict the state comes from.
    """
    for key, shape in state.items():
        if shape is None or len(shape) != len(param_shape) or not shape:
            continue
        if not all(s in (p, 1) for s, p in zip(shape, param_shape)):
            raise error(on_rank(
                f"{source}: optimizer state '{key}' of parameter {param} has shape {shape}, but the "
                f"parameter has shape {param_shape}; it was saved for a different model",
                group_rank,
            ))


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


def _to_cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value
