"""How the FSDP strategy shards a module: its arguments in Lightning's shapes, turned into a call
of sharded's layer 3, plus activation checkpointing of chosen submodules (a model's blocks).

Lightning users bring ``FSDPStrategy``'s arguments, which are spelled in torch FSDP1's types
(``ShardingStrategy`` members or their names, ``CPUOffload``, ``MixedPrecision``, a set of module
classes or a policy callable; Lightning calls these "layer classes", a word sharded keeps for
its own layers 1-3). This module accepts those spellings (torch's objects as well as
sharded's) and builds :class:`sharded.fsdp.FullyShardedDataParallel` from them. Nothing here
imports Lightning.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.checkpoint import checkpoint

from .._common.errors import on_rank
from ..fsdp import FullyShardedDataParallel
from ..fsdp.fully_sharded_data_parallel import CPUOffload, MixedPrecision, ShardingStrategy
from ..fsdp.wrap import as_wrap_policy, modules_to_wrap
from ._sharding import constructor_defaults

__all__ = [
    "FSDPConfig",
    "ShardedRoot",
    "checkpoint_activations",
    "is_sharded",
    "parameter_names",
    "rebuild_optimizers",
    "shard_module",
    "with_hybrid_mesh",
]

# The strategies Lightning's FSDPStrategy offers by name.
_STRATEGY_NAMES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
# FullyShardedDataParallel's arguments that the strategy sets itself.
_SET_BY_STRATEGY = ("self", "module", "sharding_strategy", "cpu_offload", "mixed_precision", "auto_wrap_policy", "device_id")


@dataclass(frozen=True)
class FSDPConfig:
    """How to shard: the strategy's arguments, validated and converted to sharded's types by
    :meth:`from_arguments`, which takes these spellings:

    Args:
        sharding_strategy: a name (``"FULL_SHARD"``...) or a ``ShardingStrategy`` member,
            sharded's or torch's.
        cpu_offload: ``True``/``False`` or a ``CPUOffload`` (sharded's or torch's).
        mixed_precision: a ``MixedPrecision`` (sharded's or torch's) or ``None``.
        auto_wrap_policy: a set of module classes or a wrap-policy callable (see
            :mod:`sharded.fsdp.wrap`), or ``None``: the submodules that become units of their own.
        activation_checkpointing_policy: the same shapes: the submodules whose activations are
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


def parse_strategy_arguments(
    state_dict_type: str,
    sharding_strategy: Any,
    cpu_offload: Any,
    mixed_precision: Any,
    auto_wrap_policy: Any,
    activation_checkpointing_policy: Any,
    kwargs: dict[str, Any],
) -> tuple[FSDPConfig, Optional[tuple[int, ...]], dict[str, Any]]:
    """What an FSDP strategy's arguments mean, for the Trainer's and Fabric's alike: the config,
    the hybrid mesh shape given as ``device_mesh=(replicate, shard)`` (or None), and the
    launcher's own arguments (``start_method``). Pops those two from ``kwargs``; what is left
    must be ``FullyShardedDataParallel``'s."""
    if state_dict_type not in ("full", "sharded"):
        raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}")
    launch = {"start_method": kwargs.pop("start_method")} if "start_method" in kwargs else {}
    mesh_shape = kwargs.pop("device_mesh") if isinstance(kwargs.get("device_mesh"), tuple) else None
    config = FSDPConfig.from_arguments(
        sharding_strategy, cpu_offload, mixed_precision, auto_wrap_policy, activation_checkpointing_policy, kwargs
    )
    return config, mesh_shape, launch


def with_hybrid_mesh(
    config: FSDPConfig, shape: Optional[tuple[int, ...]], device_type: str, nodes: int, processes_per_node: int
) -> FSDPConfig:
    """``config`` with the ``(replicate, shard)`` device mesh of hybrid sharding built: of
    ``shape`` when given, else, under ``HYBRID_SHARD`` without a mesh or process groups of the
    user's, one row per node. Collective (it creates the mesh's process groups)."""
    given = {k for k, v in config.wrapper_kwargs.items() if v is not None} & {"device_mesh", "process_group"}
    if shape is None and (config.sharding_strategy is not ShardingStrategy.HYBRID_SHARD or given):
        return config
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape or (nodes, processes_per_node), mesh_dim_names=("replicate", "shard"))
    return replace(config, wrapper_kwargs={**config.wrapper_kwargs, "device_mesh": mesh})


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was already applied to ``module`` (a LightningModule fitted before)."""
    from ..fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_module(module: nn.Module, config: FSDPConfig, device: Optional[torch.device]) -> FullyShardedDataParallel:
    """``module`` sharded as ``config`` says, its meta-device submodules materialised unit by unit.

    Submodules the user already sharded (``fully_shard`` in ``configure_model``) are kept as they
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


