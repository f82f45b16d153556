"""Policies for ``fully_shard``: small frozen dataclasses, as in torch FSDP2.

They describe *what* a unit does with its parameters' dtypes and placement; the unit reads them
once when it is built, so changing a policy means calling ``fully_shard`` on a fresh model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "BackwardPrefetch"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in a narrow dtype while the sharded masters (and the optimizer) stay in theirs.

    Args:
        param_dtype: dtype of the unsharded parameters that forward and backward compute with.
            Shards are cast before the all-gather, so ``torch.bfloat16`` also halves the bytes
            gathered. ``None`` keeps the parameters' own dtype.
        reduce_dtype: dtype gradients are reduce-scattered in, and accumulated in while gradient
            sync is off. ``None`` follows the torch sharded runs with, so that the numbers equal
            its ``fully_shard``'s: from torch 2.15 on, each parameter's ``grad_dtype`` (its own
            dtype unless set: fp32 for fp32 masters under ``param_dtype=torch.bfloat16``; a unit
            mixing several reduces in their promoted dtype); before 2.15, ``param_dtype`` (or the
            masters' dtype). ``reduce_dtype=torch.bfloat16`` keeps bf16 on every torch. The
            reduced shard is cast to the parameter's ``grad_dtype`` (its own dtype unless set)
            before it lands in ``param.grad``.
        output_dtype: cast floating-point outputs of the module's forward to this dtype.
        cast_forward_inputs: cast floating-point tensors in the forward's arguments to
            ``param_dtype`` (ignored when ``param_dtype`` is ``None``).
        param_dtype_override_fn: keyword-only; ``param -> None | dtype``, asked once per
            parameter by ``fully_shard`` (with the parameter as the module holds it then):
            ``None`` or ``param_dtype`` computes it in ``param_dtype``, the parameter's own dtype
            keeps it there (e.g. fp32 norms inside a bf16 unit); any other answer raises
            ``ValueError``. Inputs are still cast to ``param_dtype``. torch 2.15's field, offered
            on every torch sharded supports. Its answers must be the same on every rank.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Optional[Callable[[nn.Parameter], Optional[torch.dtype]]] = field(default=None, kw_only=True)

    def compute_dtype_of(self, param: nn.Parameter, name: str) -> Optional[torch.dtype]:
        """The dtype ``param`` (called ``name`` in errors) is gathered and computed in
        (``None``: whatever dtype it has then), as ``param_dtype`` and ``param_dtype_override_fn`` say."""
        if self.param_dtype_override_fn is None:
            return self.param_dtype
        answer = self.param_dtype_override_fn(param)
        if answer is None or answer == self.param_dtype:
            return self.param_dtype
        if answer == param.dtype:
            return param.dtype  # kept in it even if the module's dtype changes later, as in torch
        raise ValueError(
            f"MixedPrecisionPolicy.param_dtype_override_fn returned {answer!r} for parameter {name} of dtype "
            f"{param.dtype}; it may return None, param_dtype ({self.param_dtype}) or the parameter's own dtype"
        )


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
