"""``ShardedDDPStrategy`` for Lightning Fabric: ``Fabric(strategy="ddp_sharded")``.

The same sharding as the Trainer's strategy (:mod:`sharded.lightning.ddp`), on Fabric's
``DDPStrategy``: ``fabric.setup(model, optimizer, scheduler=...)`` returns the module wrapped for
the stage and the optimizers re-created as ``OSS`` (the scheduler re-pointed), and
``fabric.clip_gradients`` / ``fabric.no_backward_sync`` / ``fabric.save`` / ``fabric.load`` do
the sharded thing. Fabric clips in the strategy, so no precision plugin of our own is needed:
only the fp16 loss scaler is swapped for one that agrees on inf checks across ranks.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..sharded_ddp import ShardedDataParallel
from ._sharding import ShardingConfig, as_sharded_scaler, point_schedulers_at, shard_optimizers, wrap_stage2

__all__ = ["ShardedDDPStrategy"]


class ShardedFabricPrecision:
    """Mixin for a Fabric strategy: fp16 mixed precision scales with a ``ShardedGradScaler``
    (whose inf/NaN check is agreed across ranks) instead of the plain scaler."""

    _precision: Optional[Precision]

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        if isinstance(precision, MixedPrecision):
            precision.scaler = as_sharded_scaler(precision.scaler, precision.device)
        self._precision = precision


class ShardedDDPStrategy(ShardedFabricPrecision, DDPStrategy):
    """Fabric's DDP strategy with the optimizer state (stage 1) or also the gradients (stage 2)
    sharded, by :class:`~sharded.OSS` and :class:`~sharded.ShardedDataParallel`.

    ``Fabric(strategy="ddp_sharded")`` (stage 2) and ``Fabric(strategy="ddp_zero1")`` (stage 1)
    select it once ``sharded.lightning`` is imported. Set the model up together with its
    optimizers (``fabric.setup(model, optimizer)``): the wrapper needs the sharded optimizers. An
    lr scheduler passed as ``fabric.setup(..., scheduler=s)`` is pointed at the new optimizer;
    one created after ``setup`` should be created on the optimizer ``setup`` returned.

    Args:
        stage, reduce_buffer_size, broadcast_fp16, reduce_fp16: as for the Trainer's
            :class:`sharded.lightning.ShardedDDPStrategy`.
        **kwargs: Fabric ``DDPStrategy``'s arguments, and the wrapper's: DDP's at stage 1,
            ``ShardedDataParallel``'s at stage 2.
    """

    def __init__(
        self,
        stage: int = 2,
        reduce_buffer_size: Optional[int] = None,
        broadcast_fp16: bool = False,
        reduce_fp16: bool = False,
        **kwargs: Any,
    ) -> None:
        self._sharding = ShardingConfig(stage, reduce_buffer_size, broadcast_fp16, reduce_fp16)
        super().__init__(**kwargs)
        self._wrapper_kwargs = self._sharding.wrapper_kwargs(self._ddp_kwargs) if stage == 2 else {}
        self._backward_sync_control = _ShardedBackwardSyncControl()

    @property
    def stage(self) -> int:
        """The ZeRO stage: 1 (optimizer state sharded) or 2 (gradients too)."""
        return self._sharding.stage

    # ------------------------------------------------------------------------ set-up

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        """Re-create the optimizers as ``OSS`` (re-pointing ``scheduler``), then wrap the module."""
        sharded = shard_optimizers(optimizers, self._sharding.broadcast_fp16)
        if scheduler is not None:
            point_schedulers_at([scheduler], {old: new for old, new in zip(optimizers, sharded) if old is not new})
        if self.stage == 1:
            return super().setup_module(module), list(sharded), scheduler
        return wrap_stage2(module, sharded, self._wrapper_kwargs), list(sharded), scheduler

    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        """Stage 1: wrap in DDP. Stage 2 needs the optimizers: use ``fabric.setup(model, optimizer)``."""
        if self.stage == 2:
            raise NotImplementedError(self._err_msg_joint_setup_required())
        return super().setup_module(module)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Stage 1: re-create ``optimizer`` as an ``OSS``. Stage 2: set it up with the module."""
        if self.stage == 2:
            raise NotImplementedError(self._err_msg_joint_setup_required())
        return shard_optimizers([optimizer], self._sharding.broadcast_fp16)[0]

    # -------------------------------------------------------------------- training loop

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the norm over every rank's shard (``OSS.clip_grad_norm``); return that norm."""
        self.precision.unscale_gradients(optimizer)
        return optimizer.clip_grad_norm(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------ checkpoints

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The wrapped module's state dict, without the wrapper's ``module.`` prefix."""
        return super().get_module_state_dict(_unwrapped(module))

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load into the wrapped module (the one ``get_module_state_dict`` saved)."""
        super().load_module_state_dict(_unwrapped(module), state_dict, strict)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"ddp_sharded"`` (stage 2) and ``"ddp_zero1"`` (stage 1)."""
        strategy_registry.register(
            "ddp_sharded", cls, description="ZeRO-2: sharded.OSS + sharded.ShardedDataParallel", override=True, stage=2
        )
        strategy_registry.register(
            "ddp_zero1", cls, description="ZeRO-1: sharded.OSS + DistributedDataParallel", override=True, stage=1
        )


class _ShardedBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the wrapper's ``no_sync`` at either stage."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, (ShardedDataParallel, DistributedDataParallel)):
            raise TypeError(
                "fabric.no_backward_sync needs the module that fabric.setup returned (wrapped in "
                f"ShardedDataParallel or DistributedDataParallel), got {type(module).__name__}"
            )
        return module.no_sync()


def _unwrapped(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, (ShardedDataParallel, DistributedDataParallel)) else module
