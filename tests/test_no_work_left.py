"""Every asynchronous collective that ZeRO-1/2/3 start is waited for before the forward, backward
or optimizer step that started it returns: none is left in flight for the next step to find, or
for the interpreter to find at exit while gloo's threads still use its tensors. And no storage a
collective was given is freed, resized or swapped before that collective is waited for: gloo's
threads read and write those bytes until then (freeing one under an in-flight gloo collective
kills the process with SIGSEGV; issue #36's hunt).

:class:`tests._work_tracking.TrackWork` observes both, in program order; after each phase of a
step every collective it recorded must have been waited for (with ShardedDataParallel's
``overlap_param_broadcast``, a step's broadcasts by the next forward).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, LowBit, ShardedDataParallel, fully_shard
from sharded.fsdp import Owned, summon_full_params
from tests._harness import run_on_ranks
from tests._models import mlp, mlp_batch, mlp_loss
from tests._work_tracking import TrackWork


class TwoBranches(nn.Module):
    """Two units in forward order; the loss uses the second only, so the first is prefetched
    for a backward that never reaches it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(12, 3), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first(x), self.second(x)


def _steps(track, model, optimizer, rank, what, steps=2, loss_of=lambda out, y: ((out - y) ** 2).mean()):
    for step in range(steps):
        optimizer.zero_grad()
        x, y = mlp_batch(rank, step)
        out = model(x)
        track.assert_none_in_flight(f"{what}: forward {step}")
        loss_of(out, y).backward()
        track.assert_none_in_flight(f"{what}: backward {step}")
        optimizer.step()
        track.assert_none_in_flight(f"{what}: step {step}")


def _accumulate_then_sync(track, model, optimizer, no_sync, rank, what):
    optimizer.zero_grad()
    with no_sync():
        mlp_loss(model, mlp_batch(rank, 0)).backward()
    mlp_loss(model, mlp_batch(rank, 1)).backward()
    track.assert_none_in_flight(f"{what}: synced backward after no_sync")
    optimizer.step()
    track.assert_none_in_flight(f"{what}: step after no_sync")


def _overlapped_steps(track, model, optimizer, rank, what="ZeRO-2 overlap_param_broadcast"):
    """The broadcasts each step leaves in flight are all waited for by the next forward."""
    for step in range(3):
        optimizer.zero_grad()
        x, y = mlp_batch(rank, step)
        out = model(x)
        track.assert_none_in_flight(f"{what}: forward {step}")
        torch.nn.functional.mse_loss(out, y).backward()
        track.assert_none_in_flight(f"{what}: backward {step}")
        optimizer.step()
    model.wait_for_params()
    track.assert_none_in_flight(f"{what}: wait_for_params after the last step")


def _zero3(model: nn.Module, reshard_after_backward: bool, **kwargs) -> nn.Module:
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, **kwargs)
    fully_shard(model, **kwargs)
    model.set_reshard_after_backward(reshard_after_backward)
    return model


