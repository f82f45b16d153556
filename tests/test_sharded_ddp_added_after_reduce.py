"""A backward that adds to gradients an earlier reduce handed out gets DDP's numbers.

DDP keeps each averaged gradient on every rank, and a backward run before the gradients are
zeroed adds to it: old average + new average. Under ZeRO-2 only the owner keeps the average; it
sets it aside as autograd is about to add to it, reduces the new gradient alone and adds the
average back (``sharded/_owners/held_averages.py``). The loops here used to raise (a second
backward before the step; a step on such a sum); each now runs on DDP + the plain optimizer and
on ShardedDataParallel + OSS, and the parameters are compared. All cases of a world size run in
one launch.

Tolerance: ``ATOL``/``RTOL`` of tests/test_oss.py (1e-6 absolute, 1e-5 relative: about 80 float32
ulps). DDP adds the old average on every rank before its all-reduce, ``(old + g_r) / W`` summed
over ranks; the owner here adds it after the reduce, ``sum(g_r / W) + old``. Both are old + new
average, rounded in another order: a few ulps of the gradient per backward, and SGD moves a
parameter by ``lr`` times that (measured: at most 6e-8 absolute, 8e-6 relative, over these loops
at worlds 2 and 3; leaving out the average's return is 1e-4 to 2e-2 off). At world 1 nothing is
reduced and the results are DDP's bit for bit, which is checked.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, mlp, mlp_batch, mlp_loss, token_batch
from tests.test_oss import _assert_close
from tests.test_sharded_ddp_loops import _Stack, _stack_batch

SGD = dict(lr=0.05, momentum=0.9)

Loop = Callable[[nn.Module, Sequence[torch.optim.Optimizer], int], None]


def _halves(model: nn.Module) -> list[list[nn.Parameter]]:
    params = list(model.parameters())
    return [params[: len(params) // 2], params[len(params) // 2 :]]


def _compare(rank: int, world: int, what: str, loop: Loop, make_model: Callable[[], nn.Module] = mlp,
             two_optimizers: bool = False, ddp_kwargs: dict | None = None, **sdp_kwargs) -> None:
    """Run ``loop(wrapped, optimizers, rank)`` on DDP + SGD and on ShardedDataParallel + OSS
    over identical models (one SGD per half with ``two_optimizers``); compare the parameters."""
    models = []
    for sharded in (False, True):
        model = make_model()
        groups = _halves(model) if two_optimizers else [list(model.parameters())]
        if sharded:
            optimizers = [OSS(g, torch.optim.SGD, **SGD) for g in groups]
            wrapped: nn.Module = ShardedDataParallel(model, optimizers, **sdp_kwargs)
        else:
            optimizers = [torch.optim.SGD(g, **SGD) for g in groups]
            wrapped = DDP(model, **(ddp_kwargs or {}))
        loop(wrapped, optimizers, rank)
        models.append(model)
    ours, ref = models[1], models[0]
    _assert_close(ours, ref, what)
    assert_same_on_all_ranks(list(ours.parameters()), what)
    if world == 1:
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters())), f"{what}: world 1 not DDP's bits"


def _backward(wrapped: nn.Module, rank: int, step: int) -> torch.Tensor:
    loss = mlp_loss(wrapped, mlp_batch(rank, step))
    loss.backward()
    return loss


# ------------------------------------------------------------------------------ the loops


def _never_zeroed(wrapped, optimizers, rank):
    """backward, step, backward, step, ...: nothing ever zeroes the gradients."""
    for step in range(4):
        _backward(wrapped, rank, step)
        optimizers[0].step()


def _two_optimizers_with_closures(wrapped, optimizers, rank):
    """fairscale's test_two_optimizers pattern: each optimizer steps with a closure that runs a
    forward and backward, so the second closure adds to what the first left unstepped."""
    calls = iter(range(100))
    closure = lambda: _backward(wrapped, rank, next(calls))  # noqa: E731
    for _ in range(3):
        for optimizer in optimizers:
            optimizer.step(closure)


def _closure_steps_never_zeroed(wrapped, optimizers, rank):
    """optimizer.step(closure) with a closure that runs backward, and nothing zeroing."""
    calls = iter(range(100))
    for _ in range(3):
        optimizers[0].step(lambda: _backward(wrapped, rank, next(calls)))


def _zeroing_between_forward_and_backward(wrapped, optimizers, rank):
    """Each way DDP code zeroes after a step, run between the forward and its backward."""
    def release():
        for p in wrapped.module.parameters():
            p.grad = None

    styles = (optimizers[0].zero_grad, wrapped.zero_grad, lambda: wrapped.module.zero_grad(set_to_none=False), release)
    _backward(wrapped, rank, 0)
    optimizers[0].step()
    for step, zero in enumerate(styles, start=1):
        loss = mlp_loss(wrapped, mlp_batch(rank, step))
        zero()
        loss.backward()
        optimizers[0].step()


def _backward_twice_before_each_step(wrapped, optimizers, rank):
    """Two backward passes per step, zeroed in turn by release, in place, or not at all."""
    for step in range(4):
        _backward(wrapped, rank, 2 * step)
        _backward(wrapped, rank, 2 * step + 1)
        optimizers[0].step()
        if step < 2:
            optimizers[0].zero_grad(set_to_none=step == 0)


def _no_sync_mixed_in(wrapped, optimizers, rank):
    """Accumulation inside no_sync() over gradients left from the last step, which only the
    second and fourth steps zeroed first."""
    for step in range(4):
        if step % 2:
            optimizers[0].zero_grad()
        for micro in range(3):
            with wrapped.no_sync() if micro < 2 else contextlib.nullcontext():
                _backward(wrapped, rank, 3 * step + micro)
        optimizers[0].step()


def _no_sync_then_unzeroed_synced(wrapped, optimizers, rank):
    """step; a no_sync backward; a synced one; step; then released by hand and stepped clean."""
    _backward(wrapped, rank, 0)
    optimizers[0].step()
    with wrapped.no_sync():
        _backward(wrapped, rank, 1)
    _backward(wrapped, rank, 2)
    optimizers[0].step()
    for p in wrapped.module.parameters():
        p.grad = None
    _backward(wrapped, rank, 3)
    optimizers[0].step()


def _one_of_two_zeroed_in_place(wrapped, optimizers, rank):
    """Two optimizers; only the first zeroed (in place, on the owner's flat bucket the second's
    gradients share) between steps: the second accumulates across steps, as under DDP."""
    for step in range(3):
        _backward(wrapped, rank, step)
        for optimizer in optimizers:
            optimizer.step()
        optimizers[0].zero_grad(set_to_none=False)


def _alternating_optimizers(wrapped, optimizers, rank):
    """Each optimizer zeroed just before its own backward (on its own loss), in turn."""
    for step in range(3):
        for i, optimizer in enumerate(optimizers):
            optimizer.zero_grad()
            _backward(wrapped, rank, 2 * step + i)
            optimizer.step()


class _Branchy(nn.Module):
    """An MLP with a side branch that only some ranks take on some steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
        self.side = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        return self.body(x) + (self.side(x) if side else 0.0)


