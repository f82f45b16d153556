"""torch's ``get_optimizer_state_dict`` / ``set_*_state_dict`` with full state dicts over
owner-placed parameters.

Only an owned parameter's owner steps it, so only the owner's optimizer holds its state. torch
gathers a full optimizer state dict by walking each rank's own state in order and gathering every
DTensor in it collectively: with entries missing on the ranks that do not own a parameter, the
ranks would walk different lists, pairing one tensor's gather with another's (wrong numbers or a
hang), and rank 0 would write a file without the state of the matrices it does not own. Loading a
full state dict back would leave every rank a whole copy of each owned parameter's state, which
only its owner uses.

Once a model places a parameter ``Owned()``, torch's private ``_get_optim_state_dict`` and
``_load_optim_state_dict`` (which ``get_optimizer_state_dict``, ``get_state_dict`` and their
``set_*`` call by name, at call time) are routed here. Getting a full state dict over optimizers
with owned parameters: torch's local state dict, then each owned parameter's state is described
by its first holder to every rank that does not hold it (which values are DTensors held whole,
with their shape and dtype; every other value as it is, such as ``step``); those ranks stand in
an empty DTensor on the owner's mesh for each DTensor and take the other values as sent; the
entries are put in the optimizers' parameter order on every rank, and torch gathers them (each
owned DTensor through :mod:`._torch_whole`). Loading: torch's own, then the state of owned
parameters a rank does not hold is dropped, as training leaves it.

Loading with ``broadcast_from_rank0=True`` (Accelerate's ``cpu_ram_efficient_loading``), torch
copies into each DTensor the slice of the broadcast full tensor that its coordinates give; for a
rank outside a DTensor's mesh torch computes no slice at all and copies the whole tensor into the
empty local one, which raises. torch's private ``_distribute_tensors`` is routed too: it leaves a
rank's DTensors held whole by other ranks as they are (there is nothing of them to copy here).
Everything else goes to torch's own functions unchanged.
"""

from __future__ import annotations

import copy
import functools
from types import ModuleType
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._common import comm
from .._common.dtensors import held_here, local_tensor_of, whole_on_group

__all__ = ["route_torch_state_dict_for_owned"]

# What a non-holder stands in for one value of an owned parameter's state: a DTensor held whole
# (its shape and dtype), or the value itself.
_Described = tuple[str, Any]


def route_torch_state_dict_for_owned() -> None:
    """Route torch's state dict functions as the module docstring says (call it once per
    process: :func:`._owned_routes.route_torch_for_owned`)."""
    import torch.distributed._state_dict_utils as torch_state_dict_utils
    import torch.distributed.checkpoint.state_dict as torch_state_dict  # heavy: only once a parameter is owned

    torch_state_dict_utils._distribute_tensors = _distributing(torch_state_dict_utils._distribute_tensors)
    torch_state_dict._get_optim_state_dict = _getting(torch_state_dict._get_optim_state_dict, torch_state_dict)
    torch_state_dict._load_optim_state_dict = _loading(torch_state_dict._load_optim_state_dict)


def _getting(torch_own: Any, torch_state_dict: ModuleType) -> Any:
    @functools.wraps(torch_own)
    def _get_optim_state_dict(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], info: Any) -> Any:
        if not (info.handle_optim and info.full_state_dict) or info.fsdp_modules or not _owned_params(optimizers):
            return torch_own(model, optimizers, info)
        full, cpu_offload, flatten = info.full_state_dict, info.cpu_offload, info.flatten_optimizer_state_dict
        info.full_state_dict = info.cpu_offload = info.flatten_optimizer_state_dict = False
        try:
            local = torch_own(model, optimizers, info)
            _drop_states_held_elsewhere(optimizers)
        finally:
            info.full_state_dict, info.cpu_offload, info.flatten_optimizer_state_dict = full, cpu_offload, flatten
        local["state"] = _with_owned_states(local["state"], list(_params_and_fqns(optimizers, local["param_groups"])))
        if flatten:
            local = torch_state_dict._flatten_optim_state_dict(local)
        return torch_state_dict._maybe_full_or_cpu_state_dict(local, info)

    return _get_optim_state_dict


def _loading(torch_own: Any) -> Any:
    @functools.wraps(torch_own)
    def _load_optim_state_dict(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], state_dict: Any, info: Any) -> None:
        torch_own(model, optimizers, state_dict, info)
        _drop_states_held_elsewhere(optimizers)

    return _load_optim_state_dict


