"""Loops DDP runs that ShardedDataParallel must match (found reviewing how gradients held after a
reduce are zeroed, probed and added to): each compares with DDP + the plain optimizer. More such
loops, which add to the held gradients, are in test_sharded_ddp_added_after_reduce.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel
from tests._harness import run_on_ranks


class _Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, what: str, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if what == "critic":  # D's loss on real x and detached fake y: G's parameters unused
            return self.D(y).mean() - self.D(x).mean()
        return -self.D(self.G(x)).mean()  # G's loss reaches D's parameters too


def _gan_with_optimizers(sharded: bool) -> tuple[_Gan, torch.optim.Optimizer, torch.optim.Optimizer, nn.Module]:
    """A GAN, its generator's and critic's SGD (OSS when ``sharded``), and its wrapper."""
    model = _Gan()
    if sharded:
        opt_g = OSS(model.G.parameters(), torch.optim.SGD, lr=0.1)
        opt_d = OSS(model.D.parameters(), torch.optim.SGD, lr=0.1)
        return model, opt_g, opt_d, ShardedDataParallel(model, [opt_g, opt_d])
    opt_g = torch.optim.SGD(model.G.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(model.D.parameters(), lr=0.1)
    return model, opt_g, opt_d, DDP(model, find_unused_parameters=True)


def _same(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), f"{what}: {name} differs from DDP"


def _check_wgan_with_several_critic_steps(rank: int, world: int) -> None:
    """WGAN's loop: the critic steps n_critic times per generator step, each optimizer zeroed
    just before its own backward. The critic's backward never touches G's gradients, which
    stay held from G's last step until G's next zero_grad: DDP is fine, so must we be."""
    models = []
    for sharded in (False, True):
        model, opt_g, opt_d, wrapped = _gan_with_optimizers(sharded)
        for i in range(5):
            g = torch.Generator().manual_seed(100 * i + rank)
            real, z = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
            opt_d.zero_grad()
            wrapped("critic", real, model.G(z).detach()).backward()
            opt_d.step()
            if i % 3 == 0:
                opt_g.zero_grad()
                wrapped("generator", z).backward()
                opt_g.step()
        models.append(model)
    _same(models[1], models[0], "WGAN, 3 critic steps per generator step")


def _check_zeroing_through_data(rank: int, world: int) -> None:
    """Old-style zeroing, ``p.grad.data.zero_()``, changes no version counter: still a zeroing."""
    models = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        if sharded:
            opt = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
            wrapped = ShardedDataParallel(model, opt)
        else:
            opt, wrapped = torch.optim.SGD(model.parameters(), lr=0.1), DDP(model)
        for i in range(3):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.zero_()
            wrapped(torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * i + rank))).pow(2).mean().backward()
            opt.step()
        models.append(model)
    _same(models[1], models[0], "zeroing by p.grad.data.zero_()")


@pytest.mark.parametrize("world_size", [2, 3])
def test_zeroing_through_data_matches_ddp(world_size):
    run_on_ranks(_check_zeroing_through_data, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_wgan_with_several_critic_steps_per_generator_step_matches_ddp(world_size):
    run_on_ranks(_check_wgan_with_several_critic_steps, world_size)


def _check_wgan_with_probe_between_step_and_zero_grad(rank: int, world: int, probe: str, zero: str) -> None:
    """The WGAN loop with the critic probed after its step, before its next zero_grad(): by
    ``torch.autograd.grad`` (a gradient-norm log; ``.grad`` untouched: the average the pre-hook
    set aside must come back) or a ``no_sync`` backward whose sum the zero_grad() discards (the
    average set aside under it must not come back onto the next critic's fresh reduce)."""
    models = []
    for sharded in (False, True):
        model, opt_g, opt_d, wrapped = _gan_with_optimizers(sharded)
        for i in range(4):
            g = torch.Generator().manual_seed(100 * i + rank)
            real, z = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
            opt_d.zero_grad() if zero == "optimizer" else model.D.zero_grad()  # the latter: no hook
            wrapped("critic", real, model.G(z).detach()).backward()
            opt_d.step()
            if probe == "autograd.grad":
                torch.autograd.grad(model("critic", real, model.G(z).detach()), list(model.D.parameters()))
            else:
                with wrapped.no_sync():
                    wrapped("critic", real, model.G(z).detach()).backward()
            if i % 2 == 0:
                opt_g.zero_grad()
                wrapped("generator", z).backward()
                opt_g.step()
        models.append(model)
    _same(models[1], models[0], f"WGAN, critic probed by {probe} between its step and {zero}.zero_grad()")


@pytest.mark.parametrize("world_size", [2, 3])
def test_wgan_with_critic_probed_before_its_zero_grad_matches_ddp(world_size):
    for zero in ("optimizer", "module"):
        for probe in ("no_sync backward", "autograd.grad"):
            run_on_ranks(_check_wgan_with_probe_between_step_and_zero_grad, world_size, probe, zero)


def _check_untold_in_place_zeroing(rank: int, world: int) -> None:
    """Zeroing that the wrapper is not told of, in place (the inner module's
    ``zero_grad(set_to_none=False)``, ``p.grad.data.zero_()``), then ``no_sync`` micro-steps and a
    synced one: what is set aside are zeros, and adding them back changes nothing."""
    models = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        if sharded:
            opt = OSS(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
            wrapped = ShardedDataParallel(model, opt)
        else:
            opt, wrapped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), DDP(model)
        for i in range(4):
            if i % 2:
                model.zero_grad(set_to_none=False)
            else:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.data.zero_()
            for micro in range(3):
                g = torch.Generator().manual_seed(10 * i + micro + 100 * rank)
                with wrapped.no_sync() if micro < 2 else contextlib.nullcontext():
                    wrapped(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
            opt.step()
        models.append(model)
    _same(models[1], models[0], "zeroing in place, untold, then no_sync accumulation")


@pytest.mark.parametrize("world_size", [2, 3])
def test_untold_in_place_zeroing_then_no_sync_accumulation_matches_ddp(world_size):
    run_on_ranks(_check_untold_in_place_zeroing, world_size)
