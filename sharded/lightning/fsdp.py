"""``ShardedFSDPStrategy``: ZeRO-3 for the Lightning Trainer over sharded's layer 3
(``strategy="sharded_fsdp"``), with the arguments of Lightning's own ``FSDPStrategy``.

Processes, devices, launchers and collectives are those of Lightning's ``DDPStrategy``, which
this class extends; what differs is what happens to the model (sharded by
:class:`sharded.FullyShardedDataParallel` instead of wrapped in DDP) and to checkpoints (full
or sharded, see :mod:`sharded.lightning._fsdp_checkpoint`).
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Generator, Literal, Mapping, Optional

import torch
import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer

from .._common.errors import on_rank
from . import _fsdp_checkpoint as checkpoints
from ._fsdp_setup import ShardedRoot, checkpoint_activations, is_sharded, parse_strategy_arguments, shard_module, with_hybrid_mesh
from .precision import ShardedPrecisionPlugin

__all__ = ["ShardedFSDPStrategy"]


class ShardedFSDPStrategy(ShardedPrecisionPlugin, DDPStrategy):
    """Fully sharded training (ZeRO-3) with sharded's layer 3; a drop-in for Lightning's
    ``FSDPStrategy``: ``Trainer(strategy=ShardedFSDPStrategy(...))`` or
    ``Trainer(strategy="sharded_fsdp")`` once ``sharded.lightning`` is imported.

    Parameters, gradients and optimizer state are sharded over the ranks. Each layer the
    ``auto_wrap_policy`` picks (e.g. ``{Block}``) becomes a unit whose parameters are gathered
    just before its forward and backward and freed after; the LightningModule itself is the unit
    for the rest. Results equal ``strategy="ddp"``'s: the same optimizer steps the same averaged
    gradients. Build the model in ``configure_model``: inside it tensors are created on the meta
    device (no memory), and each unit is materialised (``reset_parameters()``) and sharded in
    turn, so the whole model never exists on one rank. Build the optimizer in
    ``configure_optimizers`` from ``self.parameters()`` as usual; it then steps each rank's shard.

    ``accumulate_grad_batches`` accumulates without communication, ``gradient_clip_val`` clips
    by the norm over every rank's shards, and ``precision="16-mixed"`` / ``"bf16-mixed"`` run
    under autocast with full-precision shards (``"16-mixed"`` with a ``ShardedGradScaler``),
    exactly as under ``strategy="ddp"``; ``mixed_precision=`` additionally gathers parameters
    and reduces gradients in a narrower dtype. ``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``
    and ``timeout`` are taken as by Lightning's strategies.

    Args:
        cpu_offload: ``True`` or ``CPUOffload(offload_params=True)`` (sharded's or torch's) to
            keep shards, gradients and the optimizer step on the CPU.
        mixed_precision: a ``MixedPrecision`` (sharded's or torch FSDP's): the dtypes
            parameters are gathered and computed in, and gradients reduced in.
        auto_wrap_policy: a set of module classes (Lightning's "layer classes", e.g. a
            transformer block) or a wrap-policy callable (:mod:`sharded.fsdp.wrap`): the
            submodules that become units. ``None``: one unit.
        activation_checkpointing_policy: the same shapes: the submodules whose activations are
            recomputed in backward instead of kept.
        sharding_strategy: ``"FULL_SHARD"`` (ZeRO-3), ``"SHARD_GRAD_OP"`` (parameters kept
            from forward to backward), ``"NO_SHARD"`` (DDP) or ``"HYBRID_SHARD"`` (sharded
            within a node, replicated across nodes; ``device_mesh=(replicate, shard)`` sizes
            the grid otherwise), or a ``ShardingStrategy`` member.
        state_dict_type: ``"full"``: checkpoints are one file with full tensors written by rank
            0, in torch's format (they load under ``strategy="ddp"`` too). ``"sharded"``: a
            :mod:`sharded.checkpoint` folder in which each rank writes its shards, Lightning's
            own state (loops, callbacks, schedulers) included; it appears, or replaces an
            earlier one of the same name, only once complete, and loads without running code
            from it. Both resume at any world size.
        **kwargs: ``sharded.FullyShardedDataParallel``'s other arguments (``device_mesh``,
            ``param_init_fn``, ``ignored_modules``, ``backward_prefetch``,
            ``shard_placement_fn``: ``lambda p: Owned() if p.ndim == 2 else None`` keeps each
            matrix whole on one rank for Muon, and full checkpoints hold it whole...), and
            ``start_method`` as for ``DDPStrategy``.
    """

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        cpu_offload: Any = None,
        mixed_precision: Any = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "full",
        **kwargs: Any,
    ) -> None:
        self._fsdp, self._mesh_shape, launch = parse_strategy_arguments(
            state_dict_type, sharding_strategy, cpu_offload, mixed_precision, auto_wrap_policy,
            activation_checkpointing_policy, kwargs,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **launch,
        )
        self._state_dict_type = state_dict_type

    @property
    def state_dict_type(self) -> str:
        """``"full"`` or ``"sharded"``: how checkpoints are written."""
        return self._state_dict_type

    @property
    def sharding_strategy(self) -> Any:
        """The :class:`sharded.fsdp.ShardingStrategy` in use."""
        return self._fsdp.sharding_strategy

    # ------------------------------------------------------------------------ set-up

    def setup_environment(self) -> None:
        """Start the process group as DDP does; then build the ``(replicate, shard)`` mesh of
        hybrid sharding: the tuple given as ``device_mesh``, or by default one row per node."""
        super().setup_environment()
        self._fsdp = with_hybrid_mesh(self._fsdp, self._mesh_shape, self.root_device.type, self.num_nodes, self.num_processes)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: tensors are created on the meta device, taking no memory;
        setup materialises and shards them one unit at a time."""
        with torch.device("meta"):
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the model (not just when fitting: evaluation also needs the units' gathers),
        then build the optimizers over the sharded parameters."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self._shard(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, module: nn.Module) -> nn.Module:
        """``module`` sharded and wrapped (a LightningModule fitted before is sharded already and
        only wrapped), activations checkpointed as the policy says.

        The wrapper matters: Lightning calls ``training_step`` through the wrapper's forward,
        which calls the LightningModule, whose forward hooks gather its parameters.
        """
        if is_sharded(module):
            wrapper: nn.Module = ShardedRoot(module)
        else:
            device = self.root_device if self.root_device.type != "cpu" else None
            wrapper = shard_module(module, self._fsdp, device)
        checkpoint_activations(module, self._fsdp.activation_checkpointing_policy)
        return wrapper

    def model_to_device(self) -> None:
        """Nothing: sharding puts each unit on the device as it materialises it."""

    def configure_ddp(self) -> None:
        """Nothing to wrap in DDP: :meth:`setup` shards the model."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the sharded model, so after setup."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """Optimizer state is loaded in :meth:`load_checkpoint`, shard by shard."""
        return False

    def teardown(self) -> None:
        """Unwrap the model and tear down the environment; the LightningModule stays sharded
        (fit it again, or read full weights with ``sharded.fsdp.summon_full_params``)."""
        self.model = self.lightning_module
        if self._layer_sync and self.model is not None and getattr(self.model, "_trainer", None) is not None:
            if self.model.trainer.state.fn == TrainerFn.FITTING:
                self.model = self._layer_sync.revert(self.model)
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Collective: full tensors on rank 0 (``"full"``) or each rank's shards (``"sharded"``)."""
        assert self.lightning_module is not None
        if self._state_dict_type == "full":
            return checkpoints.full_model_state(self.lightning_module)
        return checkpoints.sharded_model_state(self.lightning_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective: the whole state in torch's format on rank 0 (``"full"``) or each rank's
        shards filed by parameter FQN (``"sharded"``)."""
        assert self.lightning_module is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._state_dict_type == "full":
            return checkpoints.full_optimizer_state(self.lightning_module, optimizer)
        return checkpoints.sharded_optimizer_state(self.lightning_module, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """``"full"``: rank 0 writes one file. ``"sharded"``: every rank writes into a folder,
        which replaces an earlier checkpoint of that name only once complete."""
        path = Path(self.broadcast(str(filepath)))
        if self._state_dict_type == "full":
            if path.is_dir():
                raise IsADirectoryError(on_rank(
                    f"state_dict_type='full' writes one file, but {path} is a folder "
                    "(a sharded checkpoint?); remove it or save elsewhere"
                ))
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(on_rank("state_dict_type='sharded' writes through torch.distributed.checkpoint, which takes no storage_options"))
        if path.is_file():
            raise FileExistsError(on_rank(
                f"state_dict_type='sharded' writes a folder, but {path} is a file "
                "(a full checkpoint?); remove it or save elsewhere"
            ))
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        checkpoints.save_sharded(path, checkpoint["state_dict"], checkpoint.get("optimizer_states", []), rest)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Collective: load a full file or a sharded folder, saved at any world size, into the
        sharded model (and, when fitting, the optimizers); return the rest of the checkpoint.
        Whatever ``weights_only`` says, files are read with ``torch.load(weights_only=True)``
        and folders by :mod:`sharded.checkpoint`: nothing in a checkpoint runs."""
        assert self.lightning_module is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers] if fitting else []
        if path.is_dir():
            return checkpoints.load_sharded(path, module, optimizers, module.strict_loading)
        if not path.is_file():
            raise FileNotFoundError(on_rank(f"checkpoint {path} does not exist"))
        checkpoint = checkpoints.read_file(path)
        return checkpoints.load_full(checkpoint, module, optimizers, module.strict_loading, path)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the model already."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the optimizers already."""

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"sharded_fsdp"``."""
        strategy_registry.register(
            "sharded_fsdp", cls, description="ZeRO-3: sharded.FullyShardedDataParallel", override=True
        )

