"""``FullyShardedDataParallel``'s arguments in their three dialects, read into one frozen object.

Code reaches the FSDP1-shaped wrapper in three spellings of the same choices:

* torch FSDP1's: ``sharding_strategy``, ``cpu_offload=CPUOffload(...)``,
  ``mixed_precision=MixedPrecision(...)``, ``auto_wrap_policy``, ``device_id`` as a CUDA index;
* fairscale's: ``reshard_after_forward`` (``False``: ``SHARD_GRAD_OP``), ``move_params_to_cpu``
  or ``cpu_offload=True``, ``mixed_precision=True`` with ``compute_dtype`` and
  ``fp32_reduce_scatter``, ``fsdp_auto_wrap_policy``;
* Lightning's strategy: a set of layer classes as the wrap policy, ``device_id`` as the
  ``torch.device`` it trains on, a ``device_mesh`` it built for hybrid sharding.

:func:`fsdp1_options` turns any mix of them into one :class:`FSDP1Options`, raising where two
spellings contradict each other. It is pure (no ranks, no process groups, nothing moved), so
every mapping is tested on its own; the wrapper's build only reads the result. The FSDP1 option
types (:class:`ShardingStrategy`, :class:`CPUOffload`, :class:`MixedPrecision`) live here too and
are re-exported by :mod:`.fully_sharded_data_parallel`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch import nn

from .._common.errors import on_rank
from .._common.lowbit import LowBit
from .policies import BackwardPrefetch, CPUOffloadPolicy, MixedPrecisionPolicy
from .wrap import WrapPolicy, as_wrap_policy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CPUOffload", "FSDP1Options", "MixedPrecision", "ProcessGroups", "ShardingStrategy", "fsdp1_options"]

logger = logging.getLogger(__name__)

ProcessGroups = Union[None, dist.ProcessGroup, tuple]
_Enum = TypeVar("_Enum", bound=enum.Enum)


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


_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


@dataclass(frozen=True)
class FSDP1Options:
    """The wrapper's choices, one spelling each; properties give what ``fully_shard`` takes.

    Attributes:
        strategy: the :class:`ShardingStrategy`.
        process_group: ``None``, a group, or for hybrid sharding a ``(shard, replicate)`` pair.
        device_mesh: the mesh given, if any.
        device: the compute device to move the module to first; ``None``: leave it where it
            is, and materialise meta tensors on the mesh's device.
        offload_params: whether shards, gradients and the optimizer step live on the CPU.
        mixed_precision: FSDP1's :class:`MixedPrecision`, or ``None``.
        wrap_policy: picks the submodules that become units of their own; ``None``: only the root.
        backward_prefetch: when each unit prefetches the next one in backward.
        ignored_modules: modules whose parameters stay unsharded and unsynchronised.
        param_init_fn: materialises meta-device submodules; ``None``: ``reset_parameters()``.
        sync_module_states: whether every rank starts from rank 0's parameters and buffers.
        shard_placement_fn: ``fully_shard``'s, for every unit: how each parameter is placed
            (``None`` / ``Shard(dim)`` / ``sharded.fsdp.Owned()``); ``None``: all cut on dim 0.
        lowbit: ``fully_shard``'s, for every unit: what the unit's collectives send in fewer bits.
    """

    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    process_group: ProcessGroups = None
    device_mesh: Optional[DeviceMesh] = None
    device: Optional[torch.device] = None
    offload_params: bool = False
    mixed_precision: Optional[MixedPrecision] = None
    wrap_policy: Optional[WrapPolicy] = None
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    ignored_modules: tuple[nn.Module, ...] = ()
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    sync_module_states: bool = False
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None
    lowbit: Optional[LowBit] = None

    @property
    def hybrid(self) -> bool:
        """Whether units shard within a row of ranks and replicate across rows."""
        return self.strategy in _HYBRID

    @property
    def reshard_after_forward(self) -> Optional[bool]:
        """``fully_shard``'s: ``None`` (FSDP2's "after forward, except the root": FSDP1 keeps the
        root gathered too) for the strategies that free after forward, else ``False``."""
        return None if self.strategy in _RESHARD_AFTER_FORWARD else False

    @property
    def offload_policy(self) -> Optional[CPUOffloadPolicy]:
        return CPUOffloadPolicy() if self.offload_params else None

    @property
    def buffer_dtype(self) -> Optional[torch.dtype]:
        """The dtype floating-point buffers are cast to before sharding, if any."""
        return self.mixed_precision.buffer_dtype if self.mixed_precision is not None else None

    def mp_policy(self, root: bool) -> MixedPrecisionPolicy:
        """``fully_shard``'s mixed precision for the root unit or another one (FSDP1 casts the
        root's forward inputs and the others' by separate switches). FSDP1 reduces in
        ``param_dtype`` unless told otherwise, on every torch: spelled out, as ``fully_shard``'s
        own default follows ``grad_dtype`` from torch 2.15 on."""
        mixed = self.mixed_precision
        if mixed is None:
            return MixedPrecisionPolicy()
        cast = mixed.cast_root_forward_inputs if root else mixed.cast_forward_inputs
        return MixedPrecisionPolicy(mixed.param_dtype, mixed.reduce_dtype or mixed.param_dtype, cast_forward_inputs=cast)


def fsdp1_options(
    *,
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
    use_orig_params: bool = True,
    device_mesh: Optional[DeviceMesh] = None,
    fsdp_auto_wrap_policy: Any = None,
    reshard_after_forward: Optional[bool] = None,
    move_params_to_cpu: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
    fp32_reduce_scatter: bool = False,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
    lowbit: Optional[LowBit] = None,
) -> FSDP1Options:
    """One :class:`FSDP1Options` from ``FullyShardedDataParallel``'s arguments in any dialect.

    The arguments are the wrapper's (see its docstring) except those accepted for
    compatibility only. Raises ``ValueError`` where two spellings of one choice are both given,
    or a ``(shard, replicate)`` group pair comes without a hybrid strategy, and ``TypeError``
    for a wrap policy of no known shape.
    """
    if auto_wrap_policy is not None and fsdp_auto_wrap_policy is not None:
        raise ValueError(on_rank("pass auto_wrap_policy or its alias fsdp_auto_wrap_policy, not both"))
    if not use_orig_params:
        logger.info("use_orig_params=False is treated as True: parameters are always the original ones")
    strategy = _strategy(sharding_strategy, reshard_after_forward)
    _check_group_pair(process_group, strategy)
    return FSDP1Options(
        strategy=strategy,
        process_group=process_group,
        device_mesh=device_mesh,
        device=_device(device_id),
        offload_params=_offload_params(cpu_offload, move_params_to_cpu),
        mixed_precision=_mixed_precision(mixed_precision, compute_dtype, fp32_reduce_scatter),
        wrap_policy=as_wrap_policy(auto_wrap_policy if auto_wrap_policy is not None else fsdp_auto_wrap_policy),
        backward_prefetch=None if backward_prefetch is None else _as_ours(backward_prefetch, BackwardPrefetch, "backward_prefetch"),
        ignored_modules=tuple(ignored_modules or ()),
        param_init_fn=param_init_fn,
        sync_module_states=sync_module_states,
        shard_placement_fn=shard_placement_fn,
        lowbit=lowbit,
    )


def _strategy(sharding_strategy: Optional[ShardingStrategy], reshard_after_forward: Optional[bool]) -> ShardingStrategy:
    """FSDP1's ``sharding_strategy`` (default ``FULL_SHARD``) or fairscale's ``reshard_after_forward``."""
    if reshard_after_forward is None:
        return ShardingStrategy.FULL_SHARD if sharding_strategy is None else _as_ours(sharding_strategy, ShardingStrategy, "sharding_strategy")
    if sharding_strategy is not None:
        raise ValueError(on_rank("pass sharding_strategy or fairscale's reshard_after_forward, not both"))
    return ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def _as_ours(value: object, ours: type[_Enum], argument: str) -> _Enum:
    """``value`` as a member of our enum ``ours``: torch's enum of the same name (code written for
    torch's FSDP passes it) maps by member name; anything else raises."""
    if isinstance(value, ours):
        return value
    if isinstance(value, enum.Enum) and value.name in ours.__members__:
        return ours[value.name]
    raise TypeError(on_rank(f"{argument} must be a {ours.__name__} (sharded's or torch's), got {value!r}"))


