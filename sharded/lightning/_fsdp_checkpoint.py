"""Checkpoints of a fully sharded model and its optimizers, in the two layouts Lightning's FSDP
strategy offers, through ``torch.distributed.checkpoint``.

* ``"full"``: one file, written by rank 0, holding full tensors: the model's ``state_dict`` and
  each optimizer's state in torch's own format (keyed by parameter index), so the file loads
  into an unsharded model and a plain optimizer (``strategy="ddp"``) as well as into a sharded
  one at any world size.
* ``"sharded"``: a folder; each rank writes its own shards with ``torch.distributed.checkpoint``,
  which also reads them back at another world size (it reshards on load). Everything else in
  the Lightning checkpoint (loop progress, schedulers, callbacks) goes into one metadata file.

The sharded parameters are DTensors, so torch's state-dict API (``get_model_state_dict`` and
friends) gathers and scatters them; what is ours is the layout above and the conversion of
optimizer state between torch's index-keyed format and the parameter-name-keyed one that API
speaks. Nothing here imports Lightning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

__all__ = [
    "METADATA_FILE",
    "full_model_state",
    "full_optimizer_state",
    "load_full",
    "load_sharded",
    "save_sharded",
    "sharded_model_state",
    "sharded_optimizer_state",
]

METADATA_FILE = "meta.pt"  # in a sharded checkpoint's folder: the checkpoint without model and optimizers
_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0 only


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """Collective: ``module.state_dict()`` with full tensors on the CPU on rank 0; ``{}`` elsewhere."""
    return get_model_state_dict(module, options=_ON_RANK0)


def sharded_model_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with each rank's shards (DTensors)."""
    return get_model_state_dict(module)


def full_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Collective: ``optimizer``'s whole state in torch's format (``optimizer.state_dict()`` of
    the unsharded model) on rank 0; ``{}`` elsewhere."""
    by_name = get_optimizer_state_dict(module, optimizer, options=_ON_RANK0)
    return _keyed_by_index(by_name) if by_name else {}


def sharded_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s state with each rank's shards, keyed by parameter name."""
    return get_optimizer_state_dict(module, optimizer)


def save_sharded(folder: Path, model_state: Mapping[str, Any], optimizer_states: Sequence[Mapping[str, Any]], metadata: Mapping[str, Any]) -> None:
    """Collective: write the shards into ``folder`` and, from rank 0, ``metadata`` beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(_sharded_layout(model_state, optimizer_states), checkpoint_id=folder)
    if dist.get_rank() == 0:
        torch.save(dict(metadata), folder / METADATA_FILE)


def load_sharded(folder: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool) -> dict[str, Any]:
    """Collective: load a sharded checkpoint into ``module`` and ``optimizers`` (none: the model
    only) at this world size, whatever the world size that saved it; return its metadata."""
    if not (folder / METADATA_FILE).is_file():
        raise FileNotFoundError(
            f"rank {dist.get_rank()}: {folder} is a folder but not a sharded checkpoint: {METADATA_FILE} is missing"
        )
    targets = _sharded_layout(sharded_model_state(module), [sharded_optimizer_state(module, o) for o in optimizers])
    dcp.load(targets, checkpoint_id=folder)
    set_model_state_dict(module, targets["model"], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, targets[f"optimizer_{index}"])
    return torch.load(folder / METADATA_FILE, map_location="cpu", weights_only=True)


def load_full(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, path: Path
) -> dict[str, Any]:
    """Collective: take this rank's shards of a full checkpoint (the dict of a file every rank
    read) into ``module`` and, when given, ``optimizers``; return the rest of the checkpoint."""
    rest = dict(checkpoint)
    set_model_state_dict(module, rest.pop("state_dict"), options=StateDictOptions(full_state_dict=True, strict=strict))
    states = rest.pop("optimizer_states", None)
    if not optimizers or states is None:
        return rest
    if len(states) != len(optimizers):
        raise ValueError(
            f"rank {dist.get_rank()}: {path} holds the state of {len(states)} optimizers, but "
            f"configure_optimizers returned {len(optimizers)}"
        )
    full = StateDictOptions(full_state_dict=True)
    for index, (optimizer, state) in enumerate(zip(optimizers, states)):
        set_optimizer_state_dict(module, optimizer, _keyed_by_name(state, module, optimizer, f"{path}: optimizer {index}"), options=full)
    return rest


def _sharded_layout(model_state: Mapping[str, Any], optimizer_states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"model": dict(model_state), **{f"optimizer_{i}": dict(s) for i, s in enumerate(optimizer_states)}}


def _keyed_by_index(state: Mapping[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state as ``torch.optim.Optimizer.state_dict()`` has it: parameters
    numbered in the order of the param groups."""
    index: dict[str, int] = {}
    for group in state["param_groups"]:
        for name in group["params"]:
            index.setdefault(name, len(index))
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]],
    }


def _keyed_by_name(state: Mapping[str, Any], module: nn.Module, optimizer: Optimizer, what: str) -> dict[str, Any]:
    """An index-keyed optimizer state (torch's format) keyed by ``module``'s parameter names, as
    ``optimizer`` orders its parameters; a name-keyed one is returned as it is."""
    if not any(isinstance(p, int) for group in state["param_groups"] for p in group["params"]):
        return dict(state)
    name_of = {id(param): name for name, param in module.named_parameters()}
    names = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    saved = [p for group in state["param_groups"] for p in group["params"]]
    if sorted(saved) != list(range(len(names))):
        raise ValueError(
            f"rank {dist.get_rank()}: {what} holds the state of {len(saved)} parameters, but the optimizer "
            f"has {len(names)}; resume with the optimizer (and param groups) that saved it"
        )
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }
