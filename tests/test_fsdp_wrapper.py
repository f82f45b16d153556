"""FullyShardedDataParallel (the FSDP1 / fairscale-shaped wrapper) against torch DDP + the plain
optimizer: every sharding strategy, hybrid sharding on 2 "nodes" x 2, FSDP1's options, full
state dicts and summon_full_params. Tolerances as stated in tests/_fsdp_reference.py."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.gpt import GPT, Block
from sharded import FullyShardedDataParallel as FSDP
from sharded.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from sharded.fsdp._unit import units_under
from sharded.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy
from tests._fsdp_reference import ADAMW, SGD, assert_matches_ddp, full_tensors, optimizers_for, train_both
from tests._exact_sums import average_after_the_sum, batch_rank, pairwise_ddp
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

WORLD_SIZES = [1, 2, 3]
POLICIES = [
    dict(auto_wrap_policy={Block}),
    dict(auto_wrap_policy=ModuleWrapPolicy({Block})),
    dict(fsdp_auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})),
]


def _check_strategies(rank, world):
    cases = [(s, o) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") for o in (SGD, ADAMW)]
    data_rank = batch_rank(rank, world)
    for index, (strategy, optim) in enumerate(cases):
        what = f"{strategy}, {optim[0].__name__}"
        ref = average_after_the_sum(DDP(gpt()))  # and rank 0's batches at world 3: tests/_exact_sums.py
        ours = FSDP(gpt(), sharding_strategy=ShardingStrategy[strategy], **POLICIES[index % len(POLICIES)])
        assert len(units_under(ours)) == 3, f"{what}: each block and the root should be a unit"
        ref_opt, our_opt = optimizers_for(optim, ref, ours)
        for step in range(5):
            norms = []
            for model, opt in ((ref, ref_opt), (ours, our_opt)):
                opt.zero_grad()
                with model.no_sync():
                    gpt_loss(model, token_batch(data_rank, 10 * step)).backward()
                gpt_loss(model, token_batch(data_rank, 10 * step + 1)).backward()
                clip = model.clip_grad_norm_ if model is ours else functools.partial(torch.nn.utils.clip_grad_norm_, model.parameters())
                norms.append(clip(0.5))
                opt.step()
            torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=0, msg=f"{what}: global norm")
        # the clip norm's squares are added in another association than torch's: an ulp of the
        # clip factor scales every gradient alike, which flips no sign and AdamW's m / sqrt(v)
        # all but cancels (measured: 2.7e-7 at most); AdamW's bound, not bits
        assert_matches_ddp(ours.module, ref.module, what, optim, exact=False)
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.module.named_parameters()]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_sharding_strategy_with_no_sync_and_clipping_matches_ddp(world_size):
    run_on_ranks(_check_strategies, world_size)


def _check_hybrid(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_group, replicate_group = mesh.get_group("shard"), mesh.get_group("replicate")
    cases = [
        ("HYBRID_SHARD", SGD, dict(device_mesh=mesh)),
        ("HYBRID_SHARD", ADAMW, dict(process_group=(shard_group, replicate_group))),
        ("_HYBRID_SHARD_ZERO2", SGD, dict(device_mesh=mesh, sync_module_states=True)),  # rank 0's weights win
    ]
    for strategy, optim, where in cases:
        what = f"{strategy} {optim[0].__name__} over {', '.join(where)}"
        ref = pairwise_ddp(gpt(), [[0, 1], [2, 3]])  # the mesh's rows are the shard groups
        seed = rank if where.get("sync_module_states") else 0
        ours = FSDP(gpt(seed), sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy={Block}, **where)
        train_both(zip((ref, ours), optimizers_for(optim, ref, ours)), rank)
        assert_matches_ddp(ours.module, ref.module, what, optim)
        for p in ours.parameters():  # the two "nodes" hold identical shards
            local = p.to_local().reshape(-1)
            copies = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(copies, local, group=replicate_group)
            assert torch.equal(copies[0], copies[1]), f"{what}: replicas of a shard differ"


def test_hybrid_shard_on_two_nodes_of_two_matches_ddp():
    run_on_ranks(_check_hybrid, 4)


def _check_state_dict_and_full_params(rank, world):
    ref, ours = DDP(gpt()), FSDP(gpt(), auto_wrap_policy={Block})
    train_both(zip((ref, ours), optimizers_for(SGD, ref, ours)), rank, steps=2)
    state = ours.state_dict()
    assert list(state) == list(ref.module.state_dict()), "keys must be the unwrapped model's"
    for key, value in ref.module.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    fresh = FSDP(gpt(seed=7), auto_wrap_policy={Block})
    fresh.load_state_dict(state)
    assert_matches_ddp(fresh.module, ref.module, "load_state_dict of a full state dict")
    with FSDP.summon_full_params(fresh):
        assert fresh.module.head.weight.shape == (64, 32) and not hasattr(fresh.module.head.weight, "placements")
        with torch.no_grad():
            fresh.module.head.weight.add_(1.0)
    torch.testing.assert_close(fresh.module.head.weight.full_tensor(), ref.module.head.weight + 1.0)
    with FSDP.summon_full_params(fresh, writeback=False, rank0_only=True, offload_to_cpu=True):
        assert hasattr(fresh.module.head.weight, "placements") == (rank != 0), "rank0_only: only rank 0 holds full"
        if rank == 0:
            with torch.no_grad():
                fresh.module.head.weight.zero_()  # not written back
    torch.testing.assert_close(fresh.module.head.weight.full_tensor(), ref.module.head.weight + 1.0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_full_state_dict_and_summon_full_params_use_unwrapped_names(world_size):
    run_on_ranks(_check_state_dict_and_full_params, world_size)


def _nested_net(seed: int) -> nn.Module:
    """fairscale's pattern: wrappers built by hand inside the model, then the whole wrapped."""
    torch.manual_seed(seed)
    inner = nn.Sequential(nn.Linear(5, 7), nn.Sequential(nn.Linear(7, 7), nn.BatchNorm1d(7)))
    return FSDP(nn.Sequential(nn.Linear(4, 5), FSDP(nn.Sequential(inner[0], FSDP(inner[1]))), nn.Linear(7, 3)))


