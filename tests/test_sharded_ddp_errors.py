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


def _check_second_backward(rank, world):
    model = gpt()
    opt = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    gpt_loss(sdp, token_batch(rank, 0)).backward()
    with pytest.raises(RuntimeError, match="backward ran again after the gradients were reduced"):
        gpt_loss(sdp, token_batch(rank, 1)).backward()
    # zeroing the gradients (a skipped step, as GradScaler does on overflow) makes it legal again
    for set_to_none in (True, False):
        opt.zero_grad(set_to_none=set_to_none)
        gpt_loss(sdp, token_batch(rank, 2)).backward()
    opt.step()
    gpt_loss(sdp, token_batch(rank, 3)).backward()


@pytest.mark.parametrize("world_size", [2, 3])
def test_backward_twice_without_step_raises_instead_of_corrupting(world_size):
    run_on_ranks(_check_second_backward, world_size)


def _check_second_backward_with_two_optimizers(rank, world):
    """A backward after one optimizer stepped adds to the reduced gradients the other still
    holds: its step raises (fairscale's two-closure loop: its second optimizer stepped on sums
    that had lost the other ranks' share); the alternating loop, which zeroes each optimizer's
    gradients before its own backward, still matches DDP."""
    def split(model):
        params = list(model.parameters())
        return params[: len(params) // 2], params[len(params) // 2 :]

    model = gpt()
    first, second = (OSS(ps, torch.optim.SGD, lr=0.1) for ps in split(model))
    sdp = ShardedDataParallel(model, [first, second])
    closure = lambda: gpt_loss(sdp, token_batch(rank, 0)).backward()
    first.step(closure=closure)
    with pytest.raises(RuntimeError, match=rf"rank {rank}: optimizer.step\(\) would apply the gradient of parameter "
                       r"\S+, to which a backward added after an earlier reduce"):
        second.step(closure=closure)

    ref_model, our_model = gpt(), gpt()
    ref_opts = [torch.optim.SGD(ps, lr=0.05, momentum=0.9) for ps in split(ref_model)]
    our_opts = [OSS(ps, torch.optim.SGD, lr=0.05, momentum=0.9) for ps in split(our_model)]
    ref, ours = DDP(ref_model), ShardedDataParallel(our_model, our_opts)
    for step in range(3):
        for model, opts in ((ref, ref_opts), (ours, our_opts)):
            for i, opt in enumerate(opts):  # each optimizer on its own loss, in turn
                opt.zero_grad()
                gpt_loss(model, token_batch(rank, 2 * step + i)).backward()
                opt.step()
    for (name, a), b in zip(our_model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), f"alternating optimizers: {name} differs from DDP"


@pytest.mark.parametrize("world_size", [2, 3])
def test_backward_after_one_of_two_optimizers_stepped_raises_unless_the_other_was_zeroed(world_size):
    run_on_ranks(_check_second_backward_with_two_optimizers, world_size)


def _zeroing_styles(model, sdp, optimizer):
    """Ways a training loop clears the gradients after a step, each of which DDP code uses."""
    def by_hand():
        for p in model.parameters():
            p.grad = None

    return {
        "optimizer.zero_grad()": optimizer.zero_grad,
        "wrapper.zero_grad()": sdp.zero_grad,
        "module.zero_grad(set_to_none=False)": lambda: model.zero_grad(set_to_none=False),
        "p.grad = None": by_hand,
    }


def _check_step_without_zero_grad(rank, world):
    """A backward after a step that nobody zeroed the gradients behind: DDP adds the new average
    to the old one, which only the owner still holds here. At world 1 (no reduction) it is DDP's
    sum; on more ranks the next step raises on every rank, naming the parameter, instead of
    stepping on old / world + new, unless the spoiled gradients were released first (a GAN's
    generator backward reaches the discriminator's). Each way of zeroing, at any point before
    the backward, equals DDP."""
    def same_as(ref_model, model, what):
        for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), f"{what}: {name} differs from DDP"

    def release(model):
        for p in model.parameters():
            p.grad = None

    for static_graph in (False, True):
        model, ref_model = gpt(), gpt()
        optimizer = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(model, optimizer, static_graph=static_graph)
        ref, ref_opt = DDP(ref_model), torch.optim.SGD(ref_model.parameters(), lr=0.1)
        for wrapped, opt in ((ref, ref_opt), (sdp, optimizer)):
            gpt_loss(wrapped, token_batch(rank, 0)).backward()
            opt.step()
            with wrapped.no_sync():  # the kept gradient is added to inside no_sync too
                gpt_loss(wrapped, token_batch(rank, 1)).backward()
            gpt_loss(wrapped, token_batch(rank, 2)).backward()
            if world > 1 and wrapped is sdp:
                with pytest.raises(RuntimeError, match=rf"rank {rank}: optimizer.step\(\) would apply the gradient "
                                   r"of parameter \S+, to which a backward added after an earlier reduce"):
                    opt.step()
                release(model)
            else:
                opt.step()
                release(wrapped.module)
            gpt_loss(wrapped, token_batch(rank, 3)).backward()  # released: this step is clean
            opt.step()
        if world == 1:
            same_as(ref_model, model, f"world 1 without zero_grad (static_graph={static_graph})")

    if world > 1:  # the same backward inside a closure, which step() runs
        model = gpt()
        optimizer = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(model, optimizer)
        closure = lambda: gpt_loss(sdp, token_batch(rank, 4)).backward()  # noqa: E731
        optimizer.step(closure)
        with pytest.raises(RuntimeError, match=rf"rank {rank}: optimizer.step\(\) would apply the gradient"):
            optimizer.step(closure)

    ref_model, our_model = gpt(), gpt()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    optimizer = OSS(our_model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    ref, sdp = DDP(ref_model), ShardedDataParallel(our_model, optimizer)
    for wrapped, model, opt in ((ref, ref_model, ref_opt), (sdp, our_model, optimizer)):
        gpt_loss(wrapped, token_batch(rank, 10)).backward()
        opt.step()
        gpt_loss(wrapped, token_batch(rank, 11)).backward()  # spoils the kept gradients
        release(model)  # by hand: the wrapper is not told
        gpt_loss(wrapped, token_batch(rank, 12)).backward()
        opt.step()
    same_as(ref_model, our_model, "a spoiled gradient released by hand")
    for step, (style, zero) in enumerate(_zeroing_styles(our_model, sdp, optimizer).items()):
        for model, opt, zero_it in ((ref, ref_opt, ref_opt.zero_grad), (sdp, optimizer, zero)):
            loss = gpt_loss(model, token_batch(rank, step))
            zero_it()  # between forward and backward, as some loops do
            loss.backward()
            opt.step()
        same_as(ref_model, our_model, f"zeroing by {style}")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_step_on_gradients_added_to_after_an_unzeroed_step_raises_where_ddp_would_accumulate(world_size):
    run_on_ranks(_check_step_without_zero_grad, world_size)


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
    with pytest.raises(ValueError, match=rf"rank {rank}: module 1 \(Embedding\) has sparse=True.*DistributedDataParallel"):
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
