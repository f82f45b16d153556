"""``ShardedFSDPStrategy`` for Lightning Fabric: ``Fabric(strategy="sharded_fsdp")`` (ZeRO-3).

The Trainer's strategy (:mod:`sharded.lightning.fsdp`) on Fabric's ``DDPStrategy``, sharing its
set-up (:mod:`._fsdp_setup`) and checkpoints (:mod:`._fsdp_checkpoint`).
``fabric.setup(model, optimizer)`` shards the model and re-creates the optimizer over the
sharded parameters (or set the model up first and build the optimizer from its parameters);
``fabric.init_module(empty_init=True)`` builds on the meta device; ``fabric.clip_gradients``,
``fabric.no_backward_sync``, ``fabric.save`` and ``fabric.load`` work on the shards.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from .._common.errors import on_rank
from . import _fsdp_checkpoint as checkpoints
from ._fsdp_setup import (
    ShardedRoot,
    checkpoint_activations,
    is_sharded,
    parse_strategy_arguments,
    parameter_names,
    rebuild_optimizers,
    shard_module,
    with_hybrid_mesh,
)
from ._sharding import point_schedulers_at
from .fabric import ShardedFabricPrecision

__all__ = ["ShardedFSDPStrategy"]


class ShardedFSDPStrategy(ShardedFabricPrecision, DDPStrategy):
    """Fully sharded training (ZeRO-3) with sharded's layer 3 for Fabric; the arguments of
    Fabric's ``FSDPStrategy`` (see the Trainer's :class:`sharded.lightning.ShardedFSDPStrategy`
    for what each does). As with Fabric's own, ``state_dict_type`` defaults to ``"sharded"``:
    ``fabric.save`` writes a :mod:`sharded.checkpoint` folder, the Trainer's layout: one module
    (as Fabric's own allows), its optimizers, and the other entries of the state.
    """

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        cpu_offload: Any = None,
        mixed_precision: Any = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "sharded",
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
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **launch,
        )
        self._state_dict_type = state_dict_type
        self._backward_sync_control = _NoSyncControl()
        self._modules: list[nn.Module] = []  # the modules set up, to name the optimizers' parameters

    # ------------------------------------------------------------------------ set-up

    def setup_environment(self) -> None:
        """Start the process group as DDP does, then build hybrid sharding's mesh if needed."""
        super().setup_environment()
        self._fsdp = with_hybrid_mesh(self._fsdp, self._mesh_shape, self.root_device.type, self.num_nodes, self.num_processes)

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` builds on the meta device; units are
        materialised as they are sharded."""
        return torch.device("meta") if empty_init else super().module_init_context(empty_init)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        """Shard the module, then re-create the optimizers over its sharded parameters."""
        names = parameter_names(module)
        wrapped = self.setup_module(module)
        rebuilt = rebuild_optimizers(optimizers, names, _unwrapped(wrapped))
        if scheduler is not None:
            point_schedulers_at([scheduler], dict(zip(optimizers, rebuilt)))
        return wrapped, rebuilt, scheduler

    # DDPStrategy promises a DistributedDataParallel; this strategy reuses its launch and process
    # group set-up but returns the sharded module (as Lightning's own FSDPStrategy does)
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        """Shard ``module`` (once: a module set up again is only wrapped); build the optimizer
        afterwards, from its parameters."""
        if is_sharded(module):
            wrapped: nn.Module = ShardedRoot(module)
        else:
            device = self.root_device if self.root_device.type != "cpu" else None
            wrapped = shard_module(module, self._fsdp, device)
        checkpoint_activations(module, self._fsdp.activation_checkpointing_policy)
        self._modules.append(module)
        return wrapped

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer as it is: build it after ``setup_module``, from the sharded parameters."""
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: sharding puts each unit on the device as it materialises it."""

    # -------------------------------------------------------------------- training loop

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the norm over every rank's shards; return that norm."""
        from ..fsdp import clip_grad_norm_

        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    # ------------------------------------------------------------------------ checkpoints

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Collective: full tensors on rank 0 (``"full"``) or each rank's shards (``"sharded"``)."""
        module = _unwrapped(module)
        if self._state_dict_type == "full":
            return checkpoints.full_model_state(module)
        return checkpoints.sharded_model_state(module)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Collective: load full tensors or shards (DTensors) into the sharded module."""
        full = not any(isinstance(value, DTensor) for value in state_dict.values())
        checkpoints.load_model_state(_unwrapped(module), state_dict, full=full, strict=strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Collective: the whole state in torch's format on rank 0 (``"full"``), or each rank's
        shards keyed by parameter FQN (``"sharded"``)."""
        module = self._module_of(optimizer)
        if self._state_dict_type == "full":
            return checkpoints.full_optimizer_state(module, optimizer)
        return checkpoints.sharded_optimizer_state(module, optimizer)

    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """``"full"``: rank 0 writes one file. ``"sharded"``: every rank writes into a folder the
        shards of the module and optimizers in ``state``, rank 0 everything else; the folder
        replaces an earlier checkpoint of that name only once complete."""
        path = Path(self.broadcast(str(path)))
        if self._state_dict_type == "full":
            if path.is_dir():
                raise IsADirectoryError(on_rank(f"state_dict_type='full' writes one file, but {path} is a folder"))
            super().save_checkpoint(path, state, storage_options, filter)
            return
        if storage_options is not None:
            raise TypeError(on_rank("state_dict_type='sharded' takes no storage_options"))
        if path.is_file():
            raise FileExistsError(on_rank(f"state_dict_type='sharded' writes a folder, but {path} is a file"))
        module_key, optimizer_keys = self._sharded_objects(state, "save")
        converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
        model_state = converted.pop(module_key, {}) if module_key is not None else {}
        optimizer_states = [converted.pop(key, {}) for key in optimizer_keys]
        checkpoints.save_sharded(path, model_state, optimizer_states, converted)

    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Collective: restore the objects in ``state`` in place from a full file or a sharded
        folder, saved at any world size; return what the checkpoint holds beyond them. Files are
        read with ``torch.load(weights_only=True)``, folders by :mod:`sharded.checkpoint`."""
        path = Path(self.broadcast(str(path)))
        if isinstance(state, Optimizer):
            raise TypeError(on_rank("load an optimizer's state with fabric.load(path, {'optimizer': optimizer})"))
        wanted: dict[str, Any] = {"module": state} if isinstance(state, nn.Module) else dict(state or {})
        if path.is_dir():
            module_key, optimizer_keys = self._sharded_objects(wanted, "load")
            module = _unwrapped(wanted.pop(module_key)) if module_key is not None else None
            saved = checkpoints.load_sharded(path, module, [wanted.pop(key) for key in optimizer_keys], strict)
        elif path.is_file():
            saved = checkpoints.read_file(path)
            saved = {"module": saved} if isinstance(state, nn.Module) else saved
        else:
            raise FileNotFoundError(on_rank(f"checkpoint {path} does not exist"))
        if not wanted:
            return saved
        rest = self._restore(wanted, saved, strict)
        if isinstance(state, dict):
            state.update({k: v for k, v in wanted.items() if not isinstance(v, (nn.Module, Optimizer))})
        return rest

    def _sharded_objects(self, state: Mapping[str, Any], action: str) -> tuple[Optional[str], list[str]]:
        """The key of the one module in ``state`` (or ``None``) and those of its optimizers, sorted:
        a sharded checkpoint files them under ``"model"`` and ``"optim"``, whatever their keys."""
        modules = [key for key, obj in state.items() if isinstance(obj, nn.Module)]
        optimizers = sorted(key for key, obj in state.items() if isinstance(obj, Optimizer))
        if len(modules) > 1:
            raise ValueError(on_rank(
                f"cannot {action} modules {', '.join(modules)} in one sharded "
                "checkpoint: it holds one module and its optimizers, as with Fabric's own FSDPStrategy; "
                "use one checkpoint per module"
            ))
        if optimizers and not modules:
            raise ValueError(on_rank(
                f"{action} optimizers {', '.join(optimizers)} together with the "
                "module whose parameters they step: a sharded checkpoint files their state by parameter FQN"
            ))
        return (modules[0] if modules else None), optimizers

    def _restore(self, wanted: dict[str, Any], saved: dict[str, Any], strict: bool) -> dict[str, Any]:
        """Load ``saved[key]`` (whole tensors for a module or an optimizer: a full file) into each
        object of ``wanted``; plain values are replaced."""
        missing = sorted(set(wanted) - set(saved))
        if strict and missing:
            raise KeyError(on_rank(f"the checkpoint holds no {', '.join(missing)}; pass strict=False to skip them"))
        for key, obj in wanted.items():
            if key not in saved:
                continue
            value = saved.pop(key)
            if isinstance(obj, nn.Module):
                checkpoints.load_model_state(_unwrapped(obj), value, full=True, strict=strict)
            elif isinstance(obj, Optimizer):
                checkpoints.load_full_optimizer_state(self._module_of(obj), obj, value, what=key)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(value)
            else:
                wanted[key] = value
        return saved

    def _module_of(self, optimizer: Optimizer) -> nn.Module:
        """The set-up module whose parameters ``optimizer`` steps."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in reversed(self._modules):
            if held <= {id(p) for p in module.parameters()}:
                return module
        raise ValueError(on_rank(
            f"an optimizer ({type(optimizer).__name__}) steps parameters of no module set up "
            "by this strategy; build it from the parameters of the module fabric.setup returned"
        ))

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"sharded_fsdp"``."""
        strategy_registry.register("sharded_fsdp", cls, description="ZeRO-3: sharded.FullyShardedDataParallel", override=True)


class _NoSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the sharded module's ``no_sync``."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not hasattr(module, "no_sync"):
            raise TypeError(
                f"fabric.no_backward_sync needs the module that fabric.setup returned, got {type(module).__name__}"
            )
        return module.no_sync()  # type: ignore[operator]


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module that was sharded, inside the wrapper ``setup_module`` returned."""
    from ..fsdp import FullyShardedDataParallel

    return module.module if isinstance(module, (FullyShardedDataParallel, ShardedRoot)) else module
