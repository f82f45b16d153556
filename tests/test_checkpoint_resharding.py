"""Sharded checkpoints reshard: any world size, any layer, a plain single process, torch's own tools.

Checkpoints are saved at world 2 by DDP + AdamW, ZeRO-1 (OSS + DDP), ZeRO-2 (OSS +
ShardedDataParallel) and ZeRO-3 (``fully_shard`` per block + AdamW over DTensor parameters), at
world 3 by ZeRO-1, and by a plain single process; each is loaded at world 1, 2 and 3 into every
layer (ZeRO-3 as ``fully_shard``, and for a few as the ``FullyShardedDataParallel`` wrapper). Right
after loading, the full state (model, and optimizer state consolidated on rank 0) must equal the
saving run's bit for bit: loading copies values, so no tolerance applies. Then one more training
step must match DDP + AdamW loaded from the same state, within the tolerances of the parity
tests (``tests/test_oss.py``: OSS equals DDP to float32 rounding; ``tests/test_sharded_ddp.py``
and ``tests/_fsdp_reference.py``: Adam under ZeRO-2 or ZeRO-3, whose gradient sums are ordered
differently from DDP's, may move an element by ulp noise over ``lr``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, FullyShardedDataParallel, ShardedDataParallel, checkpoint, fully_shard
from tests._fsdp_reference import ADAMW, assert_matches_ddp, full_tensors
from tests import _harness
from tests._exact_sums import average_after_the_sum, batch_rank
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch
from tests.test_oss import _assert_close, _two_groups
from tests.test_sharded_ddp import assert_adam_equal

# Every rank forks from the harness's forkserver: have it import DCP and these tests' modules once
# (each costs a rank about a second of CPU otherwise, in every launch of every checkpoint test).
_harness._PRELOAD.extend(
    m for m in ("torch.distributed.checkpoint", "tests.test_checkpoint_resharding") if m not in _harness._PRELOAD
)

LAYERS = ("ddp", "zero1", "zero2", "zero3", "fsdp")
SAVING_LAYERS = ("ddp", "zero1", "zero2", "zero3")  # "fsdp" saves what "zero3" saves
FSDP_WRAPPER_SOURCES = ("plain-w1", "zero1-w3", "zero3-w2")  # the wrapper is fully_shard plus a policy: a few suffice
ADAMW_LR = 1e-2
STEPS = 3
FROZEN_LATE = "blocks.0.ln1.weight"  # frozen after it has optimizer state, in the "-frozen" checkpoints


def build(layer, seed=0, frozen=()):
    """(model, wrapped model, optimizer) for ``layer``; ``pos.weight`` is always frozen (an
    optimizer parameter that never has state), and so are the names in ``frozen``."""
    model = gpt(seed)
    for name, param in model.named_parameters():
        if name == "pos.weight" or name in frozen:
            param.requires_grad_(False)
    if layer == "zero3":  # bottom-up: every block a unit, the model the unit for the rest
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    if layer == "fsdp":
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy={type(model.blocks[0])})
        return model, wrapped, torch.optim.AdamW(_two_groups(wrapped), lr=ADAMW_LR)
    groups = _two_groups(model)  # after sharding: the optimizer steps the DTensor parameters
    if layer == "zero3":
        return model, model, torch.optim.AdamW(groups, lr=ADAMW_LR)
    if layer in ("plain", "ddp"):
        optimizer = torch.optim.AdamW(groups, lr=ADAMW_LR)
        return model, (model if layer == "plain" else DDP(model)), optimizer
    optimizer = OSS(groups, torch.optim.AdamW, lr=ADAMW_LR)
    return model, (DDP(model) if layer == "zero1" else ShardedDataParallel(model, optimizer)), optimizer


def train(wrapped, optimizer, rank, steps, first=0):
    for step in range(first, first + steps):
        optimizer.zero_grad()
        gpt_loss(wrapped, token_batch(rank, step)).backward()
        optimizer.step()


def assert_full_equal(ours, reference, what):
    """``ours`` (``get_state_dict(full=True)``) equals ``reference`` bit for bit; ``{}`` off rank 0."""
    if not reference:
        assert ours == {}, f"{what}: only rank 0 gets the full state"
        return
    assert ours["model"].keys() == reference["model"].keys(), what
    for key, value in reference["model"].items():
        assert torch.equal(ours["model"][key], value), f"{what}: model {key}"
    assert ours["optim"]["param_groups"] == reference["optim"]["param_groups"], what
    assert ours["optim"]["state"].keys() == reference["optim"]["state"].keys(), what
    for index, state in reference["optim"]["state"].items():
        assert state.keys() == ours["optim"]["state"][index].keys(), f"{what}: state {index}"
        for key, value in state.items():
            assert torch.equal(ours["optim"]["state"][index][key], value), f"{what}: state {index}/{key}"


def assert_holds_reference(wrapped, optimizer, reference, what):
    """Every rank's sharded state equals ``reference`` (a full torch-format state dict of the
    model built by :func:`build`) bit for bit, and the ranks together hold all of its optimizer
    state: each parameter's once with OSS, on every rank with a plain optimizer (collective)."""
    ours = checkpoint.get_state_dict(wrapped, optimizer)
    for key, value in reference["model"].items():
        assert torch.equal(_whole(ours["model"][key]), value), f"{what}: model {key}"
    names = _optimizer_order()
    by_name = [{**g, "params": [names[i] for i in g["params"]]} for g in reference["optim"]["param_groups"]]
    assert ours["optim"]["param_groups"] == by_name, f"{what}: param groups"
    held = {fqn: state for fqn, state in ours["optim"]["state"].items() if state}
    for fqn, state in held.items():
        saved = reference["optim"]["state"][names.index(fqn)]
        assert state.keys() == saved.keys(), f"{what}: state keys of {fqn}"
        for key, value in saved.items():
            assert torch.equal(_whole(state[key]), value), f"{what}: state {fqn}/{key}"
    count = torch.tensor(len(held))
    torch.distributed.all_reduce(count)
    copies = 1 if isinstance(optimizer, OSS) else torch.distributed.get_world_size()
    assert count.item() == copies * len(reference["optim"]["state"]), f"{what}: {count.item()} states held"


