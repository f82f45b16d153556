"""Policies for ``fully_shard``: small frozen dataclasses, as in torch FSDP2.

They describe *what* a unit does with its parameters' dtypes and placement; the unit reads them
once when it is built, so changing a policy means calling ``fully_shard`` on a fresh model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "BackwardPrefetch"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in a narrow dtype while the sharded masters (and the optimizer) stay in theirs.

    Args:
        param_dtype: dtype of the unsharded parameters that forward and backward compute with.
            Shards are cast before the all-gather, so ``torch.bfloat16`` also halves the bytes
            gathered. ``None`` keeps the parameters' own dtype.
        reduce_dtype: dtype gradients are reduce-scattered in (default: ``param_dtype``). The
            reduced shard is cast back to the master dtype before it lands in ``param.grad``.
        output_dtype: cast floating-point outputs of the module's forward to this dtype.
        cast_forward_inputs: cast floating-point tensors in the forward's arguments to
            ``param_dtype`` (ignored when ``param_dtype`` is ``None``).
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep the sharded parameters on the compute device (no offloading)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and hence the optimizer step on the CPU.

    Each all-gather first copies this rank's shard to the compute device; reduced gradient
    shards are copied back. Build the optimizer after sharding, as always: it then steps CPU
    tensors.

    Args:
        pin_memory: allocate the CPU shards in pinned memory so host-device copies can overlap
            computation (only where CUDA is available; pinning needs it).
    """

    pin_memory: bool = True


class BackwardPrefetch(enum.Enum):
    """When a unit starts the next unit's all-gather in backward (FSDP1's names).

    ``BACKWARD_PRE``: as its own backward starts (more overlap, one more unit's parameters held);
    ``BACKWARD_POST``: once its own gradients are computed.
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
