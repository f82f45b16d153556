"""Checkpoints of a fully sharded model and its optimizers, in the two layouts Lightning's FSDP
strategy offers; the Trainer's and Fabric's strategies write and read them alike.

* ``"full"``: one file, written by rank 0, holding full tensors: the model's ``state_dict`` and
  each optimizer's state in torch's own format (keyed by parameter index), so the file loads
  into an unsharded model and a plain optimizer (``strategy="ddp"``) as well as into a sharded
  one at any world size. It is read with ``torch.load(weights_only=True)``.
* ``"sharded"``: a :mod:`sharded.checkpoint` checkpoint directory (index ``.metadata``, one data
  file per rank, each rank writing its own shards), holding::

      {"model": the module's state dict (this rank's shards),
       "optim": its optimizers' state, filed by parameter FQN (as sharded.checkpoint has it),
       "lightning": (everything else in the checkpoint,)}

  "Everything else" is Lightning's own state (loops, callbacks, schedulers, precision,
  hyperparameters) for the Trainer, the entries besides the module and optimizers for Fabric;
  rank 0's is saved, as one record (the one-element tuple keeps DCP from flattening the dict,
  which would drop empty dicts and turn keys into strings). The engine publishes a save only
  once it is complete and reads without running code (allow-listed index, ``weights_only``
  records, CRC checks, errors naming the file); it also reshards at load, so a checkpoint
  resumes at any world size.

Nothing here imports Lightning.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from .. import checkpoint
from .._common.dtensors import full_model_state_dict
from .._common.errors import on_rank
from ..checkpoint import CheckpointError
from ..checkpoint._names import is_keyed_by_number, keyed_by_fqn, keyed_by_number, optimizer_fqns, param_fqns
from ..checkpoint._ranks import Ranks
from ..checkpoint._storage import METADATA_FILE

__all__ = [
    "LIGHTNING_KEY",
    "full_model_state",
    "full_optimizer_state",
    "load_full",
    "load_full_optimizer_state",
    "load_model_state",
    "load_sharded",
    "read_file",
    "save_sharded",
    "sharded_model_state",
    "sharded_optimizer_state",
]

LIGHTNING_KEY = "lightning"  # in a sharded checkpoint: (everything but the model and optimizers,)
_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0 only


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """Collective: ``module.state_dict()`` with full tensors on the CPU on rank 0; ``{}`` elsewhere."""
    return full_model_state_dict(module, rank0_only=True, cpu_offload=True)


def sharded_model_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with each rank's shards (DTensors): the ``"model"`` entry of a
    sharded checkpoint."""
    return checkpoint.get_state_dict(module)["model"]


def full_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Collective: ``optimizer``'s whole state in torch's format (``optimizer.state_dict()`` of
    the unsharded model) on rank 0; ``{}`` elsewhere."""
    by_fqn: dict[str, Any] = dict(get_optimizer_state_dict(module, optimizer, options=_ON_RANK0))
    return keyed_by_number(by_fqn, [group["params"] for group in by_fqn["param_groups"]]) if by_fqn else {}


def sharded_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s state with each rank's shards, filed by the FQNs of ``module``'s
    parameters: its part of a sharded checkpoint's ``"optim"`` entry."""
    return checkpoint.get_state_dict(module, optimizer)["optim"]


def load_model_state(module: nn.Module, state: Mapping[str, Any], full: bool, strict: bool) -> None:
    """Collective: load a state dict of full tensors (``full``; each rank takes its shards) or
    of shards into the sharded ``module``."""
    set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=full, strict=strict))


def load_full_optimizer_state(module: nn.Module, optimizer: Optimizer, state: Mapping[str, Any], what: str) -> None:
    """Collective: load a whole optimizer state (in torch's format, parameters numbered, or keyed
    by parameter FQN) into ``optimizer`` over ``module``'s sharded parameters."""
    if is_keyed_by_number(state):
        state = keyed_by_fqn(state, optimizer_fqns(optimizer, param_fqns(module)), what)
    set_optimizer_state_dict(module, optimizer, dict(state), options=StateDictOptions(full_state_dict=True))


# ------------------------------------------------------------------------------ sharded


def save_sharded(
    folder: Path, model_state: Mapping[str, Any], optimizer_states: Sequence[Mapping[str, Any]], extra: Mapping[str, Any]
) -> None:
    """Collective: save a sharded checkpoint as directory ``folder``: ``model_state`` and
    ``optimizer_states`` as :func:`sharded_model_state` and :func:`sharded_optimizer_state`
    give them, and rank 0's ``extra``.

    A new name appears only once the checkpoint is complete. A checkpoint already under that
    name is replaced only then: a save that fails or is killed midway leaves it as it was.
    """
    ranks = Ranks(None)
    state: dict[str, Any] = {"model": dict(model_state)}
    if optimizer_states:
        state["optim"] = _merged(optimizer_states)
    if ranks.rank == 0:
        state[LIGHTNING_KEY] = (dict(extra),)
    if folder.exists():
        _replace(folder, state, ranks)
    else:
        checkpoint.save(state, folder)


