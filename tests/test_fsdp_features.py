"""fully_shard's options against torch DDP + the plain optimizer: mixed precision with
ShardedGradScaler, CPU offload, meta-device initialisation, activation checkpointing and the
global gradient norm."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from examples.gpt import GPT
from sharded import ShardedGradScaler, fully_shard
from sharded.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from tests._fsdp_reference import (
    optimizers_for,
    ADAMW,
    SGD,
    STEPS,
    CountCollectives,
    UnevenNet,
    assert_matches_ddp,
    full_tensors,
    shard_gpt,
    train_both,
    uneven_batch,
    uneven_loss,
)
from tests._device import (
    DEVICE_AGNOSTIC,
    LAYER3_OVER_GLOO_ON_CUDA,
    cpu_only,
    device_type_under_test,
    on_test_device,
    world_sizes,
)
from tests._exact_sums import average_after_the_sum, batch_rank
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

pytestmark = DEVICE_AGNOSTIC

WORLD_SIZES = world_sizes(1, 2, 3, gloo_on_cuda=LAYER3_OVER_GLOO_ON_CUDA)


# ------------------------------------------------------------------------ mixed precision


def _check_mixed_precision(rank, world):
    # bf16 compute against fp32 DDP: activations and gradients carry bf16 rounding (2**-8
    # relative); 5 SGD steps of lr 0.05 turn that into parameter differences of a few 1e-5
    # (measured 1.3e-5 to 2.6e-5 at world 1-3, either reduce dtype), while fp32 masters keep the
    # updates themselves exact. 2e-4 leaves room for that noise and none for a real error (an
    # unaveraged or lost gradient moves parameters by ~1e-3). The difference must not be 0
    # either: that would mean nothing was computed in bf16.
    for reduce_dtype, atol in ((torch.float32, 2e-4), (torch.bfloat16, 2e-4)):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        ref, ours = DDP(gpt()), shard_gpt(gpt(), mp_policy=policy)
        with CountCollectives() as counted:
            train_both(zip((ref, ours), optimizers_for(SGD, ref, ours)), rank)
        params = list(ours.parameters())
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params), "masters and grads stay fp32"
        if world > 1:
            shard_bytes = sum(p.to_local().numel() for p in params)
            assert counted.gathered_bytes <= 2 * 2 * STEPS * shard_bytes * 1.1, "shards are not gathered in bf16"
        mine, theirs = full_tensors(params), list(ref.parameters())
        worst = max((a - b).abs().max().item() for a, b in zip(mine, theirs))
        assert 0 < worst <= atol, f"bf16 compute, reduce in {reduce_dtype}: max diff to fp32 DDP {worst:.3g}"


def _check_grad_scaler(rank, world):
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    ours = shard_gpt(gpt(), mp_policy=policy)
    (opt,) = optimizers_for(SGD, ours)
    scaler = ShardedGradScaler(init_scale=2.0**10, device=device_type_under_test())
    for step in range(4):
        opt.zero_grad()
        scaler.scale(gpt_loss(ours, token_batch(rank, step))).backward()
        if step == 2 and rank == world - 1:  # only this rank's shard of one gradient overflows
            local = ours.head.weight.grad.to_local()
            local.view(-1)[:1] = float("inf")
        before = full_tensors(ours.parameters())
        scaler.step(opt)
        scaler.update()
        after = full_tensors(ours.parameters())
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
        assert unchanged == (step == 2), f"step {step}: rank {rank} {'skipped' if unchanged else 'stepped'}"
    assert scaler.get_scale() == 2.0**9, "every rank halves the scale once"
    assert_same_on_all_ranks([torch.tensor(scaler.get_scale())], "loss scales")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_mixed_precision_keeps_fp32_masters_and_sharded_grad_scaler_skips_together(world_size):
    run_on_ranks(_check_mixed_precision, world_size)
    run_on_ranks(_check_grad_scaler, world_size)


# ------------------------------------------------------------------------- CPU offload


def _check_cpu_offload(rank, world):
    ref = average_after_the_sum(DDP(gpt()))  # and rank 0's batches at world 3: tests/_exact_sums.py
    plain, offloaded = shard_gpt(gpt()), shard_gpt(gpt(), offload_policy=CPUOffloadPolicy(pin_memory=True))
    assert all(p.to_local().device.type == "cpu" for p in offloaded.parameters()), "shards must live on the CPU"
    train_both(zip((ref, plain, offloaded), optimizers_for(ADAMW, ref, plain, offloaded)), batch_rank(rank, world))
    assert all(p.grad.to_local().device.type == "cpu" for p in offloaded.parameters()), "gradients must land on the CPU"
    # On the CPU both runs step with the same kernels: bit for bit. On CUDA the offloaded AdamW
    # steps on the CPU and the plain one on the GPU, whose kernels round differently: float32
    # ulps per step, within the AdamW bound of tests/_fsdp_reference.py.
    exact = device_type_under_test() == "cpu"
    for a, b in zip(offloaded.parameters(), plain.parameters()):
        mine, theirs = a.to_local(), b.to_local().to(a.to_local().device)
        if exact:
            assert torch.equal(mine, theirs), "offloading changed the numbers"
        else:
            assert (mine - theirs).abs().max() <= 0.1 * ADAMW[1]["lr"] * STEPS, "offloading changed the numbers"
    assert_matches_ddp(offloaded, ref.module, "CPU offload", ADAMW, exact=exact)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cpu_offload_keeps_shards_on_cpu_and_equals_the_plain_run(world_size):
    run_on_ranks(_check_cpu_offload, world_size)


# ------------------------------------------------------------------- meta-device init


def _resident_kib() -> int:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])


def _peak_kib_since_reset(reset: bool = False) -> int:
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident size (VmHWM) to the current one
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])


def _materialise(model):
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _check_meta_init(rank, world):
    with torch.device("meta"):
        warm_up = shard_gpt(GPT(vocab=16, dim=8, layers=1, heads=1, seq=4))
        model = GPT(vocab=256, dim=256, layers=4, heads=4, seq=64)  # 3.3M parameters, 12.6 MiB
    full_kib = sum(p.numel() * 4 for p in model.parameters()) / 1024
    shard_gpt(model)
    _materialise(warm_up)  # first calls of the code paths allocate too; keep them out of the peak
    before = _resident_kib()
    _peak_kib_since_reset(reset=True)
    _materialise(model)
    grew = _peak_kib_since_reset() - before
    # This rank's shards are full / world; padding adds under a row per parameter and the
    # allocator a few pages: 5 % + 1 MiB. Holding the full model would add full_kib.
    assert grew <= 1.05 * full_kib / world + 1024, f"materialising took {grew:.0f} KiB, shards are {full_kib / world:.0f}"
    ref = GPT(vocab=256, dim=256, layers=4, heads=4, seq=64)
    with torch.no_grad():
        for r, full in zip(ref.parameters(), full_tensors(model.parameters())):
            r.copy_(full)
    ddp = DDP(ref)
    train_both(zip((ddp, model), optimizers_for(SGD, ddp, model)), rank, steps=2, batch_fn=_wide_batch)
    assert_matches_ddp(model, ref, "meta-device init", steps=2)


def _wide_batch(rank, step):
    return token_batch(rank, step, vocab=256, seq=16, batch=2)


@cpu_only("measures the resident set (VmRSS, VmHWM) that materialising a meta-device model adds")
@pytest.mark.parametrize("world_size", [2, 3])
def test_meta_device_init_never_holds_the_full_model(world_size):
    run_on_ranks(_check_meta_init, world_size)


# --------------------------------------------------------------- activation checkpointing


class CheckpointedGPT(GPT):
    """The test GPT recomputing each block's activations in backward (non-reentrant)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(64, 32, 2, 2, 16)
        on_test_device(self)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln(x))


