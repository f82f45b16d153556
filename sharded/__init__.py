"""sharded: ZeRO-style sharding of optimizer state, gradients and parameters for PyTorch.

Three layers: ``OSS`` shards optimizer state (layer 1, ZeRO-1); ``ShardedDataParallel`` adds
gradient sharding (layer 2, ZeRO-2), with fairscale's names and signatures, so
``from sharded import OSS, ShardedDataParallel`` is a drop-in; ``fully_shard`` (torch FSDP2's
API) and ``FullyShardedDataParallel`` (FSDP1's) also shard the parameters (layer 3, ZeRO-3,
``sharded.fsdp``, imported on first use). ``ShardedGradScaler`` makes mixed precision agree
across shards. ``sharded.checkpoint`` saves and loads sharded, resharding checkpoints for every
layer; ``sharded.lightning`` (optional) offers all three as Lightning strategies.
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
