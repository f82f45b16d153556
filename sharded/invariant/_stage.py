"""What :class:`~.micro_batches.MicroBatches` asks of a stage, and what every stage checks.

Each stage (:mod:`._replicated`: DDP, ``OSS`` + DDP, ``ShardedDataParallel``; :mod:`._sharded`:
``fully_shard`` and the FSDP wrapper) says which micro-batches this rank computes, the context
one micro-batch runs in, what to do after its backward, and at the end where the mean lands and
which gradient rows this rank holds (for the norm). :mod:`._stages` picks the stage of a model.
"""

from __future__ import annotations

from typing import ContextManager, Optional

import torch
import torch.distributed as dist

from .._common.dtensors import local_tensor_of
from .._common.errors import on_rank
from ._norm import RowsHeld

__all__ = ["Stage", "check_no_gradients"]


class Stage:
    """What :class:`~.micro_batches.MicroBatches` asks of a stage."""

    group: Optional[dist.ProcessGroup]  # the ranks whose blocks the tree combines
    world: int  # data-parallel ranks (every replica row's, for hybrid sharding)
    block: int  # this rank's block: its position among them

    def indices(self, micro_batches: int, block: int) -> list[int]:
        """The micro-batches the rank of ``block`` computes, in the order it must compute them:
        a block of consecutive ones (layers 0-2)."""
        per_rank = micro_batches // self.world
        return [block * per_rank + t for t in range(per_rank)]

    def micro_batch(self) -> ContextManager[None]:
        """The context one micro-batch's forward and backward run in."""
        raise NotImplementedError

    def begin(self) -> None:
        """A step's micro-batches start: every gradient must be empty."""
        check_no_gradients(self.params())

    def collect(self) -> None:
        """One micro-batch's backward has run."""
        raise NotImplementedError

    def finish(self, micro_batches: int) -> None:
        """The last micro-batch's backward has run: land the mean of the canonical sum."""
        raise NotImplementedError

    def params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def rows_held(self) -> tuple[list[RowsHeld], int, Optional[dist.ProcessGroup]]:
        """The gradient rows this rank holds (offset among all rows, gradient), the number of
        rows in all, and the group whose ranks hold the others (``None``: this rank holds all)."""
        raise NotImplementedError

    def mean_group_order(self) -> list[dist.ProcessGroup]:
        """Groups to gather per-micro-batch values over, innermost first (blocks in order)."""
        return [self.group] if self.group is not None else []


def check_no_gradients(params: list[torch.Tensor]) -> None:
    """A step's canonical sum starts from nothing: ``zero_grad()`` must have run."""
    held = [local_tensor_of(g) for g in (p.grad for p in params) if g is not None]
    # ``!= 0`` and not ``abs().amax() > 0``: a NaN left by a step the scaler skipped counts as held
    if held and bool(torch.stack([(g != 0).any() for g in held]).any()):
        raise RuntimeError(on_rank(
            "MicroBatches: parameters hold gradients as the micro-batch loop starts; call optimizer.zero_grad() "
            "before it (the loop sums the micro-batches' gradients in its own order and lands their mean)"
        ))
