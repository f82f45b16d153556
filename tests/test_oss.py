"""OSS (ZeRO-1) against torch DDP + the plain optimizer, on real gloo process groups.

Tolerance: OSS steps the very same torch optimizer on the very same DDP-averaged gradients and
broadcasts the resulting bits, so results agree to float32 rounding (in practice they are equal);
``ATOL``/``RTOL`` leave room only for kernels that vectorise a shard's shorter tensor list
differently. fp16 broadcasts get a looser, separately justified bound.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS
from tests._device import DEVICE_AGNOSTIC
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

pytestmark = DEVICE_AGNOSTIC

ATOL, RTOL = 1e-6, 1e-5
WORLD_SIZES = [1, 2, 3]
STEPS = 5


class NoClosureSGD(torch.optim.SGD):
    """An optimizer whose step() takes no closure (some third-party ones look like this)."""

    def step(self):  # type: ignore[override]
        return super().step()


def _two_groups(model, weight_decay=0.1, lr=None):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    second = {"params": no_decay, "weight_decay": 0.0}
    if lr is not None:
        second["lr"] = lr
    return [{"params": decay, "weight_decay": weight_decay}, second]


def _train(model, optimizer, rank, steps, first_step=0, scheduler=None, use_closure=False,
           set_to_none=True):
    """DDP training steps on rank-specific batches; returns the last loss."""
    ddp = DDP(model)
    loss = None
    for step in range(first_step, first_step + steps):
        tokens = token_batch(rank, step)

        def closure():
            optimizer.zero_grad(set_to_none=set_to_none)
            out = gpt_loss(ddp, tokens)
            out.backward()
            return out

        if use_closure:
            loss = optimizer.step(closure)
        else:
            loss = closure()
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return loss


def _assert_close(ours, ref, what, atol=ATOL, rtol=RTOL):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        if not torch.allclose(a, b, atol=atol, rtol=rtol):
            diff = (a - b).abs().max().item()
            raise AssertionError(f"{what}: {name} differs from DDP by {diff:.3g}")


PARITY_CASES = {
    "sgd_momentum": lambda params: (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "adam": lambda params: (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": lambda params: (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "no_closure_optimizer": lambda params: (NoClosureSGD, dict(lr=0.05, momentum=0.5)),
}


def _check_optimizers_match_ddp(rank, world):
    for name, case in PARITY_CASES.items():
        cls, kwargs = case(None)
        ref, ours = gpt(), gpt()
        _train(ref, cls(ref.parameters(), **kwargs), rank, STEPS)
        _train(ours, OSS(ours.parameters(), cls, **kwargs), rank, STEPS)
        _assert_close(ours, ref, name)
        assert_same_on_all_ranks(list(ours.parameters()), name)


def _check_groups_scheduler_and_closure_match_ddp(rank, world):
    ref, ours = gpt(), gpt()
    ref_opt = torch.optim.AdamW(_two_groups(ref, lr=3e-3), lr=1e-2)
    our_opt = OSS(_two_groups(ours, lr=3e-3), torch.optim.AdamW, lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    our_sched = torch.optim.lr_scheduler.StepLR(our_opt, step_size=2, gamma=0.5)
    ref_loss = _train(ref, ref_opt, rank, STEPS, scheduler=ref_sched, use_closure=True)
    our_loss = _train(ours, our_opt, rank, STEPS, scheduler=our_sched, use_closure=True)
    _assert_close(ours, ref, "two groups + StepLR + closure")
    assert torch.equal(ref_loss, our_loss)
    lrs = [g["lr"] for g in our_opt.param_groups]
    assert lrs == [g["lr"] for g in ref_opt.param_groups] == [1e-2 * 0.25, 3e-3 * 0.25]
    assert [g["lr"] for g in our_opt.optim.param_groups] == lrs, "scheduler lr did not reach the shard"
    assert "betas" in our_opt.param_groups[0], "defaults of the wrapped optimizer are not visible"
    assert isinstance(our_opt, torch.optim.Optimizer)


def _check_bucketing_and_fp16_broadcast(rank, world):
    ref = gpt()
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), rank, STEPS)
    for bucket_size in (0, 100, 2**23):
        ours = gpt()
        oss = OSS(ours.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9,
                  broadcast_buffer_size=bucket_size)
        _train(ours, oss, rank, STEPS)
        _assert_close(ours, ref, f"broadcast_buffer_size={bucket_size}")
    ours = gpt()
    oss = OSS(ours.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9, broadcast_fp16=True)
    _train(ours, oss, rank, STEPS)
    # Non-owners receive values rounded to fp16 (relative error <= 2**-11 ~ 4.9e-4) each step; the
    # rounding perturbs their gradients slightly but never accumulates in the owners' fp32 masters.
    _assert_close(ours, ref, "broadcast_fp16", atol=2e-3, rtol=2e-3)
    owned = {p for p, r in oss.param_to_rank.items() if r == rank}
    for p in ours.parameters():
        if p not in owned and world > 1:
            assert torch.equal(p, p.half().float()), "a non-owner holds more than fp16 precision"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_oss_matches_ddp_with_sgd_adam_adamw(world_size):
    run_on_ranks(_check_optimizers_match_ddp, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_oss_matches_ddp_with_param_groups_steplr_and_closure(world_size):
    run_on_ranks(_check_groups_scheduler_and_closure_match_ddp, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_oss_broadcast_buckets_and_fp16(world_size):
    run_on_ranks(_check_bucketing_and_fp16_broadcast, world_size)


def _storages(params):
    return {p.untyped_storage().data_ptr() for p in params}


def _check_parameters_live_in_their_broadcast_buckets(rank, world):
    ref, ours = gpt(), gpt()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    oss = OSS(ours.parameters(), torch.optim.Adam, lr=1e-2)
    params = list(ours.parameters())
    # the broadcast buffers are the parameters' storage: one per bucket, nothing to copy
    assert len(_storages(params)) == len(oss.broadcaster.buckets) < len(params)
    _train(ref, ref_opt, rank, 2)
    _train(ours, oss, rank, 2)
    for p in params:  # what module.to(...) does: new storage behind the same parameters
        p.data = p.data.clone()
    _train(ref, ref_opt, rank, 3, first_step=2)
    _train(ours, oss, rank, 3, first_step=2)
    _assert_close(ours, ref, "after the parameters got new storage")
    assert_same_on_all_ranks(params, "replicas after the parameters got new storage")
    assert len(_storages(params)) == len(oss.broadcaster.buckets), "the buckets were not rebuilt"
    ours.blocks[0].requires_grad_(False)
    oss.refresh_trainable()
    trainable = [p for p in params if p.requires_grad]
    assert len(_storages(trainable)) == len(oss.broadcaster.buckets) < len(trainable), "re-partition lost the buckets"
    for name, p in ours.blocks[0].named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), (
            f"frozen parameter {name} still pins an old bucket")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parameters_live_in_broadcast_buckets_and_follow_new_storage(world_size):
    run_on_ranks(_check_parameters_live_in_their_broadcast_buckets, world_size)


# ------------------------------------------------------------------------------ add_param_group


def _check_add_param_group(rank, world):
    ref, ours = gpt(), gpt()
    blocks = lambda m: [p for n, p in m.named_parameters() if not n.startswith("head")]
    ref_opt = torch.optim.Adam(blocks(ref), lr=1e-2)
    our_opt = OSS(blocks(ours), torch.optim.Adam, lr=1e-2)
    # the head is trained from the start in both (its grads are simply not stepped until added)
    _train(ref, ref_opt, rank, 2)
    _train(ours, our_opt, rank, 2)
    owners_before = dict(our_opt.param_to_rank)
    ref_opt.add_param_group({"params": [ref.head.weight], "lr": 5e-3})
    our_opt.add_param_group({"params": [ours.head.weight], "lr": 5e-3})
    assert all(our_opt.param_to_rank[p] == r for p, r in owners_before.items())
    _train(ref, ref_opt, rank, 3, first_step=2)
    _train(ours, our_opt, rank, 3, first_step=2)
    _assert_close(ours, ref, "after add_param_group")
    assert our_opt.param_groups[1]["lr"] == 5e-3 and "betas" in our_opt.param_groups[1]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_add_param_group_keeps_owners_and_matches_ddp(world_size):
    run_on_ranks(_check_add_param_group, world_size)


# ------------------------------------------------------------------------------ clip_grad_norm


def _check_clip_grad_norm(rank, world):
    for norm_type in (2.0, 1.0, math.inf):
        ref, ours = gpt(), gpt()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        our_opt = OSS(ours.parameters(), torch.optim.SGD, lr=0.1)
        wrapped = {id(ref): DDP(ref), id(ours): DDP(ours)}
        for step in range(STEPS):
            norms = []
            for model, opt in ((ref, ref_opt), (ours, our_opt)):
                opt.zero_grad()
                gpt_loss(wrapped[id(model)], token_batch(rank, step)).backward()
                if opt is ref_opt:
                    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type))
                else:
                    norms.append(opt.clip_grad_norm(0.05, norm_type))
                opt.step()
            torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=1e-6)
        _assert_close(ours, ref, f"clip_grad_norm norm_type={norm_type}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clip_grad_norm_equals_torch_on_full_gradients(world_size):
    run_on_ranks(_check_clip_grad_norm, world_size)


def _matrices(params):
    return [p for p in params if p.dim() >= 2]


def _check_clip_grad_norm_with_filter(rank, world):
    """fairscale's ``filter_params_fn`` (Megatron's model-parallel dedup) narrows the parameters
    the norm is taken over; every gradient is clipped by it, as torch's clip_grads_with_norm_."""
    for norm_type in (2.0, math.inf):
        ref, ours = gpt(), gpt()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        our_opt = OSS(ours.parameters(), torch.optim.SGD, lr=0.1)
        wrapped = {id(ref): DDP(ref), id(ours): DDP(ours)}
        for step in range(3):
            norms = []
            for model, opt in ((ref, ref_opt), (ours, our_opt)):
                opt.zero_grad()
                gpt_loss(wrapped[id(model)], token_batch(rank, step)).backward()
                if opt is ref_opt:
                    total = torch.nn.utils.get_total_norm([p.grad for p in _matrices(model.parameters())], norm_type)
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.05, total)
                    norms.append(total)
                else:
                    norms.append(opt.clip_grad_norm(0.05, norm_type, filter_params_fn=_matrices))
                opt.step()
            torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=1e-6)
        _assert_close(ours, ref, f"clip_grad_norm with filter_params_fn, norm_type={norm_type}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clip_grad_norm_filter_narrows_the_norm_and_clips_every_gradient(world_size):
    run_on_ranks(_check_clip_grad_norm_with_filter, world_size)


# --------------------------------------------------------------------------- freezing params


def _check_freeze_then_unfreeze(rank, world, explicit_refresh, optimizer):
    cls, kwargs = {"sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
                   "adam": (torch.optim.Adam, dict(lr=1e-2))}[optimizer]
    ref, ours = gpt(), gpt()
    ref_opt, our_opt = cls(ref.parameters(), **kwargs), OSS(ours.parameters(), cls, **kwargs)
    step = 0
    for phase, trainable in enumerate((True, False, True)):
        for model in (ref, ours):
            model.blocks[0].requires_grad_(trainable)
        if explicit_refresh:
            our_opt.refresh_trainable()
        _train(ref, ref_opt, rank, 3, first_step=step)
        _train(ours, our_opt, rank, 3, first_step=step)
        step += 3
        assert_same_on_all_ranks(list(ours.parameters()), f"replicas after phase {phase}")
        _assert_close(ours, ref, f"phase {phase} ({'trainable' if trainable else 'frozen'})")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_freeze_mid_training_keeps_replicas_identical_and_matches_ddp(world_size):
    for explicit in (True, False):
        for optimizer in ("sgd", "adam"):
            run_on_ranks(_check_freeze_then_unfreeze, world_size, explicit, optimizer)


# ------------------------------------------------------------------------------------ balance


def _state_bytes(states):
    return sum(v.numel() * v.element_size() for s in states for v in s.values()
               if isinstance(v, torch.Tensor))


def _check_state_balance(rank, world):
    model = gpt(vocab=256, dim=64, layers=4, heads=4)
    oss = OSS(model.parameters(), torch.optim.Adam, lr=1e-3)
    gpt_loss(model, token_batch(rank, 0, vocab=256)).backward()
    oss.step()
    mine = torch.tensor([_state_bytes(oss.optim.state.values())], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    ref_model = gpt(vocab=256, dim=64, layers=4, heads=4)
    gpt_loss(ref_model, token_batch(rank, 0, vocab=256)).backward()
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-3)
    ref.step()
    full = _state_bytes(ref.state.values())
    largest = max(_state_bytes([s]) for s in ref.state.values())
    assert sum(float(g) for g in gathered) == full
    bound = 1.05 * max(full / world, largest)
    assert max(float(g) for g in gathered) <= bound, (gathered, full, largest)


@pytest.mark.parametrize("world_size", [2, 3])
def test_optimizer_state_is_balanced_on_a_gpt_model(world_size):
    run_on_ranks(_check_state_balance, world_size)
