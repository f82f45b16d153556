"""``sharded.fully_shard`` as a drop-in for torch 2.13's ``torch.distributed.fsdp.fully_shard``.

* Our modules are torch ``FSDPModule`` instances, and every member of torch's class is
  overridden by ours (torch's would read FSDP state our modules do not have).
* A torchtitan-shaped ``parallelize`` (a unit per block, one unit over a list of modules, a tied
  embedding, summed gradients through ``set_gradient_divide_factor(1.0)`` found by
  ``isinstance(m, FSDPModule)``, a loss normalised by the global token count, microbatching,
  gradient clipping, AdamW) trains the same with torch's ``fully_shard`` and with ours.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from tests._fsdp_reference import TiedGPT, full_tensors
from tests._harness import run_on_ranks
from tests._exact_sums import batch_rank
from tests._models import gpt, token_batch

MICRO = 2


def test_every_member_of_torchs_fsdp_module_is_ours():
    from sharded.fsdp import FSDPModule, UnshardHandle

    assert issubclass(FSDPModule, TorchFSDPModule)
    members = [n for n, _ in inspect.getmembers(TorchFSDPModule) if not n.startswith("_")]
    members += ["__new__", "_apply", "_get_fsdp_state", "_set_unshard_async_op"]
    inherited = [n for n in members if n not in vars(FSDPModule)]
    assert not inherited, f"inherited from torch's FSDPModule: {inherited}"
    assert len(members) >= 26, members  # torch 2.13 has 23 public methods
    assert "wait" in vars(UnshardHandle) and issubclass(UnshardHandle, torch.distributed.fsdp.UnshardHandle)
    import sharded

    assert "fully_shard" in sharded.__all__ and "fully_shard" in dir(sharded)
    theirs = inspect.signature(torch.distributed.fsdp.fully_shard).parameters
    ours = inspect.signature(sharded.fully_shard).parameters
    assert set(theirs) <= set(ours), set(theirs) - set(ours)


# ------------------------------------------------------------ the torchtitan-shaped run


def parallelize(model, shard, mesh=None, tied=False, group_head=True, force_sum=True):
    """torchtitan's ``apply_fsdp``, reduced: a unit per block, the output layers as one unit
    (with the embedding when it is tied to the head), the root; then summed gradients."""
    for block in model.blocks:
        shard(block, mesh=mesh)
    if tied:
        shard([model.tok, model.ln, model.head], mesh=mesh)
    elif group_head:
        shard([model.ln, model.head], mesh=mesh)
    shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, TorchFSDPModule):  # what torchtitan asks
            module.set_gradient_divide_factor(1.0)
            if force_sum:  # torch's PREMUL_SUM does not exist on gloo
                module.set_force_sum_reduction_for_comms(True)
    return model


def train(model, rank, steps=3, hybrid=False):
    """Microbatches (the gradient sync, or for hybrid sharding only the all-reduce across
    replicas, on the last), a loss summed over tokens and divided by the global token count,
    clipping, AdamW. Returns the losses, the gradient norms and the final parameters. At world 3
    every rank trains on rank 0's batches (tests/_exact_sums.py); the 2 x 2 hybrid mesh sums in
    the same tree on both sides (pairs, then the pairs' sums), so there each rank keeps its own."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for step in range(steps):
        data_rank = rank if hybrid else batch_rank(rank, dist.get_world_size())
        batches = [token_batch(data_rank, 10 * step + i) for i in range(MICRO)]
        tokens = torch.tensor(float(sum(b[:, 1:].numel() for b in batches)))
        dist.all_reduce(tokens)
        for i, batch in enumerate(batches):
            last = i == MICRO - 1
            model.set_requires_all_reduce(last) if hybrid else model.set_requires_gradient_sync(last)
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum") / tokens
            loss.backward()
            losses.append(loss.detach().clone())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses), torch.stack(norms), full_tensors(model.parameters())


def _assert_same(ours, theirs, what):
    """Losses, gradient norms and parameters bit for bit (at world 3 on equal batches, whose sums
    are the same in any order: tests/_exact_sums.py)."""
    for name, a, b in zip(("losses", "gradient norms", "parameters"), ours, theirs):
        for x, y in list(zip(a, b)) if isinstance(a, list) else [(a, b)]:
            assert torch.equal(x, y), f"{what}: {name} differ from torch's by {(x - y).abs().max():.3g}"


def _torchtitan_cases(rank, world):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard

    for tied in (False, True):
        make = TiedGPT if tied else gpt
        reference = train(parallelize(make(), torch_fully_shard, tied=tied), rank)
        for force_sum in (True, False):
            model = parallelize(make(), fully_shard, tied=tied, force_sum=force_sum)
            assert all(isinstance(m, TorchFSDPModule) for m in (model, model.blocks[0], model.head))
            _assert_same(train(model, rank), reference, f"tied={tied}, force_sum={force_sum}")