def _drop_states_held_elsewhere(optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """Drop the optimizer state of owned parameters this rank does not hold: what torch's load,
    or its ``_init_optim_state`` (a step at ``lr=0`` by an optimizer with no state yet, such as
    one over only other ranks' owned parameters), left there."""
    for optimizer in optimizers:
        for p in _owned_params((optimizer,)):
            if not held_here(p):
                optimizer.state.pop(p, None)


def _distributing(torch_own: Any) -> Any:
    @functools.wraps(torch_own)
    def _distribute_tensors(local_state_dict: dict[str, Any], keys: list[str], *args: Any, **kwargs: Any) -> None:
        elsewhere = [k for k in keys if isinstance(local_state_dict.get(k), tuple) and _held_elsewhere(local_state_dict[k][0])]
        for key in elsewhere:
            local_state_dict[key] = local_state_dict[key][0]
        torch_own(local_state_dict, [k for k in keys if k not in elsewhere], *args, **kwargs)

    return _distribute_tensors


def _held_elsewhere(value: Any) -> bool:
    return whole_on_group(value) is not None and not held_here(value)


def _owned_params(optimizers: tuple[torch.optim.Optimizer, ...]) -> list[torch.Tensor]:
    return [p for o in optimizers for g in o.param_groups for p in g["params"] if whole_on_group(p) is not None]


def _params_and_fqns(optimizers: tuple[torch.optim.Optimizer, ...], groups: list[Mapping[str, Any]]) -> Iterator[tuple[torch.Tensor, str]]:
    """Each parameter of ``optimizers`` with its name in their state dict (whose param groups,
    ``groups``, list the names in the optimizers' order)."""
    ours = [g for o in optimizers for g in o.param_groups]
    for group, named in zip(ours, groups):
        yield from zip(group["params"], named["params"])


def _with_owned_states(states: Mapping[str, Any], params: list[tuple[torch.Tensor, str]]) -> dict[str, Any]:
    """Collective: ``states`` (one rank's, by name) with every owned parameter's state as its
    holders have it (on other ranks, empty DTensors on its owner mesh stand in for its DTensors),
    in the optimizers' parameter order."""
    owned = [(p, fqn) for p, fqn in params if whole_on_group(p) is not None]
    received = comm.exchange_objects(_descriptions_to_send(states, owned), None)
    from_holders: dict[str, Optional[dict[str, _Described]]] = {}
    for part in received.values():
        from_holders.update(part)
    completed = dict(states)
    for p, fqn in owned:
        if held_here(p):
            continue
        described = from_holders[fqn]
        completed.pop(fqn, None)
        if described is not None:
            completed[fqn] = {key: _stand_in(p, value) for key, value in described.items()}
    return {fqn: completed[fqn] for _, fqn in params if fqn in completed}


def _descriptions_to_send(states: Mapping[str, Any], owned: list[tuple[torch.Tensor, str]]) -> dict[int, dict[str, Any]]:
    """For each rank that does not hold some owned parameter whose first holder is this rank, the
    description of that parameter's state (``None``: it has none)."""
    me, world = comm.group_rank(None), comm.group_size(None)
    outgoing: dict[int, dict[str, Any]] = {}
    for p, fqn in owned:
        holders = set(int(r) for r in p.device_mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]
        if min(holders) != me:
            continue
        described = _described(states[fqn]) if fqn in states else None
        for rank in range(world):
            if rank not in holders:
                outgoing.setdefault(rank, {})[fqn] = described
    return outgoing


def _described(state: Mapping[str, Any]) -> dict[str, _Described]:
    out: dict[str, _Described] = {}
    for key, value in state.items():
        if whole_on_group(value) is not None:
            out[key] = ("held whole", (tuple(value.shape), value.dtype))
        elif isinstance(value, torch.Tensor):
            local = local_tensor_of(value)
            out[key] = ("tensor", (local.detach().to("cpu", copy=True), local.device.type == "cpu"))
        else:
            out[key] = ("value", copy.deepcopy(value))
    return out


def _stand_in(param: torch.Tensor, described: _Described) -> Any:
    """What a rank that does not hold ``param`` keeps for one value of its state."""
    kind, value = described
    local = local_tensor_of(param)
    if kind == "held whole":
        shape, dtype = value
        empty = torch.empty(0, dtype=dtype, device=local.device)
        strides = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(empty, param.device_mesh, param.placements, run_check=False, shape=torch.Size(shape), stride=strides)  # type: ignore[attr-defined]
    if kind == "tensor":
        tensor, on_cpu = value
        return tensor if on_cpu else tensor.to(local.device)
    return value