def _check_nested_wrappers_state_dict(rank, world):
    plain = _nested_net(0)
    names = list(plain.state_dict())
    assert "1.1.0.weight" in names and not any(".module." in n or n.startswith("module.") for n in names), names
    torch.manual_seed(1)
    x = torch.randn(6, 4)
    plain(x).sum().backward()  # BatchNorm statistics move
    saved = plain.state_dict()
    assert type(saved) is collections.OrderedDict, "like nn.Module.state_dict"
    fresh = _nested_net(2)
    assert not torch.equal(fresh.state_dict()["1.0.weight"], saved["1.0.weight"])
    fresh.load_state_dict(saved)
    loaded = fresh.state_dict()
    assert list(loaded) == names
    for name in names:
        torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0, msg=name)
    with fresh.summon_full_params(volatile=True):  # fairscale's instance spelling: no writeback
        fresh.module[0].weight.data.fill_(9.0)
    torch.testing.assert_close(fresh.state_dict()["0.weight"], saved["0.weight"], rtol=0, atol=0)
    with fresh.summon_full_params():
        fresh.module[0].weight.data.fill_(9.0)
    assert bool((fresh.state_dict()["0.weight"] == 9.0).all())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hand_nested_wrappers_state_dict_round_trips_and_fairscale_summon(world_size):
    run_on_ranks(_check_nested_wrappers_state_dict, world_size)


def _seeded_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(0.0, 0.02)
        module.bias.data.zero_()


def _check_apply_sees_full_parameters(rank, world):
    reference = _nested_net(0)
    plain = reference.state_dict()
    plain_model = nn.Sequential(nn.Linear(4, 5), nn.Sequential(nn.Linear(5, 7), nn.Sequential(nn.Linear(7, 7), nn.BatchNorm1d(7))), nn.Linear(7, 3))
    plain_model.load_state_dict(plain)
    torch.manual_seed(5)
    plain_model.apply(_seeded_init)
    expected = plain_model.state_dict()
    for what, build in (("root wrapper", lambda m: m), ("plain module around wrappers", lambda m: nn.Sequential(m))):
        model = build(_nested_net(0))
        torch.manual_seed(5)
        assert model.apply(_seeded_init) is model
        got = (model if isinstance(model, FSDP) else model[0]).state_dict()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=f"{what}: {name}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_apply_initialises_full_parameters_like_the_unwrapped_model(world_size):
    run_on_ranks(_check_apply_sees_full_parameters, world_size)


