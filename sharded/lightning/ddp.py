"""``ShardedDDPStrategy``: ZeRO-1 and ZeRO-2 for the Lightning Trainer (``strategy="ddp_sharded"``).

Lightning 2 removed ``strategy="ddp_sharded"`` together with fairscale. This strategy brings it
back over sharded's layers 1 and 2: it is Lightning's own ``DDPStrategy`` (processes, devices,
launchers, collectives, checkpoint IO) with three changes. The optimizers that
``configure_optimizers`` returns are re-created as ``OSS`` (schedulers re-pointed); at stage 2 the
module is wrapped in ``ShardedDataParallel`` instead of DDP; and the precision plugin clips by
the norm over every rank's shard. Gradient accumulation needs nothing here: Lightning's
``block_backward_sync`` calls ``no_sync()`` on any wrapper that has one (it checks a protocol,
not DDP's class), and ``ShardedDataParallel.no_sync`` accumulates without communication.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import lightning.pytorch as pl
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from .._common.errors import on_rank
from ..oss import OSS
from ..sharded_ddp import ShardedDataParallel
from ._sharding import ShardingConfig, point_schedulers_at, shard_optimizers, wrap_stage2
from .precision import ShardedPrecisionPlugin

__all__ = ["ShardedDDPStrategy"]

# DDPStrategy's own arguments that configure DDP's gradient communication, which stage 2 replaces.
_DDP_COMMUNICATION_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")


class ShardedDDPStrategy(ShardedPrecisionPlugin, DDPStrategy):
    """Lightning's DDP strategy with the optimizer state (stage 1) or also the gradients (stage 2)
    sharded across ranks, by :class:`~sharded.OSS` and :class:`~sharded.ShardedDataParallel`.

    ``Trainer(strategy="ddp_sharded")`` (stage 2, as Lightning 1.x had it) and
    ``Trainer(strategy="ddp_zero1")`` (stage 1) select it once ``sharded.lightning`` is imported.
    Results equal ``strategy="ddp"``'s: the same optimizer steps the same averaged gradients; each
    rank only keeps its shard of the optimizer state and, at stage 2, of the gradients.

    What changes for the LightningModule: nothing in ``training_step``. The optimizers returned
    by ``configure_optimizers`` are re-created as ``OSS`` over the same param groups and
    hyperparameters (an ``OSS`` returned there is kept as it is) and the schedulers are pointed
    at them. ``accumulate_grad_batches`` accumulates without communication (``no_sync``),
    ``gradient_clip_val`` clips by the global norm, ``precision="16-mixed"`` scales the loss with
    a :class:`~sharded.ShardedGradScaler`. Checkpoints hold the optimizer state consolidated on
    rank 0 in torch's format, so they resume at any world size and under ``strategy="ddp"``.
    Stage 2 needs automatic optimization; use stage 1 with ``automatic_optimization = False``.

    Args:
        stage: 1 = ``OSS`` + DDP (ZeRO-1), 2 = ``OSS`` + ``ShardedDataParallel`` (ZeRO-2).
        reduce_buffer_size: stage 2: most elements per gradient bucket (default: the wrapper's).
        broadcast_fp16: send updated parameters as fp16 (half the bytes; non-owners see values
            rounded to fp16).
        reduce_fp16: stage 2: reduce fp32 gradients as fp16.
        **kwargs: ``DDPStrategy``'s arguments (``accelerator``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``,
            ``start_method``, ...) and, as there, the wrapper's: ``DistributedDataParallel``'s
            at stage 1; at stage 2 ``ShardedDataParallel``'s (``broadcast_buffers``,
            ``sync_models_at_startup``, ``auto_refresh_trainable``, ``static_graph``, ...), where
            DDP's ``find_unused_parameters`` is accepted and unneeded.
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
        self._refuse_ddp_only_arguments(kwargs)
        self._wrapper_kwargs = self._sharding.wrapper_kwargs(self._ddp_kwargs) if stage == 2 else {}

    @property
    def stage(self) -> int:
        """The ZeRO stage: 1 (optimizer state sharded) or 2 (gradients too)."""
        return self._sharding.stage

    # ------------------------------------------------------------------------ set-up

    def setup(self, trainer: pl.Trainer) -> None:
        """Build and shard the optimizers, then wrap the model; when not fitting, as DDP does."""
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)  # no gradients to reduce: DDP syncs the states, wraps nothing
            return
        self._check_optimization_mode()
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_optimizers(trainer)  # before wrapping: ShardedDataParallel needs the OSS
        self.configure_ddp()
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Build the optimizers as Lightning does, then re-create each as an ``OSS``. Collective."""
        super().setup_optimizers(trainer)
        sharded = shard_optimizers(self.optimizers, self._sharding.broadcast_fp16)
        replaced = {old: new for old, new in zip(self.optimizers, sharded) if old is not new}
        point_schedulers_at([config.scheduler for config in self.lr_scheduler_configs], replaced)
        self.optimizers = list(sharded)

    def configure_ddp(self) -> None:
        """Wrap the model: DDP at stage 1, ``ShardedDataParallel`` over the optimizers at stage 2."""
        if self.stage == 1:
            super().configure_ddp()
            return
        assert self.model is not None
        oss = cast("list[OSS]", self.optimizers)  # setup_optimizers made each one an OSS
        self.model = wrap_stage2(self.model, oss, self._wrapper_kwargs)

    def _check_optimization_mode(self) -> None:
        assert self.lightning_module is not None
        if self.stage == 2 and not self.lightning_module.automatic_optimization:
            raise RuntimeError(on_rank(
                "ShardedDDPStrategy(stage=2) needs automatic optimization: "
                f"{type(self.lightning_module).__name__} sets automatic_optimization = False, and "
                "under ZeRO-2 a gradient is reduced to its owner by the backward that Lightning runs. "
                "Use stage=1 (strategy='ddp_zero1') for manual optimization"
            ))

    def _refuse_ddp_only_arguments(self, kwargs: dict[str, Any]) -> None:
        """Raise for DDPStrategy arguments this strategy cannot honour."""
        if kwargs.get("model_averaging_period") is not None:
            raise ValueError(
                "model_averaging_period (post-local SGD) lets ranks step on different gradients, "
                "which sharded optimizer state cannot follow; use strategy='ddp' for local SGD"
            )
        given = [name for name in _DDP_COMMUNICATION_ARGS if kwargs.get(name) is not None]
        if self.stage == 2 and given:
            raise ValueError(
                f"{', '.join(given)} configure DDP's gradient all-reduce, which stage=2 replaces by "
                "ShardedDataParallel's reduce to owners; use stage=1 for DDP communication hooks, "
                "or reduce_fp16=True for fp16 compression at stage 2"
            )

    # ------------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        """Unwrap the model (as DDPStrategy does for DDP), then tear down as DDP does.

        The wrapper's hooks come off the parameters, so the LightningModule can be fitted again.
        """
        if isinstance(self.model, ShardedDataParallel):
            self.model.remove_hooks()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"ddp_sharded"`` (stage 2) and ``"ddp_zero1"`` (stage 1)."""
        strategy_registry.register(
            "ddp_sharded", cls, description="ZeRO-2: sharded.OSS + sharded.ShardedDataParallel", override=True, stage=2
        )
        strategy_registry.register(
            "ddp_zero1", cls, description="ZeRO-1: sharded.OSS + DistributedDataParallel", override=True, stage=1
        )
