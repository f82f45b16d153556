"""sharded.lightning in a real ``lightning.Trainer`` and ``lightning.Fabric``, against Lightning's own
``"ddp"`` strategy on the same model (the example GPT, tiny), seed and data.

Each world size is one launch (tests/_harness.py) that runs every configuration in turn and
returns each rank's final weights; the tests below compare them here. Lightning sees the ranks as
launched externally (``LOCAL_RANK``/``WORLD_SIZE`` set) and finds the gloo group initialised, so
it neither spawns processes nor initialises a group of its own.

The tolerances are explained in tests/_lightning.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from typing import Any

import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry

import sharded.lightning
from sharded import ShardedGradScaler
from sharded.lightning import ShardedDDPStrategy
from tests._harness import run_on_ranks
from tests._lightning import (
    ADAM_LR,
    SGD_TOL,
    STEPS,
    GPTModule,
    ManualGPTModule,
    assert_adam_close,
    assert_sgd_close,
    error_of,
    final_weights,
    fabric_run,
    fit,
    fp16_plugin,
    loader,
    make_trainer,
    quiet_lightning,
    weights_of,
)

SHARDED = ("ddp_sharded", "ddp_zero1")


def _trainer_configs(rank: int, world: int, root: str) -> dict[str, dict]:
    """Every Trainer configuration at world 2; name -> what ``fit`` returns (Trainer dropped)."""
    fit_here = partial(fit, rank, world, root)
    runs: dict[str, dict] = {}
    for strategy in ("ddp", *SHARDED):
        runs[f"sgd/{strategy}"] = fit_here(strategy)
        runs[f"accumulate_clip/{strategy}"] = fit_here(strategy, accumulate_grad_batches=2, gradient_clip_val=0.05)
        runs[f"adamw_bf16/{strategy}"] = fit_here(strategy, "adamw", precision="bf16-mixed")
        fp16 = fit_here(strategy, plugins=[fp16_plugin()], accumulate_grad_batches=2)
        scaler = fp16["trainer"].precision_plugin.scaler
        runs[f"fp16/{strategy}"] = {**fp16, "scaler": type(scaler).__name__, "scale": scaler.get_scale()}
    runs["accumulate/ddp"] = fit_here("ddp", accumulate_grad_batches=2)
    runs["stage2_object/ddp_sharded"] = fit_here(
        ShardedDDPStrategy(stage=2, reduce_buffer_size=500), "adamw", precision="bf16-mixed"
    )
    for run in runs.values():
        del run["trainer"]
    return runs


def _resume_configs(rank: int, world: int, root: str) -> dict[str, dict]:
    """Fit one epoch (2 steps), save, and fit a second epoch from the checkpoint in a new Trainer.

    Epochs, not ``max_steps``: resuming a checkpoint saved at the end of a fit reproduces the
    uninterrupted run by epochs, while with ``max_steps`` Lightning's own ``"ddp"`` resumes
    into a different run. The checkpoints stay in ``root`` for the launch at one process.
    """
    runs = {}
    for strategy in ("ddp", *SHARDED):
        path = os.path.join(root, f"{strategy}.ckpt")
        trainer = make_trainer(rank, world, root, strategy, max_epochs=1, precision="bf16-mixed")
        trainer.fit(GPTModule("adamw"), loader(rank))
        trainer.save_checkpoint(path)
        module = GPTModule("adamw")
        trainer = make_trainer(rank, world, root, strategy, max_epochs=2, max_steps=-1, precision="bf16-mixed")
        trainer.fit(module, loader(rank), ckpt_path=path)
        runs[f"resume/{strategy}"] = {"weights": weights_of(module)}
    return runs


def _refit_configs(rank: int, world: int, root: str) -> dict[str, dict]:
    """Fit the same LightningModule twice, in two Trainers."""
    runs = {}
    for strategy in ("ddp", "ddp_sharded"):
        module = GPTModule()
        for _ in range(2):
            make_trainer(rank, world, root, strategy).fit(module, loader(rank))
        runs[f"refit/{strategy}"] = {"weights": weights_of(module)}
    return runs


def _at_two_ranks(rank: int, world: int, root: str) -> dict[str, dict]:
    quiet_lightning()
    runs = _trainer_configs(rank, world, root)
    runs.update(_resume_configs(rank, world, root))
    runs.update(_refit_configs(rank, world, root))
    for strategy in ("ddp", *SHARDED):
        runs[f"fabric/{strategy}"] = fabric_run(rank, world, strategy, strategy, root)
    return runs


def _at_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Resume the two-rank checkpoints at one process, then the error cases."""
    quiet_lightning()
    runs: dict[str, Any] = {}
    for strategy in ("ddp", *SHARDED):
        module = GPTModule("adamw")
        trainer = make_trainer(rank, world, root, strategy, max_epochs=2, max_steps=-1, precision="bf16-mixed")
        trainer.fit(module, loader(rank), ckpt_path=os.path.join(root, f"{strategy}.ckpt"))
        runs[f"resume_at_1/{strategy}"] = {"weights": weights_of(module)}
    checkpoint = torch.load(os.path.join(root, "ddp_sharded.ckpt"), map_location="cpu", weights_only=True)
    runs["saved_optimizer_states"] = len(checkpoint["optimizer_states"][0]["state"])
    runs["params"] = len(list(GPTModule().parameters()))
    runs["errors"] = {
        "lbfgs": error_of(lambda: make_trainer(rank, world, root, "ddp_sharded").fit(GPTModule("lbfgs"), loader(rank))),
        "manual": error_of(lambda: make_trainer(rank, world, root, "ddp_sharded").fit(ManualGPTModule(), loader(rank))),
    }
    return runs


