"""Low-bit error-feedback residuals in a checkpoint: exact at the same world size, resharded at another.

A residual is what a rank's last low-bit message rounded away, kept to be added to its next one
(:mod:`sharded._common.lowbit.feedback`). The ``"lowbit"`` entry saves them twice:

- ``world{W}_rank{r}``: rank ``r``'s own, which rank ``r`` of a run at the same world size loads
  back, so the resumed run sends the bits the uninterrupted one would have. ``ShardedDataParallel``
  saves them per parameter (a resumed run folds them into whatever buckets it plans, bit for bit
  when it plans the saved ones); a ``fully_shard`` model per message, a unit's rows (keyed
  ``<unit's module path> (<n> params, <checksum of their names>)[r]``).
- ``debt``: per parameter (its FQN, its shape), the sum over ranks of what their residuals add to
  the reduced gradient: the rounding the average still owes. A run at another world size ``W'``,
  or one that finds no entry of its own rank, gives every rank ``debt / W'`` to carry into its
  next messages, so the next reduced gradient receives the same debt (rounded in other blocks:
  not bit for bit). Parameters are named as the model's state dict names them.

The debt is an all-reduce over the wrapper's group: with low-bit error feedback,
:func:`~sharded.checkpoint.get_state_dict` is collective.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Mapping, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .._common import comm
from .._common.errors import on_rank
from ..sharded_ddp import ShardedDataParallel
from ._names import param_fqns, unwrap
from ._paths import LoadIfSaved

__all__ = ["lowbit_entry", "set_lowbit_entry"]

log = logging.getLogger("sharded.lowbit")


class _Residuals(Protocol):
    """One wrapper's residuals as the checkpoint sees them."""

    group: Any
    world: int
    rank: int

    def __len__(self) -> int: ...  # messages holding a residual and parameters carrying one
    def trainable(self) -> list[torch.Tensor]: ...  # the model's parameters residuals may belong to, the same on every rank
    def own_state(self, fqn_of: Mapping[torch.Tensor, str]) -> dict[str, torch.Tensor]: ...
    def load_own(self, state: Mapping[str, torch.Tensor], param_of: Mapping[str, torch.Tensor]) -> int: ...
    def shares(self) -> dict[torch.Tensor, torch.Tensor]: ...  # model parameter -> what this rank's residuals add to its reduced gradient
    def carry(self, shares: Mapping[torch.Tensor, torch.Tensor]) -> None: ...
    def clear(self) -> None: ...


class _BucketResiduals:
    """``ShardedDataParallel``'s: its buckets' residuals, saved per parameter (a bucket holds
    gradients already divided by the world size: a residual adds to the average as it is)."""

    def __init__(self, model: ShardedDataParallel) -> None:
        assert model.lowbit_buckets is not None
        self._buckets, self._module = model.lowbit_buckets, model.module
        self.group, self.world, self.rank = model.process_group, model.world_size, model.rank

    def __len__(self) -> int:
        feedback = self._buckets.wire.feedback
        return len(feedback) + len(feedback.carried)

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self._module.parameters() if p.requires_grad]

    def own_state(self, fqn_of: Mapping[torch.Tensor, str]) -> dict[str, torch.Tensor]:
        return {fqn_of[p]: r for p, r in self._buckets.residuals_by_param().items() if p in fqn_of}

    def load_own(self, state: Mapping[str, torch.Tensor], param_of: Mapping[str, torch.Tensor]) -> int:
        fits = {param_of[k]: v for k, v in state.items() if k in param_of and tuple(v.shape) == tuple(param_of[k].shape)}
        self._buckets.carry(fits)
        return len(fits)

    def shares(self) -> dict[torch.Tensor, torch.Tensor]:
        return self._buckets.residuals_by_param()

    def carry(self, shares: Mapping[torch.Tensor, torch.Tensor]) -> None:
        self._buckets.carry(dict(shares))

    def clear(self) -> None:
        self._buckets.wire.feedback.clear()


class _UnitResiduals:
    """A ``fully_shard`` model's, over the wires its units share (one per policy): saved per
    message together, loaded back each into the wire of the unit it belongs to; per parameter
    through each unit (:func:`sharded.fsdp._lowbit_reduce.residuals_by_param`)."""

    def __init__(self, units: list[Any], wires: list[tuple[Any, set[str]]], reduce: Any) -> None:
        self._units, self._wires, self._reduce = units, wires, reduce  # wires: (wire, the names of the units sending through it)
        first = wires[0][0]
        self.group, self.world, self.rank = first.group, first.world, first.rank

    def __len__(self) -> int:
        return sum(len(wire.feedback) + len(wire.feedback.carried) for wire, _ in self._wires)

    def trainable(self) -> list[torch.Tensor]:
        return [sp.sharded for unit in self._units for sp in unit.params if sp.requires_grad and sp.owner is None]

    def own_state(self, fqn_of: Mapping[torch.Tensor, str]) -> dict[str, torch.Tensor]:
        return {name: value for wire, _ in self._wires for name, value in wire.feedback.state_dict().items()}

    def load_own(self, state: Mapping[str, torch.Tensor], param_of: Mapping[str, torch.Tensor]) -> int:
        taken = 0
        for wire, units in self._wires:
            mine = {key: value for key, value in state.items() if _unit_of(key) in units}
            wire.feedback.load_state_dict(mine)
            taken += len(mine)
        return taken

    def shares(self) -> dict[torch.Tensor, torch.Tensor]:
        return {sp.sharded: share for unit in self._units for sp, share in self._reduce.residuals_by_param(unit).items()}

    def carry(self, shares: Mapping[torch.Tensor, torch.Tensor]) -> None:
        for unit in self._units:
            self._reduce.carry_residuals(unit, {sp: shares[sp.sharded] for sp in unit.params if sp.sharded in shares})

    def clear(self) -> None:
        for wire, _ in self._wires:
            wire.feedback.clear()