def _whole(tensor):
    """``tensor`` itself, or a DTensor's full value (collective: every rank, in the same order)."""
    return full_tensors([tensor])[0] if isinstance(tensor, DTensor) else tensor


def _optimizer_order():
    """Parameter names in the order :func:`build`'s optimizers number them."""
    named = list(gpt().named_parameters())
    return [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]


def save_with_reference(wrapped, optimizer, directory, rank):
    """Save sharded to ``directory`` and the full state beside it (``.pt``) as the reference."""
    checkpoint.save(checkpoint.get_state_dict(wrapped, optimizer), directory)
    full = checkpoint.get_state_dict(wrapped, optimizer, full=True)
    if rank == 0:
        torch.save(full, f"{directory}.pt")


def load_into(wrapped, optimizer, directory):
    state = checkpoint.get_state_dict(wrapped, optimizer)
    checkpoint.load(state, directory)
    checkpoint.set_state_dict(wrapped, optimizer, state)


# ------------------------------------------------------------------------------- saving


def _save_every_layer(rank, world, root):
    for layer in SAVING_LAYERS if world == 2 else ("zero1",):
        model, wrapped, optimizer = build(layer)
        train(wrapped, optimizer, rank, STEPS)
        if layer == "zero3":
            _assert_holds_only_its_shards(checkpoint.get_state_dict(wrapped, optimizer), world)
        save_with_reference(wrapped, optimizer, root / f"{layer}-w{world}", rank)
    if world == 2:  # a parameter frozen after it got optimizer state keeps it; ZeRO-2 re-partitions
        model, wrapped, optimizer = build("zero2")
        train(wrapped, optimizer, rank, STEPS - 1)
        model.get_parameter(FROZEN_LATE).requires_grad_(False)
        train(wrapped, optimizer, rank, 1, first=STEPS - 1)
        save_with_reference(wrapped, optimizer, root / "zero2-frozen-w2", rank)


