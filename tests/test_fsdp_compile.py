"""Layer 3 under ``torch.compile``: the recipe FSDP2 users follow, compile each block, then
``fully_shard`` each block and the root, trains as eager does and as torch's ``fully_shard`` does
with the same recipe.

The block is compiled in place (``block.compile()``), so its forward hooks run inside the
compiled call; with torch's FSDP2 Dynamo skips them and each block is one graph. Ours must be
the same: a hook traced by Dynamo would cut the block into many graphs around every collective
and piece of bookkeeping (it did: 19 graphs and graph breaks at each gather and wait). The graph
count is asserted; ``backend="aot_eager"`` keeps eager's arithmetic, so the parameters must equal
DDP's to the tolerances of test_fsdp.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._fsdp_reference import ATOL, RTOL, SGD, assert_matches_ddp, full_tensors, optimizers_for, train_both
from tests._harness import run_on_ranks
from tests._models import gpt

STEPS = 3


def _compiled_and_sharded(shard, in_place: bool):
    """The GPT with each block compiled, then a unit per block and the root as the last unit."""
    model = gpt()
    for i, block in enumerate(model.blocks):
        if in_place:
            block.compile(backend="aot_eager")
        else:  # the older spelling: the compiled wrapper replaces the block
            model.blocks[i] = torch.compile(block, backend="aot_eager")
    for block in model.blocks:
        shard(block)
    return shard(model)


def _check_recipe(rank: int, world: int, in_place: bool) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard

    ref = gpt()
    eager = gpt()
    for block in eager.blocks:
        fully_shard(block)
    fully_shard(eager)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ours = _compiled_and_sharded(fully_shard, in_place)
    models = [DDP(ref), eager, ours]
    train_both(list(zip(models, optimizers_for(SGD, *models))), rank, steps=STEPS)
    graphs = dict(torch._dynamo.utils.counters["stats"]).get("unique_graphs", 0)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert graphs == 1 and breaks == 0, f"rank {rank}: the two blocks compiled to {graphs} graphs, with {breaks} graph breaks"

    torch._dynamo.reset()
    theirs = _compiled_and_sharded(torch_fully_shard, in_place)
    train_both([(theirs, optimizers_for(SGD, theirs)[0])], rank, steps=STEPS)

    what = f"compiled blocks ({'block.compile()' if in_place else 'torch.compile(block)'})"
    assert_matches_ddp(ours, ref, what, steps=STEPS)
    for name, a, b, c in zip(
        [n for n, _ in ours.named_parameters()],
        full_tensors(ours.parameters()),
        full_tensors(eager.parameters()),
        full_tensors(theirs.parameters()),
    ):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}, {name} against eager: {m}")
        torch.testing.assert_close(a, c, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}, {name} against torch's fully_shard: {m}")


# Compiling is slow on this machine: one spelling per world size (world 1 shards nothing).
@pytest.mark.parametrize("world_size, in_place", [(2, True), (3, False)])
def test_compiling_each_block_then_sharding_matches_eager_and_torchs_fully_shard(world_size, in_place):
    run_on_ranks(_check_recipe, world_size, in_place, timeout=240)