class _Net(nn.Module):
    """A GPT plus a BatchNorm'd side path and an extra head to ignore."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(64, 32, 2, 2, 16)
        self.norm = nn.BatchNorm1d(64)
        self.ignored = nn.Linear(64, 64)

    def forward(self, tokens):
        logits = self.gpt(tokens)
        return logits + self.ignored(self.norm(logits.mean(1))).unsqueeze(1)


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _check_fsdp1_options(rank, world):
    size_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=8_000)
    cases = {
        "cpu_offload": dict(cpu_offload=CPUOffload(offload_params=True), auto_wrap_policy={Block}),
        "BACKWARD_POST, size policy": dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST, auto_wrap_policy=size_policy),
        "no backward prefetch, forward_prefetch": dict(backward_prefetch=None, forward_prefetch=True, auto_wrap_policy={Block}),
        "device_id, limit_all_gathers off": dict(device_id=torch.device("cpu"), limit_all_gathers=False, auto_wrap_policy={Block}),
    }
    for what, options in cases.items():
        ref = average_after_the_sum(DDP(_net(), broadcast_buffers=False))  # AdamW bit for bit: tests/_exact_sums.py
        ours = FSDP(_net(), ignored_modules=[], **options)
        train_both(zip((ref, ours), optimizers_for(ADAMW, ref, ours)), batch_rank(rank, world))
        assert_matches_ddp(ours.module, ref.module, what, ADAMW)
    # mixed precision, as for fully_shard: bf16 rounding moves 5 SGD steps by ~2e-5, bound 2e-4
    ref = DDP(gpt())
    ours = FSDP(gpt(), mixed_precision=MixedPrecision(torch.bfloat16, torch.float32), auto_wrap_policy={Block})
    train_both(zip((ref, ours), optimizers_for(SGD, ref, ours)), rank)
    worst = max((a - b).abs().max().item() for a, b in zip(full_tensors(ours.parameters()), ref.parameters()))
    assert 0 < worst <= 2e-4, f"bf16 mixed precision: max diff to fp32 DDP {worst:.3g}"
    fairscale = FSDP(gpt(), reshard_after_forward=False, mixed_precision=True, compute_dtype=torch.bfloat16,
                     fp32_reduce_scatter=True, move_params_to_cpu=True, fsdp_auto_wrap_policy={Block})
    unit = units_under(fairscale)[0]
    assert not unit.settings.reshard_after_forward and unit.settings.offloads, "fairscale's spellings of SHARD_GRAD_OP, offload"
    assert (unit.settings.mp_policy.param_dtype, unit.reduce_dtype_for(unit.params, [None] * len(unit.params))) == (torch.bfloat16, torch.float32)
    buffers = FSDP(_net(), mixed_precision=MixedPrecision(buffer_dtype=torch.float16)).module.norm.running_mean
    assert buffers.dtype == torch.float16, "buffer_dtype casts buffers"
    # sync_module_states: ranks built different weights, rank 0's win
    ref = DDP(_net(seed=0), broadcast_buffers=False)
    ours = FSDP(_net(seed=rank), sync_module_states=True, auto_wrap_policy={Block})
    train_both(zip((ref, ours), optimizers_for(SGD, ref, ours)), rank)
    assert_matches_ddp(ours.module, ref.module, "sync_module_states")
    # ignored modules keep plain parameters and local gradients (frozen here, to compare with DDP)
    ref, ours = _net(), _net()
    for model in (ref, ours):
        model.ignored.requires_grad_(False)
    ours = FSDP(ours, ignored_modules=[ours.ignored], auto_wrap_policy={Block})
    assert not isinstance(ours.module.ignored.weight, DTensor) and isinstance(ours.module.norm.weight, DTensor)
    ref = DDP(ref, broadcast_buffers=False)
    train_both(zip((ref, ours), optimizers_for(SGD, ref, ours)), rank)
    assert_matches_ddp(ours.module, ref.module, "ignored_modules")
    # a meta-device model, materialised unit by unit by param_init_fn
    with torch.device("meta"):
        meta = _net()
    names = {id(m): n for n, m in meta.named_modules()}
    initial = dict(_net().named_modules())
    initialised = []

    def init(module):
        module.to_empty(device="cpu", recurse=False)
        initialised.append(type(module).__name__)
        with torch.no_grad():
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                tensor.copy_(getattr(initial[names[id(module)]], name))

    ours = FSDP(meta, param_init_fn=init, auto_wrap_policy={Block})
    assert "Block" not in initialised and "Linear" in initialised, "param_init_fn is called per submodule"
    ref = DDP(_net(), broadcast_buffers=False)
    train_both(zip((ref, ours), optimizers_for(SGD, ref, ours)), rank)
    assert_matches_ddp(ours.module, ref.module, "meta init with param_init_fn")
    _check_sync_after_materialising(rank)


def _random_init(module: nn.Module) -> None:
    """A ``param_init_fn`` drawing every tensor of ``module`` (its own, not its children's) from
    the global RNG, buffers too: ranks seeded differently get different values."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.is_floating_point():
                tensor.normal_()
            else:
                tensor.random_(0, 1000)


def _meta_fsdp(seed: int, param_init_fn, sync_module_states: bool) -> FSDP:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = _Net()
    return FSDP(model, param_init_fn=param_init_fn, sync_module_states=sync_module_states, auto_wrap_policy={Block})


def _check_sync_after_materialising(rank):
    """sync_module_states with a meta model (reset_parameters, or a param_init_fn) ends with rank
    0's initial values everywhere. Full parameters are the same on every rank whatever their rows
    hold, so the reference is an unsynchronised run in which every rank draws with rank 0's seed."""
    for what, init in (("meta, reset_parameters", None), ("meta, param_init_fn", _random_init)):
        expected = _meta_fsdp(100, init, sync_module_states=False).state_dict()
        ours = _meta_fsdp(100 + rank, init, sync_module_states=True)
        for key, value in ours.state_dict().items():
            assert torch.equal(value, expected[key]), f"sync_module_states, {what}: {key} is not rank 0's on rank {rank}"
        ref = _Net()
        ref.load_state_dict(expected)
        ref = DDP(ref, broadcast_buffers=False)
        train_both(zip((ref, ours), optimizers_for(SGD, ref, ours)), rank, steps=1)
        assert_matches_ddp(ours.module, ref.module, f"sync_module_states, {what}", steps=1)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp1_options_cpu_offload_prefetch_sync_states_and_param_init_fn_match_ddp(world_size):
    run_on_ranks(_check_fsdp1_options, world_size)
