"""``ShardedDataParallel(static_graph=True)`` against DDP(static_graph=True) + the plain optimizer:
the same numbers, no agreement all-reduce after the first backward, and a clear error (no hang,
no wrong numbers) when the graph changes after all.

Tolerances: SGD, whose update is linear in the gradient, so only the order of float32 additions
differs from DDP's (a reduce instead of an all-reduce, a gradient of two checkpointed passes
summed pass by pass): test_oss's ``ATOL``/``RTOL``. Against ShardedDataParallel without the
switch the numbers are bit-identical: the same reduces in the same order.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from sharded import OSS, ShardedDataParallel
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch
from tests.test_oss import _assert_close
from tests.test_sharded_ddp_skipped_steps import _check_accumulation_across_skipped_steps

WORLD_SIZES = [1, 2, 3]
STEPS = 4
SGD = dict(lr=0.05, momentum=0.9)


class _Net(nn.Module):
    """A block used twice, each use in its own reentrant checkpoint segment (so its gradient
    arrives in two backward passes), a layer never used, and ``branch``, used only while
    ``take_branch`` is set. ``block_uses`` sets how often the block is used.

    The unused layers come first, hence last in the first guess of the gradients' order, so the
    first backward launches the block's bucket at its first arrival and reduces its second late.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.unused, self.branch = nn.Linear(16, 16), nn.Linear(16, 16)
        self.inp, self.block, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.take_branch, self.block_uses = False, 2

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(self.block_uses):
            h = checkpoint(self._block, h, use_reentrant=True)
        if self.take_branch:
            h = h + self.branch(h)
        return self.out(h)


