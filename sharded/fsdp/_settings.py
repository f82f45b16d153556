"""What a unit is told: its own settings, and the step it shares with the rest of its model.

:class:`UnitSettings` is the one home of a unit's settings: what ``fully_shard`` was given and
what the module's ``set_*`` methods (FSDP2's ``FSDPModule`` API) change later. The unit, its root
and its gradient reducer read them there when they act, so a change applies from the next use.

:class:`StepContext` is shared by a model's root and all its units once the root is known: where
the model is in its step, and the settings that apply to the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import nn

from .._common.lowbit.policy import LowBit
from ._finalization import FinalizationMode
from ._placement.secondary_shard import SecondaryShardGroup
from .policies import BackwardPrefetch, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["UnitSettings", "StepContext"]


@dataclass
class UnitSettings:
    """One unit's settings.

    ``reshard_after_forward=k`` (``1 < k < shard world``) is ``reshard_after_forward=True`` with a
    ``secondary_shard`` group of ``k`` ranks: after forward the unit keeps its secondary shard,
    which backward gathers within that group (:mod:`._placement.secondary_shard`).
    """

    mp_policy: MixedPrecisionPolicy
    offload_policy: Optional[OffloadPolicy] = None
    # gathering and freeing the parameters
    reshard_after_forward: Optional[bool] = None  # None: decided with the root (True, except for the root)
    secondary_shard: Optional[SecondaryShardGroup] = None
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    keep_unsharded_storage: bool = False  # reshard keeps the gathered storage (its data pointers)
    unshard_async_op: bool = True  # False: the forward's all-gather lands before prefetches start
    custom_all_gather: Optional[Any] = None  # a torch.distributed.fsdp.AllGather
    # prefetching: fully_shard modules to gather next (None: the unit after this one last time)
    forward_prefetch: Optional[list[nn.Module]] = None
    backward_prefetch: Optional[list[nn.Module]] = None
    backward_prefetch_timing: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    # reducing the gradients
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    gradient_divide_factor: Optional[float] = None
    force_sum_reduction: bool = False
    reduce_scatter_unused_params: bool = False
    max_reductions_in_flight: Optional[int] = None
    all_reduce_hook: Optional[Any] = None
    all_reduce_hook_stream: Optional[Any] = None
    custom_reduce_scatter: Optional[Any] = None  # a torch.distributed.fsdp.ReduceScatter
    reduce_scatter_group: Optional[dist.ProcessGroup] = None
    # what reduces the gradients instead, while set: ``(params, grads) -> UnitReduction``
    # (sharded.invariant's canonical exchange sets it for the micro-batches of a step)
    reduction_override: Optional[Callable[[list[Any], list[Any]], Any]] = None
    # parameters and/or gradients on the wire in fewer bits (fully_shard(lowbit=...), _lowbit)
    lowbit: Optional[LowBit] = None

    @property
    def offloads(self) -> bool:
        return isinstance(self.offload_policy, CPUOffloadPolicy)

    @property
    def pins_memory(self) -> bool:
        return isinstance(self.offload_policy, CPUOffloadPolicy) and self.offload_policy.pin_memory

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """A ``bool`` set later replaces a secondary shard too, as in torch: ``True`` frees
        everything after forward, ``False`` keeps everything."""
        self.reshard_after_forward = reshard_after_forward
        self.secondary_shard = None


@dataclass
class StepContext:
    """The step of a whole model, shared by its root and all its units once the root is known."""

    in_backward: bool = False  # the root's: from the first unit backward reaches to the end of backward
    is_last_backward: bool = True  # set_is_last_backward
    post_optim_event: Optional[Any] = None  # set_post_optim_event
    finalization: FinalizationMode = field(default_factory=FinalizationMode)  # set_manual_backward_finalization
