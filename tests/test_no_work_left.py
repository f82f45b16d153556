"""Every asynchronous collective that ZeRO-1/2/3 start is waited for before the forward, backward
or optimizer step that started it returns: none is left in flight for the next step to find, or
for the interpreter to find at exit while gloo's threads still use its tensors.

The collectives are observed by wrapping torch.distributed's functions (the library looks them
up at call time): each ``Work`` returned by an ``async_op=True`` call is recorded, and after each
phase of a step every recorded one must have been waited for (with ShardedDataParallel's
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

from sharded import OSS, ShardedDataParallel, fully_shard
from tests._harness import run_on_ranks
from tests._models import mlp, mlp_batch, mlp_loss

ASYNC_COLLECTIVES = (
    "broadcast",
    "reduce",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
)


class _TrackedWork:
    """A ``Work`` that remembers whether it was waited for."""

    def __init__(self, name: str, work: dist.Work) -> None:
        self.name, self._work, self.waited = name, work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._work, attr)


class TrackWork:
    """While active, records every asynchronous collective started through torch.distributed."""

    def __enter__(self) -> "TrackWork":
        self.started: list[_TrackedWork] = []
        self._saved = {name: getattr(dist, name) for name in ASYNC_COLLECTIVES if hasattr(dist, name)}
        for name, fn in self._saved.items():
            setattr(dist, name, self._tracking(name, fn))
        return self

    def _tracking(self, name, fn):
        def tracked(*args, **kwargs):
            work = fn(*args, **kwargs)
            if not kwargs.get("async_op") or work is None:
                return work
            self.started.append(_TrackedWork(name, work))
            return self.started[-1]

        return tracked

    def assert_none_in_flight(self, after: str) -> None:
        left = [w.name for w in self.started if not w.waited]
        assert not left, f"after {after}, {len(left)} collective(s) never waited for: {left}"

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


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
        assert track.started, "no asynchronous collective was observed: the tracking is broken"


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
    run_on_ranks(_check_no_work_left, world_size)
