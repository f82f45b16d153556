"""ShardedGradScaler: AMP with sharded gradients, every rank skipping or stepping together."""

from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedGradScaler
from tests._device import DEVICE_AGNOSTIC, device_type_under_test, on_test_device
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt_loss, token_batch
from tests.test_oss import _assert_close
from tests.test_sharded_ddp import STEPS, _pair

pytestmark = DEVICE_AGNOSTIC

INF_STEP = 2


def _check_amp_skips_together(rank, world, amp_dtype):
    ref, ref_opt, ours, our_opt = _pair()
    device = device_type_under_test()
    scalers = {id(ref): torch.amp.GradScaler(device, init_scale=2.0**10),
               id(ours): ShardedGradScaler(init_scale=2.0**10, device=device)}
    head_owner = our_opt.param_to_rank[ours.module.head.weight]
    for step in range(STEPS):
        for model, opt in ((ref, ref_opt), (ours, our_opt)):
            scaler = scalers[id(model)]
            opt.zero_grad()
            with torch.autocast(device, dtype=amp_dtype):
                loss = gpt_loss(model, token_batch(rank, step))
            poison = None
            if step == INF_STEP and rank == world - 1:
                # one rank's gradient of one parameter overflows: after the reduce only that
                # parameter's owner sees the inf
                poison = model.module.head.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
            scaler.scale(loss).backward()
            if poison is not None:
                poison.remove()
            before = [p.detach().clone() for p in model.parameters()]
            if model is ours and step == INF_STEP and rank != head_owner:
                local = [p.grad for p in model.parameters() if p.grad is not None]
                assert all(torch.isfinite(g).all() for g in local), "this rank should see no inf"
            scaler.step(opt)
            scaler.update()
            if step == INF_STEP:
                unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                assert unchanged, f"rank {rank} stepped although a shard overflowed"
    assert scalers[id(ours)].get_scale() == scalers[id(ref)].get_scale() == 2.0**9
    assert_same_on_all_ranks(list(ours.parameters()), "replicas after AMP")
    _assert_close(ours.module, ref.module, f"AMP {amp_dtype}")


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_amp_with_sharded_grad_scaler_skips_on_every_rank(world_size, amp_dtype):
    run_on_ranks(_check_amp_skips_together, world_size, amp_dtype)


def _check_rank_without_parameters(rank, world):
    torch.manual_seed(0)
    model = on_test_device(nn.Linear(4, 4))  # two parameters: at world 3, rank 2 owns nothing
    opt = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
    scaler = ShardedGradScaler(init_scale=4.0, device=device_type_under_test())
    ddp = DDP(model)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(ddp(on_test_device(torch.randn(2, 4))).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert_same_on_all_ranks(list(model.parameters()), "replicas")


def test_a_rank_that_owns_nothing_steps_with_the_others():
    run_on_ranks(_check_rank_without_parameters, 3)


def _consumer(scaler: Optional[torch.cuda.amp.GradScaler]) -> str:
    """A trainer's check of its scaler argument, as fairscale-era trainers annotate it."""
    if scaler is not None and not isinstance(scaler, torch.cuda.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.cuda.amp.GradScaler, got {type(scaler).__name__}")
    return "amp" if scaler is not None and scaler.is_enabled() else "fp32"


def test_the_scaler_is_a_cuda_grad_scaler_as_fairscales_was():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch.cuda.amp.GradScaler() warns deprecated
        scaler = ShardedGradScaler(device="cpu")
    assert isinstance(scaler, torch.cuda.amp.GradScaler) and isinstance(scaler, torch.amp.GradScaler)
    assert _consumer(scaler) == "amp"
    with pytest.raises(TypeError, match="torch.cuda.amp.GradScaler"):
        _consumer(torch.amp.GradScaler("cpu"))


def test_a_type_checked_consumer_takes_the_scaler():
    typeguard = pytest.importorskip("typeguard")
    typeguard.check_type(ShardedGradScaler(device="cpu"), Optional[torch.cuda.amp.GradScaler])
    checked = typeguard.typechecked(_consumer)
    assert checked(ShardedGradScaler(device="cpu")) == "amp"
    with pytest.raises(typeguard.TypeCheckError):
        checked(torch.amp.GradScaler("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is CUDA, present here")
def test_without_cuda_the_default_scaler_disables_itself_as_torchs():
    with pytest.warns(UserWarning, match="CUDA is not available") as ours:
        scaler = ShardedGradScaler()
    with pytest.warns(UserWarning, match="CUDA is not available") as torchs:
        reference = torch.amp.GradScaler("cuda")
    assert [str(w.message) for w in ours] == [str(w.message) for w in torchs]
    assert not scaler.is_enabled() and scaler.get_scale() == reference.get_scale() == 1.0
    assert _consumer(scaler) == "fp32"
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    loss = (weight * 2).sum()
    assert scaler.scale(loss) is loss  # nothing scaled, as torch's disabled scaler
    loss.backward()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(weight.detach(), torch.zeros(3)) and scaler.state_dict() == reference.state_dict() == {}


def test_the_device_is_a_device_type():
    with pytest.raises(TypeError, match="device type"):
        ShardedGradScaler(device=torch.device("cpu"))  # type: ignore[arg-type]
