"""``fully_shard(lowbit=...)``: the plumbing (one wire per policy and group, shared by a model's
units, closed once per step; ``lowbit_traffic``) and what is refused, naming the module or the
parameter and the rank."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from examples.gpt import Block
from sharded import LowBit
from tests import _fsdp_reference  # noqa: F401  (preloads layer 3 in the harness's forkserver)
from tests._device import device_type_under_test
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch


def _shard_gpt(lowbit, root_lowbit="same", **kwargs):
    from sharded import fully_shard

    model = gpt()
    for block in model.blocks:
        fully_shard(block, lowbit=lowbit, **kwargs)
    return fully_shard(model, lowbit=lowbit if root_lowbit == "same" else root_lowbit, **kwargs)


def _plumbing_cases(rank, world):
    from sharded.fsdp._unit import units_under

    policy = LowBit(params="int8", block_size=64, min_numel=0)
    model = _shard_gpt(policy)
    units = units_under(model)
    assert all(u.settings.lowbit is policy for u in units)
    assert model.lowbit_traffic is None, "no step has ended yet"
    gpt_loss(model, token_batch(rank, 0)).backward()
    assert len({id(u.lowbit_wire) for u in units}) == 1, "the root's wire is every unit's"
    wire = units[0].lowbit_wire
    assert wire.traffic.step == 1 and model.lowbit_traffic is wire.traffic.last is not None

    # accumulation: the step ends with the backward that sends the gradients, not before
    with model.no_sync():
        gpt_loss(model, token_batch(rank, 1)).backward()
    assert wire.traffic.step == 1
    gpt_loss(model, token_batch(rank, 2)).backward()
    assert wire.traffic.step == 2

    # a unit with another policy keeps its own wire; the root's property sums both
    other = LowBit(params="int8", block_size=128, min_numel=0)
    mixed = _shard_gpt(other, root_lowbit=policy)
    gpt_loss(mixed, token_batch(rank, 0)).backward()
    wires = {id(u.lowbit_wire): u.lowbit_wire for u in units_under(mixed)}
    assert len(wires) == 2
    total = mixed.lowbit_traffic
    assert total.sent_bytes == sum(w.traffic.last.sent_bytes for w in wires.values())
    assert mixed.blocks[0].lowbit_traffic is units_under(mixed.blocks[0])[0].lowbit_wire.traffic.last

    # off: no wire, no traffic
    plain = _shard_gpt(None)
    gpt_loss(plain, token_batch(rank, 0)).backward()
    assert plain.lowbit_traffic is None and all(u.lowbit_wire is None for u in units_under(plain))

    # the FSDP1 wrapper passes it to every unit
    from sharded.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(gpt(), auto_wrap_policy={Block}, lowbit=policy)
    assert all(u.settings.lowbit is policy for u in units_under(wrapped.module)) and len(units_under(wrapped.module)) == 3
    gpt_loss(wrapped, token_batch(rank, 0)).backward()
    assert wrapped.lowbit_traffic is not None


def _refusal_cases(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from sharded import fully_shard
    from sharded.fsdp import CPUOffloadPolicy, Owned
    from sharded.invariant import MicroBatches

    policy = LowBit.mode("int8")
    with pytest.raises(TypeError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit must be a sharded.LowBit"):
        fully_shard(nn.Linear(4, 4), lowbit="int8")
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* CPU offloading"):
        fully_shard(nn.Linear(4, 4), lowbit=policy, offload_policy=CPUOffloadPolicy())
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* parameter weight: it is placed Owned"):
        fully_shard(nn.Linear(4, 4), lowbit=policy, shard_placement_fn=lambda p: Owned() if p.ndim == 2 else None)
    mesh = init_device_mesh(device_type_under_test(), (1, world), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* 2-D mesh"):
        fully_shard(nn.Linear(4, 4), lowbit=policy, mesh=mesh)
    layer = nn.Linear(4, 4)
    layer.weight.fsdp_pre_all_gather = layer.weight.fsdp_post_all_gather = lambda *args, **kwargs: None
    with pytest.raises(ValueError, match=f"rank {rank}: fully_shard\\(Linear\\): lowbit=.* parameter weight: .*all-gather extension"):
        fully_shard(layer, lowbit=policy)

    # a custom all-gather would replace the low-bit one; with grads only it is the plain gather
    module = fully_shard(nn.Linear(4, 4), lowbit=policy)
    with pytest.raises(ValueError, match=f"rank {rank}: set_custom_all_gather on fully_shard\\(Linear\\)"):
        module.set_custom_all_gather(object())
    fully_shard(nn.Linear(4, 4), lowbit=LowBit.mode("int8-grads")).set_custom_all_gather(None)

    # the invariant promise is bits
    if world & (world - 1) == 0:
        with pytest.raises(NotImplementedError, match=f"rank {rank}: MicroBatches: fully_shard\\(GPT\\): lowbit=.*bits"):
            MicroBatches(_shard_gpt(policy), 2)
    dist.barrier()


def test_secondary_shard_is_refused_for_low_bit_gathers():
    """``reshard_after_forward=k`` needs world 4 for a real group; the refusal is decided here."""
    from sharded.fsdp._lowbit import check_scope

    info = types.SimpleNamespace(mesh=types.SimpleNamespace(ndim=1), spmd=None)
    with pytest.raises(ValueError, match="rank 0: fully_shard\\(Block\\): .*reshard_after_forward=k"):
        check_scope(LowBit.mode("int8"), "fully_shard(Block)", info, [], offloads=False, secondary_shard=True)
    assert check_scope(LowBit.mode("int8-grads"), "fully_shard(Block)", info, [], offloads=False, secondary_shard=True) is not None


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_low_bit_plumbing_shares_one_wire_and_ends_one_step_per_sync(world_size):
    run_on_ranks(_plumbing_cases, world_size)
    run_on_ranks(_refusal_cases, world_size)
