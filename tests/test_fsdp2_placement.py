"""``fully_shard(shard_placement_fn=...)``: parameters cut on another dim than 0 (``Shard(1)``),
per parameter, against torch 2.13's own ``fully_shard`` on the same model, data and function."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from torch.nn import functional as F

from tests._exact_sums import batch_rank
from tests._harness import run_on_ranks
from tests._models import gpt, token_batch


def _dim1_where_even(world):
    """``Shard(1)`` for the matrices whose dim 1 divides evenly, ``Shard(-1)`` for the others of
    them too when they do, ``None`` (dim 0) for everything else: a per-parameter mix."""

    def placement(param):
        if param.dim() == 2 and param.shape[1] % world == 0:
            return Shard(1) if param.shape[0] >= param.shape[1] else Shard(-1)
        return None if param.dim() != 2 else Shard(0)

    return placement


VOCAB = 48  # with a width of 24: every matrix divides evenly over 1, 2 and 3 ranks on dim 1


def _train(model, data_rank, steps=2):
    """AdamW on ``data_rank``'s batches, clipping on; the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        batch = token_batch(data_rank, step, vocab=VOCAB, seq=8)
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _assert_same(losses, reference, ours, theirs, what):
    """Losses and parameters bit for bit."""
    assert torch.equal(losses, reference), f"{what}: losses {losses} != torch's {reference}"
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), f"{what}: parameters differ from torch's by {(a - b).abs().max():.3g}"


def _sharded_gpt(shard, placement, **kwargs):
    model = gpt(vocab=VOCAB, dim=24, seq=8)
    for block in model.blocks:
        shard(block, shard_placement_fn=placement, **kwargs)
    shard(model, shard_placement_fn=placement, **kwargs)
    return model


def _locals(model):
    return [p.to_local().clone() for p in model.parameters()]


def _placement_cases(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard

    placement = _dim1_where_even(world)
    data_rank = batch_rank(rank, world)  # at world 3 rank 0's batches: exact sums, tests/_exact_sums.py
    for kwargs in ({}, {"reshard_after_forward": False}, {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}):
        theirs, ours = (_sharded_gpt(shard, placement, **kwargs) for shard in (torch_fully_shard, fully_shard))
        assert [p.placements for p in ours.parameters()] == [p.placements for p in theirs.parameters()]
        if world > 1:
            assert any(p.placements[-1] == Shard(1) for p in ours.parameters())
        for a, b in zip(_locals(ours), _locals(theirs)):
            assert torch.equal(a, b), "the sharded parameters' local tensors differ from torch's"
        reference, losses = _train(theirs, data_rank), _train(ours, data_rank)
        _assert_same(losses, reference, _locals(ours), _locals(theirs), f"{kwargs}")
        assert all(p.grad is None for p in ours.parameters())

    # state_dict: DTensors with torch's placements; a round trip through full tensors
    ours = _sharded_gpt(fully_shard, placement)
    state = ours.state_dict()
    assert all(isinstance(v, DTensor) for v in state.values())
    full = {k: v.full_tensor() for k, v in state.items()}
    for k, v in gpt(vocab=VOCAB, dim=24, seq=8).state_dict().items():
        assert torch.equal(full[k], v), k
    fresh = _sharded_gpt(fully_shard, placement)
    with torch.no_grad():
        for p in fresh.parameters():
            p.to_local().zero_()
    fresh.load_state_dict(state)
    for a, b in zip(_locals(fresh), _locals(ours)):
        assert torch.equal(a, b)
    if world == 2:
        _bad_placements(rank)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_placement_fn_matches_torch_fully_shard(world_size):
    """(At world 2, also the errors for placements sharded does not take.)"""
    run_on_ranks(_placement_cases, world_size)


def _bad_placements(rank):
    from torch.distributed.tensor import Replicate
    from torch import nn

    from sharded import fully_shard

    with pytest.raises(NotImplementedError, match=f"rank {rank}.*Replicate.*weight"):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate())
    with pytest.raises(ValueError, match=f"rank {rank}.*weight.*no dim 2"):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2) if p.dim() == 2 else None)
    with pytest.raises(NotImplementedError, match=f"rank {rank}.*weight.*dim 1 does not divide evenly"):
        fully_shard(nn.Linear(5, 4), shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)


def hybrid_cases(rank, mesh):
    """On a 2-D ``(replicate, shard)`` mesh (run inside test_fsdp2_api's world-4 launch):
    ``Shard(1)`` parameters and the all-gather extension, bit for bit like torch."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard
    from tests.test_fsdp2_gather_extension import Bf16Gathered, Stack
    from tests.test_fsdp2_gather_extension import _shard as shard_stack
    from tests.test_fsdp2_gather_extension import _train as train_stack

    placement = _dim1_where_even(mesh.size(1))
    theirs, ours = (_sharded_gpt(shard, placement, mesh=mesh) for shard in (torch_fully_shard, fully_shard))
    assert [p.placements for p in ours.parameters()] == [p.placements for p in theirs.parameters()]
    reference, losses = _train(theirs, rank), _train(ours, rank)
    _assert_same(losses, reference, _locals(ours), _locals(theirs), "HSDP, Shard(1)")
    (losses, params), (reference, ref_params) = (
        train_stack(shard_stack(Stack(Bf16Gathered, True), shard, mesh=mesh), rank) for shard in (fully_shard, torch_fully_shard)
    )
    _assert_same(losses, reference, params, ref_params, "HSDP, the all-gather extension")
