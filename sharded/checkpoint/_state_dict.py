"""A model's and its optimizers' state as a checkpoint sees it: sharded, or full on rank 0.

The sharded form is torch's distributed-checkpoint layout, keyed by the FQNs of the unwrapped
model::

    {"model": {fqn: tensor, ...},
     "optim": {"state": {fqn: {"exp_avg": tensor, ...}, ...},
               "param_groups": [{"lr": ..., "params": [fqn, ...]}, ...],
               "classes": ["torch.optim.adamw.AdamW", ...]}}   # one per param group

Every rank lists in ``optim.state`` exactly the parameters whose optimizer state it keeps: with
``OSS`` that is the parameters the rank owns, with a plain optimizer all of them but those placed
whole on another rank (``sharded.fsdp.Owned``). Values are the
live tensors, not copies, so building it costs nothing; DCP writes each replicated tensor once,
and each rank its own shard. An optimizer that has not stepped yet has no state: its trainable
parameters get placeholders of the right shapes instead (``_placeholders``), so that any loader,
torch's ``dcp.load`` included, has something to fill, and :func:`set_state_dict` can tell a
template nothing filled. A parameter with no state (frozen, or never given a gradient) gets ``{}``.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from .._common import comm
from .._common.dtensors import full_copy, full_model_state_dict, held_here, local_tensor_of, whole_on_group
from .._common.errors import on_rank, process_rank
from .._common.optimizers import hyperparams
from .._owners.lowbit_params import MASTER_KEY
from .._owners.optim_state import check_state_shapes, shapes_of
from ..oss import OSS
from ._fit_checks import CheckpointError, check_entries, check_filled, check_param_groups
from ._lowbit import lowbit_entry, set_lowbit_entry
from ._names import Optimizers, as_optimizer_list, inner_optimizer_class, keyed_by_number, optimizer_fqns, param_fqns, unwrap
from ._placeholders import placeholder_states, unfilled_params

__all__ = ["get_state_dict", "set_state_dict"]


def get_state_dict(model: nn.Module, optimizers: Optimizers = (), *, full: bool = False) -> dict[str, Any]:
    """The state of ``model`` and ``optimizers``, to save with :func:`sharded.checkpoint.save`
    (or ``torch.distributed.checkpoint.save``).

    Collective when ``full``. ``model`` may be wrapped in DDP, ``ShardedDataParallel`` or
    ``FullyShardedDataParallel``, or ``fully_shard``-ed; keys are those of the model inside.
    ``optimizers`` may be ``OSS`` or plain torch optimizers (over DTensor parameters under
    ZeRO-3), one or a list over disjoint parameters.

    Sharded (default): every rank returns what it holds and nothing more; ``OSS`` ranks list
    only the optimizer state of the parameters they own, so no rank ever holds the whole
    optimizer state; under ZeRO-3 parameters and their element-wise optimizer state are
    DTensors holding this rank's shard. A wrapper with low-bit error feedback adds its
    residuals under ``"lowbit"`` (see :mod:`._lowbit`); this call is then collective, their
    per-parameter sum over the ranks being an all-reduce. An optimizer that has not stepped gets placeholder
    state (zeros of the shapes it would create) for a loader to fill; :func:`save` leaves
    placeholders out, and :func:`set_state_dict` refuses them if nothing filled them.

    Full: rank 0 gets CPU copies in plain torch format, ``{"model": model.state_dict(),
    "optim": optimizer.state_dict()}`` (a list of optimizer dicts if a list was passed),
    loadable by the unwrapped model and a plain optimizer; other ranks get ``{}``.
    """
    module, listed = unwrap(model), as_optimizer_list(optimizers)
    if full:
        return _rank0_torch_state_dict(module, listed, single=isinstance(optimizers, Optimizer))
    state: dict[str, Any] = {"model": module.state_dict()}
    if listed:
        state["optim"] = _optimizer_entries(listed, param_fqns(module))
    lowbit = lowbit_entry(model)
    if lowbit is not None:
        state["lowbit"] = lowbit
    return state


def set_state_dict(model: nn.Module, optimizers: Optimizers, state: Mapping[str, Any]) -> None:
    """Load a sharded-form ``state`` (as :func:`sharded.checkpoint.load` filled it) into
    ``model`` and ``optimizers``. Not collective.

    Everything is checked before anything is loaded: the model keys and shapes, the param
    groups (by parameter FQN, not position), the optimizer class and the state shapes; an error
    names what does not fit and leaves model and optimizers untouched. Each ``OSS`` keeps the
    state of the parameters it owns. ``state`` may lack ``"model"`` to load optimizers only.
    """
    module, listed = unwrap(model), as_optimizer_list(optimizers)
    source = "the state dict"
    check_filled(unfilled_params(state.get("optim", {}).get("state", {})), source)
    if "model" in state:
        check_entries(shapes_of(module.state_dict()), shapes_of(state["model"]), "model", source)
    loads = _optimizer_loads(listed, state, param_fqns(module), source) if listed else []
    if "model" in state:
        module.load_state_dict(state["model"])
    for optimizer, torch_format in loads:
        optimizer.load_state_dict(torch_format)
    set_lowbit_entry(model, state.get("lowbit"))


def _optimizer_entries(optimizers: list[Optimizer], fqn_of: Mapping[torch.Tensor, str]) -> dict[str, Any]:
    """The ``"optim"`` part of the sharded form for ``optimizers`` (live tensors, no copies)."""
    description = _optimizer_description(optimizers, fqn_of)  # first: it names a stranger parameter
    state = {fqn_of[p]: dict(held) for optimizer in optimizers for p, held in _held_states(optimizer).items()}
    return {"state": state, **description}


def _optimizer_description(optimizers: list[Optimizer], fqn_of: Mapping[torch.Tensor, str]) -> dict[str, Any]:
    """The param groups (hyperparameters and parameter FQNs) and the class of each."""
    groups, classes = [], []
    for optimizer in optimizers:
        for group, fqns in zip(optimizer.param_groups, optimizer_fqns(optimizer, fqn_of)):
            groups.append({**hyperparams(group), "params": fqns})
            classes.append(inner_optimizer_class(optimizer))
    return {"param_groups": groups, "classes": classes}


def _held_states(optimizer: Optimizer) -> dict[torch.Tensor, Mapping[str, Any]]:
    """Parameter -> its optimizer state, for every parameter whose state this rank keeps;
    placeholders when the optimizer that steps them has no state at all yet."""
    if isinstance(optimizer, OSS):
        partition = optimizer.partition
        kept = [partition.params[i] for i in partition.owned_indices(optimizer.rank)]
        stepping = optimizer.optim
    else:  # every parameter this rank holds (an owner-placed one only on its owner)
        kept = [p for group in optimizer.param_groups for p in group["params"] if held_here(p)]
        stepping = optimizer
    table: Mapping[torch.Tensor, Mapping[str, Any]] = stepping.state or placeholder_states(stepping, kept)
    if isinstance(optimizer, OSS) and optimizer.lowbit is not None:  # the owners' exact masters, by parameter
        table = {**table, **{p: {**table.get(p, {}), **held} for p, held in optimizer.held_states().items()}}
    return {p: table.get(p, {}) for p in kept}


def _optimizer_loads(
    optimizers: list[Optimizer], state: Mapping[str, Any], fqn_of: Mapping[torch.Tensor, str], source: str
) -> list[tuple[Optimizer, dict[str, Any]]]:
    """Check ``state["optim"]`` against ``optimizers``; return each one's part in torch format."""
    if "optim" not in state:
        raise CheckpointError(on_rank(f"{source} has no 'optim' entry for the optimizers"))
    saved = state["optim"]
    check_param_groups(saved, _optimizer_description(optimizers, fqn_of), source)
    param_of = {fqn: p for p, fqn in fqn_of.items()}
    for fqn, held in saved["state"].items():
        check_state_shapes(shapes_of(held), tuple(param_of[fqn].shape), fqn, source, CheckpointError)
    held = {fqn: dict(s) for fqn, s in saved["state"].items() if s}
    loads, start = [], 0
    for optimizer in optimizers:
        fqns = optimizer_fqns(optimizer, fqn_of)
        groups = saved["param_groups"][start : start + len(fqns)]
        start += len(fqns)
        loads.append((optimizer, keyed_by_number({"state": held, "param_groups": groups}, fqns)))
    return loads


