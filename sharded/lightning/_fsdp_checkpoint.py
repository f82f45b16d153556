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

import pickle
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
    "load_model_state",
    "load_optimizer_state",
    "load_sharded",
    "read_file",
    "read_sharded",
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


def load_model_state(module: nn.Module, state: Mapping[str, Any], full: bool, strict: bool) -> None:
    """Collective: load a state dict of full tensors (``full``; each rank takes its shards) or
    of shards into the sharded ``module``."""
    set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=full, strict=strict))


def load_optimizer_state(module: nn.Module, optimizer: Optimizer, state: Mapping[str, Any], full: bool, what: str) -> None:
    """Collective: load an optimizer state, full (in torch's index-keyed format or keyed by
    parameter name) or sharded, into ``optimizer`` over ``module``'s sharded parameters."""
    if full:
        state = _keyed_by_name(state, module, optimizer, what)
    set_optimizer_state_dict(module, optimizer, dict(state), options=StateDictOptions(full_state_dict=full))


def save_sharded(folder: Path, states: Mapping[str, Mapping[str, Any]], metadata: Mapping[str, Any]) -> None:
    """Collective: write ``states`` (name -> a state dict of shards) into ``folder`` with
    ``torch.distributed.checkpoint``, and from rank 0 ``metadata`` (anything else) beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save({name: dict(state) for name, state in states.items()}, checkpoint_id=folder)
    if dist.get_rank() == 0:
        torch.save(dict(metadata), folder / METADATA_FILE)


def read_sharded(folder: Path, targets: dict[str, Any]) -> dict[str, Any]:
    """Collective: fill ``targets`` (name -> a state dict of this rank's shards, as the objects
    to load into give it now) from ``folder``, resharding to this world size; return the metadata."""
    if not (folder / METADATA_FILE).is_file():
        raise FileNotFoundError(
            f"rank {dist.get_rank()}: {folder} is a folder but not a sharded checkpoint: {METADATA_FILE} is missing"
        )
    dcp.load(targets, checkpoint_id=folder)
    return read_file(folder / METADATA_FILE)


def read_file(path: Path) -> Any:
    """A checkpoint file's contents, read safely (``weights_only=True``) on the CPU."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(
            f"rank {dist.get_rank() if dist.is_initialized() else 0}: {path} holds an object that "
            f"torch.load(weights_only=True) does not load (save hyperparameters as plain values, e.g. "
            f"vars(namespace)): {error}"
        ) from error


def load_sharded(folder: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool) -> dict[str, Any]:
    """Collective: load a Trainer's sharded checkpoint (``model``, ``optimizer_0``...) into
    ``module`` and ``optimizers`` (none: the model only); return its metadata."""
    targets = _sharded_layout(sharded_model_state(module), [sharded_optimizer_state(module, o) for o in optimizers])
    metadata = read_sharded(folder, targets)
    load_model_state(module, targets["model"], full=False, strict=strict)
    for index, optimizer in enumerate(optimizers):
        load_optimizer_state(module, optimizer, targets[f"optimizer_{index}"], full=False, what=f"{folder}: optimizer {index}")
    return metadata


def load_full(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, path: Path
) -> dict[str, Any]:
    """Collective: take this rank's shards of a Trainer's full checkpoint (the dict of a file
    every rank read) into ``module`` and, when given, ``optimizers``; return the rest."""
    rest = dict(checkpoint)
    load_model_state(module, rest.pop("state_dict"), full=True, strict=strict)
    states = rest.pop("optimizer_states", None)
    if not optimizers or states is None:
        return rest
    if len(states) != len(optimizers):
        raise ValueError(
            f"rank {dist.get_rank()}: {path} holds the state of {len(states)} optimizers, but "
            f"configure_optimizers returned {len(optimizers)}"
        )
    for index, (optimizer, state) in enumerate(zip(optimizers, states)):
        load_optimizer_state(module, optimizer, state, full=True, what=f"{path}: optimizer {index}")
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
