"""sharded: ZeRO-style sharding of optimizer state, gradients and parameters for PyTorch.

``OSS`` shards optimizer state (ZeRO-1); ``ShardedDataParallel`` adds gradient sharding
(ZeRO-2); ``ShardedGradScaler`` makes mixed precision agree across shards. The names and
signatures follow fairscale, so ``from sharded import OSS, ShardedDataParallel`` is a drop-in.
``sharded.checkpoint`` saves and loads sharded, resharding checkpoints for every layer.
"""

from __future__ import annotations

from . import checkpoint
from .grad_scaler import ShardedGradScaler
from .oss import OSS
from .sharded_ddp import ShardedDataParallel
from .fsdp import __getattr__  # noqa: F401  layer 3 (fully_shard, FullyShardedDataParallel...), imported on first use

__version__ = "0.1.0"

__all__ = ["OSS", "ShardedDataParallel", "ShardedGradScaler", "fully_shard", "FullyShardedDataParallel", "__version__"]


def __dir__() -> list[str]:
    """The module's names and the lazily imported layer-3 ones (``dir(sharded)`` lists ``fully_shard``)."""
    return sorted(set(globals()) | set(__all__))
