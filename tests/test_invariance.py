"""``sharded.invariant.MicroBatches``: the same bits at any number of ranks.

A step's global batch is 8 micro-batches, each drawn from (step, index). Every configuration
trains 10 steps at world sizes 1, 2 and 4 (one launch per world size runs them all), clipping at
every step, and returns the per-step losses and norms, the gradients the optimizer saw at the
last step, and the final parameters and optimizer state, all whole on rank 0. The test then
compares the world sizes with ``torch.equal``: no tolerance, the contract is bit-identity.

Configurations: stages 1 (``OSS`` + DDP), 2 (``OSS`` + ``ShardedDataParallel``) and 3
(``fully_shard``), with AdamW alone and with ``torch.optim.Muon`` on the blocks' matrices (under
ZeRO-3 placed ``Owned()``) and AdamW on the rest, in fp32 and in bf16 (autocast for stages 1-2,
``MixedPrecisionPolicy(param_dtype=bf16)`` for stage 3); at world 4 also hybrid sharding (a
2 x 2 mesh) and the FSDP wrapper. The same loop without ``MicroBatches`` (DDP's accumulation)
gives other bits at another world size, so the comparison can fail. A checkpoint saved at world
2 resumes at world 4, and one saved at world 4 at world 2, on the uninterrupted run's bits.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel, checkpoint, fully_shard
from sharded.fsdp import MixedPrecisionPolicy, Owned
from sharded.invariant import MicroBatches
from tests._fsdp_reference import full_tensors
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

M = 8
STEPS = 10
SAVED_AT = 5
MAX_NORM = 0.2  # below the gradients' norm: every step clips
STAGES = ("1", "2", "3")
CONFIGS = [(stage, optim, precision) for stage in STAGES for optim in ("adamw", "muon") for precision in ("fp32", "bf16")]


def _is_block_matrix(name, param):
    return name.startswith("blocks.") and param.dim() == 2


def _build(stage, optim, precision, mesh=None):
    """(model, the wrapped model, optimizers) of one configuration."""
    model = gpt()
    muon = optim == "muon"
    if stage == "3":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else MixedPrecisionPolicy()
        matrices = {id(p) for n, p in model.named_parameters() if _is_block_matrix(n, p)} if muon else set()
        placement = lambda p: Owned() if id(p) in matrices else None  # noqa: E731
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
    elif stage == "fsdp":
        from examples.gpt import Block
        from sharded import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, auto_wrap_policy={Block})
    groups = _groups(model, muon)  # after sharding: the optimizers hold the DTensor parameters
    if stage in ("3", "fsdp"):
        return model, model, [cls(params, **kw) for cls, params, kw in groups]
    optimizers = [OSS(params, cls, **kw) for cls, params, kw in groups]
    wrapped = DDP(model) if stage == "1" else ShardedDataParallel(model, optimizers)
    return model, wrapped, optimizers


def _groups(model, muon):
    """(class, parameters, hyperparameters): Muon over the blocks' matrices if ``muon``, AdamW
    over the rest."""
    named = list(model.named_parameters())
    matrices = [p for n, p in named if muon and _is_block_matrix(n, p)]
    rest = [p for n, p in named if not (muon and _is_block_matrix(n, p))]
    adamw = (torch.optim.AdamW, rest, dict(lr=1e-2, weight_decay=0.1))
    return ([(torch.optim.Muon, matrices, dict(lr=0.02))] if muon else []) + [adamw]


def _autocast(stage, precision):
    if precision == "bf16" and stage in ("1", "2"):
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _train(stage, optim, precision, rank, first=0, last=STEPS, built=None, mesh=None, save_to=None):
    """Train one configuration from step ``first`` to ``last``; return what is compared (on
    rank 0; ``{}`` elsewhere)."""
    model, wrapped, optimizers = built or _build(stage, optim, precision, mesh)
    micro_batches = MicroBatches(wrapped, M)
    losses, norms, grads = [], [], None
    for step in range(first, last):
        for optimizer in optimizers:
            optimizer.zero_grad()
        mine = []
        for index in micro_batches:
            with _autocast(stage, precision):
                loss = gpt_loss(wrapped, token_batch(index, step))
            loss.backward()
            mine.append(loss.detach())
        norms.append(micro_batches.clip_grad_norm_(MAX_NORM))
        if step == last - 1:
            grads = _full_grads(model, stage)
        for optimizer in optimizers:
            optimizer.step()
        losses.append(micro_batches.mean(mine))
        if save_to is not None and step + 1 == SAVED_AT:
            checkpoint.save(checkpoint.get_state_dict(wrapped, optimizers), save_to)
    full = checkpoint.get_state_dict(wrapped, optimizers, full=True)
    if rank != 0:
        return {}
    return {"losses": torch.stack(losses), "norms": torch.stack(norms), "grads": grads,
            "params": full["model"], "optim": [o["state"] for o in full["optim"]]}


def _full_grads(model, stage):
    """The gradients the optimizer is about to see, whole (collective): every rank's under
    stage 1, each owner's under stage 2, the shards (and owners' matrices) under stage 3."""
    if stage in ("3", "fsdp"):
        from sharded._common.dtensors import full_tensor_of

        # an owned matrix's gradient is on its owner only; the others receive it into p's shape
        return [full_tensor_of(p.grad if p.grad is not None else p.detach()).detach().clone() for p in model.parameters()]
    fulls = []
    for p in model.parameters():
        held = torch.tensor([float(p.grad is not None)])
        owners = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(owners, held)
        source = next(r for r, h in enumerate(owners) if h.item())
        full = p.grad.detach().clone() if p.grad is not None else torch.empty_like(p)
        dist.broadcast(full, source)
        fulls.append(full)
    return fulls


def _plain_accumulation(rank, world):
    """DDP's usual accumulation over this rank's share of the same 8 micro-batches: what the
    option replaces, whose bits depend on the world size."""
    model = gpt()
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_rank = M // world
    for step in range(3):
        optimizer.zero_grad()
        for t in range(per_rank):
            with ddp.no_sync() if t < per_rank - 1 else contextlib.nullcontext():
                (gpt_loss(ddp, token_batch(rank * per_rank + t, step)) / per_rank).backward()
        optimizer.step()
    return full_tensors(model.parameters()) if rank == 0 else None


def _uneven(rank, stage):
    """Parameters of awkward shapes (0-dim, one row, fewer rows than ranks) at stage 1 and 3:
    the norm counts each row once, and both stages train the same bits."""
    from tests._fsdp_reference import UnevenNet, uneven_batch, uneven_loss

    model = UnevenNet()
    if stage == "3":
        for child in (model.lin, model.tiny, model.out):
            fully_shard(child)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2) if stage == "3" else OSS(model.parameters(), torch.optim.AdamW, lr=1e-2)
    wrapped = model if stage == "3" else DDP(model)
    micro_batches = MicroBatches(wrapped, M)
    norms = []
    for step in range(3):
        optimizer.zero_grad()
        for index in micro_batches:
            uneven_loss(wrapped, uneven_batch(index, step)).backward()
        norms.append(micro_batches.clip_grad_norm_(0.05))
        optimizer.step()
    full = checkpoint.get_state_dict(wrapped, optimizer, full=True)
    return {"norms": torch.stack(norms), "params": full.get("model", {})} if rank == 0 else {}


def _train_every_configuration(rank, world, directory):
    results = {config: _train(*config, rank) for config in CONFIGS}
    results["uneven 1"], results["uneven 3"] = _uneven(rank, "1"), _uneven(rank, "3")
    results["fsdp"] = _train("fsdp", "adamw", "fp32", rank)
    results["plain"] = _plain_accumulation(rank, world)
    if world == 4:
        from sharded.fsdp._placement.mesh import hybrid_mesh

        results["hybrid"] = _train("3", "adamw", "fp32", rank, mesh=hybrid_mesh(2))
        with pytest.raises(ValueError, match="2 micro-batches over 4 ranks"):
            MicroBatches(DDP(gpt()), 2)
    if world in (2, 4):  # checkpoints to resume at the other world size
        _train("3", "muon", "fp32", rank, last=SAVED_AT, save_to=directory / f"zero3-w{world}")
        _train("2", "adamw", "bf16", rank, last=SAVED_AT, save_to=directory / f"zero2-w{world}")
    _keep(results, rank, directory / f"results-w{world}.pt")


def _resume(rank, world, directory):
    """Resume the checkpoints the other world size saved and train to the end."""
    other = 4 if world == 2 else 2
    resumed = {}
    for name, config in (("zero3", ("3", "muon", "fp32")), ("zero2", ("2", "adamw", "bf16"))):
        built = _build(*config)
        model, wrapped, optimizers = built
        state = checkpoint.get_state_dict(wrapped, optimizers)
        checkpoint.load(state, directory / f"{name}-w{other}")
        checkpoint.set_state_dict(wrapped, optimizers, state)
        resumed[config] = _train(*config, rank, first=SAVED_AT, built=built)
    _keep(resumed, rank, directory / f"resumed-w{world}.pt")


def _keep(results, rank, path):
    """Rank 0 writes what it returns to a file (tensors do not cross the harness's pipe once
    the rank has exited)."""
    if rank == 0:
        torch.save(results, path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("invariance")
    results = {}
    for world in (1, 2, 4):
        run_on_ranks(_train_every_configuration, world, directory, timeout=600)
        results[world] = torch.load(directory / f"results-w{world}.pt", weights_only=True)
    for world in (4, 2):
        run_on_ranks(_resume, world, directory, timeout=300)
        results[f"resumed at {world}"] = torch.load(directory / f"resumed-w{world}.pt", weights_only=True)
    return results


def _assert_identical(ours, theirs, what):
    """Every tensor of two results equal, bit for bit."""
    assert ours.keys() == theirs.keys(), what
    for key in ours:
        a, b = ours[key], theirs[key]
        if key == "optim":
            for i, (x, y) in enumerate(zip(a, b)):
                assert x.keys() == y.keys(), f"{what}: optimizer {i}'s parameters"
                for index in x:
                    for name in x[index]:
                        assert torch.equal(torch.as_tensor(x[index][name]), torch.as_tensor(y[index][name])), f"{what}: optimizer {i} state {index}/{name}"
        elif key == "params":
            for name in a:
                assert torch.equal(a[name], b[name]), f"{what}: parameter {name}"
        elif key == "grads":
            for i, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), f"{what}: gradient {i} differs by {(x - y).abs().max():.3g}"
        else:
            assert torch.equal(a, b), f"{what}: {key} {a} != {b}"


@pytest.mark.parametrize("config", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_losses_norms_gradients_parameters_and_state_are_bit_identical_at_worlds_1_2_4(runs, config):
    for world in (2, 4):
        _assert_identical(runs[world][config], runs[1][config], f"stage {config[0]}, {config[1]}, {config[2]}: world {world} vs 1")


def test_stages_hybrid_sharding_and_the_fsdp_wrapper_give_the_same_bits_as_each_other(runs):
    """The canonical tree is the same at every stage: fp32 AdamW trains the same bits at ZeRO-1,
    -2, -3, on a hybrid mesh and under the FSDP wrapper."""
    reference = runs[1][("1", "adamw", "fp32")]
    for world in (1, 2, 4):
        for stage in ("2", "3"):
            _assert_identical(runs[world][(stage, "adamw", "fp32")], reference, f"stage {stage} at world {world} vs stage 1")
        _assert_identical(runs[world]["fsdp"], reference, f"FSDP wrapper at world {world} vs stage 1")
    _assert_identical(runs[4]["hybrid"], reference, "hybrid 2 x 2 at world 4 vs stage 1")
    for world in (1, 2, 4):  # a 0-dim parameter, one row, fewer rows than ranks
        _assert_identical(runs[world]["uneven 3"], runs[1]["uneven 1"], f"uneven shapes, stage 3 at world {world} vs stage 1")
        _assert_identical(runs[world]["uneven 1"], runs[1]["uneven 1"], f"uneven shapes, stage 1 at world {world}")


def test_without_micro_batches_the_world_sizes_differ(runs):
    """The check can fail: DDP's own accumulation over the same global batch differs with the
    world size (its all-reduce and its sequential accumulation add in other orders)."""
    plain = {world: runs[world]["plain"] for world in (1, 2, 4)}
    for world in (2, 4):
        assert any(not torch.equal(a, b) for a, b in zip(plain[world], plain[1])), f"plain accumulation at world {world} equals world 1"


def test_checkpoints_resume_across_world_sizes_on_the_uninterrupted_bits(runs):
    for where in ("resumed at 4", "resumed at 2"):
        for config, resumed in runs[where].items():
            uninterrupted = runs[1][config]
            for key in ("params", "optim", "grads"):
                _assert_identical({key: resumed[key]}, {key: uninterrupted[key]}, f"{config} {where}")
            for key in ("losses", "norms"):
                assert torch.equal(resumed[key], uninterrupted[key][SAVED_AT:]), f"{config} {where}: {key}"


def _check_refusals(rank, world):
    model = DDP(gpt())
    with pytest.raises(ValueError, match=r"rank \d: MicroBatches: 8 micro-batches over 3 ranks; the results are the same"):
        MicroBatches(model, 8)


def _check_no_sync_inside_the_loop(rank, world):
    sharded_model, _, _ = _build("3", "adamw", "fp32")
    micro_batches = MicroBatches(sharded_model, 1)
    with pytest.raises(RuntimeError, match="kept its gradient locally"):
        for index in micro_batches:
            with sharded_model.no_sync():
                gpt_loss(sharded_model, token_batch(index, 0)).backward()


def _check_refusals_in_one_process(rank, world):
    model = DDP(gpt())
    for count in (6, 0):
        with pytest.raises(ValueError, match="MicroBatches"):
            MicroBatches(model, count)
    micro_batches = MicroBatches(model, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gpt_loss(model, token_batch(0, 0)).backward()
    with pytest.raises(RuntimeError, match="call optimizer.zero_grad"):
        next(iter(micro_batches))
    optimizer.zero_grad()
    for index in micro_batches:
        gpt_loss(model, token_batch(index, 0)).backward()
        break
    with pytest.raises(RuntimeError, match="stopped after 0 of this rank's 4 micro-batches"):
        optimizer.step()
    optimizer.zero_grad()
    for index in micro_batches:
        gpt_loss(model, token_batch(index, 0)).backward()
    oss = OSS(model.parameters(), torch.optim.AdamW, lr=1e-2, broadcast_fp16=True)
    with pytest.raises(NotImplementedError, match="OSS.broadcast_fp16=True. under MicroBatches"):
        oss.step()


def test_counts_the_tree_cannot_serve_and_misuse_are_refused_at_start():
    run_on_ranks(_check_refusals_in_one_process, 1)
    run_on_ranks(_check_refusals, 3, timeout=60)
    run_on_ranks(_check_no_sync_inside_the_loop, 1)
