"""Lightning strategies over sharded's layers: ``Trainer(strategy="ddp_sharded")`` works again.

Importing this package registers ``"ddp_sharded"`` (ZeRO-2) and ``"ddp_zero1"`` (ZeRO-1) with the
Lightning Trainer and with Lightning Fabric, and so ``"sharded_fsdp"`` (ZeRO-3)::

    import lightning as L
    import sharded.lightning  # noqa: F401  (registers the strategies)

    trainer = L.Trainer(strategy="ddp_sharded", accelerator="gpu", devices=8)

It needs Lightning 2 (``pip install 'sharded[lightning]'``); ``import sharded`` alone never
imports Lightning. Strategy classes: :class:`ShardedDDPStrategy` and :class:`ShardedFSDPStrategy` (the
arguments of Lightning's ``FSDPStrategy``) for the Trainer, and
``sharded.lightning.fabric.ShardedDDPStrategy`` and
``sharded.lightning.fabric_fsdp.ShardedFSDPStrategy`` for Fabric.

Stages and layers: a strategy's ``stage`` is the ZeRO stage it trains with, and sharded's layer of
the same number runs it: stage 1 is layer 1 (``OSS``, the model in DDP), stage 2 is layer 2
(``OSS`` + ``ShardedDataParallel``), stage 3 is layer 3 (``FullyShardedDataParallel``, the
``ShardedFSDPStrategy``). "Layer" names those parts of sharded, never a model's modules.

Modules: ``ddp.py``, ``fsdp.py`` (the Trainer's strategies), ``fabric.py``, ``fabric_fsdp.py``
(Fabric's), ``precision.py`` (precision plugins); what they do to the model, optimizers and
checkpoints lives in ``_sharding``, ``_fsdp_setup`` and ``_fsdp_checkpoint``, which import no Lightning.
"""

from __future__ import annotations

try:
    import lightning  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "sharded.lightning needs Lightning 2.x (the 'lightning' package): pip install 'sharded[lightning]'"
    ) from error

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY

from . import fabric, fabric_fsdp
from .ddp import ShardedDDPStrategy
from .fsdp import ShardedFSDPStrategy

__all__ = ["ShardedDDPStrategy", "ShardedFSDPStrategy", "fabric", "fabric_fsdp"]

ShardedDDPStrategy.register_strategies(_TRAINER_REGISTRY)
ShardedFSDPStrategy.register_strategies(_TRAINER_REGISTRY)
fabric.ShardedDDPStrategy.register_strategies(_FABRIC_REGISTRY)
fabric_fsdp.ShardedFSDPStrategy.register_strategies(_FABRIC_REGISTRY)
