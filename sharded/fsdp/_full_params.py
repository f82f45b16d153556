"""Full (unsharded) parameters on demand, outside forward and backward: FSDP1's
``summon_full_params``, and loading full-tensor state dicts with it.

A full state dict is produced by ``sharded._common.dtensors.full_model_state_dict``, the one
producer every layer uses."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from .._common.dtensors import full_tensor_of
from .._common.errors import on_rank
from ._unit import TrainingState, Unit, units_under

__all__ = ["summon_full_params", "load_full_model_state_dict"]


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module, writeback: bool = True, rank0_only: bool = False, offload_to_cpu: bool = False
) -> Iterator[None]:
    """Collective context: inside it ``module`` (and every sharded module under it) holds full
    parameters in their master dtype; with ``writeback`` changes made to them are copied back to
    the shards on exit.

    Args:
        rank0_only: only rank 0 gets the full parameters (the others keep their shards);
            cannot be combined with ``writeback``.
        offload_to_cpu: put the full parameters on the CPU.
    """
    if rank0_only and writeback:
        raise ValueError(on_rank("summon_full_params: rank0_only=True needs writeback=False (other ranks hold no full copy to write)"))
    units = units_under(module)
    busy = [u for u in units if u.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(on_rank(f"summon_full_params inside forward or backward ({busy[0]} is {busy[0].training_state.name})"))
    _check_no_tensor_parallel(units)
    for unit in units:
        unit.reshard()
    device = torch.device("cpu") if offload_to_cpu else None
    fulls = [(unit, unit.gather_full_copies(device)) for unit in units]
    if rank0_only and dist.get_rank() != 0:
        yield
        return
    for unit, copies in fulls:
        for sp, full in zip(unit.params, copies):
            sp.show(nn.Parameter(full, requires_grad=sp.requires_grad))
    try:
        yield
    finally:
        for unit, _ in fulls:
            _restore_shards(unit, writeback)


def _check_no_tensor_parallel(units: list[Unit]) -> None:
    tensor_parallel = [sp.fqn for unit in units for sp in unit.params if sp.layout is not None]
    if tensor_parallel:
        raise NotImplementedError(on_rank(
            f"summon_full_params: parameter {tensor_parallel[0]} is tensor-parallel (a DTensor before fully_shard); "
            "sharded gathers it over the data-parallel ranks only. Use p.full_tensor(), or "
            "torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True)"
        ))


def _restore_shards(unit: Unit, writeback: bool) -> None:
    for sp in unit.params:
        if writeback and sp.held_here:  # an owner-placed parameter is written back by its owner
            full = sp.held_by_module()
            if full is None:
                raise RuntimeError(on_rank(f"summon_full_params(writeback=True): parameter {sp.fqn} was removed from its module"))
            with torch.no_grad():
                sp.local_shard().copy_(sp.rows_of(full.detach()))
        sp.show_sharded()


def load_full_model_state_dict(module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True):
    """Collective: load full tensors (or DTensors) into a sharded ``module``; each rank keeps its
    rows. Returns what ``load_state_dict`` returns (missing and unexpected keys)."""
    full = {k: full_tensor_of(v) for k, v in state_dict.items()}
    with summon_full_params(module, writeback=True):
        return module.load_state_dict(full, strict=strict)