def _side_branch_on_some_ranks(wrapped, optimizers, rank):
    """Unzeroed steps in which the side branch is taken by one rank at a time (the owner of its
    average too, or not): an average held where the backward did not reach keeps its value and
    gets the other ranks' new gradients added; one no rank reached is left alone."""
    world = torch.distributed.get_world_size()
    for step in range(4):
        x, y = mlp_batch(rank, step)
        side = step > 0 and rank == step % world
        nn.functional.mse_loss(wrapped(x, side=side), y).backward()
        optimizers[0].step()


def _checkpointed_shared_block(wrapped, optimizers, rank):
    """A block reused four times under reentrant checkpointing (its gradient arrives in four
    nested backward passes), never zeroed."""
    for step in range(3):
        wrapped(_stack_batch(rank, step)).pow(2).mean().backward()
        optimizers[0].step()


def _gpt_never_zeroed(wrapped, optimizers, rank):
    for step in range(3):
        gpt_loss(wrapped, token_batch(rank, step)).backward()
        optimizers[0].step()


def _check_added_after_reduce(rank: int, world: int) -> None:
    _compare(rank, world, "never zeroed", _never_zeroed)
    _compare(rank, world, "never zeroed, static_graph", _never_zeroed, static_graph=True)
    _compare(rank, world, "never zeroed, one bucket per gradient", _never_zeroed, reduce_buffer_size=0)
    _compare(rank, world, "two optimizers with closures", _two_optimizers_with_closures, two_optimizers=True)
    _compare(rank, world, "closure steps never zeroed", _closure_steps_never_zeroed)
    _compare(rank, world, "zeroing between forward and backward", _zeroing_between_forward_and_backward)
    _compare(rank, world, "backward twice before each step", _backward_twice_before_each_step)
    _compare(rank, world, "no_sync mixed in", _no_sync_mixed_in)
    _compare(rank, world, "no_sync then an unzeroed synced backward", _no_sync_then_unzeroed_synced)
    _compare(rank, world, "no_sync then unzeroed, static_graph", _no_sync_then_unzeroed_synced, static_graph=True)
    _compare(rank, world, "one of two optimizers zeroed", _one_of_two_zeroed_in_place, two_optimizers=True)
    _compare(rank, world, "alternating optimizers", _alternating_optimizers, two_optimizers=True)
    _compare(rank, world, "side branch on some ranks", _side_branch_on_some_ranks, _Branchy,
             ddp_kwargs=dict(find_unused_parameters=True))
    _compare(rank, world, "GPT never zeroed", _gpt_never_zeroed, gpt)
    checkpointed = lambda: _Stack(shared=True, checkpointing="layer", reentrant=True)  # noqa: E731
    ref = _Stack(shared=True)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    _checkpointed_shared_block(DDP(ref), [ref_opt], rank)
    model = checkpointed()
    optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
    _checkpointed_shared_block(ShardedDataParallel(model, optimizer, reduce_buffer_size=200), [optimizer], rank)
    _assert_close(model, ref, "reentrant checkpointing of a shared block, never zeroed")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_backward_adding_to_reduced_gradients_matches_ddp(world_size):
    run_on_ranks(_check_added_after_reduce, world_size, timeout=180)


