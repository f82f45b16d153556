"""The two kinds of tensor a checkpoint holds: plain tensors and DTensors (ZeRO-3's shards).

Told apart without importing DTensor, which is slow to import and cannot be in play before
something else imported it.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch

__all__ = ["is_dtensor", "local_part"]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor (slow) when none can exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard, which shares its storage and
    in-place version counter, or the tensor itself."""
    return cast(torch.Tensor, tensor.to_local()) if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