def _divide_factor_alone(rank, world):
    """Only the summed gradients: per-block units and the root, no list (so this fails on code
    that ignores the factor, not on the list argument)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard

    reference = train(parallelize(gpt(), torch_fully_shard, group_head=False), rank, steps=2)
    ours = train(parallelize(gpt(), fully_shard, group_head=False), rank, steps=2)
    _assert_same(ours, reference, "set_gradient_divide_factor(1.0)")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_torchtitan_shaped_training_matches_torch_fully_shard(world_size):
    run_on_ranks(_divide_factor_alone, world_size)
    run_on_ranks(_torchtitan_cases, world_size)


def _hybrid_case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reference = train(parallelize(gpt(), torch_fully_shard, mesh=mesh), rank, hybrid=True)
    ours = train(parallelize(gpt(), fully_shard, mesh=mesh), rank, hybrid=True)
    _assert_same(ours, reference, "HSDP 2x2, set_requires_all_reduce microbatching")
    # and averaging (no factor), with the all-reduce deferred the same way
    models = [gpt(), gpt()]
    for model, shard in zip(models, (torch_fully_shard, fully_shard)):
        for block in model.blocks:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
    _assert_same(train(models[1], rank, hybrid=True), train(models[0], rank, hybrid=True), "HSDP, averaged")
    from tests.test_fsdp2_placement import hybrid_cases  # Shard(1) and the all-gather extension, same launch

    hybrid_cases(rank, mesh)


def test_hybrid_sharding_defers_the_all_reduce_like_torch():
    run_on_ranks(_hybrid_case, 4, timeout=150)


# ------------------------------------------------------------------ single members


def _half_extension() -> nn.Module:
    """A layer whose weight has only half of the all-gather extension (torch's float8 hooks)."""
    layer = nn.Linear(4, 4)
    layer.weight.fsdp_pre_all_gather = lambda *args: None
    return layer


class Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _members(rank, world):
    from sharded import fully_shard
    from sharded.fsdp import register_fsdp_forward_method
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import OffloadPolicy as TorchOffload
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.tensor import Replicate, Shard

    # torch's policy objects, the int spellings of reshard_after_forward, Shard(0) placements
    model = gpt()
    fully_shard(model.blocks[0], mp_policy=TorchMP(param_dtype=torch.bfloat16), reshard_after_forward=world)
    fully_shard(model.blocks[1], offload_policy=TorchOffload(), reshard_after_forward=1, shard_placement_fn=lambda p: Shard(0))
    fully_shard(model)
    from sharded.fsdp._unit import unit_of

    first, second = unit_of(model.blocks[0]).settings, unit_of(model.blocks[1]).settings
    assert first.mp_policy.param_dtype is torch.bfloat16
    assert first.reshard_after_forward is True and second.reshard_after_forward is False
    assert first.secondary_shard is None and second.offload_policy is None
    fully_shard(nn.Linear(2, 2), offload_policy=torch.distributed.fsdp.CPUOffloadPolicy(pin_memory=False))
    sequential = fully_shard(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert type(sequential[0:1]) is nn.Sequential, "slicing a sharded Sequential builds the plain class"

    for call, names in (
        (lambda: fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate()), ["shard_placement_fn", "Replicate()"]),
        (lambda: model.set_symm_mem_for_comm(), ["set_symm_mem_for_comm"]),
        (lambda: model.set_allocate_memory_from_process_group_for_comm(True), ["set_allocate_memory_from_process_group_for_comm"]),
        (lambda: model._get_fsdp_state()._comm_ctx, ["_comm_ctx"]),
    ):
        with pytest.raises(NotImplementedError) as raised:
            call()
        assert all(n in str(raised.value) for n in names) and f"rank {rank}" in str(raised.value), raised.value
    model.set_allocate_memory_from_process_group_for_comm(False)
    with pytest.raises(TypeError, match=f"rank {rank}.*weight defines fsdp_pre_all_gather but not its pair"):
        fully_shard(_half_extension())

    # register_fsdp_forward_method (ours and torch's): a method other than forward gathers too
    for register in (register_fsdp_forward_method, torch_register):
        m = gpt()
        fully_shard(m.blocks[0])
        fully_shard(m)
        m.blocks[0].double_forward = lambda x, blk=m.blocks[0]: blk.mlp(x) * 2
        register(m.blocks[0], "double_forward")
        x = torch.randn(2, 32)
        m(token_batch(rank, 0)[:, :-1])  # claim the root
        out = m.blocks[0].double_forward(x)
        assert isinstance(m.blocks[0].mlp[0].weight, DTensor), "resharded after the method"
        ref = gpt().blocks[0].mlp(x) * 2
        torch.testing.assert_close(out, ref)

    # set_reduce_scatter_unused_params: a parameter no rank used gets a zero gradient, not None
    for flag in (False, True):
        m = Skips()
        fully_shard(m)
        m.set_reduce_scatter_unused_params(flag)
        m(torch.randn(2, 3)).sum().backward()
        grad = m.unused.weight.grad
        assert (grad is not None and not grad.full_tensor().any()) if flag else grad is None

    # set_all_reduce_hook (on a stream), custom collectives, a separate reduce-scatter group: the same numbers
    seen, calls = [], []

    class Gather(AllGather):
        def allocate(self, size, *, dtype, device):
            calls.append("allocate")
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            calls.append("gather")
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    class Scatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            calls.append("scatter")
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    plain, custom = gpt(), gpt()
    for m in (plain, custom):
        for block in m.blocks:
            fully_shard(block)
        fully_shard(m)
    for block in custom.blocks:
        block.set_custom_all_gather(Gather())
        block.set_custom_reduce_scatter(Scatter())
    custom.set_all_reduce_hook(lambda out: seen.append(out.numel()), stream=torch.cpu.Stream())  # CPU: orders nothing
    custom.set_separate_reduce_scatter_group()
    custom.set_reduce_scatter_max_input_buffers(1)
    custom.set_post_optim_event(None)
    custom.set_is_last_backward(False)
    for m in (plain, custom):
        F.cross_entropy(m(token_batch(rank, 1)[:, :-1]).flatten(0, 1), token_batch(rank, 1)[:, 1:].flatten()).backward()
    custom.set_is_last_backward(True)
    custom(token_batch(rank, 2)[:, :-1]).sum().mul(0).backward()  # lands what was left in flight
    plain(token_batch(rank, 2)[:, :-1]).sum().mul(0).backward()
    assert seen, "all-reduce hook not called"
    if world > 1:
        assert {"allocate", "gather", "scatter"} <= set(calls), calls
    for a, b in zip(full_tensors(p.grad for p in custom.parameters()), full_tensors(p.grad for p in plain.parameters())):
        assert torch.equal(a, b)

    # reset_iter_state: a forward that raised midway leaves nothing behind
    m = gpt()
    for block in m.blocks:
        fully_shard(block)
    fully_shard(m)
    def boom(*_):
        raise KeyError("boom")

    handle = m.blocks[1].register_forward_pre_hook(boom)
    with pytest.raises(KeyError):
        m(token_batch(rank, 0)[:, :-1])
    with pytest.raises(RuntimeError, match="root"):
        m.blocks[0].reset_iter_state()
    m.reset_iter_state()
    handle.remove()
    m(token_batch(rank, 0)[:, :-1]).sum().backward()
    assert all(isinstance(p, DTensor) for p in m.parameters())
    with pytest.warns(FutureWarning):
        m.set_reduce_scatter_divide_factor(2.0)


def test_fsdp_module_members_behave_as_torch_documents():
    run_on_ranks(_members, 2)


def _state_and_unshard_order(rank, world):
    from sharded import fully_shard
    from sharded.fsdp._unit import Unit

    # fully_shard.state(module): one state per fully_shard call, the same object each time
    model = gpt()
    for block in model.blocks:
        fully_shard(block)
    fully_shard([model.tok, model.pos])
    fully_shard(model)
    states = [fully_shard.state(m) for m in (model, *model.blocks, model.tok)]
    assert all(s is not None for s in states) and len({id(s) for s in states}) == len(states)
    assert fully_shard.state(model) is states[0] is model._get_fsdp_state()
    assert fully_shard.state(model.pos) is fully_shard.state(model.tok), "a list unit has one state"
    assert fully_shard.state(model.blocks[0].mlp) is None and fully_shard.state(nn.Linear(2, 2)) is None

    # _set_unshard_async_op: False waits for a unit's all-gather before its prefetch is issued
    events = []
    start, wait = Unit._start_gather, Unit.wait_for_unshard

    def logged_start(unit):
        events.append(("start", unit.module_name))
        start(unit)

    def logged_wait(unit):
        if unit.shard_state.name == "GATHERING":
            events.append(("wait", unit.module_name))
        wait(unit)

    Unit._start_gather, Unit.wait_for_unshard = logged_start, logged_wait
    try:
        model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
        outputs = []
        for async_op in (True, False):
            model._set_unshard_async_op(async_op)
            events.clear()
            outputs.append(model(token_batch(rank, 0)[:, :-1]))
            order = events.index(("wait", "blocks.0")) < events.index(("start", "blocks.1"))
            assert order is (not async_op), (async_op, events)
    finally:
        Unit._start_gather, Unit.wait_for_unshard = start, wait
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    _check_dropped_model_is_freed(rank)


def _check_dropped_model_is_freed(rank):
    """A sharded model its user drops is freed by one collection, with its units and shards, also
    after a forward and backward: a global map of units kept every model alive (each unit holds
    its modules), and the units' autograd hooks, holding their states strongly in dicts torch's
    collector cannot see, made it take two collections (three after optimizer steps)."""
    import gc
    import weakref

    from sharded import fully_shard

    def trained_and_dropped():
        # no name may outlive this call: after the first forward any block reaches the model
        model = gpt()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        assert fully_shard.state(model.blocks[0]) is not None
        model(token_batch(rank, 0)[:, :-1]).float().square().mean().backward()
        return weakref.ref(model)

    dropped = trained_and_dropped()
    gc.collect()
    assert dropped() is None, "a dropped sharded model stays alive"


def test_fully_shard_state_and_unshard_async_op():
    run_on_ranks(_state_and_unshard_order, 2)