def _assert_holds_only_its_shards(state, world):
    """ZeRO-3's sharded form holds DTensors whose local part is this rank's shard: no rank
    materialises a whole parameter or its optimizer state."""
    tensors = list(state["model"].values()) + [v for held in state["optim"]["state"].values() for v in held.values()]
    sharded = [t for t in tensors if isinstance(t, DTensor)]
    assert len(sharded) == len(state["model"]) + 2 * (len(state["model"]) - 1), "DTensor params and Adam moments"
    for tensor in sharded:
        rows = tensor.shape[0]
        assert tensor.to_local().shape[0] <= -(-rows // world), f"a local part of {tuple(tensor.shape)} is not a shard"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints saved at world 2 by every layer, at world 3 by ZeRO-1, and by a plain
    single process; a full torch-format copy of each beside it as the reference."""
    root = tmp_path_factory.mktemp("checkpoints")
    for world in (2, 3):
        run_on_ranks(_save_every_layer, world, root)
    model, _, optimizer = build("plain")
    train(model, optimizer, 0, STEPS)
    save_with_reference(model, optimizer, root / "plain-w1", rank=0)
    return root


def _sources(root):
    return sorted(p.name for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith("."))


# ------------------------------------------------------------------------------ loading


def _resume_every_checkpoint_in_every_layer(rank, world, root):
    for name in _sources(root):
        reference = torch.load(root / f"{name}.pt", weights_only=True)
        frozen = (FROZEN_LATE,) if "frozen" in name else ()
        for layer in LAYERS if name in FSDP_WRAPPER_SOURCES else LAYERS[:-1]:
            what = f"{name} loaded as {layer} at world {world}"
            model, wrapped, optimizer = build(layer, seed=1, frozen=frozen)  # other weights: loading must replace them
            load_into(wrapped, optimizer, root / name)
            assert_holds_reference(wrapped, optimizer, reference, what)
            _check_next_step_matches_ddp(model, wrapped, optimizer, layer, frozen, reference, batch_rank(rank, world), what)
            assert_same_on_all_ranks(full_tensors(model.parameters()), what)


def _check_next_step_matches_ddp(model, wrapped, optimizer, layer, frozen, full, data_rank, what):
    """One step more on ``data_rank``'s batch (rank 0's at world 3) beside DDP: ZeRO-2 and
    ZeRO-3 bit for bit (ZeRO-3 against DDP averaging after the sum as its reduce-scatter does,
    tests/_exact_sums.py); DDP and ZeRO-1, whose gradients are DDP's own, within test_oss's tolerance."""
    ref_model, ref_wrapped, ref_optimizer = build("ddp", seed=1, frozen=frozen)
    if layer in ("zero3", "fsdp"):
        average_after_the_sum(ref_wrapped)
    ref_model.load_state_dict(full["model"])
    ref_optimizer.load_state_dict(copy.deepcopy(full["optim"]))  # torch's load keeps the tensors it gets
    train(ref_wrapped, ref_optimizer, data_rank, 1, first=STEPS)
    train(wrapped, optimizer, data_rank, 1, first=STEPS)
    if layer in ("zero3", "fsdp"):
        assert_matches_ddp(model, ref_model, what, optim=ADAMW, steps=1)
    elif layer == "zero2":
        assert_adam_equal(model, ref_model, what)
    else:
        _assert_close(model, ref_model, what)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_checkpoints_of_every_layer_and_world_size_resume_in_every_layer(saved, world_size):
    run_on_ranks(_resume_every_checkpoint_in_every_layer, world_size, saved, timeout=180)


def test_sharded_checkpoints_load_into_a_plain_single_process_model(saved):
    for name in _sources(saved):
        frozen = (FROZEN_LATE,) if "frozen" in name else ()
        model, _, optimizer = build("plain", seed=1, frozen=frozen)
        load_into(model, optimizer, saved / name)
        reference = torch.load(saved / f"{name}.pt", weights_only=True)
        assert_full_equal(checkpoint.get_state_dict(model, optimizer, full=True), reference, f"{name} in one process")


def test_optimizer_state_is_matched_by_parameter_name_not_position(saved):
    model, _, optimizer = build("plain", seed=1)
    load_into(model, optimizer, saved / "zero2-w2")
    reordered = gpt(seed=2)
    reordered.pos.weight.requires_grad_(False)
    groups = [{**g, "params": list(reversed(g["params"]))} for g in _two_groups(reordered)]
    reordered_optimizer = torch.optim.AdamW(groups, lr=ADAMW_LR)
    load_into(reordered, reordered_optimizer, saved / "zero2-w2")
    expected = checkpoint.get_state_dict(model, optimizer)["optim"]["state"]
    found = checkpoint.get_state_dict(reordered, reordered_optimizer)["optim"]["state"]
    assert found.keys() == expected.keys()
    for fqn, state in expected.items():
        for key, value in state.items():
            assert torch.equal(found[fqn][key], value), f"{fqn}/{key} loaded by position"


def test_files_are_standard_dcp_checkpoints_that_torch_reads_and_writes(saved, tmp_path):
    """torch's own state-dict API and ``dcp.save`` / ``dcp.load`` work on the same files."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    reference = torch.load(saved / "zero1-w3.pt", weights_only=True)
    model, _, optimizer = build("plain", seed=1)
    train(model, optimizer, 0, 1)  # torch's loader fills the optimizer state that already exists
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=saved / "zero1-w3")
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    assert_full_equal(checkpoint.get_state_dict(model, optimizer, full=True), reference, "read by torch's API")

    ours = checkpoint.get_state_dict(model, optimizer)
    dcp.save(ours, checkpoint_id=tmp_path / "written-by-dcp")
    other, _, other_optimizer = build("plain", seed=2)
    load_into(other, other_optimizer, tmp_path / "written-by-dcp")
    assert_full_equal(checkpoint.get_state_dict(other, other_optimizer, full=True), reference, "written by dcp.save")

    # torch's own state dict (no "classes" entry: the param groups' keys are compared instead)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path / "torchs-own")
    other, _, other_optimizer = build("plain", seed=3)
    load_into(other, other_optimizer, tmp_path / "torchs-own")
    assert_full_equal(checkpoint.get_state_dict(other, other_optimizer, full=True), reference, "torch's state dict")


