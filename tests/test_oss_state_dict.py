"""OSS state dicts: consolidation, torch format, round trips with plain optimizers, world sizes."""

from __future__ import annotations

import copy

import pytest
import torch

from sharded import OSS
from tests._harness import run_on_ranks
from tests._models import gpt
from tests.test_oss import _assert_close, _train

WORLD_SIZES = [1, 2, 3]
ADAM = dict(lr=1e-2, weight_decay=0.01)


def _assert_state_dicts_equal(ours, ref):
    assert ours["param_groups"] == ref["param_groups"]
    assert ours["state"].keys() == ref["state"].keys()
    for index, state in ref["state"].items():
        assert state.keys() == ours["state"][index].keys()
        for key, value in state.items():
            torch.testing.assert_close(ours["state"][index][key], value, rtol=1e-5, atol=1e-6,
                                       msg=f"state {index}/{key}")


def _check_round_trips(rank, world):
    ref, ours = gpt(), gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
    our_opt = OSS(ours.parameters(), torch.optim.AdamW, **ADAM)
    _train(ref, ref_opt, rank, 3)
    _train(ours, our_opt, rank, 3)

    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        our_opt.state_dict()
    our_opt.consolidate_state_dict(recipient_rank=world - 1)
    if rank == world - 1:
        consolidated = our_opt.state_dict()
        _assert_state_dicts_equal(consolidated, ref_opt.state_dict())
    else:
        with pytest.raises(RuntimeError, match=f"rank {rank}"):
            our_opt.state_dict()

    everywhere = our_opt.state_dict(all_ranks=True)
    _assert_state_dicts_equal(everywhere, ref_opt.state_dict())

    # OSS state -> plain optimizer, and plain optimizer state -> fresh OSS; both continue like ref
    plain_model, resumed_model = gpt(), gpt()
    for m in (plain_model, resumed_model):
        m.load_state_dict(ref.state_dict())
    plain = torch.optim.AdamW(plain_model.parameters(), **ADAM)
    plain.load_state_dict(everywhere)
    resumed = OSS(resumed_model.parameters(), torch.optim.AdamW, **ADAM)
    resumed.load_state_dict(ref_opt.state_dict())
    for model, opt in ((ref, ref_opt), (plain_model, plain), (resumed_model, resumed)):
        _train(model, opt, rank, 3, first_step=3)
    _assert_close(plain_model, ref, "plain optimizer loaded from OSS")
    _assert_close(resumed_model, ref, "OSS loaded from a plain optimizer")

    with pytest.raises(RuntimeError):
        resumed.state_dict()  # stepped since: the old consolidation must not be served


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_round_trips_with_plain_optimizers(world_size):
    run_on_ranks(_check_round_trips, world_size)