# ------------------------------------------------------------------------- parent side


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, Any]:
    """Both launches: two ranks (every configuration, checkpoints saved), then one (resumed)."""
    root = str(tmp_path_factory.mktemp("lightning"))
    two = run_on_ranks(_at_two_ranks, 2, root, timeout=240)
    one = run_on_ranks(_at_one_rank, 1, root, timeout=120)
    return {"two": two, "one": one[0]}


@pytest.mark.parametrize("strategy", SHARDED)
def test_trainer_strategy_matches_ddp_and_really_shards(launches, strategy):
    assert_sgd_close(final_weights(launches, f"sgd/{strategy}"), final_weights(launches, "sgd/ddp"), strategy)
    seen = launches["two"][0][f"sgd/{strategy}"]
    assert seen["optimizer"] == "OSS"
    if strategy == "ddp_sharded":  # gradients sharded: each rank holds only the ones it owns
        assert seen["wrapper"] == "ShardedDataParallel"
        held = [runs[f"sgd/{strategy}"]["grads_held"] for runs in launches["two"]]
        assert sum(held) == len(list(GPTModule().parameters())), held
    else:
        assert seen["wrapper"] == "DistributedDataParallel"


@pytest.mark.parametrize("strategy", SHARDED)
def test_accumulation_and_clipping_by_the_global_norm_match_ddp(launches, strategy):
    ref = final_weights(launches, "accumulate_clip/ddp")
    assert not torch.allclose(ref, final_weights(launches, "accumulate/ddp")), "clip_val too large to clip anything"
    assert_sgd_close(final_weights(launches, f"accumulate_clip/{strategy}"), ref, f"{strategy} accumulate 2 + clip")


@pytest.mark.parametrize("strategy", SHARDED)
def test_adamw_param_groups_scheduler_and_bf16_match_ddp(launches, strategy):
    ours, ref = launches["two"][0][f"adamw_bf16/{strategy}"], launches["two"][0]["adamw_bf16/ddp"]
    assert_adam_close(final_weights(launches, f"adamw_bf16/{strategy}"), final_weights(launches, "adamw_bf16/ddp"), strategy)
    assert ours["lrs"] == ref["lrs"] == [ADAM_LR * 0.5**STEPS] * 2, "the scheduler did not drive OSS"
    assert not [w for w in ours["warnings"] if "lr_scheduler" in w or "optimizer.step()" in w], ours["warnings"]


@pytest.mark.parametrize("strategy", SHARDED)
def test_fp16_loss_scaling_with_accumulation_agrees_across_ranks_and_matches_ddp(launches, strategy):
    ours, ref = launches["two"][0][f"fp16/{strategy}"], launches["two"][0]["fp16/ddp"]
    assert ours["scaler"] == "ShardedGradScaler"
    assert ours["scale"] == ref["scale"] == 2.0**20, "expected exactly one skipped step"
    assert_sgd_close(final_weights(launches, f"fp16/{strategy}"), final_weights(launches, "fp16/ddp"), f"{strategy} fp16")


def test_strategy_object_with_small_buckets_matches_ddp(launches):
    assert_adam_close(
        final_weights(launches, "stage2_object/ddp_sharded"), final_weights(launches, "adamw_bf16/ddp"), "ShardedDDPStrategy(stage=2)"
    )


@pytest.mark.parametrize("strategy", SHARDED)
def test_save_and_resume_match_uninterrupted_ddp(launches, strategy):
    assert_adam_close(final_weights(launches, f"resume/{strategy}"), final_weights(launches, "adamw_bf16/ddp"), f"{strategy} resumed")


def test_checkpoint_holds_the_whole_optimizer_state_in_torch_format(launches):
    assert launches["one"]["saved_optimizer_states"] == launches["one"]["params"]


