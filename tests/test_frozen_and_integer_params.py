"""Parameters that do not train, under OSS + DDP (ZeRO-1) and OSS + ShardedDataParallel (ZeRO-2),
against DDP + the plain optimizer.

A torch optimizer steps a parameter iff it has a gradient, whatever its ``requires_grad``: a
frozen parameter whose gradient ``zero_grad(set_to_none=False)`` left as zeros keeps moving under
AdamW (its moments decay, weight decay applies). Integer parameters (tables, counters) are held
and never stepped. Both must behave exactly so here, with replicas identical.

Compared bit for bit: at world 3 every rank trains on rank 0's batches, whose gradients, each
divided by 3 first as DDP and ZeRO-2 both do, add alike in any order (tests/_exact_sums.py says
why a bound on AdamW would not do).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel
from tests._exact_sums import batch_rank
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

WORLD_SIZES = [1, 2, 3]
ADAMW = dict(lr=1e-2, weight_decay=0.1)
STEPS_PER_PHASE = 3


def _assert_same(ours, ref, what):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{what}: {name} differs from DDP's by {(a.double() - b.double()).abs().max():.3g}"


def _train(model, optimizer, rank, first, steps):
    for step in range(first, first + steps):
        optimizer.zero_grad(set_to_none=False)
        gpt_loss(model, token_batch(rank, step)).backward()
        optimizer.step()


def _check_frozen_params_with_zero_grads_are_stepped(rank, world):
    for stage in ("zero1", "zero2"):
        ref_model, our_model = gpt(), gpt()
        ref_opt = torch.optim.AdamW(ref_model.parameters(), **ADAMW)
        our_opt = OSS(our_model.parameters(), torch.optim.AdamW, **ADAMW)
        ours = ShardedDataParallel(our_model, our_opt) if stage == "zero2" else None
        step = 0
        for phase, trainable in enumerate((True, False, True, False)):
            for model in (ref_model, our_model):
                model.blocks[0].requires_grad_(trainable)
            before = [p.detach().clone() for p in our_model.blocks[0].parameters()]
            ref = DDP(ref_model)  # DDP must be rebuilt when trainability changes
            _train(ref, ref_opt, batch_rank(rank, world), step, STEPS_PER_PHASE)
            _train(ours or DDP(our_model), our_opt, batch_rank(rank, world), step, STEPS_PER_PHASE)
            step += STEPS_PER_PHASE
            what = f"{stage}, phase {phase} ({'trainable' if trainable else 'frozen, zero gradients'})"
            assert_same_on_all_ranks(list(our_model.parameters()), what)
            _assert_same(our_model, ref_model, what)
            moved = any(not torch.equal(b, p) for b, p in zip(before, our_model.blocks[0].parameters()))
            assert moved, f"{what}: the frozen block was not stepped, as torch would have done"
            loads = our_opt.partition.trainable_bytes_per_rank()
            largest = max(p.numel() * p.element_size() for p in our_model.parameters() if p.requires_grad)
            assert max(loads) - min(loads) <= largest, f"{what}: unbalanced partition {loads}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_frozen_parameters_holding_a_gradient_are_stepped_as_torch_does(world_size):
    run_on_ranks(_check_frozen_params_with_zero_grads_are_stepped, world_size, timeout=150)


class _TableGPT(nn.Module):
    """A GPT whose tokens go through an integer lookup table, with an integer step counter."""

    def __init__(self, table_seed: int = 0) -> None:
        super().__init__()
        self.net = gpt()
        g = torch.Generator().manual_seed(table_seed)
        self.table = nn.Parameter(torch.randperm(64, generator=g), requires_grad=False)
        self.calls = nn.Parameter(torch.zeros((), dtype=torch.int64), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(self.table[tokens])


def _check_integer_parameters(rank, world):
    rank0_table = _TableGPT().table.detach().clone()
    for stage in ("zero1", "zero2"):
        ref_model, our_model = _TableGPT(), _TableGPT(table_seed=rank)  # ranks disagree on the table
        ref_opt = torch.optim.AdamW(ref_model.parameters(), **ADAMW)
        our_opt = OSS(our_model.parameters(), torch.optim.AdamW, **ADAMW)  # torch accepts them: so must we
        ours = ShardedDataParallel(our_model, our_opt) if stage == "zero2" else DDP(our_model)
        # both wrappers take rank 0's values at construction, integer parameters included
        assert torch.equal(our_model.table, rank0_table), f"{stage}: the table was not synced from rank 0"
        _train(DDP(ref_model), ref_opt, batch_rank(rank, world), 0, 4)
        _train(ours, our_opt, batch_rank(rank, world), 0, 4)
        _assert_same(our_model, ref_model, stage)
        assert torch.equal(our_model.table, rank0_table) and int(our_model.calls) == 0, f"{stage}: an integer parameter changed"
        assert our_model.table.dtype == torch.int64
        assert_same_on_all_ranks(list(our_model.parameters()), f"{stage} replicas")
        assert all(s == {} or "exp_avg" in s for s in our_opt.optim.state.values())
        assert our_model.table not in our_opt.optim.state, "an integer parameter got optimizer state"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_integer_parameters_are_carried_and_never_stepped(world_size):
    run_on_ranks(_check_integer_parameters, world_size)