def load_sharded(folder: Path, module: Optional[nn.Module], optimizers: Sequence[Optimizer], strict: bool) -> dict[str, Any]:
    """Collective: load a sharded checkpoint, saved at any world size, into ``module`` (``None``:
    no module) and ``optimizers`` (none: the saved optimizer state is not read); return
    everything else it holds. ``strict=False`` loads the model keys both sides have."""
    optimizers = list(optimizers)
    state = checkpoint.get_state_dict(module, optimizers) if module is not None else {}
    state[LIGHTNING_KEY] = None  # a place for whatever was saved under that key
    checkpoint.load(state, folder, strict=strict)
    rest = _saved_rest(state[LIGHTNING_KEY], folder)
    if module is not None:
        checkpoint.set_state_dict(module, optimizers, state)
    return rest


def _saved_rest(saved: Any, folder: Path) -> dict[str, Any]:
    if isinstance(saved, tuple) and len(saved) == 1 and isinstance(saved[0], dict):
        return dict(saved[0])
    raise CheckpointError(on_rank(
        f"{folder}: its '{LIGHTNING_KEY}' entry holds a {type(saved).__name__}, "
        "not a checkpoint's other state; it was not written by sharded.lightning. Nothing was loaded"
    ))


def _merged(optimizer_states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``"optim"`` entry of several optimizers, as ``sharded.checkpoint.get_state_dict``
    gives it for a list of them."""
    merged: dict[str, Any] = {"state": {}, "param_groups": [], "classes": []}
    for index, part in enumerate(optimizer_states):
        shared = sorted(merged["state"].keys() & part.get("state", {}).keys())
        if shared:
            raise ValueError(on_rank(
                f"optimizer {index} steps parameters that an earlier one steps too ({', '.join(shared[:3])}); "
                "a sharded checkpoint files optimizer state by parameter FQN, so each parameter may "
                "belong to one optimizer only"
            ))
        merged["state"].update(part.get("state", {}))
        merged["param_groups"] += part.get("param_groups", [])
        merged["classes"] += part.get("classes", [])
    return merged


def _replace(folder: Path, state: Mapping[str, Any], ranks: Ranks) -> None:
    """Save ``state`` as ``.<name>.next`` beside the checkpoint ``folder``, then put it in its place."""
    if not (folder / METADATA_FILE).is_file():
        raise FileExistsError(on_rank(
            f"{folder} exists and is not a checkpoint (it has no {METADATA_FILE}), so it is not "
            "replaced; remove it or save elsewhere"
        ))
    staged = _beside(folder, "next")
    ranks.agree(lambda: _remove_on_rank0(staged, ranks.rank), f"clearing {staged}")
    try:
        checkpoint.save(state, staged)
    except CheckpointError as error:
        raise CheckpointError(on_rank(f"replacing {folder} failed; it still holds the previous checkpoint. {error}")) from error
    ranks.agree(lambda: _swap_on_rank0(staged, folder, ranks.rank), f"replacing {folder}")


def _swap_on_rank0(staged: Path, folder: Path, rank: int) -> None:
    """Two renames, then the old checkpoint is deleted. A crash between the renames (there is
    no atomic swap of directories) leaves both whole, as ``.<name>.old`` and ``.<name>.next``."""
    if rank != 0:
        return
    retired = _beside(folder, "old")
    shutil.rmtree(retired, ignore_errors=True)
    os.rename(folder, retired)
    os.rename(staged, folder)
    _fsync_directory(folder.parent)
    shutil.rmtree(retired)


def _remove_on_rank0(path: Path, rank: int) -> None:
    """What a save killed before its swap left behind is discarded."""
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _beside(folder: Path, what: str) -> Path:
    return folder.with_name(f".{folder.name}.{what}")


def _fsync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


# --------------------------------------------------------------------------------- full


def read_file(path: Path) -> Any:
    """A checkpoint file's contents, read safely (``weights_only=True``) on the CPU."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(on_rank(
            f"{path} holds an object that "
            f"torch.load(weights_only=True) does not load (save hyperparameters as plain values, e.g. "
            f"vars(namespace)): {error}"
        )) from error


def load_full(
    contents: dict[str, Any], module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, path: Path
) -> dict[str, Any]:
    """Collective: take this rank's shards of a Trainer's full checkpoint (``contents``, the
    dict of a file every rank read) into ``module`` and, when given, ``optimizers``; return the rest."""
    rest = dict(contents)
    load_model_state(module, rest.pop("state_dict"), full=True, strict=strict)
    states = rest.pop("optimizer_states", None)
    if not optimizers or states is None:
        return rest
    if len(states) != len(optimizers):
        raise ValueError(on_rank(
            f"{path} holds the state of {len(states)} optimizers, but "
            f"configure_optimizers returned {len(optimizers)}"
        ))
    for index, (optimizer, state) in enumerate(zip(optimizers, states)):
        load_full_optimizer_state(module, optimizer, state, what=f"{path}: optimizer {index}")
    return rest
