"""Manual backward finalization and kept unsharded storage, torch 2.15's additions to
``FSDPModule``, on every torch: ``set_manual_backward_finalization``, ``finalize_backward`` (with
and without ``async_op``) and its ``GradientReductionHandle``, ``set_keep_unsharded_storage``.

Each behaviour is compared bit for bit (world 3 trains on rank 0's batches:
tests/_exact_sums.py). Against torch's ``fully_shard``: where torch has the API (2.15) making the
same calls; on an older torch, the run it makes with automatic finalization and the same gradient
sync per microbatch (finalizing by hand must not change a number). The run that accumulates
microbatches and reduces once at finalization is also compared with DDP under ``no_sync``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from examples.gpt import Block
from tests._exact_sums import averaging_ddp, batch_rank
from tests._fsdp_reference import full_tensors, shard_gpt
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

TORCH_HAS_MANUAL = hasattr(TorchFSDPModule, "finalize_backward")  # torch 2.15 on
MICRO, STEPS = 3, 2


def _ours():
    from sharded import fully_shard

    return fully_shard


def _torchs():
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _batch(rank, world, step, i=0):
    return token_batch(batch_rank(rank, world), 10 * step + i)


def _assert_same(ours, theirs, what):
    """``(losses, full parameters)`` of two runs, bit for bit."""
    pairs = [("losses", ours[0], theirs[0])] + [("parameters", a, b) for a, b in zip(ours[1], theirs[1])]
    for name, a, b in pairs:
        assert torch.equal(a, b), f"{what}: {name} differ by {(a - b).abs().max():.3g}"


def _train(model, rank, world, *, manual, accumulate, async_op=False, other_work=None):
    """``STEPS`` AdamW steps of ``MICRO`` microbatches. ``accumulate``: gradient sync off (and
    gathered parameters kept) for every backward, set after each forward and turned on before
    the finalization, as torch's pipelining does; else each backward reduces, but for a unit whose backward ends
    only at the end of backward (the root here, whose inputs are token ids): manual finalization
    keeps its gradients at each backward's end and sends their sum at finalization (torch
    2.15's semantics). ``manual=False`` (the reference on a torch without the API): automatic
    finalization with gradient sync set so that each unit sends the same sums, on the last
    microbatch's backward. ``other_work()`` runs between an asynchronous finalization and its
    ``wait()`` (the reference: before the optimizer step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if manual:
        model.set_manual_backward_finalization(True)
    losses = []
    for step in range(STEPS):
        for i in range(MICRO):
            loss = gpt_loss(model, _batch(rank, world, step, i))
            syncs = not accumulate or (not manual and i == MICRO - 1)
            model.set_requires_gradient_sync(syncs)  # between forward and backward, as pipelining does
            model.set_reshard_after_backward(syncs)
            if not manual and not accumulate:  # what manual finalization does to the root (see above)
                model.set_requires_gradient_sync(i == MICRO - 1, recurse=False)
            loss.backward()
            losses.append(loss.detach())
        if manual:
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            handle = model.finalize_backward(async_op=async_op)
            assert (handle is None) is not async_op
            if async_op:
                if TORCH_HAS_MANUAL:
                    assert isinstance(handle, torch.distributed.fsdp.GradientReductionHandle)
                if other_work is not None:
                    other_work()
                handle.wait()
                handle.wait()  # a second wait does nothing
        elif other_work is not None:
            other_work()
        optimizer.step()
        optimizer.zero_grad()
    if manual:
        model.set_manual_backward_finalization(False)
    return torch.stack(losses), full_tensors(model.parameters())


def _other_model(shard, rank, world):
    """Another sharded model and its optimizer; ``work()`` is a forward of another batch (no
    grad), then a training step of its own (automatic finalization): collectives of another root
    while the first model's reductions are in flight."""
    model = shard_gpt(gpt(seed=1), shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []

    def work():
        with torch.no_grad():
            losses.append(gpt_loss(model, _batch(rank, world, 7)))
        loss = gpt_loss(model, _batch(rank, world, 8 + len(losses)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())

    return work, lambda: (torch.stack(losses), full_tensors(model.parameters()))


def _train_ddp(rank, world):
    """The accumulating run under DDP: ``no_sync`` for all but the last microbatch."""
    model = averaging_ddp(gpt())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        for i in range(MICRO):
            with model.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
                loss = gpt_loss(model, _batch(rank, world, step, i))
                loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses), [p.detach().clone() for p in model.module.parameters()]


def _finalization_matches(rank, world):
    ours, torchs = _ours(), _torchs()
    ddp = None
    for accumulate in (False, True):
        work, other = _other_model(torchs, rank, world)
        reference = _train(shard_gpt(gpt(), torchs), rank, world, manual=TORCH_HAS_MANUAL, accumulate=accumulate,
                           async_op=True, other_work=work)
        reference_other = other()
        for async_op in (False, True):
            work, other = _other_model(ours, rank, world)
            mine = _train(shard_gpt(gpt(), ours), rank, world, manual=True, accumulate=accumulate, async_op=async_op,
                          other_work=work)
            what = f"accumulate={accumulate}, async_op={async_op}"
            _assert_same(mine, reference, what)
            if async_op:
                _assert_same(other(), reference_other, f"{what}: the other model's work before wait()")
            if accumulate:
                ddp = ddp or _train_ddp(rank, world)
                _assert_same(mine, ddp, f"{what} against DDP with no_sync")


def _pending_through_reset(shard, rank, world):
    """A pending handle: the model's forward and a second finalization refuse to start;
    ``reset_iter_state`` invalidates it (its ``wait()`` raises). Then a normal step."""
    model = shard_gpt(gpt(), shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.set_manual_backward_finalization(True)
    gpt_loss(model, _batch(rank, world, 0)).backward()
    handle = model.finalize_backward(async_op=True)
    with pytest.raises(RuntimeError, match="waited on before forward"):
        gpt_loss(model, _batch(rank, world, 1))
    with pytest.raises(RuntimeError, match="waited on before finalizing backward again"):
        model.finalize_backward()
    model.reset_iter_state()
    with pytest.raises(RuntimeError, match="invalidated"):
        handle.wait()
    grads = [p.grad for p in model.parameters()]
    if TORCH_HAS_MANUAL:  # 2.15's reset drops every .grad
        assert all(g is None for g in grads), "reset_iter_state left a gradient"
    model.set_manual_backward_finalization(False)
    optimizer.zero_grad()
    loss = gpt_loss(model, _batch(rank, world, 2))
    loss.backward()
    optimizer.step()
    return loss.detach().view(1), full_tensors(model.parameters())


def _nothing_to_finalize(shard, rank, world):
    """Before the first forward, after a forward without grad, after a finalized backward:
    finalization changes nothing (and refuses nothing)."""
    from sharded.fsdp import GradientReductionHandle

    model = shard_gpt(gpt(), shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert model.finalize_backward() is None
    handle = model.finalize_backward(async_op=True)
    if shard is _ours():
        assert isinstance(handle, GradientReductionHandle)
    handle.wait()
    model.set_manual_backward_finalization(True)
    with torch.no_grad():
        model(_batch(rank, world, 0)[:, :-1])
    model.finalize_backward()
    assert all(p.grad is None for p in model.parameters())
    loss = gpt_loss(model, _batch(rank, world, 1))
    loss.backward()
    model.finalize_backward()
    grads = full_tensors(p.grad for p in model.parameters())
    model.finalize_backward()
    model.finalize_backward(async_op=True).wait()
    assert all(torch.equal(a, b) for a, b in zip(grads, full_tensors(p.grad for p in model.parameters())))
    optimizer.step()
    return loss.detach().view(1), full_tensors(model.parameters())


def _one_step(shard, rank, world, step):
    """The step alone: what the cases above must equal where torch has no such API (an
    abandoned iteration and empty finalizations leave no trace)."""
    model = shard_gpt(gpt(), shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = gpt_loss(model, _batch(rank, world, step))
    loss.backward()
    optimizer.step()
    return loss.detach().view(1), full_tensors(model.parameters())


def _edge_cases_match(rank, world):
    ours, torchs = _ours(), _torchs()
    for case, step in ((_pending_through_reset, 2), (_nothing_to_finalize, 1)):
        theirs = case(torchs, rank, world) if TORCH_HAS_MANUAL else _one_step(torchs, rank, world, step)
        _assert_same(case(ours, rank, world), theirs, case.__name__)
    if world == 2:
        _refusals(ours, rank)
        if TORCH_HAS_MANUAL:
            _refusals(torchs, rank)


def _refusals(shard, rank):
    """What torch refuses, ours refuses: not on the root, not in manual mode, a change of mode
    inside a backward or before the iteration is finalized."""
    model = shard_gpt(gpt(), shard)
    with torch.no_grad():
        model(token_batch(rank, 0)[:, :-1])  # the root is known from the first forward
    with pytest.raises(RuntimeError, match="requires manual backward finalization"):
        model.finalize_backward()
    with pytest.raises(RuntimeError, match="root"):
        model.blocks[0].finalize_backward()
    with pytest.raises(RuntimeError, match="root"):
        model.blocks[0].set_manual_backward_finalization(True)
    model.set_manual_backward_finalization(True)
    gpt_loss(model, token_batch(rank, 1)).backward()
    with pytest.raises(RuntimeError, match="after backward starts"):
        model.set_manual_backward_finalization(False)
    model.finalize_backward()
    model.set_manual_backward_finalization(False)
    loss = gpt_loss(model, token_batch(rank, 2))
    loss.register_hook(lambda grad: model.set_manual_backward_finalization(True))
    with pytest.raises(RuntimeError, match="during backward"):
        loss.backward()
    model.reset_iter_state()
    fresh = shard_gpt(gpt(), shard)
    fresh.blocks[0].set_manual_backward_finalization(True)
    with pytest.raises(RuntimeError, match="root"):
        fresh(token_batch(rank, 0)[:, :-1])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_manual_finalization_matches_torch_and_ddp(world_size):
    run_on_ranks(_finalization_matches, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_pending_handle_and_empty_finalization_behave_as_torchs(world_size):
    run_on_ranks(_edge_cases_match, world_size)


# ---------------------------------------------------------------- kept unsharded storage


def _train_recording_storage(shard, rank, world, keep):
    """Two AdamW steps; each forward records every unsharded parameter's data pointer (a
    forward pre-hook on each module with parameters, after ``fully_shard``'s own)."""
    model = shard_gpt(gpt(), shard)
    if keep is not None:
        model.set_keep_unsharded_storage(keep)
    seen: dict[str, list] = {}
    for name, module in model.named_modules():
        if module._parameters and not list(module.children()):
            def record(mod, args, prefix=name):
                for pname, p in [(n, q) for n, q in mod._parameters.items() if q is not None]:
                    seen.setdefault(f"{prefix}.{pname}", []).append((p, p.data_ptr()))
            module.register_forward_pre_hook(record)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        loss = gpt_loss(model, _batch(rank, world, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return (torch.stack(losses), full_tensors(model.parameters())), seen


def _kept_storage(rank, world):
    from sharded import estimate_memory

    ours, torchs = _ours(), _torchs()
    freed, _ = _train_recording_storage(ours, rank, world, keep=None)
    kept, seen = _train_recording_storage(ours, rank, world, keep=True)
    _assert_same(kept, freed, "set_keep_unsharded_storage(True)")
    runs = [(ours, seen)]
    if TORCH_HAS_MANUAL:
        theirs, their_seen = _train_recording_storage(torchs, rank, world, keep=True)
        _assert_same(kept, theirs, "set_keep_unsharded_storage(True) against torch's")
        runs.append((torchs, their_seen))
    for shard, recorded in runs:
        for name, uses in recorded.items():
            assert len({ptr for _, ptr in uses}) == 1, f"{name}: the unsharded storage moved: {[ptr for _, ptr in uses]}"
            assert uses[-1][0].untyped_storage().nbytes() > 0, f"{name}: the storage was freed at reshard"
    _, freed_seen = _train_recording_storage(ours, rank, world, keep=False)
    if world > 1:  # one rank: the unsharded parameters are views of the shards
        assert all(uses[-1][0].untyped_storage().nbytes() == 0 for uses in freed_seen.values())
    # estimate_memory counts the storage every unit keeps, all through the optimizer step
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for uses in seen.values() for p, _ in uses}
    estimates = [estimate_memory(gpt(), world_size=world, stage=3, wrap={Block}, keep_unsharded_storage=keep)
                 for keep in (False, True)]
    held = estimates[1].phases["optimizer step"] - estimates[0].phases["optimizer step"]
    assert held == (sum(storages.values()) if world > 1 else 0), (held, storages)
    with pytest.raises(ValueError, match="stage 3"):
        estimate_memory(gpt(), world_size=world, stage=2, keep_unsharded_storage=True)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_keep_unsharded_storage_keeps_data_pointers_and_is_estimated(world_size):
    run_on_ranks(_kept_storage, world_size)