def _check_no_work_left(rank, world):
    sgd = dict(lr=0.05, momentum=0.9)
    with TrackWork() as track:
        model = DDP(mlp())
        _steps(track, model, OSS(model.parameters(), torch.optim.SGD, **sgd), rank, "ZeRO-1")
        for bucket in (2**23, 40):
            inner = mlp()
            optimizer = OSS(inner.parameters(), torch.optim.SGD, **sgd)
            model = ShardedDataParallel(inner, optimizer, reduce_buffer_size=bucket)
            _steps(track, model, optimizer, rank, f"ZeRO-2 bucket {bucket}", loss_of=torch.nn.functional.mse_loss)
            _accumulate_then_sync(track, model, optimizer, model.no_sync, rank, f"ZeRO-2 bucket {bucket}")
        inner = mlp()
        optimizer = OSS(inner.parameters(), torch.optim.SGD, broadcast_buffer_size=40, **sgd)
        _overlapped_steps(track, ShardedDataParallel(inner, optimizer, overlap_param_broadcast=True), optimizer, rank)
        for reshard_after_backward in (True, False):
            what = f"ZeRO-3 reshard_after_backward={reshard_after_backward}"
            model = _zero3(mlp(), reshard_after_backward)
            optimizer = torch.optim.SGD(model.parameters(), **sgd)
            _steps(track, model, optimizer, rank, what, loss_of=torch.nn.functional.mse_loss)
            model = _zero3(TwoBranches(), reshard_after_backward)
            optimizer = torch.optim.SGD(model.parameters(), **sgd)
            _steps(track, model, optimizer, rank, f"{what}, a unit backward never reaches", loss_of=lambda out, y: out[1].sum())
        model = _zero3(mlp(), True, mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")))
        optimizer = torch.optim.SGD(model.parameters(), **sgd)
        _steps(track, model, optimizer, rank, "ZeRO-3 hybrid", loss_of=torch.nn.functional.mse_loss)
        _accumulate_then_sync(track, model, optimizer, _no_sync_of(model), rank, "ZeRO-3 hybrid")
        _where_storages_are_freed(track, rank, sgd)
        assert track.started, "no asynchronous collective was observed: the tracking is broken"


def _where_storages_are_freed(track, rank, sgd):
    """The paths that free or swap storages of their own: the all-gather extension's outputs and
    what its hooks built, owned parameters, low-bit messages and residuals at every stage, full
    parameters summoned and given back."""
    from tests.test_fsdp2_gather_extension import Bf16Gathered, Int8Gathered, Stack, _shard

    mse = torch.nn.functional.mse_loss
    first_outputs = lambda out, y: mse(out[:, : y.shape[1]], y)  # noqa: E731  (the stack's head has 6)
    for subclass in (Bf16Gathered, Int8Gathered):
        model = _shard(Stack(subclass, bias=True), fully_shard, reshard_after_forward=subclass is Bf16Gathered)
        optimizer = torch.optim.SGD(model.parameters(), **sgd)
        _steps(track, model, optimizer, rank, f"ZeRO-3, weights gathered as {subclass.__name__}", loss_of=first_outputs)
        with summon_full_params(model, writeback=False):
            track.assert_none_in_flight(f"summon_full_params over {subclass.__name__} weights")
        track.assert_none_in_flight(f"leaving summon_full_params over {subclass.__name__} weights")
    model = mlp()
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, shard_placement_fn=lambda p: Owned() if p.ndim == 2 else None)
    fully_shard(model)
    _steps(track, model, torch.optim.SGD(model.parameters(), **sgd), rank, "ZeRO-3, owned matrices", loss_of=mse)
    lowbit = LowBit(params="int8", grads="int8", block_size=8, min_numel=0)
    model = _zero3(mlp(), True, lowbit=lowbit)
    _steps(track, model, torch.optim.SGD(model.parameters(), **sgd), rank, "ZeRO-3 low-bit", loss_of=mse)
    inner = mlp()
    optimizer = OSS(inner.parameters(), torch.optim.SGD, **sgd)
    model = ShardedDataParallel(inner, optimizer, lowbit=LowBit(grads="int8", block_size=8, min_numel=0))
    _steps(track, model, optimizer, rank, "ZeRO-2 low-bit", loss_of=mse)
    model = DDP(mlp())
    optimizer = OSS(model.parameters(), torch.optim.SGD, lowbit=LowBit(params="int8", block_size=8, min_numel=0), **sgd)
    _steps(track, model, optimizer, rank, "ZeRO-1 low-bit")


def _check_the_check_sees_a_storage_let_go(rank, world):
    """The check itself: a buffer freed, and one swapped, after their all-gathers finished but
    before anyone waited for them (so gloo no longer touches them, and nothing can crash here)."""
    with TrackWork() as track:
        for let_go in (lambda t: t.untyped_storage().resize_(0), lambda t: setattr(t, "data", torch.zeros_like(t))):
            out = torch.empty(4 * world)
            work = dist.all_gather_into_tensor(out, torch.ones(4), async_op=True)
            while not work.is_completed():
                pass
            let_go(out)
            work.wait()
        assert len(track.released_in_flight) == 4, track.released_in_flight
        assert [m.split(" on ")[0] for m in track.released_in_flight[::2]] == ["UntypedStorage.resize_(0)", "Tensor.data = ..."]
        assert all("changed while in flight" in m for m in track.released_in_flight[1::2]), track.released_in_flight
        TrackWork.excuse_all()  # let go of on purpose (a harness-wide tracker saw them too)


def _no_sync_of(model):
    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return no_sync


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_async_collective_is_waited_for_before_its_step_returns(world_size):
    """(And no storage a collective holds is let go of before it is waited for.)"""
    run_on_ranks(_check_no_work_left, world_size)


def test_the_check_sees_a_storage_let_go_before_its_collective_was_waited_for():
    run_on_ranks(_check_the_check_sees_a_storage_let_go, 2)