def _check_checkpointing(rank, world):
    for reshard in (True, False):
        ref, ours = DDP(gpt()), shard_gpt(CheckpointedGPT(), reshard_after_forward=reshard)
        train_both(zip((ref, ours), optimizers_for(SGD, ref, ours)), rank)
        assert_matches_ddp(ours, ref.module, f"activation checkpointing, reshard_after_forward={reshard}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_activation_checkpointing_matches_ddp(world_size):
    run_on_ranks(_check_checkpointing, world_size)


# --------------------------------------------------------------------- gradient norm


def _check_global_grad_norm(rank, world):
    from sharded.fsdp import clip_grad_norm_

    for make, loss_fn, batch_fn in ((gpt, gpt_loss, token_batch), (UnevenNet, uneven_loss, uneven_batch)):
        ref = DDP(make())
        torch_clipped = make()
        ours = make()
        for model in (torch_clipped, ours):
            for block in getattr(model, "blocks", []):
                fully_shard(block)
            fully_shard(model)
        for norm_type in (2.0, 1.0, math.inf):
            for model in (ref, torch_clipped, ours):
                model.zero_grad()
                loss_fn(model, batch_fn(rank, 0)).backward()
            expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type)
            by_us = clip_grad_norm_(ours.parameters(), 0.01, norm_type)
            what = f"{make.__name__} norm {norm_type}"
            torch.testing.assert_close(by_us, expected, rtol=1e-5, atol=0, msg=what)
            # torch's own function on DTensor gradients gives the global norm too, except the
            # inf-norm of a shard that is empty on some rank, which torch's foreach norm refuses
            torch_works = norm_type != math.inf or make is gpt
            if torch_works:
                by_torch = torch.nn.utils.clip_grad_norm_(torch_clipped.parameters(), 0.01, norm_type)
                torch.testing.assert_close(by_torch.full_tensor(), expected, rtol=1e-5, atol=0, msg=what)
            for model in (torch_clipped, ours) if torch_works else (ours,):
                grads = full_tensors([p.grad for p in model.parameters()])
                for mine, theirs in zip(grads, (p.grad for p in ref.parameters())):
                    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7, msg=f"{what}: clipped gradients")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clip_grad_norm_returns_the_global_norm(world_size):
    run_on_ranks(_check_global_grad_norm, world_size)
