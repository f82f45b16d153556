"""sharded: ZeRO-style sharding of optimizer state, gradients and parameters for PyTorch.

Three layers: ``OSS`` shards optimizer state (layer 1, ZeRO-1; ``ZeroRedundancyOptimizer`` is
the same engine behind torch's ``ZeroRedundancyOptimizer`` interface, imported on first use);
``ShardedDataParallel`` adds gradient sharding (layer 2, ZeRO-2), with fairscale's names and
signatures, so ``from sharded import OSS, ShardedDataParallel`` is a drop-in; ``fully_shard``
(torch FSDP2's API) and ``FullyShardedDataParallel`` (FSDP1's) also shard the parameters (layer
3, ZeRO-3, ``sharded.fsdp``, imported on first use). ``ShardedGradScaler`` makes mixed precision agree
across shards. ``sharded.checkpoint`` saves and loads sharded, resharding checkpoints for every
layer; ``sharded.lightning`` (optional) offers all three as Lightning strategies.
``estimate_memory`` and ``plan`` say what each stage holds per rank, and which fit a budget.
``newton_schulz_cost`` is the step cost ``OSS`` balances for Muon (pass your own as
``param_cost``). ``sharded.invariant.MicroBatches`` accumulates a global batch of micro-batches so
that every stage reaches the same bits at any number of ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import checkpoint
from .grad_scaler import ShardedGradScaler
from .oss import OSS
from .sharded_ddp import ShardedDataParallel
from .ddp_zero_hook import hook_with_zero_step, hook_with_zero_step_interleaved
from ._memory.estimate import MemoryEstimate, estimate_memory
from ._common.step_cost import newton_schulz_cost
from ._common.lowbit import LowBit, LowBitCheck
from .fsdp import __getattr__ as _fsdp_getattr

if TYPE_CHECKING:  # imported on first use at run time (see __getattr__); typed for checkers
    from .zero_redundancy_optimizer import ZeroRedundancyOptimizer

__version__ = "0.2.0"

__all__ = [
    "OSS",
    "ZeroRedundancyOptimizer",
    "ShardedDataParallel",
    "ShardedGradScaler",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "fully_shard",
    "FullyShardedDataParallel",
    "use_for_torch_fsdp",
    "MemoryEstimate",
    "estimate_memory",
    "plan",
    "newton_schulz_cost",
    "LowBit",
    "LowBitCheck",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """Layer 3 (``fully_shard``, ``FullyShardedDataParallel``...), ``plan`` and
    ``ZeroRedundancyOptimizer`` (which imports ``torch.distributed.optim``), on first use.

    ``plan`` lives in ``sharded/plan.py``, which is also the ``python -m sharded.plan`` command;
    importing that module sets the package attribute ``plan`` to the module, so the function is
    put back in its place (and not imported eagerly: ``-m`` would then run a module already
    imported).
    """
    if name == "plan":
        from .plan import plan

        globals()["plan"] = plan
        return plan
    if name == "ZeroRedundancyOptimizer":
        from .zero_redundancy_optimizer import ZeroRedundancyOptimizer

        globals()[name] = ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer
    return _fsdp_getattr(name)


def __dir__() -> list[str]:
    """The module's names and the lazily imported ones (``dir(sharded)`` lists ``fully_shard``)."""
    return sorted(set(globals()) | set(__all__))
