"""Uneven inputs: ranks with different numbers of batches under torch's ``Join``.

Rank r trains on 3 + r batches (r in one case). ``ShardedDataParallel`` + ``OSS`` (under
``model.join()`` or ``Join([model, optimizer])``) must give the parameters and buffers of DDP + the plain optimizer
under DDP's ``join()``, bit for bit; ``OSS`` beside torch's DDP under ``Join([ddp, optimizer])``
must give torch's ``ZeroRedundancyOptimizer``'s numbers in the same run (not DDP's: see
docs/guides/features.md, "Uneven inputs"). At world 3 every rank
trains on rank 0's batches (the first 3 + r of them), so that the sums are exact in any order
(tests/_exact_sums.py); the joined ranks' zeros keep them exact (``a + a + 0``).
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel
from tests._device import on_test_device
from tests._exact_sums import batch_rank
from tests._harness import run_on_ranks
from tests._models import mlp, mlp_batch, mlp_loss

SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01})
ADAMW = (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})


def _batches(rank: int, world: int, per_step: int = 1, first_steps: int = 3) -> list:
    """Batches for ``first_steps + rank`` steps of ``per_step`` each; at world 3 rank 0's
    sequence (see the module docstring)."""
    return [mlp_batch(batch_rank(rank, world), i) for i in range((first_steps + rank) * per_step)]


def _bn_mlp() -> nn.Module:
    """An MLP with a BatchNorm, whose running statistics the forward broadcasts."""
    torch.manual_seed(1)
    return on_test_device(nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)))


def _train(
    model: nn.Module, optimizers: list, batches: list, accumulate: int = 1, zero_first: bool = False, clip=None
) -> None:
    """One step per ``accumulate`` batches, the first ``accumulate - 1`` of each inside no_sync;
    gradients zeroed after each step, or before each step's first backward (``zero_first``:
    a rank then runs out of data holding its last gradients)."""
    for i, batch in enumerate(batches):
        last_of_step = (i + 1) % accumulate == 0
        if zero_first and i % accumulate == 0:
            for optimizer in optimizers:
                optimizer.zero_grad()
        if last_of_step:
            mlp_loss(model, batch).backward()
        else:
            with model.no_sync():
                mlp_loss(model, batch).backward()
        if last_of_step:
            if clip is not None:
                clip(model)
            for optimizer in optimizers:
                optimizer.step()
                if not zero_first:
                    optimizer.zero_grad()


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what}: tensor {i} differs by {(g - w).abs().max().item():.3e}"


class Case(NamedTuple):
    """One training run under join, for ShardedDataParallel + OSS and for DDP + the optimizer."""

    name: str
    build: Callable[[], nn.Module]
    optim: tuple
    per_step: int = 1  # batches per step (the first ones inside no_sync)
    divide_by_initial_world_size: bool = True
    zero_first: bool = False
    first_steps: int = 3  # rank r trains first_steps + r steps
    static_graph: bool = False
    clip: Optional[float] = None  # clip_grad_norm_'s max_norm before each step


CASES = [
    Case("Join([model, oss])", _bn_mlp, SGD),
    Case("Join([model])", _bn_mlp, SGD),
    Case("model.join(), zero_grad() first", _bn_mlp, ADAMW, zero_first=True),
    Case("model.join(divide_by_initial_world_size=False)", mlp, SGD, divide_by_initial_world_size=False),
    Case("model.join() with no_sync, zero_grad() first", mlp, ADAMW, per_step=2, zero_first=True),
    Case("model.join(), static_graph=True, rank 0 without batches", mlp, ADAMW, first_steps=0, static_graph=True),
    Case("model.join(), clip_grad_norm_ each step", mlp, SGD, clip=0.05),
]


def _ddp_clip(case: Case):
    return None if case.clip is None else lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)


def _sharded_clip(case: Case):
    return None if case.clip is None else lambda model: model.clip_grad_norm_(case.clip)


def _ddp_join_reference(case: Case, batches: list) -> list[torch.Tensor]:
    model = DDP(case.build())
    optimizer = case.optim[0](model.parameters(), **case.optim[1])
    with model.join(divide_by_initial_world_size=case.divide_by_initial_world_size):
        _train(model, [optimizer], batches, case.per_step, case.zero_first, _ddp_clip(case))
    return _state(model.module)


def _check_sharded_ddp_matches_ddp_join(rank, world):
    for case in CASES:
        batches = _batches(rank, world, case.per_step, case.first_steps)
        want = _ddp_join_reference(case, batches)
        model = case.build()
        optimizer = OSS(model.parameters(), case.optim[0], **case.optim[1])
        sdp = ShardedDataParallel(model, optimizer, static_graph=case.static_graph)
        if case.name.startswith("Join"):
            context = Join([sdp, optimizer] if "oss" in case.name else [sdp])
        else:
            context = sdp.join(case.divide_by_initial_world_size)
        with context:
            _train(sdp, [optimizer], batches, case.per_step, case.zero_first, _sharded_clip(case))
        what = f"{case.name}, {case.optim[0].__name__}, rank {rank}"
        if case.clip is None:
            _assert_equal(_state(model), want, what)
        else:  # the norm adds per-owner sums, another association than torch's: ulps of the factor
            for got, expected in zip(_state(model), want):
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7, msg=what)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sharded_ddp_and_oss_under_join_give_ddp_join_numbers(world_size):
    run_on_ranks(_check_sharded_ddp_matches_ddp_join, world_size, timeout=180)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _check_oss_beside_ddp_matches_torch_zero(rank, world):
    batches = _batches(rank, world)
    records = _Records()
    logging.getLogger("sharded._owners.join_hooks").addHandler(records)
    for optim in (SGD, ADAMW):
        results = []
        for optimizer_class in (ZeroRedundancyOptimizer, OSS):
            model = DDP(mlp())
            if optimizer_class is OSS:
                optimizer = OSS(model.parameters(), optim[0], **optim[1])
                owners = [optimizer.param_to_rank[p] for p in model.parameters()]
            else:
                optimizer = ZeroRedundancyOptimizer(model.parameters(), optim[0], **optim[1])
                torch_owners = [optimizer._param_to_rank[p] for p in model.parameters()]
            with Join([model, optimizer]):
                _train(model, [optimizer], batches)
            results.append(_state(model.module))
        assert owners == torch_owners, "the comparison needs torch's partition"  # else other parameters step
        _assert_equal(results[1], results[0], f"OSS against ZeroRedundancyOptimizer, {optim[0].__name__}")
    joined_early = world > 1 and rank < world - 1
    assert len(records.messages) == (2 if joined_early else 0), records.messages
    assert all(f"rank {rank}: out of data under Join" in m for m in records.messages)


@pytest.mark.parametrize("world_size", [2, 3])
def test_oss_beside_ddp_under_join_gives_torch_zero_redundancy_optimizer_numbers(world_size):
    run_on_ranks(_check_oss_beside_ddp_matches_torch_zero, world_size, timeout=180)


def _check_misuse_raises(rank, world):
    model = mlp()
    optimizer = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, optimizer)
    with pytest.raises(ValueError, match=rf"rank {rank}: ShardedDataParallel must be the first joinable"):
        with Join([optimizer, sdp]):
            _train(sdp, [optimizer], _batches(rank, world))
    # throw_on_early_termination: torch's Join raises on every rank once one runs out of data
    expected = rf"Rank {rank} exhausted all inputs" if rank == 0 else "Detected at least one rank that exhausted inputs"
    with pytest.raises(RuntimeError, match=expected):
        with sdp.join(throw_on_early_termination=True):
            _train(sdp, [optimizer], _batches(rank, world))


def test_wrong_join_order_and_early_termination_raise_on_every_rank():
    run_on_ranks(_check_misuse_raises, 2)
