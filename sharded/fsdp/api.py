"""``fully_shard``: shard a module's parameters in place (ZeRO-3), FSDP2's way.

This file validates arguments and wires things up; the mechanism is in the private modules:

- ``_param``: one parameter's sharded and unsharded forms;
- ``_gather``: the protocol a unit gathers through, which ``_flat_buffers`` (plain parameters'
  flat buffers, and the gradients' packing) and ``_extension`` (the all-gather extension)
  implement; ``_collectives``: all-gather and reduce-scatter, moving bytes only;
- ``_gather_kinds``: which gathers a unit is made of (a flat buffer per compute dtype);
- ``_reduction``: a unit's gradient reduction, set up and in flight; ``_grad_dtypes``: the dtype
  gradients accumulate and reduce in, as the torch installed decides it;
- ``_settings``: a unit's settings and the step it shares with its model;
- ``_unit``: a unit's lifecycle; ``_root``: the model-wide forward/backward duties;
  ``_state``: the hooks that drive both; ``_hooks``: autograd and module-hook plumbing;
- ``_placement``: the mesh, DTensor parameters (tensor parallelism, ``dp_mesh_dims``) and the
  secondary shard (``reshard_after_forward=k``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional, Union, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._common.dtensors import is_dtensor, local_tensor_of
from .._common.errors import on_rank
from .._common.lowbit import LowBit
from ._arguments import as_our_policies, resolve_reshard_after_forward, shard_placements
from ._collect import check_not_sharded, collect_unit_params
from ._extension import has_gather_extension
from ._grad_dtypes import carry_grad_dtype
from ._fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from ._hooks import install_forward_hooks, install_state_dict_hooks
from ._lowbit import check_scope
from ._param import ShardedParam, ShardGeometry
from ._placement.dtensor import layout_for
from ._placement.mesh import MeshInfo, resolve_mesh
from ._placement.owned import Owned, OwnerRequest, choose_owners, owner_meshes, prepare_dtensor_rng
from ._placement.secondary_shard import secondary_shard_group, secondary_shard_world
from ._placement.spmd import resolve_spmd_mesh, spmd_layout
from ._registry import install_optimizer_guard, register_sharded, retire
from ._settings import UnitSettings
from ._state import UnitState, register_with_torch, state_of
from ._owned_routes import route_torch_for_owned
from ._unit import Unit
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
    mp_policy: Any = MixedPrecisionPolicy(),
    offload_policy: Any = None,
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    dp_mesh_dims: Any = None,
    lowbit: Optional[LowBit] = None,
) -> Any:
    """Shard ``module``'s parameters over the ranks, in place; returns ``module``.

    The arguments are ``torch.distributed.fsdp.fully_shard``'s (torch 2.13), plus
    ``process_group``; torch's own policy objects are accepted as well as ``sharded.fsdp``'s.

    Each call makes one *unit*: the parameters of ``module`` not already in a unit below it,
    all-gathered together just before ``module``'s forward and freed after it, gathered again
    for its backward, their gradients reduce-scattered as soon as that backward is done. Apply
    it bottom-up (e.g. to every transformer block, then to the whole model). A list of modules
    makes one unit over all of them (e.g. ``[model.norm, model.output]``) and returns the list.

    Afterwards every parameter is an ``nn.Parameter`` holding a DTensor sharded on dim 0
    (``Shard(0)``, or the dim ``shard_placement_fn`` chose; replicated across rows of a 2-D
    mesh): build the optimizer *after* this call,
    and it steps each rank's shard. ``p.full_tensor()``, ``torch.distributed.checkpoint`` and
    ``torch.nn.utils.clip_grad_norm_`` (which then returns the global norm) work unchanged.
    Parameter names, and so ``state_dict()`` keys, stay the same. Buffers stay replicated.

    The module becomes an instance of :class:`FSDPModule`, a subclass of torch's
    ``torch.distributed.fsdp.FSDPModule`` (``unshard``, ``reshard``, ``set_requires_gradient_sync``,
    ``set_gradient_divide_factor``, prefetch settings..., and ``no_sync``). As with torch's,
    ``fully_shard.state(module)`` gives the state of the call applied to ``module`` (``None`` if
    none was), and ``nn.ModuleList`` / ``nn.ModuleDict`` without a ``forward`` are refused.

    Args:
        module: the module, or a list of modules for one unit (their submodules' own
            ``fully_shard`` calls come first).
        process_group: the ranks to shard over (default: all); or give ``mesh``.
        mesh: a 1-D ``DeviceMesh`` to shard over, or a 2-D ``(replicate, shard)`` mesh for
            hybrid sharding: shard within a row, average gradients across rows. Parameters that
            are DTensors already (tensor parallelism on another dim of the same mesh, e.g.
            ``parallelize_module`` on ``mesh["tp"]`` and ``mesh=mesh["dp"]`` here) have their
            local tensors sharded over this mesh: at rest they are DTensors on both meshes, as
            with torch (2-D FSDP + TP).
        reshard_after_forward: free the gathered parameters after forward (``True``: ZeRO-3) or
            keep them until backward (``False``: less communication, more memory, like ZeRO-2);
            ``None`` (default): ``True``, except for the root. An ``int`` is the world to reshard
            to after forward: the shard world means ``True``, ``1`` means ``False``, a divisor
            ``k`` between (ZeRO++'s secondary shard) keeps ``1/k`` of the gathered parameters
            after forward and all-gathers within groups of ``k`` ranks in backward (not for
            DTensor parameters: ``NotImplementedError``, as in torch).
        shard_placement_fn: ``param -> None | Shard(dim) | Owned(...)``: the dim to cut each
            parameter on (``None``: 0; as in torch, a dim other than 0 must divide evenly over
            the shard world), or ``sharded.fsdp.Owned()`` to keep it whole on one rank of the
            shard group, chosen by step cost (``Owned(rank)``: that rank): broadcast from it
            for forward and backward, its gradient reduced onto it, its optimizer state and step
            there alone (for Muon and other whole-matrix optimizers; see
            :mod:`sharded.fsdp._placement.owned`). Another placement raises ``NotImplementedError``.
        mp_policy: mixed precision (:class:`MixedPrecisionPolicy`, ours or torch's).
        offload_policy: ``CPUOffloadPolicy`` (ours or torch's) to keep shards, gradients and the
            optimizer step on the CPU; ``None`` or ``OffloadPolicy()``: no offloading.
        ignored_params: parameters to leave alone: not sharded, not gathered, not reduced.
        dp_mesh_dims: a ``torch.distributed.fsdp.DataParallelMeshDims``: ``mesh`` is then the
            whole SPMD mesh, every parameter a DTensor on it, ``Replicate()`` on the data-parallel
            dims; sharded over the ``shard`` dim(s) (and all-reduced over the ``replicate``
            dims); several names in a field are flattened, as in torch. ``replicate`` alone
            raises ``NotImplementedError``.
        lowbit: a :class:`sharded.LowBit` policy to send the unit's parameter all-gathers
            (``params``) and gradient reduce-scatters (``grads``) in fewer bits, with the error
            bounds of ``docs/guides/lowbit.md``; ``None`` (default): exact. On a 1-D mesh of
            plain element-sharded parameters kept on the compute device only: hybrid and SPMD
            meshes, CPU offloading, ``Owned()`` placements, tensor-parallel parameters, the
            all-gather extension (and, for ``params``, ``reshard_after_forward=k``) raise
            ``ValueError``. The module's :attr:`FSDPModule.lowbit_traffic` gives each step's bytes.

    A parameter whose tensor defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (a tensor
    subclass such as torchao's float8 weights) is all-gathered through them, as torch calls them:
    the pre hook gives what to send (e.g. the weight in float8 or bfloat16: fewer bytes), the post
    hook builds the unsharded parameter from what arrived.
    """
    modules = _modules_of(module)
    mp_policy, offload_policy = as_our_policies(mp_policy, offload_policy)
    info = resolve_mesh(process_group, mesh) if dp_mesh_dims is None else _spmd_mesh(process_group, mesh, dp_mesh_dims, reshard_after_forward)
    reshard_after_forward = resolve_reshard_after_forward(reshard_after_forward, info.shard_world)
    for m in modules:
        check_not_sharded(m)
    taken = collect_unit_params(modules, _ids_of(modules, ignored_params))
    placements = shard_placements(shard_placement_fn, taken, info.shard_world)
    owners = _owners_of(taken, placements, info, reshard_after_forward)
    params = [
        ShardedParam(
            name,
            registered_as,
            ShardGeometry(local_tensor_of(param).shape, info.shard_world, placement),
            info.mesh,
            info.shard_rank,
            layout_for(param, name, info.mesh) if info.spmd is None else spmd_layout(param, name, info.spmd),
        )
        if isinstance(placement, int) else
        ShardedParam(name, registered_as, ShardGeometry(param.shape, 1), owner_meshes(info)[owners[i]], 0, owner=owners[i])
        for i, ((name, param, registered_as), placement) in enumerate(zip(taken, placements))
    ]
    for sp, (name, param, _) in zip(params, taken):
        sp.gather_extension = has_gather_extension(param, name, sp.geometry.dim)
        sp.compute_dtype = _compute_dtype(mp_policy, param, name)
    _check_tensor_parallel_params(params)
    lowbit = check_scope(lowbit, f"fully_shard({', '.join(type(m).__name__ for m in modules)})", info, params,
                         isinstance(offload_policy, CPUOffloadPolicy), secondary_shard_world(reshard_after_forward) is not None)
    settings = _unit_settings(info, params, mp_policy, offload_policy, reshard_after_forward)
    settings.lowbit = lowbit
    unit = Unit(modules, params, info, settings)
    state = UnitState(unit)
    register_with_torch(modules, state)
    unit.shard_from_full([local_tensor_of(param) for _, param, _ in taken])
    for sp, (_, original, _) in zip(params, taken):
        carry_grad_dtype(original, sp.sharded)
        sp.show_sharded()
        register_sharded(sp.sharded, unit)
        retire(original, unit, sp)
    for m in modules:
        _move_buffers(m, info.device)
        install_forward_hooks(m, functools.partial(state.pre_forward, m), functools.partial(state.post_forward, m))
        install_state_dict_hooks(m, unit.reshard_at_rest, functools.partial(unit.adopt_assigned_params, shards_only=True))
        m.__class__ = _with_fsdp_methods(cast(type, type(m)))
    install_optimizer_guard()
    return module


fully_shard.state = state_of  # type: ignore[attr-defined]  # torch's fully_shard has it too


def _compute_dtype(mp_policy: MixedPrecisionPolicy, param: nn.Parameter, name: str) -> Optional[torch.dtype]:
    """The dtype ``param`` is gathered in (``None``: its own)."""
    try:
        return mp_policy.compute_dtype_of(param, name)
    except ValueError as bad:
        raise ValueError(on_rank(f"fully_shard: {bad}")) from None


def _spmd_mesh(process_group: Any, mesh: Optional[DeviceMesh], dp_mesh_dims: Any, reshard_after_forward: Any) -> MeshInfo:
    if process_group is not None:
        raise ValueError(on_rank("fully_shard(dp_mesh_dims=...) takes the SPMD mesh as mesh=, not process_group="))
    if secondary_shard_world(reshard_after_forward) is not None:
        raise NotImplementedError(on_rank("fully_shard: reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"))
    return resolve_spmd_mesh(mesh, dp_mesh_dims)


def _unit_settings(
    info: MeshInfo, params: list[ShardedParam], mp_policy: MixedPrecisionPolicy, offload_policy: Optional[OffloadPolicy],
    reshard_after_forward: Union[bool, int, None],
) -> UnitSettings:
    """The new unit's settings. ``reshard_after_forward=k`` is ``True`` with a secondary shard
    group of ``k`` ranks (collective: it may create that group)."""
    world = secondary_shard_world(reshard_after_forward)
    if world is None:
        return UnitSettings(mp_policy, offload_policy, None if reshard_after_forward is None else bool(reshard_after_forward))
    _check_plain_params(params, world)
    return UnitSettings(mp_policy, offload_policy, reshard_after_forward=True, secondary_shard=secondary_shard_group(info, world))


def _owners_of(taken: list, placements: list, info: MeshInfo, reshard_after_forward: Union[bool, int, None]) -> dict[int, int]:
    """Index -> owner (a shard-group rank) of each parameter ``shard_placement_fn`` placed with
    :class:`~._placement.owned.Owned`, chosen by the balancer; the placement's refusals."""
    requests = {i: OwnerRequest(name, param.shape, p) for i, ((name, param, _), p) in enumerate(zip(taken, placements)) if isinstance(p, Owned)}
    if not requests:
        return {}
    first = next(iter(requests.values())).fqn
    refused = [why for why, asked in (
        ("on an SPMD mesh (dp_mesh_dims)", info.spmd is not None),
        (f"with reshard_after_forward={reshard_after_forward} (a secondary shard)", secondary_shard_world(reshard_after_forward) is not None),
        ("for a DTensor (tensor-parallel) parameter", any(is_dtensor(taken[i][1]) for i in requests)),
    ) if asked]
    if refused:
        raise NotImplementedError(on_rank(f"fully_shard: parameter {first} is placed Owned() {refused[0]}; the owner placement keeps a plain parameter whole on a rank of a 1-D or hybrid mesh"))
    prepare_dtensor_rng(info)
    route_torch_for_owned()
    return dict(zip(requests, choose_owners(list(requests.values()), info)))


def _check_tensor_parallel_params(params: list[ShardedParam]) -> None:
    """DTensor (tensor-parallel) parameters are cut on dim 0 of their local tensor, gathered
    plainly; owner-placed parameters are broadcast whole, never through the all-gather extension."""
    for sp in params:
        if sp.owner is not None and sp.gather_extension:
            raise NotImplementedError(on_rank(
                f"fully_shard: parameter {sp.fqn} has the all-gather extension (fsdp_pre_all_gather) and is placed "
                "Owned(); owner-placed parameters are broadcast whole from their owner"
            ))
        if sp.layout is not None and (sp.geometry.dim != 0 or sp.gather_extension):
            what = f"shard_placement_fn chose Shard({sp.geometry.dim})" if sp.geometry.dim else "it has the all-gather extension"
            raise NotImplementedError(on_rank(
                f"fully_shard: parameter {sp.fqn} is a DTensor (tensor parallelism) and {what}; sharded shards "
                "DTensor parameters on dim 0 of their local tensor, with a plain all-gather, only"
            ))


def _check_plain_params(params: list[ShardedParam], reshard_after_forward: int) -> None:
    tensor_parallel = [sp.fqn for sp in params if sp.layout is not None]
    if tensor_parallel:
        raise NotImplementedError(on_rank(
            f"fully_shard(reshard_after_forward={reshard_after_forward}): parameter {tensor_parallel[0]} is a DTensor; "
            "resharding to a smaller mesh is not supported for DTensor parameters (nor by torch)"
        ))


def _modules_of(module: Any) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    strangers = [m for m in modules if not isinstance(m, nn.Module)]
    if strangers or not modules:
        what = type(strangers[0]).__name__ if strangers else "an empty list"
        raise TypeError(on_rank(f"fully_shard takes an nn.Module or a list of them, got {what}"))
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError(on_rank("fully_shard got the same module twice in its list"))
    for m in modules:  # as torch: a forward pre-hook on a container nobody calls would never run
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(on_rank(
                f"fully_shard does not support containers that do not implement forward: {type(m).__name__} "
                "has no forward, so its unit would never gather; apply fully_shard to the modules inside it, "
                "or to the module whose forward calls them"
            ))
    return modules


def _ids_of(modules: list[nn.Module], ignored_params: Optional[Iterable[nn.Parameter]]) -> set[int]:
    ignored = list(ignored_params or ())
    own = {id(p) for m in modules for p in m.parameters()}
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
