"""ShardedDataParallel's overlap_param_broadcast: ``OSS.step()`` leaves the parameter broadcasts
in flight and each module waits for its own before it runs. Every way of reading the parameters
between a step and the next forward that the wrapper can see must give the new values, and the
training must stay DDP's, bit for bit at world 1 and 2 (SGD: the reduce sums in DDP's order)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch
from tests.test_oss import _assert_close

STEPS = 7
SGD = dict(lr=0.05, momentum=0.9)


def _pair(broadcast_buffer_size):
    ref, ours = gpt(), gpt()
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    our_opt = OSS(ours.parameters(), torch.optim.SGD, broadcast_buffer_size=broadcast_buffer_size, **SGD)
    sdp = ShardedDataParallel(ours, our_opt, overlap_param_broadcast=True)
    return DDP(ref), ref_opt, sdp, our_opt


def _step(model, optimizer, rank, step):
    optimizer.zero_grad()
    gpt_loss(model, token_batch(rank, step)).backward()
    optimizer.step()


def _read_between_steps(how, ref, ours, our_opt, rank, step):
    """Read the parameters of ``ours`` one way; they must be the ones DDP has."""
    what = f"{how} after step {step}"
    if how == "state_dict":  # e.g. a checkpoint
        mine, theirs = ours.module.state_dict(), ref.module.state_dict()
        for name, value in theirs.items():
            torch.testing.assert_close(mine[name], value, rtol=1e-5, atol=1e-6, msg=what)
    elif how == "module_forward":  # e.g. an evaluation with the bare module
        tokens = token_batch(rank, 100 + step)[:, :-1]
        with torch.no_grad():
            torch.testing.assert_close(ours.module(tokens), ref.module(tokens), rtol=1e-5, atol=1e-6, msg=what)
    elif how == "wrapper_parameters":
        for a, b in zip(ours.parameters(), ref.module.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)
    elif how == "load_state_dict":  # a broadcast landing after the load would undo it
        halved = {name: value * 0.5 for name, value in ref.module.state_dict().items()}
        ref.module.load_state_dict(halved)
        ours.module.load_state_dict(halved)
        ours.wait_for_params()
        _assert_close(ours.module, ref.module, what)
    elif how == "wait_for_params":
        our_opt.wait_for_params()
        _assert_close(ours.module, ref.module, what)


def _check_overlapped_broadcast(rank, world):
    hows = ("state_dict", "module_forward", "wrapper_parameters", "load_state_dict", "wait_for_params", "next_forward")
    for bucket in (2**23, 300):  # one broadcast per rank, or many (waited one module at a time)
        ref, ref_opt, ours, our_opt = _pair(bucket)
        for step in range(STEPS):
            _step(ref, ref_opt, rank, step)
            _step(ours, our_opt, rank, step)
            _read_between_steps(hows[step % len(hows)], ref, ours, our_opt, rank, step)
        ours.wait_for_params()
        _assert_close(ours.module, ref.module, f"broadcast_buffer_size={bucket}")
        assert_same_on_all_ranks(list(ours.parameters()), f"replicas, broadcast_buffer_size={bucket}")
        if world <= 2:
            for a, b in zip(ours.parameters(), ref.module.parameters()):
                assert torch.equal(a, b), f"broadcast_buffer_size={bucket}: not bit-identical to DDP"


def _check_refresh_and_cast(rank, world):
    """Re-planned broadcasts (requires_grad changes, a dtype cast) wait for what was in flight."""
    ref, ref_opt, ours, our_opt = _pair(300)
    for step in range(2):
        _step(ref, ref_opt, rank, step)
        _step(ours, our_opt, rank, step)
    for model in (ref.module, ours.module):
        model.head.weight.requires_grad_(False)
    ref = DDP(ref.module)
    for step in range(2, 4):
        _step(ref, ref_opt, rank, step)
        _step(ours, our_opt, rank, step)
    ours.to(dtype=torch.float64)
    ref = DDP(ref.module.to(torch.float64))
    for step in range(4, 6):
        _step(ref, ref_opt, rank, step)
        _step(ours, our_opt, rank, step)
    ours.wait_for_params()
    _assert_close(ours.module, ref.module, "after freezing and a cast")
    assert_same_on_all_ranks(list(ours.parameters()), "replicas after freezing and a cast")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_overlapped_param_broadcast_matches_ddp_on_every_read(world_size):
    run_on_ranks(_check_overlapped_broadcast, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_overlapped_param_broadcast_survives_refresh_and_cast(world_size):
    run_on_ranks(_check_refresh_and_cast, world_size)