def _net_loss(model, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return model(torch.randn(5, 8, generator=g)).pow(2).mean()


def _gpt_loss(model, rank, step):
    return gpt_loss(model, token_batch(rank, step))


def _wrap(model, **kwargs):
    optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
    return ShardedDataParallel(model, optimizer, **kwargs), optimizer


def _train(model, optimizer, loss_fn, rank, steps, first=0, micro_steps=1):
    """``micro_steps`` forwards per step, all but the last inside ``no_sync``."""
    for step in range(first, first + steps):
        optimizer.zero_grad()
        for micro in range(micro_steps):
            with model.no_sync() if micro < micro_steps - 1 else contextlib.nullcontext():
                loss_fn(model, rank, 10 * step + micro).backward()
        optimizer.step()


def _train_from_a_synced_step(model, optimizer, loss_fn, rank, micro_steps):
    """One plain step, then ``micro_steps`` per step: DDP(static_graph=True) needs its first
    backward synced (inside no_sync() it fails an internal assert of torch's reducer)."""
    _train(model, optimizer, loss_fn, rank, 1)
    _train(model, optimizer, loss_fn, rank, STEPS - 1, first=1, micro_steps=micro_steps)


def _check_matches_ddp_static_graph(rank, world):
    cases = [(gpt, _gpt_loss, 2**23), (gpt, _gpt_loss, 300), (_Net, _net_loss, 200), (_Net, _net_loss, 0)]
    for make_model, loss_fn, bucket in cases:
        for micro_steps in (1, 3):  # 3: two of them accumulate inside no_sync()
            what = f"{make_model.__name__} bucket={bucket} micro_steps={micro_steps}"
            ref = make_model()
            ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
            _train_from_a_synced_step(DDP(ref, static_graph=True), ref_opt, loss_fn, rank, micro_steps)
            model = make_model()
            wrapped, optimizer = _wrap(model, reduce_buffer_size=bucket, static_graph=True)
            _train_from_a_synced_step(wrapped, optimizer, loss_fn, rank, micro_steps)
            _assert_close(model, ref, what)
            assert_same_on_all_ranks(list(model.parameters()), what)
            if make_model is _Net:
                assert model.unused.weight.grad is None and torch.equal(model.unused.weight, _Net().unused.weight), what
            if world > 1:
                assert wrapped.backward_stats.agreed_on_late_gradients is False, what


def _check_no_agreement_after_the_first_backward(rank, world):
    """Count torch's all_reduce over steps 2..N: none with the switch, one per step without."""
    counts = {}
    for static_graph in (True, False):
        wrapped, optimizer = _wrap(_Net(), reduce_buffer_size=200, static_graph=static_graph)
        _train(wrapped, optimizer, _net_loss, rank, 1)
        calls = []
        original = dist.all_reduce
        dist.all_reduce = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
        try:
            _train(wrapped, optimizer, _net_loss, rank, STEPS - 1, first=1)
        finally:
            dist.all_reduce = original
        counts[static_graph] = len(calls)
    expected = {True: 0, False: STEPS - 1 if world > 1 else 0}
    assert counts == expected, f"all_reduce calls over steps 2..{STEPS}: {counts}, expected {expected}"
    # the same numbers as without the switch, bit for bit: the same reduces in the same order
    runs = {}
    for static_graph in (True, False):
        model = _Net()
        wrapped, optimizer = _wrap(model, reduce_buffer_size=200, static_graph=static_graph)
        _train(wrapped, optimizer, _net_loss, rank, STEPS)
        runs[static_graph] = model
    for a, b in zip(runs[True].parameters(), runs[False].parameters()):
        assert torch.equal(a, b), "static_graph changed the numbers"


def _check_graph_change_raises(rank, world):
    """Every rank changes its graph, so each raises and none waits for the others: a gradient
    used for the first time, one used once less (both seen at the end of backward), one used
    once more (arriving after its bucket left)."""
    for change, value, culprit in (("take_branch", True, "branch"), ("block_uses", 1, "block"), ("block_uses", 3, "block")):
        model = _Net()
        wrapped, optimizer = _wrap(model, reduce_buffer_size=200, static_graph=True)
        _train(wrapped, optimizer, _net_loss, rank, 2)
        setattr(model, change, value)
        if world == 1:  # nothing is reduced on one rank, so nothing can go wrong or be checked
            _train(wrapped, optimizer, _net_loss, rank, 1, first=2)
            continue
        with pytest.raises(RuntimeError) as raised:
            _train(wrapped, optimizer, _net_loss, rank, 1, first=2)
        message = str(raised.value)
        assert f"rank {rank}:" in message and f"parameter {culprit}." in message, message
        assert "static_graph=True assumes the same gradients every iteration" in message, message
        wrapped.remove_hooks()


def _check_held_gradient_of_an_unused_parameter_raises(rank, world):
    """A gradient the first synced backward did not produce, held when a later one reduces
    (accumulated inside no_sync by a branch the synced pass skips, or set by hand): the owner no
    longer reads the flags, so it raises rather than drops it (it used to be dropped)."""
    if world == 1:
        return
    for how, culprit in (("no_sync", "branch"), ("by hand", "unused")):
        model = _Net()
        wrapped, optimizer = _wrap(model, reduce_buffer_size=200, static_graph=True)
        _train(wrapped, optimizer, _net_loss, rank, 2)
        optimizer.zero_grad()
        if how == "no_sync":
            model.take_branch = True
            with wrapped.no_sync():
                _net_loss(wrapped, rank, 20).backward()
            model.take_branch = False
        else:
            model.unused.weight.grad = torch.ones_like(model.unused.weight)
        with pytest.raises(RuntimeError) as raised:
            _net_loss(wrapped, rank, 21).backward()
        message = str(raised.value)
        assert f"rank {rank}:" in message and f"parameter {culprit}." in message and "no_sync" in message, message
        wrapped.remove_hooks()


def _assert_switch_changes_nothing(rank, world, train, what):
    """``train(wrapped, optimizer, static_graph)`` with and without the switch: bit-identical."""
    runs = {}
    for static_graph in (True, False):
        model = _Net()
        wrapped, optimizer = _wrap(model, reduce_buffer_size=200, static_graph=static_graph)
        _train(wrapped, optimizer, _net_loss, rank, 2)
        train(wrapped, optimizer, static_graph)
        runs[static_graph] = model
    for a, b in zip(runs[True].parameters(), runs[False].parameters()):
        assert torch.equal(a, b), f"static_graph changed the numbers {what}"


def _check_refresh_trainable_learns_again(rank, world):
    """Freezing a layer mid-training rebuilds the router, which learns the new graph again."""

    def freeze_then_train(wrapped, optimizer, static_graph):
        wrapped.module.inp.requires_grad_(False)
        _train(wrapped, optimizer, _net_loss, rank, 1, first=2)
        if world > 1:
            assert wrapped.backward_stats.agreed_on_late_gradients is True, "the new router learns first"
        _train(wrapped, optimizer, _net_loss, rank, 2, first=3)
        if world > 1:
            assert wrapped.backward_stats.agreed_on_late_gradients is not static_graph

    _assert_switch_changes_nothing(rank, world, freeze_then_train, "after refresh_trainable()")


def _check_explicit_reduce(rank, world):
    """All micro-steps inside no_sync, then reduce(): as without the switch, bit for bit."""

    def accumulate_then_reduce(wrapped, optimizer, static_graph):
        for step in range(2, 4):
            optimizer.zero_grad()
            with wrapped.no_sync():
                for micro in range(2):
                    _net_loss(wrapped, rank, 10 * step + micro).backward()
            wrapped.reduce()
            optimizer.step()

    _assert_switch_changes_nothing(rank, world, accumulate_then_reduce, "of no_sync + reduce()")


def _check_all(rank, world):
    _check_matches_ddp_static_graph(rank, world)
    _check_no_agreement_after_the_first_backward(rank, world)
    _check_refresh_trainable_learns_again(rank, world)
    _check_explicit_reduce(rank, world)
    _check_accumulation_across_skipped_steps(rank, world, static_graph=True)
    _check_held_gradient_of_an_unused_parameter_raises(rank, world)  # these two leave a failed backward behind
    _check_graph_change_raises(rank, world)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_static_graph_matches_ddp_skips_the_agreement_and_refuses_a_changed_graph(world_size):
    run_on_ranks(_check_all, world_size, timeout=180)