# ------------------------------------------------------------------ torch's own fully_shard


def _fully_sharded(seed):
    """A GPT under torch's own ``fully_shard`` (FSDP2): DTensor parameters laid out by torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = gpt(seed)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)


def _plain_zero(layer, seed):
    """ZeRO-1 or ZeRO-2 over one param group and no frozen parameter, like ``_fully_sharded``."""
    model = gpt(seed)
    optimizer = OSS(model.parameters(), torch.optim.AdamW, lr=ADAMW_LR)
    return model, (DDP(model) if layer == "zero1" else ShardedDataParallel(model, optimizer)), optimizer


def _check_dtensor_models_round_trip(rank, world, root):
    model, wrapped, optimizer = _plain_zero("zero1", seed=0)
    train(wrapped, optimizer, rank, STEPS)
    save_with_reference(wrapped, optimizer, root / "zero1", rank)
    expected = torch.load(root / "zero1.pt", weights_only=True) if rank == 0 else {}

    sharded_model, sharded_optimizer = _fully_sharded(seed=1)
    load_into(sharded_model, sharded_optimizer, root / "zero1")
    assert_full_equal(checkpoint.get_state_dict(sharded_model, sharded_optimizer, full=True), expected, "ZeRO-1 -> FSDP2")
    exp_avg = next(iter(sharded_optimizer.state.values()))["exp_avg"]
    assert type(exp_avg).__name__ == "DTensor", "optimizer state of DTensor parameters must stay DTensors"

    checkpoint.save(checkpoint.get_state_dict(sharded_model, sharded_optimizer), root / "fsdp2")
    model, wrapped, optimizer = _plain_zero("zero2", seed=2)
    load_into(wrapped, optimizer, root / "fsdp2")
    assert_full_equal(checkpoint.get_state_dict(wrapped, optimizer, full=True), expected, "FSDP2 -> ZeRO-2")


def test_models_under_torchs_own_fully_shard_exchange_checkpoints_with_zero(tmp_path):
    """A user of torch's FSDP2 moves to or from sharded's ZeRO-1/2 through the same functions:
    uneven DTensor shards at world 3, both directions."""
    run_on_ranks(_check_dtensor_models_round_trip, 3, tmp_path, timeout=180)


# ------------------------------------------------------------ torch's dcp.load into our template

TORCH_LOADED_SOURCES = ("ddp-w2", "zero1-w2", "zero2-w2", "zero3-w2")


def _torch_dcp_load_into_every_layer(rank, world, root):
    """torch's recipe with our state-dict functions: a fresh optimizer's template holds
    placeholder state of the right shapes, ``dcp.load`` fills it, and the result is exact."""
    for name in TORCH_LOADED_SOURCES:
        reference = torch.load(root / f"{name}.pt", weights_only=True)
        for layer in LAYERS[:-1]:
            what = f"{name} read by torch's dcp.load as {layer} at world {world}"
            model, wrapped, optimizer = build(layer, seed=1)
            state = checkpoint.get_state_dict(wrapped, optimizer)
            dcp.load(state, checkpoint_id=root / name)
            checkpoint.set_state_dict(wrapped, optimizer, state)
            assert_holds_reference(wrapped, optimizer, reference, what)
    _check_unfilled_templates_are_refused(rank, world, root)


def _check_unfilled_templates_are_refused(rank, world, root):
    """A template nothing filled (no load, or a partial load of a checkpoint without optimizer
    state) is refused by name on every rank, and neither model nor optimizer changes. Saving a
    fresh optimizer's template writes no placeholders: resuming from it is starting afresh."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    model_only = root / f"model-only-w{world}"
    model, wrapped, optimizer = build("zero2")
    checkpoint.save({"model": checkpoint.get_state_dict(wrapped)["model"]}, model_only)
    for layer in ("zero2", "zero3"):
        model, wrapped, optimizer = build(layer, seed=1)
        for how in ("not loaded", "partially loaded"):
            state = checkpoint.get_state_dict(wrapped, optimizer)
            if how == "partially loaded":
                dcp.load(state, checkpoint_id=model_only, planner=DefaultLoadPlanner(allow_partial_load=True))
            before = [t.clone() for t in full_tensors(model.parameters())]
            with pytest.raises(checkpoint.CheckpointError, match=rf"rank {rank}: .*optimizer state of [a-z].* is still the placeholder"):
                checkpoint.set_state_dict(wrapped, optimizer, state)
            assert not optimizer.state, f"{layer}, {how}: optimizer state was loaded"
            after = full_tensors(model.parameters())
            assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{layer}, {how}: the model changed"
        checkpoint.save(checkpoint.get_state_dict(wrapped, optimizer), root / f"fresh-{layer}-w{world}")
        resumed_model, resumed, resumed_optimizer = build(layer, seed=2)
        load_into(resumed, resumed_optimizer, root / f"fresh-{layer}-w{world}")
        assert not resumed_optimizer.state, f"{layer}: a fresh optimizer's checkpoint brought state"
        train(wrapped, optimizer, rank, 1)
        train(resumed, resumed_optimizer, rank, 1)
        assert all(torch.equal(a, b) for a, b in zip(full_tensors(model.parameters()), full_tensors(resumed_model.parameters())))


@pytest.mark.parametrize("world_size", [2, 3])
def test_torchs_dcp_load_fills_the_template_of_a_fresh_optimizer(saved, world_size):
    """Issue #17: ``dcp.load`` into ``get_state_dict``'s template of an optimizer that has not
    stepped used to load no optimizer state at all, silently; our own :func:`checkpoint.load`
    is covered by the matrix above."""
    run_on_ranks(_torch_dcp_load_into_every_layer, world_size, saved, timeout=180)
