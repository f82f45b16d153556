"""Every asynchronous collective that ZeRO-1/2/3 start is waited for before the forward, backward
or optimizer step that started it returns: none is left in flight for the next step to find, or
for the interpreter to find at exit while gloo's threads still use its tensors. And no storage a
collective was given is freed, resized or swapped before that collective is waited for: gloo's
threads read and write those bytes until then (freeing one under an in-flight gloo collective
kills the process with SIGSEGV; issue #36's hunt).

The collectives are observed by wrapping torch.distributed's functions (the library looks them
up at call time): each ``Work`` returned by an ``async_op=True`` call is recorded with the storages
of the tensors it was given, and after each phase of a step every recorded one must have been
waited for (with ShardedDataParallel's ``overlap_param_broadcast``, a step's broadcasts by the next
forward). Storages are watched where Python code can let them go: ``UntypedStorage.resize_``,
``Tensor.set_``, ``Tensor.data = ...`` and ``torch.utils.swap_tensors`` on a storage an unwaited
collective holds are recorded, and at ``wait()`` each held storage must still have the address and
size it had when the collective started. The check follows program order, not timing: it fails
the same way whether or not gloo had finished.
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


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """The address and size in bytes of ``tensor``'s storage."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _tensors_in(values) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors_in(value))
    return found


class _TrackedWork:
    """A ``Work`` that remembers whether it was waited for, and the storages it was given."""

    def __init__(self, name: str, work: dist.Work, tensors: list[torch.Tensor], on_wait) -> None:
        self.name, self._work, self.waited = name, work, False
        self.held = [(tensor, _storage_of(tensor)) for tensor in tensors]
        self._on_wait = on_wait

    def holds(self, address: int) -> bool:
        return any(held[0] == address and held[1] > 0 for _, held in self.held)

    def wait(self, *args, **kwargs):
        self.waited = True
        result = self._work.wait(*args, **kwargs)
        self._on_wait(self)
        return result

    def __getattr__(self, attr):
        return getattr(self._work, attr)


class TrackWork:
    """While active, records every asynchronous collective started through torch.distributed."""

    def __enter__(self) -> "TrackWork":
        self.started: list[_TrackedWork] = []
        self.released_in_flight: list[str] = []  # storages let go of before their collective was waited for
        self._saved = {name: getattr(dist, name) for name in ASYNC_COLLECTIVES if hasattr(dist, name)}
        for name, fn in self._saved.items():
            setattr(dist, name, self._tracking(name, fn))
        self._watch_storages()
        return self

    def _tracking(self, name, fn):
        def tracked(*args, **kwargs):
            work = fn(*args, **kwargs)
            if not kwargs.get("async_op") or work is None:
                return work
            self.started.append(_TrackedWork(name, work, _tensors_in([*args, *kwargs.values()]), self._check_held))
            return self.started[-1]

        return tracked

    def _watch_storages(self) -> None:
        """Wrap the Python calls that free, resize or swap a storage."""
        resize, set_, swap = torch.UntypedStorage.resize_, torch.Tensor.set_, torch.utils.swap_tensors
        data = torch._C.TensorBase.data
        released = self._released

        def resize_(storage, size):
            released(storage.data_ptr(), f"UntypedStorage.resize_({size})")
            return resize(storage, size)

        def set_tensor(tensor, *args, **kwargs):
            released(_storage_of(tensor)[0], "Tensor.set_")
            return set_(tensor, *args, **kwargs)

        def set_data(tensor, value):
            released(_storage_of(tensor)[0], "Tensor.data = ...")
            data.__set__(tensor, value)

        def swap_tensors(a, b):
            released(_storage_of(a)[0], "swap_tensors")
            released(_storage_of(b)[0], "swap_tensors")
            return swap(a, b)

        def unwatch():
            torch.UntypedStorage.resize_, torch.Tensor.set_, torch.utils.swap_tensors = resize, set_, swap
            del torch.Tensor.data

        assert "data" not in vars(torch.Tensor), "torch.Tensor defines data itself now: wrap it there"
        torch.UntypedStorage.resize_, torch.Tensor.set_ = resize_, set_tensor
        torch.Tensor.data = property(data.__get__, set_data)
        torch.utils.swap_tensors = swap_tensors
        self._unwatch = unwatch

    def _released(self, address: int, how: str) -> None:
        for work in self.started:
            if not work.waited and work.holds(address):
                self.released_in_flight.append(f"{how} on a storage that {work.name} still held")

    def _check_held(self, work: _TrackedWork) -> None:
        for tensor, (address, nbytes) in work.held:
            if _storage_of(tensor) != (address, nbytes):
                self.released_in_flight.append(
                    f"{work.name}: a {tuple(tensor.shape)} {tensor.dtype} tensor's storage changed while in flight "
                    f"(address {address:#x}, {nbytes} bytes -> {_storage_of(tensor)[0]:#x}, {_storage_of(tensor)[1]} bytes)"
                )

    def assert_none_in_flight(self, after: str) -> None:
        left = [w.name for w in self.started if not w.waited]
        assert not left, f"after {after}, {len(left)} collective(s) never waited for: {left}"
        assert not self.released_in_flight, f"by {after}: {self.released_in_flight}"

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._unwatch()


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