def _unit_of(key: str) -> str:
    """The unit path of a residual's name, ``"<unit path> (<n> params, <checksum>)[<row>]"``."""
    return key.rpartition("[")[0].rpartition(" (")[0]


def _residual_store(model: nn.Module) -> Optional[_Residuals]:
    """The wrapper's residuals; ``None`` where it keeps none."""
    if isinstance(model, ShardedDataParallel) and model.lowbit is not None and model.lowbit.error_feedback:
        return _BucketResiduals(model)
    return _fully_shard_store(unwrap(model))


def _fully_shard_store(module: nn.Module) -> Optional[_UnitResiduals]:
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
    sending = []
    for unit in units:
        wire = unit.lowbit_wire
        if wire is not None and wire.policy.grads is not None and wire.policy.error_feedback:
            wires.setdefault(id(wire), (wire, set()))[1].add(unit.module_name)
            sending.append(unit)
    if not wires:
        return None
    return _UnitResiduals(sending, list(wires.values()), sys.modules["sharded.fsdp._lowbit_reduce"])


def lowbit_entry(model: nn.Module) -> Optional[dict[str, Any]]:
    """The ``"lowbit"`` entry of the sharded state dict (``None`` where the wrapper keeps no
    residuals): how many residuals each rank keeps, by world size; this rank's own; the debt per
    parameter (collective). Every part loads only where saved, so a checkpoint without them
    loads too."""
    store = _residual_store(model)
    if store is None:
        return None
    fqn_of = param_fqns(unwrap(model))
    return {
        "counts": LoadIfSaved({f"world{store.world}": len(store)}),
        f"world{store.world}_rank{store.rank}": LoadIfSaved(store.own_state(fqn_of)),
        "debt": LoadIfSaved(_debt(store, fqn_of)),
    }


def _debt(store: _Residuals, fqn_of: Mapping[torch.Tensor, str]) -> dict[str, torch.Tensor]:
    """Per parameter, the sum over the group's ranks of their shares (one all-reduce each, on
    every rank alike; none at all when no rank holds a residual)."""
    shares = store.shares()
    device = comm.comm_device(store.group)
    anyone = torch.tensor([float(bool(shares))], device=device)
    if store.world > 1:
        comm.all_reduce(anyone, store.group, dist.ReduceOp.MAX)
    if not bool(anyone.item()):
        return {}
    debt: dict[str, torch.Tensor] = {}
    for param in sorted(store.trainable(), key=lambda p: fqn_of.get(p, "")):
        if param not in fqn_of:
            continue
        share = shares.get(param)
        total = share.float().to(device).clone() if share is not None else torch.zeros(param.shape, dtype=torch.float32, device=device)
        if store.world > 1:
            comm.all_reduce(total, store.group)
        debt[fqn_of[param]] = total.cpu()
    return debt


def set_lowbit_entry(model: nn.Module, entry: Optional[Mapping[str, Any]]) -> None:
    """Give the wrapper this rank's saved residuals; where the checkpoint has none of its rank
    at its world size, its share of the saved debt (logged); where it has neither, none (a
    warning if residuals were saved)."""
    store = _residual_store(model)
    if store is None or entry is None:
        return
    store.clear()
    param_of = {fqn: p for p, fqn in param_fqns(unwrap(model)).items()}
    if store.load_own(dict(entry.get(f"world{store.world}_rank{store.rank}", {})), param_of):
        return
    debt = {fqn: value for fqn, value in dict(entry.get("debt", {})).items() if fqn in param_of}
    saved_at = {int(key.removeprefix("world")): int(count) for key, count in entry.get("counts", {}).items() if int(count)}
    if debt:
        store.carry({param_of[fqn]: value.float() / store.world for fqn, value in debt.items()
                     if tuple(value.shape) == tuple(param_of[fqn].shape)})
        log.info(on_rank(
            f"low-bit: the checkpoint's error-feedback residuals (saved at world size {_sizes(saved_at)}) are resharded "
            f"to world size {store.world}: each rank carries 1/{store.world} of the debt of {len(debt)} parameters "
            "into its next messages", store.rank))
        return
    if saved_at:
        log.warning(on_rank(
            f"low-bit: the checkpoint holds error-feedback residuals (saved at world size {_sizes(saved_at)}) but neither "
            f"this rank's own at world size {store.world} nor a per-parameter debt for this model's parameters: they are "
            "dropped, and every message starts without one", store.rank))


def _sizes(saved_at: Mapping[int, int]) -> str:
    return ", ".join(str(w) for w in sorted(saved_at)) or "unknown"