class ShardedRoot(nn.Module):
    """A module ``fully_shard`` was applied to before (a model set up again), called through
    ``forward`` so that its hooks run, and offering ``no_sync`` where Lightning looks for it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> Any:
        """Backward passes inside accumulate gradients without communication."""
        return self.module.no_sync()  # type: ignore[operator]


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Parameter id -> name in ``module``; sharding keeps the names, not the tensors."""
    return {id(param): name for name, param in module.named_parameters()}


def rebuild_optimizers(optimizers: list[Optimizer], names_before: dict[int, str], module: nn.Module) -> list[Optimizer]:
    """Each optimizer built before ``module`` was sharded, re-created over the sharded parameters
    of the same names, with the same param groups and hyperparameters.

    Sharding replaces every parameter by a DTensor, so an optimizer holding the old tensors
    would train nothing. ``names_before`` maps the old tensors to their names (see
    :func:`parameter_names`). Optimizers that already stepped cannot be rebuilt (their state
    belongs to the old tensors).
    """
    now = dict(module.named_parameters())
    rebuilt = []
    for index, optimizer in enumerate(optimizers):
        if optimizer.state:
            raise ValueError(on_rank(f"optimizer {index} has stepped already; set it up before training"))
        groups = []
        for group in optimizer.param_groups:
            strays = [p for p in group["params"] if id(p) not in names_before]
            if strays:
                raise ValueError(on_rank(
                    f"optimizer {index} holds a parameter of shape {tuple(strays[0].shape)} that is not a "
                    "parameter of the module set up with it"
                ))
            groups.append({**group, "params": [now[names_before[id(p)]] for p in group["params"]]})
        rebuilt.append(type(optimizer)(groups, **constructor_defaults(optimizer)))
    return rebuilt


def checkpoint_activations(module: nn.Module, policy: Optional[Callable[..., bool]]) -> list[nn.Module]:
    """Make the submodules ``policy`` picks recompute their activations in backward; return them.

    Each picked submodule's ``forward`` runs inside ``torch.utils.checkpoint.checkpoint``
    (non-reentrant). Only the forward is replaced, on the instance, so parameter names, state
    dicts and the sharding hooks of the submodule stay as they were.
    """
    if policy is None:
        return []
    picked = modules_to_wrap(module, policy)
    for sub in picked:
        if "forward" not in vars(sub):  # a submodule fitted before already recomputes
            sub.forward = functools.partial(checkpoint, sub.forward, use_reentrant=False)
    return picked


def _as_sharding_strategy(value: Any) -> ShardingStrategy:
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if not isinstance(name, str) or name.upper() not in _STRATEGY_NAMES:
        raise ValueError(on_rank(
            f"sharding_strategy must be one of {', '.join(_STRATEGY_NAMES)} (a name or a "
            f"ShardingStrategy member), got {value!r}"
        ))
    return ShardingStrategy[name.upper()]


def _as_cpu_offload(value: Any) -> CPUOffload:
    if value is None or isinstance(value, bool):
        return CPUOffload(offload_params=bool(value))
    if not hasattr(value, "offload_params"):
        raise TypeError(on_rank(f"cpu_offload must be True, False or a CPUOffload, got {value!r}"))
    return CPUOffload(offload_params=bool(value.offload_params))


def _as_mixed_precision(value: Any) -> Optional[MixedPrecision]:
    """sharded's ``MixedPrecision`` from torch FSDP1's (the same fields) or sharded's own."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    fields = [name for name in inspect.signature(MixedPrecision).parameters if hasattr(value, name)]
    if "param_dtype" not in fields:
        raise TypeError(on_rank(f"mixed_precision must be a MixedPrecision (sharded's or torch FSDP's), got {value!r}"))
    return MixedPrecision(**{name: getattr(value, name) for name in fields})


def _as_policy(argument: str, value: Any) -> Optional[Callable[..., bool]]:
    try:
        return as_wrap_policy(value)
    except TypeError:
        raise TypeError(on_rank(
            f"{argument} must be a set of module classes (nn.Module subclasses) or a wrap-policy "
            f"callable, got {value!r}"
        )) from None


def _checked_wrapper_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    accepted = set(inspect.signature(FullyShardedDataParallel.__init__).parameters) - set(_SET_BY_STRATEGY)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(on_rank(
            f"the FSDP strategy passes its extra arguments to sharded.FullyShardedDataParallel, which "
            f"does not take {', '.join(unknown)}; it takes {', '.join(sorted(accepted))}"
        ))
    return dict(kwargs)


