"""``MicroBatches``: gradient accumulation whose result does not depend on the number of ranks.

A step's global batch is ``M`` micro-batches whose data depend only on the step and the
micro-batch index. Iterating a ``MicroBatches`` yields the indices this rank computes; after the
loop every gradient is the mean over all ``M`` micro-batches, summed in one fixed tree
(:mod:`._tree`) however many ranks computed them. So is the norm :meth:`MicroBatches.clip_grad_norm_`
clips by, and the mean :meth:`MicroBatches.mean` takes of per-micro-batch values (the loss).
Everything downstream (the optimizer step, elementwise or on whole matrices) then sees the
same bits at any world size that divides ``M``.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .._common import comm
from .._common.dtensors import local_tensor_of
from .._common.errors import on_rank
from .._common.norm import scale_by_norm_
from .._common.step_checks import install_step_check
from ._norm import check_norm_type, invariant_grad_norm
from ._stages import Stage, stage_of
from ._tree import is_power_of_two, tree_sum

__all__ = ["MicroBatches"]

_unfinished: "weakref.WeakSet[MicroBatches]" = weakref.WeakSet()  # loops started and not run to their end
_live: "weakref.WeakSet[MicroBatches]" = weakref.WeakSet()  # every MicroBatches in use


class MicroBatches:
    """The micro-batches of one step's global batch that this rank computes, accumulated so that
    the gradients, and all that follows from them, are the same at any world size.

    ::

        micro_batches = MicroBatches(model, 8)         # after DDP / ShardedDataParallel / fully_shard
        for step in range(steps):
            optimizer.zero_grad()
            losses = []
            for index in micro_batches:                 # this rank's indices of the 8
                loss = loss_fn(model(inputs(step, index)), targets(step, index))
                loss.backward()                          # each micro-batch's own mean loss, unscaled
                losses.append(loss.detach())
            micro_batches.clip_grad_norm_(1.0)
            optimizer.step()
            step_loss = micro_batches.mean(losses)       # the global batch's loss, every rank

    After the loop each gradient is the mean over the ``M`` micro-batches, where the stage keeps
    it: on every rank (DDP, ``OSS`` + DDP), on its owner (``ShardedDataParallel``), as this rank's
    shard (``fully_shard``, the FSDP wrapper). ``M`` and the world size must be powers of two,
    the world size at most ``M`` (see ``docs/invariance.md``); anything else is refused here.

    What the user must keep independent of the world size: the data of micro-batch ``i`` of step
    ``s`` (draw it from ``(s, i)``), randomness inside the model (seed dropout from ``(s, i)``), the
    number of intra-op threads per rank, and on CUDA ``torch.use_deterministic_algorithms(True)``.

    Args:
        model: the wrapped model (``DistributedDataParallel``, ``ShardedDataParallel``, a model
            ``fully_shard`` was applied to, ``FullyShardedDataParallel``; a plain module in one
            process).
        micro_batches: ``M``, the micro-batches of every step's global batch.
    """

    def __init__(self, model: nn.Module, micro_batches: int) -> None:
        self.count = micro_batches
        self._stage: Stage = stage_of(model)
        _check_counts(micro_batches, self._stage.world)
        self.indices: list[int] = self._stage.indices(micro_batches, self._stage.block)
        self._position = 0  # micro-batches of the current loop done
        self._param_ids = {id(p) for p in self._stage.params()}
        _live.add(self)
        install_step_check(_refuse_steps_that_break_invariance)

    @property
    def world_size(self) -> int:
        """The data-parallel ranks the micro-batches are spread over."""
        return self._stage.world

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's micro-batch indices; run each one's forward and backward in the loop
        body. After the last, the gradients hold the mean; leaving the loop early leaves them
        incomplete, and an optimizer step then raises."""
        self._stage.begin()
        self._position = 0
        _unfinished.add(self)
        for index in self.indices:
            with self._stage.micro_batch():
                yield index
            self._stage.collect()
            self._position += 1
        self._stage.finish(self.count)
        _unfinished.discard(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by their global norm and return it (collective): the same norm,
        bit for bit, at every world size (its terms are added in one order, :mod:`._norm`);
        it equals ``torch.nn.utils.clip_grad_norm_`` on one process to float32 rounding."""
        norm_type = check_norm_type(norm_type)
        held, total_rows, group = self._stage.rows_held()
        device = next((g.device for _, g in held), _first_device(self._stage.params()))
        total = invariant_grad_norm(held, total_rows, group, norm_type, device)
        scale_by_norm_([local_tensor_of(g) for g in (p.grad for p in self._stage.params()) if g is not None], total, max_norm, norm_type, error_if_nonfinite)
        return total

    def mean(self, values: Sequence[Any]) -> torch.Tensor:
        """The mean over the global batch of per-micro-batch scalars (this rank's, in the order
        of its indices), summed up the canonical tree: the same bits on every rank and at every
        world size. Collective."""
        mine = torch.stack([torch.as_tensor(v, dtype=torch.float32).detach().reshape(()) for v in values]).float()
        if mine.numel() != len(self.indices):
            raise ValueError(on_rank(f"MicroBatches.mean: {mine.numel()} values for this rank's {len(self.indices)} micro-batches"))
        gathered = self._gather_in_block_order(mine)
        by_index = torch.empty(self.count, dtype=torch.float32, device=gathered.device)
        by_index[torch.tensor(self._all_indices(), device=gathered.device)] = gathered
        return (tree_sum(by_index) / self.count).cpu()

    def _gather_in_block_order(self, mine: torch.Tensor) -> torch.Tensor:
        gathered = mine
        for group in self._stage.mean_group_order():
            device = comm.comm_device(group)
            parts = comm.all_gather(gathered.to(device), group)
            gathered = torch.cat(parts)
        return gathered

    def _all_indices(self) -> list[int]:
        """Every block's indices, in block order (what :meth:`_gather_in_block_order` gives)."""
        return [i for block in range(self._stage.world) for i in self._stage.indices(self.count, block)]

    def _describe_unfinished(self) -> str:
        return f"{self._position} of this rank's {len(self.indices)} micro-batches"


def _check_counts(micro_batches: int, world: int) -> None:
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(on_rank(f"MicroBatches: the micro-batch count must be a positive int, got {micro_batches!r}"))
    if not is_power_of_two(micro_batches) or not is_power_of_two(world) or micro_batches % world:
        raise ValueError(on_rank(
            f"MicroBatches: {micro_batches} micro-batches over {world} ranks; the results are the same at every world "
            "size only when the micro-batch count is a power of two and the ranks a power of two no larger (the "
            "canonical tree is a balanced binary tree whose subtrees the ranks take; see docs/invariance.md)"
        ))


def _first_device(params: list[torch.Tensor]) -> torch.device:
    return local_tensor_of(params[0]).device if params else torch.device("cpu")


def _refuse_steps_that_break_invariance(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """Before every optimizer step: no ``MicroBatches`` loop was left before its end, and no
    ``OSS`` stepping a ``MicroBatches`` model's parameters broadcasts them in fp16 (the ranks
    that do not own a parameter would compute with a rounded copy, and which ranks those are
    depends on the world size)."""
    if getattr(optimizer, "broadcast_fp16", False) and _live:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(m._param_ids & ids for m in list(_live)):
            raise NotImplementedError(on_rank(
                "OSS(broadcast_fp16=True) under MicroBatches: the ranks that do not own a parameter would compute with "
                "its fp16 copy, and which ranks those are changes with the world size; use broadcast_fp16=False"
            ))
    if getattr(optimizer, "lowbit", None) is not None and _live:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(m._param_ids & ids for m in list(_live)):
            raise NotImplementedError(on_rank(
                "OSS(lowbit=...) under MicroBatches: every rank computes with parameters rounded by the low-bit "
                "broadcast, in blocks laid out by the partition, which changes with the world size (the "
                "invariant promise is bits); use lowbit=None"
            ))
    unfinished = [m for m in list(_unfinished) if m._position < len(m.indices)]
    if unfinished:
        raise RuntimeError(on_rank(
            f"{type(optimizer).__name__}.step() after a MicroBatches loop that stopped after "
            f"{unfinished[0]._describe_unfinished()}: the gradients hold no mean yet; run the loop to its end"
        ))
