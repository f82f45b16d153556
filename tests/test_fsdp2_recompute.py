"""Activation checkpointing around ``fully_shard`` units, against torch's own ``fully_shard``.

Reentrant checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``, Megatron's full
recompute) runs a unit's first forward without grad and its real forward inside backward, where
it builds a graph of its own: the unit must set up its backward then, or its gradients are never
sent (they were dropped, silently, before). Non-reentrant checkpointing recomputes inside the
backward the first forward already set up. Both, per block and around the whole stack of
blocks, around the root itself, by torch's ``checkpoint_wrapper`` and composable ``checkpoint``,
with ``reshard_after_forward`` True / False / an int, with explicit prefetching, with a block whose recompute runs twice (used twice in forward), and
through the FSDP1-shaped wrapper: the same losses and parameters as torch's ``fully_shard`` on
the same code and data, bit for bit (at world 3 every rank on rank 0's batches, whose sums are
the same in any order: tests/_exact_sums.py; the block recomputed twice to float32 rounding above
world 1, see there).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from examples.gpt import GPT, Block
from tests._fsdp_reference import assert_same_as_torch, shard_gpt, train_recording
from tests._exact_sums import batch_rank
from tests._harness import run_on_ranks



class RecomputedGPT(GPT):
    """The test GPT with its blocks recomputed in backward.

    ``around``: ``"block"`` checkpoints each block call, ``"stack"`` the whole stack of blocks in
    one region; ``shared``: the first block runs again after the last (one module, two calls).
    """

    def __init__(self, reentrant: bool, around: str = "block", shared: bool = False) -> None:
        torch.manual_seed(0)
        super().__init__(64, 32, 2, 2, 16)
        self.reentrant, self.around, self.shared = reentrant, around, shared

    def calls(self) -> list[nn.Module]:
        return list(self.blocks) + ([self.blocks[0]] if self.shared else [])

    def _stack(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.calls():
            x = block(x)
        return x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        if self.around == "nothing":
            x = self._stack(x)
        elif self.around == "stack":
            x = checkpoint(self._stack, x, use_reentrant=self.reentrant)
        else:
            for block in self.calls():
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.ln(x))


class CheckpointedRoot(nn.Module):
    """A stack of blocks whose root unit itself runs under reentrant checkpointing: no unit's
    backward has begun when the recompute runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Block(16, 2), Block(16, 2))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))


def _root_batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(40_000 + 100 * step + rank)
    return torch.randn(2, 5, 16, generator=g)


def _root_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(model, x.requires_grad_(), use_reentrant=True).square().mean()


def _shard(model: nn.Module, shard, prefetch: bool = False, **kwargs) -> nn.Module:
    shard_gpt(model, shard, **kwargs)
    if prefetch:  # explicit lists, as torchtitan sets them: the next block in each direction
        blocks = list(model.blocks)
        for before, after in zip(blocks, blocks[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    return model


def _wrapped_blocks(how: str) -> nn.Module:
    """The plain GPT with its blocks checkpointed by torch's wrappers, applied before sharding
    as torchtitan and Lightning do: ``checkpoint_wrapper`` (reentrant or not; the block becomes
    the wrapper's child) or the composable ``checkpoint(block)`` (module hooks, non-reentrant)."""
    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model = RecomputedGPT(reentrant=False, around="nothing")
    for i, block in enumerate(model.blocks):
        if how == "composable":
            composable_checkpoint(block)
        else:
            impl = CheckpointImpl.REENTRANT if how == "reentrant" else CheckpointImpl.NO_REENTRANT
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=impl)
    return model


def _recompute_cases(rank, world):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import FullyShardedDataParallel, fully_shard

    data_rank = batch_rank(rank, world)  # at world 3 rank 0's batches: exact sums, tests/_exact_sums.py
    cases = [
        ("reentrant per block", dict(reentrant=True), {}),
        ("reentrant per block, reshard_after_forward=False", dict(reentrant=True), dict(reshard_after_forward=False)),
        (f"reentrant per block, reshard_after_forward={world}", dict(reentrant=True), dict(reshard_after_forward=world)),
        ("reentrant per block, explicit prefetching", dict(reentrant=True), dict(prefetch=True)),
        ("reentrant around the stack", dict(reentrant=True, around="stack"), {}),
        ("non-reentrant per block", dict(reentrant=False), {}),
        ("non-reentrant per block, reshard_after_forward=False", dict(reentrant=False), dict(reshard_after_forward=False)),
        ("non-reentrant around the stack, explicit prefetching", dict(reentrant=False, around="stack"), dict(prefetch=True)),
        ("non-reentrant, a block recomputed twice", dict(reentrant=False, shared=True), {}),
    ]
    for what, model_args, shard_args in cases:
        theirs = train_recording(_shard(RecomputedGPT(**model_args), torch_fully_shard, **shard_args), data_rank)
        ours = train_recording(_shard(RecomputedGPT(**model_args), fully_shard, **shard_args), data_rank)
        assert_same_as_torch(ours, theirs, what, exact=True)

    # torch's fully_shard loses a use's gradient here (its parameters 4e-3 off the unsharded
    # model's at world 1 after 3 steps): against torch's without checkpointing, the same math.
    # Each recompute's backward sends its own gradient, so the two uses are added after their
    # reductions, not before: bit for bit at world 1, float32 rounding apart above.
    theirs = train_recording(_shard(RecomputedGPT(reentrant=True, around="nothing", shared=True), torch_fully_shard), data_rank)
    ours = train_recording(_shard(RecomputedGPT(reentrant=True, shared=True), fully_shard), data_rank)
    assert_same_as_torch(ours, theirs, "reentrant, a block recomputed twice", exact=world == 1)

    for how in ("reentrant", "non-reentrant", "composable"):
        theirs = train_recording(_shard(_wrapped_blocks(how), torch_fully_shard), data_rank)
        ours = train_recording(_shard(_wrapped_blocks(how), fully_shard), data_rank)
        assert_same_as_torch(ours, theirs, f"{how} checkpoint wrapper per block", exact=True)

    theirs = train_recording(_shard(CheckpointedRoot(), torch_fully_shard), data_rank, loss_fn=_root_loss, batch_fn=_root_batch)
    ours = train_recording(_shard(CheckpointedRoot(), fully_shard), data_rank, loss_fn=_root_loss, batch_fn=_root_batch)
    assert_same_as_torch(ours, theirs, "reentrant around the root", exact=True)

    # the FSDP1-shaped wrapper, each block a unit (auto-wrapped), Megatron's full recompute
    theirs = train_recording(_shard(RecomputedGPT(reentrant=True), torch_fully_shard), data_rank)
    wrapped = FullyShardedDataParallel(RecomputedGPT(reentrant=True), auto_wrap_policy={Block})
    assert_same_as_torch(train_recording(wrapped, data_rank), theirs, "FullyShardedDataParallel, reentrant per block", exact=True)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_activation_checkpointing_reentrant_or_not_matches_torch_fully_shard(world_size):
    run_on_ranks(_recompute_cases, world_size, timeout=180)
