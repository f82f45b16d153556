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
import enum
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, TypeVar, Union, cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._common.broadcast import plan_broadcasts, start_broadcasts
from .._common.errors import on_rank
from .._common.flat import DEFAULT_BUCKET_NUMEL
from ._collect import modules_outside_units
from ._fsdp_module import FSDPModule
from ._full_params import full_model_state_dict, load_full_model_state_dict, summon_full_params
from ._grad_norm import clip_grad_norm_
from ._placement.mesh import MeshInfo, hybrid_mesh, mesh_from_groups, resolve_mesh
from ._unit import units_under
from .api import fully_shard
from .policies import BackwardPrefetch, CPUOffloadPolicy, MixedPrecisionPolicy
from .wrap import as_wrap_policy, modules_to_wrap

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "CPUOffload", "MixedPrecision"]

logger = logging.getLogger(__name__)



class ShardingStrategy(enum.Enum):
    """What each rank keeps (FSDP1's names)."""

    FULL_SHARD = enum.auto()  # ZeRO-3: parameters freed after forward, gathered again for backward
    SHARD_GRAD_OP = enum.auto()  # ZeRO-2 communication: parameters kept from forward to backward
    NO_SHARD = enum.auto()  # DDP: every rank keeps everything, gradients all-reduced
    HYBRID_SHARD = enum.auto()  # FULL_SHARD within a node, replicated across nodes
    _HYBRID_SHARD_ZERO2 = enum.auto()  # SHARD_GRAD_OP within a node, replicated across nodes


@dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True``: shards, gradients and the optimizer step live on the CPU."""

    offload_params: bool = False


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP1's mixed precision: compute in ``param_dtype``, reduce in ``reduce_dtype`` (default:
    ``param_dtype``), buffers cast to ``buffer_dtype``; sharded masters keep their dtype."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True


ProcessGroups = Union[None, dist.ProcessGroup, tuple]
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
    after wrapping, from ``model.parameters()``.

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
    ) -> None:
        super().__init__()
        if auto_wrap_policy is not None and fsdp_auto_wrap_policy is not None:
            raise ValueError(on_rank("pass auto_wrap_policy or its alias fsdp_auto_wrap_policy, not both"))
        if not use_orig_params:
            logger.info("use_orig_params=False is treated as True: parameters are always the original ones")
        if reshard_after_forward is not None:
            if sharding_strategy is not None:
                raise ValueError(on_rank("pass sharding_strategy or fairscale's reshard_after_forward, not both"))
            sharding_strategy = ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        if isinstance(cpu_offload, bool):  # fairscale's older spelling of move_params_to_cpu
            cpu_offload = CPUOffload(offload_params=cpu_offload)
        if move_params_to_cpu:
            cpu_offload = CPUOffload(offload_params=True)
        if isinstance(mixed_precision, bool):  # fairscale: fp16 compute (or compute_dtype), fp32 masters
            compute = compute_dtype or torch.float16
            reduce = torch.float32 if fp32_reduce_scatter else compute
            mixed_precision = MixedPrecision(compute, reduce) if mixed_precision else None
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        mesh = _mesh_for(strategy, process_group, device_mesh)
        device = _device_for(device_id, MeshInfo(mesh).device)
        if device_id is not None and not _has_meta(module):
            module.to(device)
        ignored = frozenset(id(p) for m in ignored_modules or () for p in m.parameters())
        if mixed_precision is not None and mixed_precision.buffer_dtype is not None:
            _cast_buffers(module, mixed_precision.buffer_dtype)
        shard: dict[str, Any] = dict(
            mesh=mesh,
            # None: FSDP2's "after forward, except the root" (FSDP1 keeps the root gathered too)
            reshard_after_forward=None if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD) else False,
            offload_policy=CPUOffloadPolicy() if cpu_offload is not None and cpu_offload.offload_params else None,
        )
        policy = as_wrap_policy(auto_wrap_policy if auto_wrap_policy is not None else fsdp_auto_wrap_policy)
        for sub in [*(modules_to_wrap(module, policy, ignored) if policy is not None else []), module]:
            _materialise(sub, param_init_fn, device)
            if sync_module_states:
                _broadcast_from_rank0(sub, mesh)
            mp_policy = _mp_policy(mixed_precision, root=sub is module)
            fully_shard(sub, mp_policy=mp_policy, ignored_params=_own(sub, ignored), **shard)
        for unit in units_under(module):
            unit.settings.backward_prefetch_timing = backward_prefetch
        self.module = module
        self.sharding_strategy = strategy
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


def _mesh_for(strategy: ShardingStrategy, process_group: ProcessGroups, device_mesh: Optional[DeviceMesh]) -> DeviceMesh:
    hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if isinstance(process_group, tuple):
        if not hybrid:
            raise ValueError(on_rank(f"a (shard_group, replicate_group) pair is for hybrid sharding, not {strategy.name}"))
        return device_mesh if device_mesh is not None else mesh_from_groups(*process_group)
    if hybrid:
        return device_mesh if device_mesh is not None else hybrid_mesh(_ranks_per_node(), process_group)
    if strategy is ShardingStrategy.NO_SHARD:
        return hybrid_mesh(1, process_group)
    return device_mesh if device_mesh is not None else resolve_mesh(process_group, None).mesh


def _ranks_per_node() -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local)
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    raise ValueError(on_rank("hybrid sharding: pass device_mesh or process_group=(shard, replicate), or run under torchrun (LOCAL_WORLD_SIZE)"))


def _device_for(device_id: Union[None, int, torch.device], default: torch.device) -> torch.device:
    if device_id is None:
        return default
    return torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)


def _mp_policy(mixed_precision: Optional[MixedPrecision], root: bool) -> MixedPrecisionPolicy:
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    cast = mixed_precision.cast_root_forward_inputs if root else mixed_precision.cast_forward_inputs
    return MixedPrecisionPolicy(mixed_precision.param_dtype, mixed_precision.reduce_dtype, cast_forward_inputs=cast)


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
