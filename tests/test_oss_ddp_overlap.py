"""OSS(overlap_with_ddp=True) stepped bucket by bucket in DDP's backward, against DDP + the plain
optimizer, on real process groups (gloo on the CPU).

Exact: both sides reduce with the same DDP and the same comm hook (so the same sums in the same
order, at any world size and with different batches per rank), and the owner steps each
parameter with the very torch optimizer on the very averaged gradient; only when the step runs
differs. So parameters and DDP's gradients compare bit for bit after every step, from the first
(torch's version skips the updates of the first iterations while it learns DDP's buckets).
DDP's buckets are kept small so that a model spreads over several and every owner has some.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import sharded
from sharded import OSS
from tests._device import DEVICE_AGNOSTIC
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

pytestmark = DEVICE_AGNOSTIC

STEPS = 4
BUCKET_MB = 0.004  # a few KiB: the small GPT spreads over about ten buckets
HOOKS = {
    "allreduce": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}
DRIVERS = {"step": sharded.hook_with_zero_step, "interleaved": sharded.hook_with_zero_step_interleaved}


def _ddp(model):
    return DDP(model, bucket_cap_mb=BUCKET_MB)


def _reference(hook_name, optimizer):
    model = gpt()
    ddp = _ddp(model)
    ddp.register_comm_hook(dist.group.WORLD, HOOKS[hook_name])
    optim_class, hyper = OPTIMIZERS[optimizer]
    return model, ddp, optim_class(model.parameters(), **hyper)


def _overlapped(hook_name, optimizer, driver, groups=None):
    model = gpt()
    ddp = _ddp(model)
    optim_class, hyper = OPTIMIZERS[optimizer]
    params = groups(model) if groups else model.parameters()
    if driver == "interleaved":  # torch's class on the same engine (parameters keep their storage)
        zero = sharded.ZeroRedundancyOptimizer(params, optim_class, overlap_with_ddp=True, **hyper)
    else:
        zero = OSS(params, optim_class, overlap_with_ddp=True, **hyper)
    ddp.register_comm_hook(dist.group.WORLD, DRIVERS[driver](HOOKS[hook_name], ddp, zero))
    return model, ddp, zero


def _train_step(ddp, optimizer, rank, step, call_step=True):
    optimizer.zero_grad()
    gpt_loss(ddp, token_batch(rank, step)).backward()
    if call_step:
        optimizer.step()


def _backward_steps_every_parameter(ddp, zero, rank, step):
    """One overlapped step; raises unless the backward itself moved every parameter (weight
    decay moves even those whose gradient is zero)."""
    zero.zero_grad()
    before = [p.detach().clone() for p in ddp.parameters()]
    gpt_loss(ddp, token_batch(rank, step)).backward()
    still = [n for (n, p), b in zip(ddp.module.named_parameters(), before) if torch.equal(p, b)]
    if still:
        raise AssertionError(f"step {step}: the backward left {still} as they were")
    zero.step()


def _assert_equal(ours, ref, what):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: {name} differs from DDP by {(a - b).abs().max().item():.3g}")
        if (a.grad is None) != (b.grad is None) or (a.grad is not None and not torch.equal(a.grad, b.grad)):
            raise AssertionError(f"{what}: {name}'s gradient is not DDP's")


def _hooks_ddp_takes():
    """The hooks of HOOKS that DDP accepts here: torch's bf16 hook needs NCCL (DDP refuses it
    on gloo before it runs)."""
    if dist.get_backend() == dist.Backend.NCCL:
        return list(HOOKS)
    return [name for name in HOOKS if name != "bf16"]


def _parity_cases(rank, world_size):
    for hook_name in _hooks_ddp_takes():
        for optimizer in OPTIMIZERS:
            for driver in DRIVERS:
                what = f"{hook_name} hook, {optimizer}, {driver}"
                ref_model, ref_ddp, ref_opt = _reference(hook_name, optimizer)
                model, ddp, zero = _overlapped(hook_name, optimizer, driver)
                for step in range(STEPS):
                    _train_step(ref_ddp, ref_opt, rank, step)
                    _backward_steps_every_parameter(ddp, zero, rank, step)
                    _assert_equal(model, ref_model, f"{what}, step {step}")
                assert_same_on_all_ranks([p.detach() for p in model.parameters()], what)
                dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_overlapped_steps_equal_ddp_with_the_same_hook_and_the_plain_optimizer(world_size):
    """allreduce, fp16 (and, on NCCL, bf16) compression hooks x SGD and AdamW x both drivers,
    every step."""
    run_on_ranks(_parity_cases, world_size, timeout=240)


def _loops_without_step_and_with_frozen_and_groups(rank, world_size):
    # torch's loop: no step() call at all, the hook does it. Against DDP's own reduction (no
    # hook) where allreduce_hook's division before the sum is the same bits (world 1 and 2: exact).
    ref_model, ref_ddp, ref_opt = _reference("allreduce", "adamw")
    if world_size <= 2:
        ref_model = gpt()
        ref_ddp = _ddp(ref_model)
        ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPTIMIZERS["adamw"][1])
    model, ddp, zero = _overlapped("allreduce", "adamw", "interleaved")
    for step in range(STEPS):
        _train_step(ref_ddp, ref_opt, rank, step)
        _train_step(ddp, zero, rank, step, call_step=False)
    _assert_equal(model, ref_model, "no step() call")

    # Two param groups (one of them without weight decay) and a frozen parameter that holds a
    # zeroed gradient: DDP leaves it out of its buckets, a plain SGD still decays it; step() does.
    def frozen_head(model):
        model.head.weight.requires_grad_(False)
        return model

    def groups(model):
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        return [{"params": matrices}, {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]

    ref_model = frozen_head(gpt())
    ref_ddp = _ddp(ref_model)
    ref_ddp.register_comm_hook(None, HOOKS["allreduce"])
    ref_opt = torch.optim.SGD(groups(ref_model), lr=0.05, momentum=0.9, weight_decay=0.01)
    model = frozen_head(gpt())
    ddp = _ddp(model)
    zero = OSS(groups(model), torch.optim.SGD, overlap_with_ddp=True, lr=0.05, momentum=0.9, weight_decay=0.01)
    ddp.register_comm_hook(None, sharded.hook_with_zero_step(HOOKS["allreduce"], ddp, zero))
    for step in range(STEPS):
        for m, d, o in ((ref_model, ref_ddp, ref_opt), (model, ddp, zero)):
            o.zero_grad(set_to_none=False)
            m.head.weight.grad = torch.zeros_like(m.head.weight)
            gpt_loss(d, token_batch(rank, step)).backward()
            o.step()
        _assert_equal(model, ref_model, f"param groups and a frozen parameter, step {step}")
    assert_same_on_all_ranks([p.detach() for p in model.parameters()], "frozen parameter")

    # Gradients as views of DDP's buckets, and DDP's static graph, on both sides.
    sides = []
    for overlap in (False, True):
        model = gpt()
        ddp = DDP(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True, static_graph=True)
        optim_class, hyper = OPTIMIZERS["adamw"]
        if overlap:
            opt = OSS(model.parameters(), optim_class, overlap_with_ddp=True, **hyper)
            ddp.register_comm_hook(None, sharded.hook_with_zero_step_interleaved(HOOKS["allreduce"], ddp, opt))
        else:
            opt = optim_class(model.parameters(), **hyper)
            ddp.register_comm_hook(None, HOOKS["allreduce"])
        sides.append((model, ddp, opt))
    for step in range(STEPS):
        for _, d, o in sides:
            _train_step(d, o, rank, step)
        _assert_equal(sides[1][0], sides[0][0], f"gradient_as_bucket_view and static_graph, step {step}")

    # no_sync() accumulation: the synced backward steps; step() after it steps nothing twice.
    ref_model, ref_ddp, ref_opt = _reference("allreduce", "sgd")
    model, ddp, zero = _overlapped("allreduce", "sgd", "step")
    for step in range(2):
        for d, o in ((ref_ddp, ref_opt), (ddp, zero)):
            o.zero_grad()
            with d.no_sync():
                gpt_loss(d, token_batch(rank, 10 + step)).backward()
            gpt_loss(d, token_batch(rank, step)).backward()
            o.step()
        _assert_equal(model, ref_model, f"no_sync accumulation, step {step}")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_torch_style_loop_frozen_parameter_groups_and_no_sync_equal_ddp(world_size):
    """torch's loop without step(), two param groups and a frozen parameter holding a gradient,
    gradient_as_bucket_view with static_graph, and no_sync() accumulation."""
    run_on_ranks(_loops_without_step_and_with_frozen_and_groups, world_size, timeout=120)


def _misuse(rank, world_size, caplog_level):
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook

    model = gpt()
    ddp = _ddp(model)
    zero = OSS(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    errors = {}

    def expect(kind, what, call):
        try:
            call()
        except kind as e:
            errors[what] = str(e)
        else:
            raise AssertionError(f"{what}: no {kind.__name__}")

    hook = default_hooks.allreduce_hook
    expect(AttributeError, "torch's hook", lambda: ddp_zero_hook.hook_with_zero_step(hook, ddp, zero))
    expect(AttributeError, "torch's interleaved", lambda: ddp_zero_hook.hook_with_zero_step_interleaved(hook, ddp, zero))
    plain = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
    expect(ValueError, "without overlap", lambda: sharded.hook_with_zero_step(hook, ddp, plain))
    torch_zero = torch.distributed.optim.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    expect(TypeError, "torch's optimizer", lambda: sharded.hook_with_zero_step(hook, ddp, torch_zero))
    expect(ValueError, "shard_buckets", lambda: sharded.hook_with_zero_step(hook, ddp, zero, shard_buckets=False))
    unused = DDP(gpt(), find_unused_parameters=True)
    unused_zero = OSS(unused.module.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    expect(ValueError, "find_unused", lambda: sharded.hook_with_zero_step(hook, unused, unused_zero))
    partial = OSS([model.head.weight], torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    expect(ValueError, "missing", lambda: sharded.hook_with_zero_step(hook, ddp, partial))
    from torch.distributed.algorithms.join import Join

    expect(NotImplementedError, "join", lambda: Join([ddp, zero]))

    ddp.register_comm_hook(None, sharded.hook_with_zero_step(hook, ddp, zero))
    gpt_loss(ddp, token_batch(rank, 0)).backward()
    expect(RuntimeError, "clip after", lambda: zero.clip_grad_norm(1.0))
    expect(TypeError, "step kwargs", lambda: zero.step(foo=1))
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_misuse_raises_naming_what_to_do(world_size):
    """torch's hooks refuse ours (and name ours); ours refuse torch's optimizer, an optimizer
    without overlap_with_ddp, shard_buckets=False, find_unused_parameters, a parameter the
    optimizer lacks, LBFGS; after an overlapped backward, clipping and step arguments raise."""
    errors = run_on_ranks(_misuse, world_size, logging.WARNING)[0]
    assert "sharded.hook_with_zero_step" in errors["torch's hook"]
    assert "overlap_with_ddp=True" in errors["without overlap"]
    assert "uneven inputs" in errors["join"] and "rank 0" in errors["join"]
    assert "rank 0" in errors["missing"] and "'" in errors["missing"]
    assert "find_unused_parameters=False" in errors["find_unused"]
    assert "already stepped" in errors["clip after"]