# ------------------------------------------------------------------------------- full form


def _rank0_torch_state_dict(module: nn.Module, optimizers: list[Optimizer], single: bool) -> dict[str, Any]:
    rank = process_rank()
    model = full_model_state_dict(module, rank0_only=True, cpu_offload=True)
    optims = [_full_optimizer_state(optimizer, rank) for optimizer in optimizers]
    if rank != 0:
        return {}
    for optimizer, torch_format in zip(optimizers, optims):
        _masters_into_model(optimizer, torch_format, model, param_fqns(module))
    full: dict[str, Any] = {"model": model}
    if optimizers:
        full["optim"] = optims[0] if single else optims
    return full


def _full_optimizer_state(optimizer: Optimizer, rank: int) -> Optional[dict[str, Any]]:
    """The torch-format state dict of ``optimizer`` as CPU copies on rank 0 (collective)."""
    if isinstance(optimizer, OSS):
        optimizer.consolidate_state_dict(recipient_rank=0)
        return optimizer.state_dict() if rank == 0 else None
    torch_format = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owned = {index for index, p in enumerate(params) if whole_on_group(p) is not None}
    state = {
        index: {key: full_copy(value, keep=rank == 0) for key, value in held.items()}
        for index, held in torch_format["state"].items()
        if index not in owned
    }
    state.update(_owned_states_on_rank0(params, owned, torch_format["state"]))
    return {"state": dict(sorted(state.items())), "param_groups": copy.deepcopy(torch_format["param_groups"])} if rank == 0 else None