def _check_group_pair(process_group: ProcessGroups, strategy: ShardingStrategy) -> None:
    if isinstance(process_group, tuple) and strategy not in _HYBRID:
        raise ValueError(on_rank(f"a (shard_group, replicate_group) pair is for hybrid sharding, not {strategy.name}"))


def _device(device_id: Union[None, int, torch.device]) -> Optional[torch.device]:
    """FSDP1's CUDA index, or the ``torch.device`` Lightning passes."""
    if device_id is None:
        return None
    return torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)


def _offload_params(cpu_offload: Union[None, CPUOffload, bool], move_params_to_cpu: bool) -> bool:
    """FSDP1's ``CPUOffload`` (sharded's or torch's), fairscale's ``move_params_to_cpu``, or
    fairscale's older ``cpu_offload=True``."""
    if move_params_to_cpu:
        return True
    if isinstance(cpu_offload, bool):
        return cpu_offload
    return cpu_offload is not None and bool(cpu_offload.offload_params)


def _mixed_precision(
    mixed_precision: Union[None, MixedPrecision, bool], compute_dtype: Optional[torch.dtype], fp32_reduce_scatter: bool
) -> Optional[MixedPrecision]:
    """FSDP1's ``MixedPrecision`` as given, or fairscale's ``mixed_precision=True``: compute in
    ``compute_dtype`` (default fp16), reduce in fp32 with ``fp32_reduce_scatter``, else in the
    compute dtype; the masters stay fp32."""
    if not isinstance(mixed_precision, bool):
        return mixed_precision
    if not mixed_precision:
        return None
    compute = compute_dtype or torch.float16
    return MixedPrecision(compute, torch.float32 if fp32_reduce_scatter else compute)
