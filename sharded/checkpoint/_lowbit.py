"""Low-bit error-feedback residuals in a checkpoint: each rank's own, under its world size.

A residual is what a rank's last low-bit message rounded away, kept to be added to its next one
(:mod:`sharded._common.lowbit.feedback`). It belongs to that rank at that world size: it is saved
under ``lowbit.world{W}_rank{r}`` and loaded back by rank ``r`` of a run at the same world size
only, so a resumed run sends the bits the uninterrupted one would have. At another world size the
gradients split otherwise and no rank's residual fits: they are dropped with a log line saying
how many, and every message starts without one (the rounding of one step is lost, no more).

Two wrappers keep residuals: ``ShardedDataParallel`` (one store, keyed by bucket) and a
``fully_shard`` model (one store per wire its units share, keyed ``<unit's module path> (<n> params, <checksum of their names>)[r]``:
:class:`_UnitResiduals` gathers them under the same entry).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Mapping, Optional, Protocol, Union

import torch
from torch import nn

from .._common.errors import on_rank
from .._common.lowbit import ErrorFeedback
from ..sharded_ddp import ShardedDataParallel
from ._names import unwrap
from ._paths import LoadIfSaved

__all__ = ["lowbit_entry", "set_lowbit_entry"]

log = logging.getLogger("sharded.lowbit")


class _Residuals(Protocol):
    def __len__(self) -> int: ...
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


class _UnitResiduals:
    """A ``fully_shard`` model's residuals, over the wires its units share (one per policy):
    saved together; loaded back each into the wire of the unit it belongs to."""

    def __init__(self, wires: list[tuple[Any, set[str]]]) -> None:
        self._wires = wires  # (wire, the names of the units sending through it)

    def __len__(self) -> int:
        return sum(len(wire.feedback) for wire, _ in self._wires)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value for wire, _ in self._wires for name, value in wire.feedback.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for wire, units in self._wires:
            wire.feedback.load_state_dict({key: value for key, value in state.items() if _unit_of(key) in units})


def _unit_of(key: str) -> str:
    """The unit path of a residual's name, ``"<unit path> (<n> params, <checksum>)[<row>]"``."""
    return key.rpartition("[")[0].rpartition(" (")[0]


def _residual_store(model: nn.Module) -> Optional[tuple[Union[ErrorFeedback, _Residuals], int, int]]:
    """The wrapper's residuals, its world size and its rank; ``None`` where it keeps none."""
    if isinstance(model, ShardedDataParallel) and model.lowbit is not None and model.lowbit.error_feedback:
        return model.lowbit_residuals, model.world_size, model.rank
    return _fully_shard_store(unwrap(model))


def _fully_shard_store(module: nn.Module) -> Optional[tuple[_Residuals, int, int]]:
    """The residuals of ``module``'s units that reduce-scatter their gradients in low bits with
    error feedback (``None`` if none do). The units are named by their paths and share their
    wires now, as their root does at its first forward, so that residuals loaded before it land
    in the wire each unit will send through, under the name it will send as."""
    unit_module, lowbit_module = sys.modules.get("sharded.fsdp._unit"), sys.modules.get("sharded.fsdp._lowbit")
    if unit_module is None or lowbit_module is None:  # layer 3 never imported: no such model
        return None
    units = unit_module.units_under(module)
    if all(unit.lowbit_wire is None for unit in units):
        return None
    paths = {id(m): path for path, m in module.named_modules()}
    for unit in units:
        unit.name_by_paths([paths.get(id(m), "") for m in unit.modules])
    lowbit_module.share_wires(units)
    wires: dict[int, tuple[Any, set[str]]] = {}
    for unit in units:
        wire = unit.lowbit_wire
        if wire is not None and wire.policy.grads is not None and wire.policy.error_feedback:
            wires.setdefault(id(wire), (wire, set()))[1].add(unit.module_name)
    if not wires:
        return None
    first = next(iter(wires.values()))[0]
    return _UnitResiduals(list(wires.values())), first.world, first.rank


def lowbit_entry(model: nn.Module) -> Optional[dict[str, Any]]:
    """The ``"lowbit"`` entry of the sharded state dict: how many residuals each rank keeps, by
    world size, and this rank's residuals by message name (live tensors); ``None`` without any.
    Both parts load only where saved, so a checkpoint without them loads too."""
    store = _residual_store(model)
    if store is None:
        return None
    feedback, world, rank = store
    return {
        "counts": LoadIfSaved({f"world{world}": len(feedback)}),
        f"world{world}_rank{rank}": LoadIfSaved(feedback.state_dict()),
    }


def set_lowbit_entry(model: nn.Module, entry: Optional[Mapping[str, Any]]) -> None:
    """Give the wrapper this rank's saved residuals (those of its world size; none saved: it
    starts without), and log the residuals saved at another world size that are dropped."""
    store = _residual_store(model)
    if store is None or entry is None:
        return
    feedback, world, rank = store
    feedback.load_state_dict(dict(entry.get(f"world{world}_rank{rank}", {})))
    elsewhere = {key: int(count) for key, count in entry.get("counts", {}).items() if key != f"world{world}" and int(count)}
    for key, count in elsewhere.items():
        saved_world = int(key.removeprefix("world"))
        log.warning(on_rank(
            f"low-bit: the checkpoint's error-feedback residuals were saved at world size {saved_world} "
            f"({count} per rank, {count * saved_world} in all); at world size {world} they do not apply and "
            "are dropped: every message starts without one", rank))