def _masters_into_model(optimizer: Optimizer, torch_format: Optional[dict[str, Any]], model: dict[str, Any],
                        fqn_of: Mapping[torch.Tensor, str]) -> None:
    """The full form is plain torch: an ``OSS(lowbit=)``'s exact masters (in its consolidated state)
    become the model's values, which the replicas every rank computed with are within one rounding of."""
    if not isinstance(optimizer, OSS) or torch_format is None:
        return
    for index, held in torch_format["state"].items():
        master = held.pop(MASTER_KEY, None)
        if master is not None:
            model[fqn_of[optimizer.partition.params[index]]] = master


def _owned_states_on_rank0(params: list[torch.Tensor], owned: set[int], states: Mapping[int, Any]) -> dict[int, Any]:
    """Collective: the optimizer state of owner-placed parameters (``sharded.fsdp.Owned``), which
    only their owners hold, as CPU copies on rank 0 (``{}`` elsewhere). Each parameter's first
    holder sends what it has; no other rank holds it."""
    if not owned:
        return {}
    mine = {
        index: {key: _cpu_copy(value) for key, value in states[index].items()}
        for index in sorted(owned)
        if index in states and _first_holder(params[index]) == process_rank()
    }
    outgoing = {0: mine} if mine and process_rank() != 0 else {}
    received = comm.exchange_objects(outgoing, None)
    if process_rank() != 0:
        return {}
    for part in received.values():
        mine.update(part)
    return mine


def _first_holder(param: torch.Tensor) -> int:
    """The lowest global rank holding an owner-placed parameter whole."""
    return int(param.device_mesh.mesh.min())  # type: ignore[attr-defined]


def _cpu_copy(value: Any) -> Any:
    """What this rank holds of ``value`` (all of an owner-placed one), as a CPU copy."""
    if isinstance(value, torch.Tensor):
        return local_tensor_of(value).detach().to("cpu", copy=True)
    return copy.deepcopy(value)