@pytest.mark.parametrize("strategy", SHARDED)
def test_resume_at_one_process_matches_ddp_resumed_there(launches, strategy):
    ours, ref = launches["one"][f"resume_at_1/{strategy}"], launches["one"]["resume_at_1/ddp"]
    what = f"{strategy} resumed at 1 process"
    assert_adam_close(torch.tensor(ours["weights"]), torch.tensor(ref["weights"]), what, steps=STEPS // 2)


def test_a_module_fitted_twice_matches_ddp(launches):
    assert_sgd_close(final_weights(launches, "refit/ddp_sharded"), final_weights(launches, "refit/ddp"), "second fit")


@pytest.mark.parametrize("strategy", SHARDED)
def test_fabric_strategy_matches_ddp_in_fp16_with_accumulation_clipping_and_save_load(launches, strategy):
    ours, ref = launches["two"][0][f"fabric/{strategy}"], launches["two"][0]["fabric/ddp"]
    assert_sgd_close(final_weights(launches, f"fabric/{strategy}"), final_weights(launches, "fabric/ddp"), f"fabric {strategy}")
    torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(ref["norms"]), **SGD_TOL)
    assert ref["norms"][0] == float("inf") and min(ref["norms"][1:]) > 0.05, "one overflow, then clipping"
    assert ours["scaler"] == "ShardedGradScaler" and ours["scale"] == ref["scale"] == 2.0**20
    assert ours["optimizer"] == "OSS" and ours["lrs"] == ref["lrs"] == [0.05 * 0.5**4]
    assert ours["wrapper"] == ("ShardedDataParallel" if strategy == "ddp_sharded" else "DistributedDataParallel")


def test_an_optimizer_oss_cannot_shard_is_refused_by_name(launches):
    error = launches["one"]["errors"]["lbfgs"]
    assert error.startswith("TypeError: rank 0: optimizer 0 (torch.optim.lbfgs.LBFGS) cannot be sharded"), error


def test_manual_optimization_at_stage_2_is_refused_with_the_way_out(launches):
    error = launches["one"]["errors"]["manual"]
    assert error.startswith("RuntimeError: rank 0: ShardedDDPStrategy(stage=2) needs automatic optimization"), error
    assert "stage=1" in error


# ------------------------------------------------------------------- single process


def test_registered_for_the_trainer_and_fabric_with_their_stages():
    for registry in (StrategyRegistry, FABRIC_REGISTRY):
        assert registry["ddp_sharded"]["init_params"] == {"stage": 2}
        assert registry["ddp_zero1"]["init_params"] == {"stage": 1}
    assert StrategyRegistry["ddp_sharded"]["strategy"] is ShardedDDPStrategy
    assert FABRIC_REGISTRY["ddp_sharded"]["strategy"] is sharded.lightning.fabric.ShardedDDPStrategy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stage=3), "stage must be 1"),
        (dict(stage=1, reduce_fp16=True), "reduce_fp16 applies to stage=2 only"),
        (dict(stage=1, reduce_buffer_size=100), "pass bucket_cap_mb instead"),
        (dict(stage=2, bucket_cap_mb=25), "does not take bucket_cap_mb"),
        (dict(stage=2, ddp_comm_hook=print), "ddp_comm_hook configure DDP's gradient all-reduce"),
        (dict(stage=1, model_averaging_period=4), "model_averaging_period"),
    ],
)
def test_bad_strategy_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardedDDPStrategy(**kwargs)


def test_ddp_options_that_sharded_ddp_learns_by_itself_are_accepted_at_stage_2():
    strategy = ShardedDDPStrategy(find_unused_parameters=True, broadcast_buffers=False)
    assert strategy._wrapper_kwargs == {"broadcast_buffers": False, "reduce_fp16": False}


def test_static_graph_is_passed_to_sharded_ddp_at_stage_2():
    strategy = ShardedDDPStrategy(find_unused_parameters=True, static_graph=True)
    assert strategy._wrapper_kwargs == {"static_graph": True, "reduce_fp16": False}


def test_precision_plugins_become_sharded_and_others_are_refused():
    from lightning.pytorch.plugins.precision import DoublePrecision

    from sharded.lightning.precision import ShardedDoublePrecision, ShardedMixedPrecision

    strategy = ShardedDDPStrategy(precision_plugin=MixedPrecision("16-mixed", "cpu"))
    assert isinstance(strategy.precision_plugin, ShardedMixedPrecision)
    assert isinstance(strategy.precision_plugin.scaler, ShardedGradScaler)
    assert isinstance(ShardedDDPStrategy(precision_plugin=DoublePrecision()).precision_plugin, ShardedDoublePrecision)

    class CustomPrecision(MixedPrecision):
        pass

    with pytest.raises(TypeError, match="got .*CustomPrecision"):
        ShardedDDPStrategy(precision_plugin=CustomPrecision("bf16-mixed", "cpu"))


def test_core_package_imports_no_lightning():
    code = "import sys, sharded; assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]"
    subprocess.run([sys.executable, "-c", code], check=True)
