"""How the FSDP strategy shards a module: its arguments in Lightning's shapes, turned into a call
of sharded's layer 3, plus activation checkpointing of chosen layers.

Lightning users bring ``FSDPStrategy``'s arguments, which are spelled in torch FSDP1's types
(``ShardingStrategy`` members or their names, ``CPUOffload``, ``MixedPrecision``, a set of layer
classes or a policy callable). This module accepts those spellings (torch's objects as well as
sharded's) and builds :class:`sharded.fsdp.FullyShardedDataParallel` from them. Nothing here
imports Lightning.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..fsdp import FullyShardedDataParallel
from ..fsdp.fully_sharded_data_parallel import CPUOffload, MixedPrecision, ShardingStrategy
from ..fsdp.wrap import as_wrap_policy, modules_to_wrap

__all__ = ["FSDPConfig", "checkpoint_activations", "is_sharded", "shard_module"]

# The strategies Lightning's FSDPStrategy offers by name.
_STRATEGY_NAMES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
# FullyShardedDataParallel's arguments that the strategy sets itself.
_SET_BY_STRATEGY = ("self", "module", "sharding_strategy", "cpu_offload", "mixed_precision", "auto_wrap_policy", "device_id")


@dataclass(frozen=True)
class FSDPConfig:
    """How to shard: the strategy's arguments, validated and converted to sharded's types.

    Args:
        sharding_strategy: a name (``"FULL_SHARD"``...) or a ``ShardingStrategy`` member,
            sharded's or torch's.
        cpu_offload: ``True``/``False`` or a ``CPUOffload`` (sharded's or torch's).
        mixed_precision: a ``MixedPrecision`` (sharded's or torch's) or ``None``.
        auto_wrap_policy: a set of layer classes or a wrap-policy callable (see
            :mod:`sharded.fsdp.wrap`), or ``None``: the layers that become units of their own.
        activation_checkpointing_policy: the same shapes: the layers whose activations are
            recomputed in backward instead of kept.
        wrapper_kwargs: further arguments of ``FullyShardedDataParallel``.
    """

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    cpu_offload: CPUOffload = CPUOffload()
    mixed_precision: Optional[MixedPrecision] = None
    auto_wrap_policy: Optional[Callable[..., bool]] = None
    activation_checkpointing_policy: Optional[Callable[..., bool]] = None
    wrapper_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_arguments(
        cls,
        sharding_strategy: Any,
        cpu_offload: Any,
        mixed_precision: Any,
        auto_wrap_policy: Any,
        activation_checkpointing_policy: Any,
        wrapper_kwargs: Mapping[str, Any],
    ) -> "FSDPConfig":
        """The config for the strategy's arguments; raises naming any argument it cannot take."""
        return cls(
            sharding_strategy=_as_sharding_strategy(sharding_strategy),
            cpu_offload=_as_cpu_offload(cpu_offload),
            mixed_precision=_as_mixed_precision(mixed_precision),
            auto_wrap_policy=_as_policy("auto_wrap_policy", auto_wrap_policy),
            activation_checkpointing_policy=_as_policy("activation_checkpointing_policy", activation_checkpointing_policy),
            wrapper_kwargs=_checked_wrapper_kwargs(wrapper_kwargs),
        )


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was already applied to ``module`` (a LightningModule fitted before)."""
    from ..fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_module(module: nn.Module, config: FSDPConfig, device: Optional[torch.device]) -> FullyShardedDataParallel:
    """``module`` sharded as ``config`` says, its meta-device layers materialised unit by unit.

    Layers the user already sharded (``fully_shard`` in ``configure_model``) are kept as they
    are, and only the rest becomes the root unit: the auto-wrap policy applies to unsharded
    models only. Collective.
    """
    already = any(is_sharded(sub) for sub in module.modules())
    return FullyShardedDataParallel(
        module,
        sharding_strategy=config.sharding_strategy,
        cpu_offload=config.cpu_offload,
        mixed_precision=config.mixed_precision,
        auto_wrap_policy=None if already else config.auto_wrap_policy,
        device_id=device,
        **config.wrapper_kwargs,
    )


def checkpoint_activations(module: nn.Module, policy: Optional[Callable[..., bool]]) -> list[nn.Module]:
    """Make the layers ``policy`` picks recompute their activations in backward; return them.

    Each picked layer's ``forward`` runs inside ``torch.utils.checkpoint.checkpoint``
    (non-reentrant). Only the forward is replaced, on the instance, so parameter names, state
    dicts and the sharding hooks of the layer stay as they were.
    """
    if policy is None:
        return []
    layers = modules_to_wrap(module, policy)
    for layer in layers:
        if "forward" not in vars(layer):  # a layer fitted before already recomputes
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return layers


def _as_sharding_strategy(value: Any) -> ShardingStrategy:
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if not isinstance(name, str) or name.upper() not in _STRATEGY_NAMES:
        raise ValueError(
            f"rank {_rank()}: sharding_strategy must be one of {', '.join(_STRATEGY_NAMES)} (a name or a "
            f"ShardingStrategy member), got {value!r}"
        )
    return ShardingStrategy[name.upper()]


def _as_cpu_offload(value: Any) -> CPUOffload:
    if value is None or isinstance(value, bool):
        return CPUOffload(offload_params=bool(value))
    if not hasattr(value, "offload_params"):
        raise TypeError(f"rank {_rank()}: cpu_offload must be True, False or a CPUOffload, got {value!r}")
    return CPUOffload(offload_params=bool(value.offload_params))


def _as_mixed_precision(value: Any) -> Optional[MixedPrecision]:
    """sharded's ``MixedPrecision`` from torch FSDP1's (the same fields) or sharded's own."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    fields = [name for name in inspect.signature(MixedPrecision).parameters if hasattr(value, name)]
    if "param_dtype" not in fields:
        raise TypeError(f"rank {_rank()}: mixed_precision must be a MixedPrecision (sharded's or torch FSDP's), got {value!r}")
    return MixedPrecision(**{name: getattr(value, name) for name in fields})


def _as_policy(argument: str, value: Any) -> Optional[Callable[..., bool]]:
    try:
        return as_wrap_policy(value)
    except TypeError:
        raise TypeError(
            f"rank {_rank()}: {argument} must be a set of layer classes (nn.Module subclasses) or a wrap-policy "
            f"callable, got {value!r}"
        ) from None


def _checked_wrapper_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    accepted = set(inspect.signature(FullyShardedDataParallel.__init__).parameters) - set(_SET_BY_STRATEGY)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"rank {_rank()}: the FSDP strategy passes its extra arguments to sharded.FullyShardedDataParallel, which "
            f"does not take {', '.join(unknown)}; it takes {', '.join(sorted(accepted))}"
        )
    return dict(kwargs)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