# ----------------------------------------------------------------------- a rebuilt router


def _check_unzeroed_step_across_refresh(rank: int, world: int) -> None:
    """refresh_trainable() rebuilds the router between an unzeroed step and the next backward:
    unchanged, or with a parameter frozen (its gradient released: DDP would otherwise step it on
    each rank's own local sum), which moves other parameters to new owners: they receive the
    average OSS moves, or the average set aside under a no_sync gradient."""
    for freeze in (False, True):
        for no_sync_first in (False, True):
            what = f"refresh after an unzeroed step, freeze={freeze}, no_sync first={no_sync_first}"
            models = []
            for sharded in (False, True):
                model = gpt()
                optimizer = (OSS(model.parameters(), torch.optim.SGD, **SGD) if sharded
                             else torch.optim.SGD(model.parameters(), **SGD))
                wrapped = ShardedDataParallel(model, optimizer) if sharded else DDP(model)
                gpt_loss(wrapped, token_batch(rank, 0)).backward()
                optimizer.step()
                if no_sync_first:
                    with wrapped.no_sync():
                        gpt_loss(wrapped, token_batch(rank, 1)).backward()
                if freeze:
                    model.blocks[0].qkv.weight.requires_grad_(False).grad = None
                if sharded:
                    owners = dict(optimizer.param_to_rank)
                    wrapped.refresh_trainable()
                    moved = [p for p in model.parameters() if p.requires_grad and owners[p] != optimizer.param_to_rank[p]]
                    assert bool(moved) == freeze, (what, len(moved))
                else:
                    wrapped = DDP(model, find_unused_parameters=True)
                gpt_loss(wrapped, token_batch(rank, 2)).backward()
                optimizer.step()
                models.append(model)
            _assert_close(models[1], models[0], what)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unzeroed_step_across_refresh_trainable_matches_ddp(world_size):
    run_on_ranks(_check_unzeroed_step_across_refresh, world_size)
