"""``FullyShardedDataParallel``: the FSDP1 / fairscale-shaped wrapper, built on ``fully_shard``.

Code written against ``torch.distributed.fsdp.FullyShardedDataParallel`` or fairscale's FSDP
keeps working: the same constructor arguments (``fsdp_auto_wrap_policy`` too), ``.module``,
``no_sync()``, ``clip_grad_norm_()``, ``summon_full_params()``, and full state dicts under the
unwrapped model's names. Underneath, each unit is an ordinary ``fully_shard`` unit, so the
parameters are the original ones (always ``use_orig_params=True``), sharded as DTensors.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, TypeVar, Union, cast, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._common.broadcast import plan_broadcasts, start_broadcasts
from .._common.dtensors import full_model_state_dict
from .._common.errors import on_rank
from .._common.flat import DEFAULT_BUCKET_NUMEL
from .._common.lowbit import LowBit, StepTraffic
from ._collect import modules_outside_units
from ._fsdp1_options import CPUOffload, FSDP1Options, MixedPrecision, ProcessGroups, ShardingStrategy, fsdp1_options
from ._fsdp_module import FSDPModule
from ._full_params import load_full_model_state_dict, summon_full_params
from ._grad_norm import clip_grad_norm_
from ._placement.mesh import MeshInfo, hybrid_mesh, mesh_from_groups, resolve_mesh
from ._unit import units_under
from .api import fully_shard
from .policies import BackwardPrefetch
from .wrap import modules_to_wrap

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "CPUOffload", "MixedPrecision"]

_Module = TypeVar("_Module", bound=nn.Module)
_applying: list[nn.Module] = []  # the wrapper whose apply() holds the full parameters now


class _StaticOrFairscale:
    """``summon_full_params`` in both spellings: torch's static ``FSDP.summon_full_params(model,
    writeback=...)`` on the class, fairscale's ``model.summon_full_params(recurse=True,
    volatile=False)`` on an instance (``volatile``: changes are not written back)."""

    def __init__(self, static: Callable[..., contextlib.AbstractContextManager]) -> None:
        self.static = static
        self.__doc__ = static.__doc__

    def __get__(self, instance: Optional[nn.Module], owner: type) -> Callable[..., contextlib.AbstractContextManager]:
        if instance is None:
            return self.static
        return functools.partial(self._fairscale, instance)

    def _fairscale(
        self, instance: nn.Module, recurse: bool = True, volatile: bool = False, **torch_kwargs: Any
    ) -> contextlib.AbstractContextManager:
        if not recurse:
            raise NotImplementedError(on_rank("summon_full_params(recurse=False): every unit under the module is gathered"))
        if volatile:
            torch_kwargs.setdefault("writeback", False)
        return self.static(instance, **torch_kwargs)


_Destination = TypeVar("_Destination", bound=dict[str, Any])


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer state over the ranks (ZeRO-3).

    ``auto_wrap_policy`` picks the submodules that become units of their own (each gathered and
    freed on its own); the root module becomes the unit for what is left. Build the optimizer
    after wrapping, from ``model.parameters()``. The arguments, in torch FSDP1's, fairscale's or
    Lightning's spelling, are first read into one :class:`._fsdp1_options.FSDP1Options` (where
    contradictory spellings raise); the build reads only that.

    Args:
        module: the model.
        process_group: the ranks to shard over; for hybrid strategies a
            ``(shard_group, replicate_group)`` pair (or give ``device_mesh``).
        sharding_strategy: a :class:`ShardingStrategy` (default ``FULL_SHARD``).
        cpu_offload: :class:`CPUOffload`.
        auto_wrap_policy: an FSDP1 policy callable, a ``ModuleWrapPolicy`` or a set of module
            classes (see :mod:`sharded.fsdp.wrap`); ``fsdp_auto_wrap_policy`` is fairscale's name.
        backward_prefetch: ``BackwardPrefetch.BACKWARD_PRE`` / ``BACKWARD_POST`` / ``None``.
        mixed_precision: :class:`MixedPrecision`.
        ignored_modules: modules whose parameters are left unsharded and unsynchronised.
        param_init_fn: materialises meta-device modules unit by unit (called on each submodule
            with meta tensors); without it such modules get ``to_empty`` + ``reset_parameters()``.
        device_id: the compute device to move the module to first.
        sync_module_states: every rank starts from rank 0's parameters and buffers: each unit's
            are broadcast (bucketed) after ``param_init_fn`` / ``reset_parameters`` has
            materialised them and before they are sharded, so a meta-device model built with
            a different RNG on each rank ends with rank 0's values everywhere.
        device_mesh: a 2-D ``(replicate, shard)`` mesh for the hybrid strategies.
        forward_prefetch, limit_all_gathers, use_orig_params, flatten_parameters (fairscale): accepted for compatibility; the
            next unit is always prefetched in forward, at most one unit ahead, and parameters
            are always the original ones.
        shard_placement_fn: ``fully_shard``'s, for every unit (beyond torch's FSDP1): ``param ->
            None | Shard(dim) | sharded.fsdp.Owned()``, e.g. ``lambda p: Owned() if p.ndim == 2
            else None`` to keep each matrix whole on one rank for a whole-matrix optimizer
            (Muon); full state dicts and ``summon_full_params`` give such parameters whole.
        lowbit: ``fully_shard``'s, for every unit (beyond torch's FSDP1): a
            :class:`sharded.LowBit` policy for low-bit all-gathers and reduce-scatters;
            :attr:`lowbit_traffic` gives each step's bytes.
        reshard_after_forward, move_params_to_cpu, compute_dtype, fp32_reduce_scatter, and
            ``mixed_precision=True``: fairscale's spellings of ``SHARD_GRAD_OP`` (when
            ``False``), ``CPUOffload`` and ``MixedPrecision(compute_dtype or fp16, fp32 or the
            compute dtype)``.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: ProcessGroups = None,
        sharding_strategy: Optional[ShardingStrategy] = None,
        cpu_offload: Union[None, CPUOffload, bool] = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Union[None, MixedPrecision, bool] = None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id: Union[None, int, torch.device] = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = True,
        device_mesh: Optional[DeviceMesh] = None,
        *,
        fsdp_auto_wrap_policy: Any = None,
        reshard_after_forward: Optional[bool] = None,
        move_params_to_cpu: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
        lowbit: Optional[LowBit] = None,
    ) -> None:
        super().__init__()
        options = fsdp1_options(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            ignored_modules=ignored_modules,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            use_orig_params=use_orig_params,
            device_mesh=device_mesh,
            fsdp_auto_wrap_policy=fsdp_auto_wrap_policy,
            reshard_after_forward=reshard_after_forward,
            move_params_to_cpu=move_params_to_cpu,
            compute_dtype=compute_dtype,
            fp32_reduce_scatter=fp32_reduce_scatter,
            shard_placement_fn=shard_placement_fn,
        )
        mesh = _mesh_for(options)
        device = options.device if options.device is not None else MeshInfo(mesh).device
        if options.device is not None and not _has_meta(module):
            module.to(device)
        if options.buffer_dtype is not None:
            _cast_buffers(module, options.buffer_dtype)
        _shard_units(module, options, mesh, device, lowbit)
        self.module = module
        self.sharding_strategy = options.strategy
        self.register_load_state_dict_pre_hook(_restore_wrapper_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    def apply(self: _Module, fn: Callable[[nn.Module], None]) -> _Module:
        """Collective: ``fn`` on every submodule, as ``nn.Module.apply``, with full parameters
        (written back to the shards after), as FSDP1 and fairscale do: an initialiser such as
        ``normal_`` run on each rank's shard would not give the unwrapped model's numbers.
        Wrappers nested under this one (or under a module being applied) gather once, here."""
        if _applying:
            return super().apply(fn)  # type: ignore[misc]
        _applying.append(self)
        try:
            with summon_full_params(cast(FullyShardedDataParallel, self).module, writeback=True):
                return super().apply(fn)  # type: ignore[misc]
        finally:
            _applying.pop()

    @property
    def lowbit_traffic(self) -> Optional[StepTraffic]:
        """The last step's bytes of the ``lowbit`` collectives (``FSDPModule.lowbit_traffic`` of
        the wrapped module); ``None`` without ``lowbit``."""
        return cast(FSDPModule, self.module).lowbit_traffic

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Forwards inside accumulate gradients locally, with no communication."""
        return cast(FSDPModule, self.module).no_sync()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their global norm (over every rank's shards); returns that norm."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def _summon_full_params(
        module: nn.Module,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager:
        """Collective context with full parameters in every sharded module under ``module``."""
        if with_grads:
            raise NotImplementedError(on_rank("summon_full_params(with_grads=True) is not supported"))
        return summon_full_params(module, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)

    summon_full_params = _StaticOrFairscale(_summon_full_params)
    del _summon_full_params

    @overload
    def state_dict(self, *, destination: _Destination, prefix: str = ..., keep_vars: bool = ...) -> _Destination: ...

    @overload
    def state_dict(self, *, prefix: str = ..., keep_vars: bool = ...) -> dict[str, Any]: ...

    def state_dict(self, *args: Any, destination: Optional[dict] = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Collective: full tensors under the unwrapped model's names, on every rank."""
        destination = collections.OrderedDict() if destination is None else destination
        for key, value in full_model_state_dict(self.module).items():
            destination[prefix + key] = value
        return destination

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Collective: load a full (or DTensor) state dict keyed by the unwrapped model's names,
        copied into each rank's rows. ``assign=True`` raises ``NotImplementedError``: the values
        are copied, never adopted (load DTensor shards with ``assign=True`` into ``self.module``,
        the sharded model, to have them adopted)."""
        if assign:
            raise NotImplementedError(on_rank(
                "FullyShardedDataParallel.load_state_dict(assign=True): the wrapper copies a full state dict "
                "into its shards; to adopt tensors, load DTensor shards laid out as the parameters with "
                "wrapper.module.load_state_dict(shards, assign=True)"
            ))
        return load_full_model_state_dict(self.module, state_dict, strict=strict)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)


def _restore_wrapper_prefix(
    wrapper: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool, missing: list, unexpected: list, errors: list
) -> None:
    """Load pre-hook of a wrapper nested inside another module: ``state_dict()`` names its entries
    without the wrapper's ``module.`` (the unwrapped model's names), so ``load_state_dict`` on an
    enclosing module reaching this wrapper puts it back; a name already valid is left as given."""
    inner = cast(nn.Module, wrapper.module)
    valid = {f"module.{n}" for n, _ in inner.named_parameters(remove_duplicate=False)}
    valid |= {f"module.{n}" for n, _ in inner.named_buffers(remove_duplicate=False)}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if rest not in valid:
            state_dict[f"{prefix}module.{rest}"] = state_dict.pop(key)


def _mesh_for(options: FSDP1Options) -> DeviceMesh:
    """The mesh the units shard over: the one given, one built from the groups given, one row
    per node for hybrid sharding, or one rank per row (nothing sharded) for ``NO_SHARD``."""
    process_group, given = options.process_group, options.device_mesh
    if isinstance(process_group, tuple):  # a (shard, replicate) pair: hybrid, as the options checked
        return given if given is not None else mesh_from_groups(*process_group)
    if options.hybrid:
        return given if given is not None else hybrid_mesh(_ranks_per_node(), process_group)
    if options.strategy is ShardingStrategy.NO_SHARD:
        return hybrid_mesh(1, process_group)
    return given if given is not None else resolve_mesh(process_group, None).mesh


def _ranks_per_node() -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local)
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    raise ValueError(on_rank("hybrid sharding: pass device_mesh or process_group=(shard, replicate), or run under torchrun (LOCAL_WORLD_SIZE)"))


def _shard_units(module: nn.Module, options: FSDP1Options, mesh: DeviceMesh, device: torch.device, lowbit: Optional[LowBit]) -> None:
    """``fully_shard`` the submodules the wrap policy picks, children first, then ``module`` as
    the root unit for the rest; each unit is materialised (and synced from rank 0) just before."""
    ignored = frozenset(id(p) for m in options.ignored_modules for p in m.parameters())
    policy = options.wrap_policy
    for sub in [*(modules_to_wrap(module, policy, ignored) if policy is not None else []), module]:
        _materialise(sub, options.param_init_fn, device)
        if options.sync_module_states:
            _broadcast_from_rank0(sub, mesh)
        fully_shard(
            sub,
            mesh=mesh,
            reshard_after_forward=options.reshard_after_forward,
            mp_policy=options.mp_policy(root=sub is module),
            offload_policy=options.offload_policy,
            ignored_params=_own(sub, ignored),
            shard_placement_fn=options.shard_placement_fn,
            lowbit=lowbit,
        )
    for unit in units_under(module):
        unit.settings.backward_prefetch_timing = options.backward_prefetch


def _own(module: nn.Module, ignored: frozenset) -> list[nn.Parameter]:
    return [p for p in module.parameters() if id(p) in ignored]


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _materialise(module: nn.Module, param_init_fn: Optional[Callable[[nn.Module], None]], device: torch.device) -> None:
    """Give real storage to the meta tensors a unit is about to take (never the whole model at
    once): ``param_init_fn(submodule)``, or ``to_empty`` + the submodule's ``reset_parameters``."""
    for _, sub in modules_outside_units(module):
        own = [t for t in [*sub._parameters.values(), *sub._buffers.values()] if t is not None]
        if not any(t.is_meta for t in own):
            continue
        if param_init_fn is not None:
            param_init_fn(sub)
            continue
        reset = getattr(sub, "reset_parameters", None)
        if reset is None:
            raise ValueError(on_rank(f"{type(sub).__name__} is on the meta device and has no reset_parameters(); pass param_init_fn"))
        sub.to_empty(device=device, recurse=False)
        reset()


def _broadcast_from_rank0(module: nn.Module, mesh: DeviceMesh) -> None:
    """Give every rank the mesh's first rank's values of what ``module``'s unit is about to
    take: its parameters and buffers, materialised and still full. It must happen here, between
    materialising and sharding: before, meta tensors have no values to send; after, no rank holds
    a full tensor, and each rank's shard would keep its own initial rows. Bucketed, one message
    per bucket; on a hybrid mesh across the rows first, then within each row."""
    buckets = plan_broadcasts([_unit_states(module)], DEFAULT_BUCKET_NUMEL)
    with torch.no_grad():
        for dim in range(mesh.ndim):
            start_broadcasts(buckets, mesh.get_group(dim)).wait()


def _unit_states(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``module`` and of its descendants outside lower units
    (those were broadcast with their own unit), each once, detached."""
    found: dict[int, torch.Tensor] = {}
    for _, sub in modules_outside_units(module):
        for tensor in [*sub._parameters.values(), *sub._buffers.values()]:
            if tensor is not None and not tensor.is_meta:
                found.setdefault(id(tensor), tensor.detach())
    return list(found.values())


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                sub._buffers[name] = buffer.to(dtype)
