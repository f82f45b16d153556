"""What both Lightning front ends (the Trainer's strategy and Fabric's) do to shard training.

Lightning hands a strategy the optimizers the user built (``configure_optimizers`` or
``fabric.setup``); here they are re-created as :class:`~sharded.OSS` over the same param groups and
hyperparameters, the schedulers are pointed at the new optimizers, and at stage 2 the module is
wrapped in :class:`~sharded.ShardedDataParallel`. Nothing in this module imports Lightning, so
both front ends share it and it stays testable without a Trainer.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import ConstantLR, LRScheduler

from .._common.errors import on_rank
from .._common.optimizers import constructor_kwargs
from ..grad_scaler import ShardedGradScaler
from ..oss import OSS
from ..sharded_ddp import ShardedDataParallel

__all__ = [
    "ShardingConfig",
    "as_sharded_scaler",
    "clip_optimizer_grads",
    "constructor_defaults",
    "point_schedulers_at",
    "shard_optimizers",
    "wrap_stage2",
]

# DDP options that mean nothing to ShardedDataParallel, which learns each parameter's gradient
# count and order from the previous backward: accepted at stage 2 so that ``strategy=`` lines
# written for DDP keep working, and dropped. (``static_graph`` it takes, with DDP's meaning.)
_DDP_ONLY_NO_OPS = ("find_unused_parameters",)
# ShardedDataParallel's arguments that the strategy sets itself.
_SET_BY_STRATEGY = ("self", "module", "sharded_optimizer", "process_group", "reduce_buffer_size", "reduce_fp16")


@dataclass(frozen=True)
class ShardingConfig:
    """How a strategy shards: the ZeRO stage and the options of the layer that runs it.

    Args:
        stage: the ZeRO stage, run by sharded's layer of that number: 1 shards optimizer state
            (layer 1: ``OSS``, the model wrapped in DDP); 2 also shards gradients (layer 2:
            ``OSS`` + ``ShardedDataParallel``).
        reduce_buffer_size: stage 2 only: most elements per gradient bucket (``None``: the
            ``ShardedDataParallel`` default).
        broadcast_fp16: send parameters as fp16 after each step (``OSS``'s option).
        reduce_fp16: stage 2 only: reduce fp32 gradients as fp16.
    """

    stage: int = 2
    reduce_buffer_size: Optional[int] = None
    broadcast_fp16: bool = False
    reduce_fp16: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (1, 2):
            raise ValueError(
                f"stage must be 1 (optimizer state sharded, OSS + DDP) or 2 (gradients too, OSS + "
                f"ShardedDataParallel), got {self.stage!r}; full parameter sharding (ZeRO-3) is not "
                "available in this strategy"
            )
        if self.stage == 1 and self.reduce_buffer_size is not None:
            raise ValueError(
                "reduce_buffer_size sets ShardedDataParallel's gradient buckets and applies to stage=2 "
                "only; at stage=1 DDP reduces the gradients: pass bucket_cap_mb instead"
            )
        if self.stage == 1 and self.reduce_fp16:
            raise ValueError(
                "reduce_fp16 applies to stage=2 only; at stage=1 DDP reduces the gradients: pass "
                "ddp_comm_hook=torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook"
            )

    def wrapper_kwargs(self, ddp_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments for ``ShardedDataParallel`` at stage 2, from the strategy's
        ``**ddp_kwargs`` plus this config; raise naming any argument it does not take."""
        accepted = set(inspect.signature(ShardedDataParallel.__init__).parameters) - set(_SET_BY_STRATEGY)
        unknown = sorted(set(ddp_kwargs) - accepted - set(_DDP_ONLY_NO_OPS))
        if unknown:
            raise ValueError(
                f"stage=2 wraps the model in sharded.ShardedDataParallel, which does not take "
                f"{', '.join(unknown)}; it takes {', '.join(sorted(accepted))} (and reduce_buffer_size, "
                "reduce_fp16 as strategy arguments). DDP's arguments apply at stage=1"
            )
        kwargs = {k: v for k, v in ddp_kwargs.items() if k not in _DDP_ONLY_NO_OPS}
        if self.reduce_buffer_size is not None:
            kwargs["reduce_buffer_size"] = self.reduce_buffer_size
        return {**kwargs, "reduce_fp16": self.reduce_fp16}


def shard_optimizers(optimizers: Sequence[Optimizer], broadcast_fp16: bool) -> list[OSS]:
    """Each optimizer re-created as an ``OSS`` over the same param groups and hyperparameters.

    An optimizer that already is an ``OSS`` (the user built it) is kept as it is. Collective.
    """
    return [
        optimizer if isinstance(optimizer, OSS) else _as_oss(optimizer, index, broadcast_fp16)
        for index, optimizer in enumerate(optimizers)
    ]


def _as_oss(optimizer: Optimizer, index: int, broadcast_fp16: bool) -> OSS:
    try:
        return OSS(
            optimizer.param_groups, type(optimizer), broadcast_fp16=broadcast_fp16, **constructor_defaults(optimizer)
        )
    except TypeError as error:
        raise TypeError(on_rank(
            f"optimizer {index} ({type(optimizer).__module__}.{type(optimizer).__qualname__}) "
            f"cannot be sharded by sharded.OSS: {error}"
        )) from error


def constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor takes (to rebuild it over other parameters)."""
    return constructor_kwargs(type(optimizer), optimizer.defaults)


def point_schedulers_at(schedulers: Iterable[Any], replacements: Mapping[Optimizer, Optimizer]) -> None:
    """Make each scheduler that drives a replaced optimizer drive its replacement instead.

    Schedulers nested in others (``SequentialLR``, ``ChainedScheduler``) are followed, and any
    attribute holding a replaced optimizer is re-pointed, so third-party schedulers work too.
    torch's schedulers also mark their optimizer's ``step`` to warn when they are stepped before
    it; :func:`_track_optimizer_steps` gives the replacement that mark.
    """
    for scheduler in schedulers:
        for name, value in list(vars(scheduler).items()):
            if isinstance(value, Optimizer) and value in replacements:
                setattr(scheduler, name, replacements[value])
                if isinstance(scheduler, LRScheduler):
                    _track_optimizer_steps(replacements[value])
            elif isinstance(value, (list, tuple)):
                point_schedulers_at([v for v in value if isinstance(v, LRScheduler)], replacements)


def _track_optimizer_steps(optimizer: Optimizer) -> None:
    """Have torch's scheduler machinery record ``optimizer.step()`` calls, without changing any lr.

    Building any torch scheduler on an optimizer installs that record; a ``ConstantLR`` with
    factor 1 for 0 iterations multiplies every lr by 1, so it is the one that changes nothing.
    """
    ConstantLR(optimizer, factor=1.0, total_iters=0)


def wrap_stage2(module: nn.Module, optimizers: Sequence[OSS], wrapper_kwargs: Mapping[str, Any]) -> ShardedDataParallel:
    """``module`` wrapped for ZeRO-2 over ``optimizers``, with a clear error when there are none."""
    if not optimizers:
        raise ValueError(on_rank(
            "stage=2 needs at least one optimizer to shard gradients over; configure_optimizers returned none"
        ))
    return ShardedDataParallel(module, list(optimizers), **wrapper_kwargs)


def as_sharded_scaler(scaler: Optional[torch.amp.GradScaler], device: str) -> Optional[ShardedGradScaler]:
    """``scaler`` as a :class:`~sharded.ShardedGradScaler` with the same settings (``None`` stays).

    Under ZeRO-2 each rank holds only its own gradients, so a plain scaler's inf check would
    differ between ranks; the sharded one agrees on it across ranks.
    """
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
        device=device,
    )


def clip_optimizer_grads(optimizer: Optimizer, max_norm: float) -> torch.Tensor:
    """Collective: clip ``optimizer``'s gradients by their norm over every rank; return that norm.

    An ``OSS`` (ZeRO-1/2) knows which rank holds which gradient; other optimizers hold
    parameters that are DTensor shards (ZeRO-3) or whole tensors, which
    :func:`sharded.fsdp.clip_grad_norm_` adds up over the ranks holding their shards.
    """
    if isinstance(optimizer, OSS):
        return optimizer.clip_grad_norm(max_norm)
    from ..fsdp import clip_grad_norm_  # DTensor is slow to import: only where ZeRO-3 is used

    return clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], max_norm)

