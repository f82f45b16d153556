"""Parameters replaced after ``fully_shard``, against torch's own ``fully_shard``.

``load_state_dict(..., assign=True)`` (Accelerate's ``cpu_ram_efficient_loading``, DCP's
``set_model_state_dict`` on a meta-device model) and plain attribute assignment put new
parameter objects on the module. Torch's FSDP2 adopts them: the forward computes with them and
their ``.grad`` gets the gradient, so the optimizer built after the load trains them. Ours kept
computing with its own objects (silently, off the meta device). Checked: the same losses and
parameters as torch's, bit for bit (at world 3 every rank on rank 0's batches, whose sums are
the same in any order: tests/_exact_sums.py); with and without the meta device; through DCP;
an assignment after training started (torch adopts only what a load assigns then: compared with
torch loading the same tensor). Beyond torch, which trains nothing silently there: an optimizer
built before the load raises at its step, naming the parameter (and so does a checkpoint of it); a replacement that is not a
shard laid out as the one it replaces raises at the next forward, naming it.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tests._fsdp_reference import SGD, assert_same_as_torch, optimizers_for, shard_gpt, train_recording
from tests._exact_sums import batch_rank
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch



def _sharded_gpt(shard, meta: bool) -> nn.Module:
    if meta:
        with torch.device("meta"):
            model = gpt(seed=1)
    else:
        model = gpt(seed=1)
    return shard_gpt(model, shard)


def _as_shards(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, DTensor]:
    """``full`` cut as ``model``'s sharded parameters are (what Accelerate's loader builds)."""
    held = model.state_dict()
    return {k: distribute_tensor(v, held[k].device_mesh, held[k].placements) for k, v in full.items()}


def _load_assigned(shard, meta: bool, loaded: dict[str, torch.Tensor]):
    """Shard, load ``loaded`` with assign=True; the model and the objects it now holds."""
    model = _sharded_gpt(shard, meta)
    model.load_state_dict(_as_shards(model, loaded), assign=True)
    return model, dict(model.named_parameters())


def _assign_cases(rank, world):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import checkpoint, fully_shard

    data_rank = batch_rank(rank, world)  # at world 3 rank 0's batches: exact sums, tests/_exact_sums.py
    loaded = gpt(seed=0).state_dict()
    for meta in (False, True):
        what = f"load_state_dict(assign=True){' on the meta device' if meta else ''}, optimizer after"
        theirs = train_recording(_load_assigned(torch_fully_shard, meta, loaded)[0], data_rank)
        model, assigned = _load_assigned(fully_shard, meta, loaded)
        ours = train_recording(model, data_rank)
        assert_same_as_torch(ours, theirs, what, exact=True)
        held = dict(model.named_parameters())
        assert all(held[n] is p and p.grad is not None for n, p in assigned.items()), f"{what}: not adopted"

        # an optimizer built before the load holds parameters the model no longer computes with
        model = _sharded_gpt(fully_shard, meta)
        early = torch.optim.SGD(model.parameters(), lr=0.1)
        model.load_state_dict(_as_shards(model, loaded), assign=True)
        gpt_loss(model, token_batch(rank, 0)).backward()
        with pytest.raises(RuntimeError, match=f"rank {rank}.*SGD holds parameter tok.weight.*assign=True"):
            early.step()
        with pytest.raises(ValueError, match=f"rank {rank}: param group 0, parameter 0 .*assign=True"):
            checkpoint.get_state_dict(model, early)  # a checkpoint of it says so too, not KeyError

    # torch's documented way to load a meta-device model: DCP assigns what it loads
    options = StateDictOptions(full_state_dict=True)
    runs = []
    for shard in (torch_fully_shard, fully_shard):
        model = _sharded_gpt(shard, meta=True)
        set_model_state_dict(model, dict(loaded), options=options)  # it replaces the values it loads
        runs.append(train_recording(model, data_rank))
    assert_same_as_torch(runs[1], runs[0], "DCP set_model_state_dict(full_state_dict=True) on the meta device", exact=True)

    # a parameter replaced after training started: by assignment (ours) and by a load (torch,
    # which adopts only what a load assigns once it has run)
    runs = []
    for shard in (torch_fully_shard, fully_shard):
        model = _sharded_gpt(shard, meta=False)
        optimizer = optimizers_for(SGD, model)[0]
        train_recording(model, data_rank, optimizer)
        fresh = {"blocks.1.qkv.weight": loaded["blocks.1.qkv.weight"]}
        replacement = nn.Parameter(_as_shards(model, fresh)["blocks.1.qkv.weight"])
        if shard is fully_shard:
            model.blocks[1].qkv.weight = replacement
        else:
            model.load_state_dict({"blocks.1.qkv.weight": replacement}, strict=False, assign=True)
        optimizer = optimizers_for(SGD, model)[0]
        runs.append(train_recording(model, data_rank, optimizer, first=3))
        assert model.blocks[1].qkv.weight is replacement and replacement.grad is not None
    assert_same_as_torch(runs[1], runs[0], "a parameter assigned after training started", exact=True)

    _check_refused_replacements(rank)


def _check_refused_replacements(rank):
    """What cannot be a shard of the parameter raises at the next forward, naming it; the FSDP1
    wrapper, which copies full state dicts into its shards, refuses to assign."""
    from sharded import FullyShardedDataParallel, fully_shard

    full = torch.ones(4, 8)
    for replacement, error, words in (
        (nn.Parameter(full), TypeError, "not a DTensor shard"),
        (None, ValueError, "was removed"),
    ):
        model = fully_shard(nn.Sequential(nn.Linear(8, 4)))
        if replacement is None:
            model[0]._parameters["weight"] = None
        else:
            model[0].weight = replacement
        with pytest.raises(error, match=f"rank {rank}.*parameter 0.weight .*{words}"):
            model(torch.ones(1, 8))
    wrapped = FullyShardedDataParallel(nn.Linear(8, 4))
    with pytest.raises(NotImplementedError, match=f"rank {rank}: FullyShardedDataParallel.load_state_dict.assign=True"):
        wrapped.load_state_dict(wrapped.state_dict(), assign=True)
    model = fully_shard(nn.Sequential(nn.Linear(8, 4)))
    mesh = model[0].weight.device_mesh
    model[0].weight = nn.Parameter(distribute_tensor(full, mesh, [Replicate()]))
    with pytest.raises(ValueError, match=re.escape("0.weight was replaced after fully_shard by a DTensor laid out")):
        model(torch.ones(1, 8))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_parameters_assigned_after_sharding_are_adopted_as_torch_does(world_size):
    run_on_ranks(_assign_cases, world_size, timeout=180)
