"""``fully_shard``: shard a module's parameters in place (ZeRO-3), FSDP2's way.

This file validates arguments and wires things up; the mechanism is in the private modules
(``_param``: one parameter's sharded and unsharded forms; ``_storage``: a unit's flat buffers;
``_collectives``: all-gather and reduce-scatter; ``_unit``: a unit's lifecycle; ``_root``: the
model-wide forward/backward duties).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._collect import check_not_sharded, collect_unit_params
from ._errors import on_rank
from ._hooks import install_forward_hooks
from ._mesh import resolve_mesh
from ._param import ShardedParam, ShardGeometry
from ._registry import install_optimizer_guard, register_sharded, retire
from ._root import Root
from ._unit import Unit, UnitConfig, unit_of, units_under
from .policies import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle"]


def fully_shard(
    module: nn.Module,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: Optional[OffloadPolicy] = None,
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
) -> nn.Module:
    """Shard ``module``'s parameters over the ranks, in place; returns ``module``.

    Each call makes one *unit*: the parameters of ``module`` not already in a unit below it,
    all-gathered together just before ``module``'s forward and freed after it, gathered again
    for its backward, their gradients reduce-scattered as soon as that backward is done. Apply
    it bottom-up (e.g. to every transformer block, then to the whole model); the outermost call
    also keeps its parameters from forward to backward, where they are needed first.

    Afterwards every parameter is an ``nn.Parameter`` holding a DTensor sharded on dim 0
    (``Shard(0)``; replicated across rows of a 2-D mesh): build the optimizer *after* this call,
    and it steps each rank's shard. ``p.full_tensor()``, ``torch.distributed.checkpoint`` and
    ``torch.nn.utils.clip_grad_norm_`` (which then returns the global norm) work unchanged.
    Parameter names, and so ``state_dict()`` keys, stay the same. Buffers stay replicated.

    ``type(module)`` gains :class:`FSDPModule`'s methods (``unshard``, ``reshard``, ``no_sync``,
    ``set_requires_gradient_sync``, prefetch settings...).

    Args:
        module: the module to shard (its submodules' own ``fully_shard`` calls come first).
        process_group: the ranks to shard over (default: all); or give ``mesh``.
        mesh: a 1-D ``DeviceMesh`` to shard over, or a 2-D ``(replicate, shard)`` mesh for
            hybrid sharding: shard within a row, average gradients across rows.
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3) or keep them
            until backward (``False``: less communication, more memory, like ZeRO-2).
        mp_policy: mixed precision (:class:`MixedPrecisionPolicy`).
        offload_policy: :class:`CPUOffloadPolicy` to keep shards, gradients and the optimizer
            step on the CPU.
        ignored_params: parameters to leave alone: not sharded, not gathered, not reduced.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(on_rank(f"fully_shard takes an nn.Module, got {type(module).__name__}"))
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(on_rank(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}"))
    info = resolve_mesh(process_group, mesh)
    check_not_sharded(module)
    taken = collect_unit_params(module, _ids_of(module, ignored_params))
    params = [
        ShardedParam(name, slots, ShardGeometry(param.shape, info.shard_world), info.mesh, info.shard_rank)
        for name, param, slots in taken
    ]
    unit = Unit(module, params, info, UnitConfig(mp_policy, offload_policy, reshard_after_forward))
    unit.storage.shard_from_full([param for _, param, _ in taken])
    for sp, (_, original, _) in zip(params, taken):
        sp.show_sharded()
        register_sharded(sp.sharded, unit)
        retire(original, unit, sp)
    _move_buffers(module, info.device)
    install_forward_hooks(module, functools.partial(_pre_forward, unit), unit.post_forward)
    install_optimizer_guard()
    module.__class__ = _with_fsdp_methods(type(module))
    return module


def _pre_forward(unit: Unit, args: Any, kwargs: Any) -> tuple[Any, Any]:
    if unit.root is None:
        Root.claim(unit)
    return unit.pre_forward(args, kwargs)


def _ids_of(module: nn.Module, ignored_params: Optional[Iterable[nn.Parameter]]) -> set[int]:
    ignored = list(ignored_params or ())
    own = {id(p) for p in module.parameters()}
    strangers = [i for i, p in enumerate(ignored) if id(p) not in own]
    if strangers:
        raise ValueError(on_rank(f"ignored_params[{strangers[0]}] is not a parameter of the module given to fully_shard"))
    return {id(p) for p in ignored}


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                sub._buffers[name] = buffer.to(device)


@functools.lru_cache(maxsize=None)
def _with_fsdp_methods(cls: type) -> type:
    """``cls`` with :class:`FSDPModule` mixed in (one subclass per class, as FSDP2 does)."""
    if issubclass(cls, FSDPModule):
        return cls
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})


class UnshardHandle:
    """Returned by ``module.unshard(async_op=True)``: ``wait()`` finishes the all-gather."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_for_unshard()


class FSDPModule:
    """Methods a module gains from ``fully_shard`` (mixed into its class)."""

    def _fsdp_unit(self) -> Unit:
        return unit_of(self)  # type: ignore[arg-type]

    def _fsdp_units(self, recurse: bool) -> list[Unit]:
        return units_under(self) if recurse else [self._fsdp_unit()]  # type: ignore[arg-type]

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's own unit now (e.g. to prefetch by hand); with ``async_op``
        return a handle whose ``wait()`` finishes it. Its next forward then gathers nothing."""
        unit = self._fsdp_unit()
        unit.unshard(async_op=async_op)
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free this module's gathered parameters (its unit only)."""
        self._fsdp_unit().reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward accumulates full gradients locally with no communication (gradient
        accumulation); the next backward with ``True`` reduce-scatters the sum. As with DDP's
        ``no_sync``, the setting in force at a forward decides for its backward."""
        for unit in self._fsdp_units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for unit in self._fsdp_units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps parameters gathered after backward (saves the next forward's
        all-gather while accumulating gradients, at the cost of memory)."""
        for unit in self._fsdp_units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these sharded modules while this one computes its forward (replaces the
        default: the module that ran next in the previous forward)."""
        self._fsdp_unit().forward_prefetch = _units_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these sharded modules when this one's backward starts (replaces the default:
        the module that ran before it in forward)."""
        self._fsdp_unit().backward_prefetch = _units_of(modules)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context for DDP habits: forwards inside it accumulate gradients without communication
        (``set_requires_gradient_sync(False)`` for the module's units, restored on exit)."""
        units = self._fsdp_units(recurse=True)
        previous = [u.requires_gradient_sync for u in units]
        for unit in units:
            unit.requires_gradient_sync = False
        try:
            yield
        finally:
            for unit, value in zip(units, previous):
                unit.requires_gradient_sync = value


def _units_of(modules: list[nn.Module]) -> list[Unit]:
    units = [unit_of(m) for m in modules]
    missing = [type(m).__name__ for m, u in zip(modules, units) if u is None]
    if missing:
        raise ValueError(on_rank(f"prefetch targets must be modules fully_shard was applied to; {missing[0]} is not"))
    return units  # type: ignore[return-value]