def _check_state_dict_reads_current_hyperparameters(rank, world):
    ref, ours = gpt(), gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
    our_opt = OSS(ours.parameters(), torch.optim.AdamW, **ADAM)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in (ref_opt, our_opt)]
    _train(ref, ref_opt, rank, 2)
    _train(ours, our_opt, rank, 2)

    recipient = world - 1
    our_opt.consolidate_state_dict(recipient_rank=recipient)
    for opt, scheduler in zip((ref_opt, our_opt), schedulers):
        scheduler.step()  # hyperparameters change between consolidating and saving
        opt.param_groups[0]["weight_decay"] = 0.3
    if rank == recipient:
        saved = our_opt.state_dict()
        _assert_state_dicts_equal(saved, ref_opt.state_dict())
        saved["param_groups"][0]["lr"] = 123.0  # the caller's dict, as torch's state_dict() gives
        _assert_state_dicts_equal(our_opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_reads_hyperparameters_changed_after_consolidation(world_size):
    run_on_ranks(_check_state_dict_reads_current_hyperparameters, world_size)


def _as_saved_by_old_torch(state_dict):
    """``state_dict`` as torch < 1.12 wrote it (fairscale-era checkpoints): a float ``step``, and
    none of the param-group keys later versions added."""
    old = copy.deepcopy(state_dict)
    for state in old["state"].values():
        state["step"] = float(state["step"])
    for group in old["param_groups"]:
        for key in ("foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"):
            group.pop(key, None)
    return old


def _check_old_format_state_dict_loads(rank, world):
    for optimizer_class, kwargs in ((torch.optim.AdamW, ADAM), (torch.optim.Adam, dict(lr=1e-2, amsgrad=True))):
        ref, ours = gpt(), gpt()
        ref_opt = optimizer_class(ref.parameters(), **kwargs)
        _train(ref, ref_opt, rank, 2)
        ours.load_state_dict(ref.state_dict())
        old = _as_saved_by_old_torch(ref_opt.state_dict())
        ref_opt = optimizer_class(ref.parameters(), **kwargs)
        ref_opt.load_state_dict(copy.deepcopy(old))  # torch upgrades the old format as it loads
        our_opt = OSS(ours.parameters(), optimizer_class, **kwargs)
        our_opt.load_state_dict(old)
        _train(ref, ref_opt, rank, 2, first_step=2)
        _train(ours, our_opt, rank, 2, first_step=2)
        _assert_close(ours, ref, f"{optimizer_class.__name__} resumed from an old-format state dict")
        _assert_state_dicts_equal(our_opt.state_dict(all_ranks=True), ref_opt.state_dict())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_saved_by_old_torch_loads_as_into_a_plain_optimizer(world_size):
    run_on_ranks(_check_old_format_state_dict_loads, world_size)


def _save_checkpoint(rank, world, path):
    model = gpt()
    opt = OSS(model.parameters(), torch.optim.AdamW, **ADAM)
    _train(model, opt, rank, 3)
    opt.consolidate_state_dict(recipient_rank=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)


def _resume_checkpoint(rank, world, path):
    checkpoint = torch.load(path, weights_only=True)
    ref, ours = gpt(), gpt()
    ref.load_state_dict(checkpoint["model"])
    ours.load_state_dict(checkpoint["model"])
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
    ref_opt.load_state_dict(checkpoint["optim"])
    our_opt = OSS(ours.parameters(), torch.optim.AdamW, **ADAM)
    our_opt.load_state_dict(checkpoint["optim"])
    for p, owner in our_opt.param_to_rank.items():
        assert (p in our_opt.optim.state) == (owner == rank), "state kept by the wrong rank"
    _train(ref, ref_opt, rank, 3, first_step=3)
    _train(ours, our_opt, rank, 3, first_step=3)
    _assert_close(ours, ref, f"resumed on world {world}")


def test_state_dict_saved_on_two_ranks_resumes_on_one_and_three(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    run_on_ranks(_save_checkpoint, 2, path)
    for world in (1, 3):
        run_on_ranks(_resume_checkpoint, world, path)


def _check_bad_state_dicts(rank, world):
    model = gpt()
    opt = OSS(model.parameters(), torch.optim.Adam, lr=1e-3)
    _train(model, opt, rank, 1)
    full = opt.state_dict(all_ranks=True)

    if world > 1:
        with pytest.raises(ValueError, match=r"param groups of sizes .* a per-rank shard"):
            opt.load_state_dict(opt.optim.state_dict())

    other = gpt(vocab=32)
    for p in other.parameters():
        p.grad = torch.zeros_like(p)
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-3)
    other_opt.step()
    with pytest.raises(ValueError, match=r"parameter 0 has shape \(32, 32\).*\(64, 32\)"):
        opt.load_state_dict(other_opt.state_dict())

    opt.load_state_dict(full)  # the good one still loads after the failed attempts


@pytest.mark.parametrize("world_size", [1, 2])
def test_loading_a_state_dict_of_the_wrong_shape_raises(world_size):
    run_on_ranks(_check_bad_state_dicts, world_size)
