"""Bad use of ShardedDataParallel raises a clear error on every rank instead of hanging."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch


def _check_construction_errors(rank, world):
    frozen = gpt().requires_grad_(False)
    with pytest.raises(ValueError, match=rf"rank {rank}: the module has no trainable parameters"):
        ShardedDataParallel(frozen, OSS(frozen.parameters(), torch.optim.SGD, lr=0.1))

    model = gpt()
    body = [p for n, p in model.named_parameters() if n != "head.weight"]
    with pytest.raises(ValueError, match=r"1 trainable parameter\(s\) are in no sharded optimizer: head.weight"):
        ShardedDataParallel(model, OSS(body, torch.optim.SGD, lr=0.1))

    with pytest.raises(TypeError, match="needs sharded.OSS optimizers"):
        ShardedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))

    # a parameter added after wrapping, by attribute or by a container's insert() (which registers
    # nothing, and here of a layer built before the wrapper), or a parameter replaced, fails the
    # next forward instead of never being trained
    changes = (
        (lambda m, extra: setattr(m, "extra", extra), r"2 trainable parameter\(s\) .*: extra\.weight, extra\.bias"),
        (lambda m, extra: m.blocks.insert(0, extra), r"2 trainable parameter\(s\) .*: blocks\.0\.weight, blocks\.0\.bias"),
        (lambda m, extra: setattr(m.ln, "weight", nn.Parameter(m.ln.weight.detach().clone())), r"1 trainable parameter\(s\) .*: ln\.weight"),
    )
    for change, names in changes:
        model, extra = gpt(), nn.Linear(2, 2)
        sdp = ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1))
        gpt_loss(sdp, token_batch(rank, 0)).backward()
        change(model, extra)
        with pytest.raises(ValueError, match=names):
            sdp(token_batch(rank, 1))

    if world > 1:
        odd = gpt()
        if rank == 0:
            odd.register_buffer("extra", torch.zeros(3))
        with pytest.raises(ValueError, match="differ across ranks: different counts"):
            ShardedDataParallel(odd, OSS(odd.parameters(), torch.optim.SGD, lr=0.1))


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_construction_raises_clear_errors(world_size):
    run_on_ranks(_check_construction_errors, world_size)


class _FunctionalSparse(nn.Module):
    """Sparse gradients without a sparse module: only the backward can see them."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.spare = nn.Parameter(torch.randn(3))  # used by no forward

    def forward(self, idx, sparse=True):
        return F.embedding(idx, self.table, sparse=sparse)


def _check_held_gradients_that_cannot_be_reduced(rank, world):
    """Gradients that reach a synced step without passing a synced hook: accumulated inside
    no_sync, or set by hand. Each raises, naming the parameter and the rank, before it is reduced."""
    sparse_error = rf"rank {rank}: parameter {{}} got a sparse gradient"
    model = _FunctionalSparse()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1))
    with sdp.no_sync():
        sdp(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=sparse_error.format("table")):
        sdp(torch.tensor([1, 2]), sparse=False).sum().backward()
    if world > 1:
        with pytest.raises(RuntimeError, match=sparse_error.format("table")):
            sdp.reduce()
    model = _FunctionalSparse()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1))
    model.spare.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match=sparse_error.format("spare")):
        sdp(torch.tensor([1, 2]), sparse=False).sum().backward()
    model = gpt()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1))
    with sdp.no_sync():
        gpt_loss(sdp, token_batch(rank, 0)).backward(create_graph=True)
    with pytest.raises(RuntimeError, match=rf"rank {rank}: the gradient of parameter \S+ requires grad"):
        gpt_loss(sdp, token_batch(rank, 1)).backward()


@pytest.mark.parametrize("world_size", [1, 2])
def test_held_sparse_and_graph_gradients_raise_before_they_are_reduced(world_size):
    run_on_ranks(_check_held_gradients_that_cannot_be_reduced, world_size)


def _check_gradients_that_cannot_be_reduced(rank, world):
    sparse = nn.Sequential(nn.Linear(4, 4), nn.Embedding(10, 4, sparse=True))
    with pytest.raises(ValueError, match=rf"rank {rank}: ShardedDataParallel: module 1 \(Embedding\) has sparse=True.*DistributedDataParallel"):
        ShardedDataParallel(sparse, OSS(sparse.parameters(), torch.optim.SGD, lr=0.1))
    model = _FunctionalSparse()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1))
    if world > 1:
        with pytest.raises(RuntimeError, match=rf"rank {rank}: parameter table got a sparse gradient"):
            sdp(torch.tensor([1, 2])).sum().backward()
    # a gradient that carries a graph (backward with create_graph=True) cannot be reduced: the
    # backward says so where it can (several ranks), the next forward always does
    model = gpt()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1))
    with pytest.raises(RuntimeError, match=rf"rank {rank}: the gradient of parameter \S+ requires grad") if world > 1 else contextlib.nullcontext():
        gpt_loss(sdp, token_batch(rank, 0)).backward(create_graph=True)
    with pytest.raises(RuntimeError, match=r"the gradient of parameter \S+ requires grad \(backward with create_graph=True\)"):
        sdp(token_batch(rank, 1))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sparse_and_double_backward_gradients_raise_naming_the_parameter(world_size):
    run_on_ranks(_check_gradients_that_cannot_be_reduced, world_size)


def _check_ddp_attributes(rank, world):
    model = gpt()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), torch.optim.SGD, lr=0.1))
    ddp = DDP(gpt())
    for name in ("device_type", "is_multi_device_module", "device_ids", "output_device", "require_backward_grad_sync"):
        assert getattr(sdp, name) == getattr(ddp, name), (name, getattr(sdp, name), getattr(ddp, name))
    # after remove_hooks() the module trains alone again: each rank keeps its own local gradients
    sdp.remove_hooks()
    gpt_loss(model, token_batch(rank, 0)).backward()
    plain = gpt()
    gpt_loss(plain, token_batch(rank, 0)).backward()
    stale = [n for (n, p), q in zip(model.named_parameters(), plain.parameters()) if not torch.equal(p.grad, q.grad)]
    assert not stale, f"rank {rank}: gradients still routed after remove_hooks(): {stale[:3]}"


@pytest.mark.parametrize("world_size", [1, 2])
def test_attributes_libraries_read_on_ddp_read_the_same(world_size):
    run_on_ranks(_check_ddp_attributes, world_size)
