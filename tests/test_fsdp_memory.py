"""What each rank holds with fully_shard, in bytes: at rest about 1/N of parameters, gradients
and optimizer state; between forward and backward and during backward only the units that the
prefetch allows."""

from __future__ import annotations

import pytest
import torch

from examples.gpt import GPT
from sharded.fsdp._unit import ShardState, units_under
from tests._fsdp_reference import local_bytes, shard_gpt
from tests._harness import run_on_ranks
from tests._models import gpt_loss, token_batch


def _watch_gathered(units):
    """Record, after every unit's all-gather completes, how many units hold gathered memory and
    how many bytes of gathered parameters exist."""
    seen = []
    for unit in units:
        finish = unit.wait_for_unshard

        def recorded(finish=finish):
            finish()
            held = sum(u.shard_state is not ShardState.SHARDED for u in units)
            seen.append((held, sum(u.storage.unsharded_bytes() for u in units)))

        unit.wait_for_unshard = recorded
    return seen


def _check_memory(rank, world):
    torch.manual_seed(0)
    model = shard_gpt(GPT(vocab=128, dim=64, layers=4, heads=4, seq=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = units_under(model)
    root = units[0]
    during = _watch_gathered(units)
    for step in range(2):
        optimizer.zero_grad()
        loss = gpt_loss(model, token_batch(rank, step, vocab=128))
        gathered = [u for u in units if u.shard_state is not ShardState.SHARDED]
        assert gathered == [root], f"between forward and backward {len(gathered)} units are gathered"
        assert sum(u.storage.unsharded_bytes() for u in units) == root.storage.unsharded_bytes() > 0
        during.clear()
        loss.backward()
        # the unit computing, the one prefetched for it, and the root (needed last)
        assert max(held for held, _ in during) <= 3, f"{max(during)} units were gathered at once during backward"
        block_bytes = max(u.storage.world * u.storage.shard_numel * 4 for u in units[1:])
        largest = max(gathered_bytes for _, gathered_bytes in during)
        assert largest <= root.storage.unsharded_bytes() + 2 * block_bytes, f"{largest} bytes gathered at once"
        optimizer.step()
    assert all(u.shard_state is ShardState.SHARDED for u in units), "a unit stayed gathered at rest"
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    held = local_bytes(params) + local_bytes([p.grad for p in params]) + local_bytes(state)
    full = 16 * sum(p.numel() for p in params)  # fp32 AdamW: parameter, gradient, two moments
    steps = 4 * len(params)  # AdamW's step counters, replicated on every rank
    # padding: every rank's slot of a parameter holds ceil(rows / N) rows, more than numel / N;
    # the first ranks fill those rows with parameter, gradient and moments (16 bytes each), the
    # last ones with padding in the parameter and gradient buffers; gradient buffers also carry
    # one "used" flag per parameter
    padding = sum(16 * (sp.geometry.slot_numel - sp.geometry.numel / world) for u in units for sp in u.params)
    flags = 4 * len(params)
    assert held <= 1.05 * full / world + padding + flags + steps, f"rank {rank} holds {held} bytes, full/N is {full / world:.0f}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_shard_holds_about_one_nth_at_rest_and_few_units_gathered_at_once(world_size):
    run_on_ranks(_check_memory, world_size)
