"""The test device: one variable picks it, every rank starts on it with the backend chosen for
its world size, gloo carries each collective tests/_device.py lists for it, and the guard stops
the ones it cannot carry before gloo sees them.

Run with ``SHARDED_TEST_DEVICE=cuda`` (``make gpu-check`` on a GPU), the collectives' test is the
check of the gloo-CUDA list; on the CPU it checks the same calls on host tensors.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests import _device
from tests._device import DEVICE_AGNOSTIC, ENV_VAR, GLOO_CUDA_SUPPORTED, backend_for, device_under_test
from tests._harness import RankFailure, run_on_ranks
from tests._models import gpt, token_batch

pytestmark = DEVICE_AGNOSTIC


def test_one_variable_picks_the_device_and_the_world_size_the_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert _device.device_type_under_test() == "cpu"
    assert [backend_for(world) for world in (1, 2, 3)] == ["gloo"] * 3
    assert [backend_for(world, "cuda") for world in (1, 2, 3)] == ["nccl", "gloo", "gloo"]
    monkeypatch.setenv(ENV_VAR, "tpu")
    with pytest.raises(ValueError, match=f"{ENV_VAR}='tpu'"):
        _device.device_type_under_test()
    if not torch.cuda.is_available():
        monkeypatch.setenv(ENV_VAR, "cuda")
        with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
            _device.device_under_test()


def _where_the_rank_runs(rank, world):
    return dist.get_backend(), os.environ[ENV_VAR], str(gpt().head.weight.device), str(token_batch(rank, 0).device)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_runs_on_the_test_device_with_its_backend(world_size):
    device = device_under_test()
    expected = (backend_for(world_size), device.type, str(device), str(device))
    assert run_on_ranks(_where_the_rank_runs, world_size) == [expected] * world_size


# ------------------------------------------------------------------- what gloo carries


def _ran_as_expected(rank, world, device):
    """Run each collective of GLOO_CUDA_SUPPORTED on ``device`` tensors; returns their names."""

    def full(value, n=2):
        return torch.full((n,), float(value), device=device)

    def equal(got, want, name):
        assert got.device == device, f"{name}: result on {got.device}"
        assert torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"

    total = sum(range(1, world + 1))
    ran = []
    t = full(rank)
    dist.broadcast(t, src=world - 1)
    equal(t, full(world - 1), "broadcast")
    ran.append("broadcast")
    t = full(rank + 1)
    dist.all_reduce(t)
    equal(t, full(total), "all_reduce")
    ran.append("all_reduce")
    t = full(rank + 1)
    dist.reduce(t, dst=0)
    if rank == 0:
        equal(t, full(total), "reduce")
    ran.append("reduce")
    gathered = [full(-1) for _ in range(world)]
    dist.all_gather(gathered, full(rank))
    equal(torch.cat(gathered), torch.cat([full(r) for r in range(world)]), "all_gather")
    ran.append("all_gather")
    out = full(-1, 2 * world)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, full(rank))
    equal(out, torch.cat([full(r) for r in range(world)]), "all_gather_into_tensor")
    ran.append("all_gather_into_tensor")
    gathered = [full(-1) for _ in range(world)] if rank == 0 else None
    dist.gather(full(rank), gathered, dst=0)
    if rank == 0:
        equal(torch.cat(gathered), torch.cat([full(r) for r in range(world)]), "gather")
    ran.append("gather")
    t = full(-1)
    dist.scatter(t, [full(10 + r) for r in range(world)] if rank == 0 else None, src=0)
    equal(t, full(10 + rank), "scatter")
    ran.append("scatter")
    # rank r sends r + i to rank i: rank i receives sum(r) + world * i
    t = full(-1)
    dist.reduce_scatter(t, [full(rank + i) for i in range(world)])
    equal(t, full(total - world + world * rank), "reduce_scatter")
    ran.append("reduce_scatter")
    t = full(-1)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(t, torch.cat([full(rank + i) for i in range(world)]))
    equal(t, full(total - world + world * rank), "reduce_scatter_tensor")
    ran.append("reduce_scatter_tensor")
    # rank r sends 100 r + i to rank i: rank i receives [100 r + i for r in ranks]
    out = torch.full((world,), -1.0, device=device)
    dist.all_to_all_single(out, torch.tensor([100.0 * rank + i for i in range(world)], device=device))
    equal(out, torch.tensor([100.0 * r + rank for r in range(world)], device=device), "all_to_all_single")
    ran.append("all_to_all_single")
    return ran


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_carries_the_listed_collectives_on_the_test_device(world_size):
    assert backend_for(world_size) == "gloo"
    ran = run_on_ranks(_ran_as_expected, world_size, device_under_test())
    assert ran == [list(GLOO_CUDA_SUPPORTED)] * world_size, "every listed collective is checked, in the list's order"


# -------------------------------------------------------------------------------- the guard


def _stopped_before_gloo(rank, world, device_type):
    """Off-host tensors (CUDA on a GPU, meta on the CPU) raise at send, recv and
    batch_isend_irecv; host tensors still pass through the guard."""
    _device.install_gloo_cuda_guard()
    _device.install_gloo_cuda_guard()  # idempotent: one guard, not two
    off_host = torch.zeros(2, device=device_type if device_type != "cpu" else "meta")
    peer = 1 - rank
    stopped = []
    for name, call in (
        ("send", lambda: dist.send(off_host, peer)),
        ("recv", lambda: dist.recv(off_host, peer)),
        ("batch_isend_irecv", lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, off_host, peer)])),
    ):
        with pytest.raises(_device.GlooDeviceUnsupported, match=f"torch.distributed.{name} got a {off_host.device.type} tensor"):
            call()
        stopped.append(name)
    host = torch.full((2,), float(rank))
    if rank == 0:
        dist.send(host, 1)
    else:
        dist.recv(host, 0)
        assert host.tolist() == [0.0, 0.0], "a host tensor no longer passes through"
    return stopped


@pytest.mark.parametrize("world_size", [2])
def test_the_guard_stops_what_gloo_cannot_carry_before_gloo_sees_it(world_size):
    stopped = run_on_ranks(_stopped_before_gloo, world_size, device_under_test().type)
    assert stopped == [["send", "recv", "batch_isend_irecv"]] * world_size


def _send_off_host(rank, world):
    _device.install_gloo_cuda_guard()
    dist.send(torch.zeros(1, device="meta"), 1 - rank)


def test_a_rank_stopped_by_the_guard_fails_its_test_with_the_collective_named():
    with pytest.raises(RankFailure, match="GlooDeviceUnsupported: torch.distributed.send got a meta tensor on gloo"):
        run_on_ranks(_send_off_host, 2)
