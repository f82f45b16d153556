"""sharded.lightning in a real ``lightning.Trainer`` and ``lightning.Fabric``, against Lightning's own
``"ddp"`` strategy on the same model (the example GPT, tiny), seed and data.

Each world size is one launch (tests/_harness.py) that runs every configuration in turn and
returns each rank's final weights; the tests below compare them here. Lightning sees the ranks as
launched externally (``LOCAL_RANK``/``WORLD_SIZE`` set) and finds the gloo group initialised, so
it neither spawns processes nor initialises a group of its own.

Tolerances. With SGD the update is linear in the gradient, and at world 2 a reduce and an
all-reduce add the same two numbers, so sharded and DDP agree to float32 rounding (``SGD_TOL``;
they come out equal in practice). AdamW's ``m / sqrt(v)`` is scale-free, so ulp noise on a
near-zero gradient element may move that element by up to ``lr`` per step: the worst element
may differ by ``0.1 * lr * steps``, the mean difference must stay at rounding level (``1e-6``),
which a real bug (a wrong schedule, a lost shard of state) would not.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from functools import partial
from typing import Any, Callable

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

import sharded.lightning
from sharded import ShardedGradScaler
from sharded.lightning import ShardedDDPStrategy
from tests._harness import run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

SGD_TOL = dict(atol=1e-6, rtol=1e-5)
ADAM_LR = 1e-2
STEPS = 4  # optimizer steps per run; the data is 2 batches per epoch, so 2 epochs
SHARDED = ("ddp_sharded", "ddp_zero1")


# --------------------------------------------------------------------------- rank side


class GPTModule(L.LightningModule):
    """The example GPT. ``recipe``: "sgd" (momentum), "adamw" (decay and no-decay groups, an lr
    halving every step), or "lbfgs" (which OSS cannot shard)."""

    def __init__(self, recipe: str = "sgd") -> None:
        super().__init__()
        self.model = gpt()
        self.recipe = recipe

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return gpt_loss(self.model, batch)

    def configure_optimizers(self) -> Any:
        if self.recipe == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.recipe == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        optimizer = torch.optim.AdamW(_decay_groups(self), lr=ADAM_LR)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ManualGPTModule(GPTModule):
    automatic_optimization = False


class Evidence(L.Callback):
    """What the strategy really built, seen just before each optimizer step."""

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.wrapper = type(trainer.strategy.model).__name__
        self.optimizer = type(optimizer).__name__
        self.grads_held = sum(p.grad is not None for p in module.parameters())


def _decay_groups(module: torch.nn.Module) -> list[dict]:
    return [
        {"params": [p for p in module.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def _loader(rank: int, batches: int = 2) -> DataLoader:
    return DataLoader([token_batch(rank, step) for step in range(batches)], batch_size=None)


def _trainer(rank: int, world: int, root: str, strategy: Any, **kwargs: Any) -> L.Trainer:
    # Lightning's teardown deletes WORLD_SIZE, so every Trainer gets the variables afresh.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    return L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, default_root_dir=root, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, **{"max_steps": STEPS, **kwargs},
    )


def _weights(module: torch.nn.Module) -> list[float]:
    """All parameters as one list (tensors would leave a rank by a file descriptor that dies with it)."""
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()]).tolist()


def _fit(rank: int, world: int, root: str, strategy: Any, recipe: str = "sgd", **kwargs: Any) -> dict:
    """Fit a fresh GPTModule; its final weights, what was built, and the warnings raised."""
    module, evidence = GPTModule(recipe), Evidence()
    trainer = _trainer(rank, world, root, strategy, callbacks=[evidence], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _loader(rank))
    return {
        "weights": _weights(module),
        "wrapper": evidence.wrapper,
        "optimizer": evidence.optimizer,
        "grads_held": evidence.grads_held,
        "lrs": [group["lr"] for group in trainer.optimizers[0].param_groups],
        "warnings": [str(w.message) for w in caught],
        "trainer": trainer,
    }


def _fp16_plugin() -> MixedPrecision:
    # Lightning turns precision="16-mixed" into bf16 on CPU, so fp16 comes as a plugin. With the
    # loss halved for accumulation over 2, a scale of 2**21 overflows in the first step only.
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**21))


def _trainer_configs(rank: int, world: int, root: str) -> dict[str, dict]:
    """Every Trainer configuration at world 2; name -> what ``_fit`` returns (Trainer dropped)."""
    fit = partial(_fit, rank, world, root)
    runs: dict[str, dict] = {}
    for strategy in ("ddp", *SHARDED):
        runs[f"sgd/{strategy}"] = fit(strategy)
        runs[f"accumulate_clip/{strategy}"] = fit(strategy, accumulate_grad_batches=2, gradient_clip_val=0.05)
        runs[f"adamw_bf16/{strategy}"] = fit(strategy, "adamw", precision="bf16-mixed")
        fp16 = fit(strategy, plugins=[_fp16_plugin()], accumulate_grad_batches=2)
        scaler = fp16["trainer"].precision_plugin.scaler
        runs[f"fp16/{strategy}"] = {**fp16, "scaler": type(scaler).__name__, "scale": scaler.get_scale()}
    runs["accumulate/ddp"] = fit("ddp", accumulate_grad_batches=2)
    runs["stage2_object/ddp_sharded"] = fit(
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
        trainer = _trainer(rank, world, root, strategy, max_epochs=1, precision="bf16-mixed")
        trainer.fit(GPTModule("adamw"), _loader(rank))
        trainer.save_checkpoint(path)
        module = GPTModule("adamw")
        trainer = _trainer(rank, world, root, strategy, max_epochs=2, max_steps=-1, precision="bf16-mixed")
        trainer.fit(module, _loader(rank), ckpt_path=path)
        runs[f"resume/{strategy}"] = {"weights": _weights(module)}
    return runs


def _refit_configs(rank: int, world: int, root: str) -> dict[str, dict]:
    """Fit the same LightningModule twice, in two Trainers."""
    runs = {}
    for strategy in ("ddp", "ddp_sharded"):
        module = GPTModule()
        for _ in range(2):
            _trainer(rank, world, root, strategy).fit(module, _loader(rank))
        runs[f"refit/{strategy}"] = {"weights": _weights(module)}
    return runs


def _fabric_run(rank: int, world: int, strategy: str, root: str) -> dict:
    """A Fabric loop in fp16 (the first step overflows and is skipped): SGD with a scheduler passed
    to setup, accumulation over 2 micro-batches with ``no_backward_sync``, clipping by norm, then
    save, load into a fresh setup, and 2 more steps."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    fp16 = FabricMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**21))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, plugins=[fp16])
    fabric.launch()

    def setup() -> tuple:
        model = gpt()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return fabric.setup(model, optimizer, scheduler=schedule)

    def train(model: Any, optimizer: Any, schedule: Any, steps: range) -> list[float]:
        norms = []
        for step in steps:
            for micro in range(2):
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    fabric.backward(gpt_loss(model, token_batch(rank, 2 * step + micro)) / 2)
            norm = fabric.clip_gradients(model, optimizer, max_norm=0.05, error_if_nonfinite=False)
            norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
        return norms

    model, optimizer, schedule = setup()
    norms = train(model, optimizer, schedule, range(2))
    path = os.path.join(root, f"fabric-{strategy}.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "schedule": schedule})
    model, optimizer, schedule = setup()
    fabric.load(path, {"model": model, "optimizer": optimizer, "schedule": schedule})
    norms += train(model, optimizer, schedule, range(2, 4))
    return {
        "weights": _weights(model),
        "norms": norms,
        "optimizer": type(optimizer.optimizer).__name__,
        "wrapper": type(model._forward_module).__name__,
        "lrs": [group["lr"] for group in optimizer.param_groups],
        "scaler": type(fabric.strategy.precision.scaler).__name__,
        "scale": fabric.strategy.precision.scaler.get_scale(),
    }


def _at_two_ranks(rank: int, world: int, root: str) -> dict[str, dict]:
    _quiet_lightning()
    runs = _trainer_configs(rank, world, root)
    runs.update(_resume_configs(rank, world, root))
    runs.update(_refit_configs(rank, world, root))
    for strategy in ("ddp", *SHARDED):
        runs[f"fabric/{strategy}"] = _fabric_run(rank, world, strategy, root)
    return runs


def _at_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Resume the two-rank checkpoints at one process, then the error cases."""
    _quiet_lightning()
    runs: dict[str, Any] = {}
    for strategy in ("ddp", *SHARDED):
        module = GPTModule("adamw")
        trainer = _trainer(rank, world, root, strategy, max_epochs=2, max_steps=-1, precision="bf16-mixed")
        trainer.fit(module, _loader(rank), ckpt_path=os.path.join(root, f"{strategy}.ckpt"))
        runs[f"resume_at_1/{strategy}"] = {"weights": _weights(module)}
    checkpoint = torch.load(os.path.join(root, "ddp_sharded.ckpt"), map_location="cpu", weights_only=False)
    runs["saved_optimizer_states"] = len(checkpoint["optimizer_states"][0]["state"])
    runs["params"] = len(list(GPTModule().parameters()))
    runs["errors"] = {
        "lbfgs": _error_of(lambda: _trainer(rank, world, root, "ddp_sharded").fit(GPTModule("lbfgs"), _loader(rank))),
        "manual": _error_of(lambda: _trainer(rank, world, root, "ddp_sharded").fit(ManualGPTModule(), _loader(rank))),
    }
    return runs


def _quiet_lightning() -> None:
    """Keep Lightning's per-Trainer banners out of the output that failures show."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _error_of(run: Callable[[], Any]) -> str:
    try:
        run()
    except Exception as error:  # the message is what the tests check
        return f"{type(error).__name__}: {error}"
    return "no error"


# ------------------------------------------------------------------------- parent side


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, Any]:
    """Both launches: two ranks (every configuration, checkpoints saved), then one (resumed)."""
    root = str(tmp_path_factory.mktemp("lightning"))
    two = run_on_ranks(_at_two_ranks, 2, root, timeout=240)
    one = run_on_ranks(_at_one_rank, 1, root, timeout=120)
    return {"two": two, "one": one[0]}


def _final(launches: dict, name: str) -> torch.Tensor:
    """Rank 0's final weights of a two-rank run, after checking every rank holds the same."""
    ranks = [torch.tensor(runs[name]["weights"]) for runs in launches["two"]]
    for rank, weights in enumerate(ranks[1:], start=1):
        assert torch.equal(weights, ranks[0]), f"{name}: rank {rank}'s replica differs from rank 0's"
    return ranks[0]


def _assert_sgd_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(ours, ref, **SGD_TOL, msg=lambda m: f"{what}: {m}")


def _assert_adam_close(ours: torch.Tensor, ref: torch.Tensor, what: str, steps: int = STEPS) -> None:
    diff = (ours - ref).abs()
    assert diff.max() <= 0.1 * ADAM_LR * steps, f"{what}: max diff {diff.max():.3g}"
    assert diff.mean() <= 1e-6, f"{what}: mean diff {diff.mean():.3g}"


@pytest.mark.parametrize("strategy", SHARDED)
def test_trainer_strategy_matches_ddp_and_really_shards(launches, strategy):
    _assert_sgd_close(_final(launches, f"sgd/{strategy}"), _final(launches, "sgd/ddp"), strategy)
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
    ref = _final(launches, "accumulate_clip/ddp")
    assert not torch.allclose(ref, _final(launches, "accumulate/ddp")), "clip_val too large to clip anything"
    _assert_sgd_close(_final(launches, f"accumulate_clip/{strategy}"), ref, f"{strategy} accumulate 2 + clip")


@pytest.mark.parametrize("strategy", SHARDED)
def test_adamw_param_groups_scheduler_and_bf16_match_ddp(launches, strategy):
    ours, ref = launches["two"][0][f"adamw_bf16/{strategy}"], launches["two"][0]["adamw_bf16/ddp"]
    _assert_adam_close(_final(launches, f"adamw_bf16/{strategy}"), _final(launches, "adamw_bf16/ddp"), strategy)
    assert ours["lrs"] == ref["lrs"] == [ADAM_LR * 0.5**STEPS] * 2, "the scheduler did not drive OSS"
    assert not [w for w in ours["warnings"] if "lr_scheduler" in w or "optimizer.step()" in w], ours["warnings"]


@pytest.mark.parametrize("strategy", SHARDED)
def test_fp16_loss_scaling_with_accumulation_agrees_across_ranks_and_matches_ddp(launches, strategy):
    ours, ref = launches["two"][0][f"fp16/{strategy}"], launches["two"][0]["fp16/ddp"]
    assert ours["scaler"] == "ShardedGradScaler"
    assert ours["scale"] == ref["scale"] == 2.0**20, "expected exactly one skipped step"
    _assert_sgd_close(_final(launches, f"fp16/{strategy}"), _final(launches, "fp16/ddp"), f"{strategy} fp16")


def test_strategy_object_with_small_buckets_matches_ddp(launches):
    _assert_adam_close(
        _final(launches, "stage2_object/ddp_sharded"), _final(launches, "adamw_bf16/ddp"), "ShardedDDPStrategy(stage=2)"
    )


@pytest.mark.parametrize("strategy", SHARDED)
def test_save_and_resume_match_uninterrupted_ddp(launches, strategy):
    _assert_adam_close(_final(launches, f"resume/{strategy}"), _final(launches, "adamw_bf16/ddp"), f"{strategy} resumed")


def test_checkpoint_holds_the_whole_optimizer_state_in_torch_format(launches):
    assert launches["one"]["saved_optimizer_states"] == launches["one"]["params"]


@pytest.mark.parametrize("strategy", SHARDED)
def test_resume_at_one_process_matches_ddp_resumed_there(launches, strategy):
    ours, ref = launches["one"][f"resume_at_1/{strategy}"], launches["one"]["resume_at_1/ddp"]
    what = f"{strategy} resumed at 1 process"
    _assert_adam_close(torch.tensor(ours["weights"]), torch.tensor(ref["weights"]), what, steps=STEPS // 2)


def test_a_module_fitted_twice_matches_ddp(launches):
    _assert_sgd_close(_final(launches, "refit/ddp_sharded"), _final(launches, "refit/ddp"), "second fit")


@pytest.mark.parametrize("strategy", SHARDED)
def test_fabric_strategy_matches_ddp_in_fp16_with_accumulation_clipping_and_save_load(launches, strategy):
    ours, ref = launches["two"][0][f"fabric/{strategy}"], launches["two"][0]["fabric/ddp"]
    _assert_sgd_close(_final(launches, f"fabric/{strategy}"), _final(launches, "fabric/ddp"), f"fabric {strategy}")
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
    strategy = ShardedDDPStrategy(find_unused_parameters=True, static_graph=True, broadcast_buffers=False)
    assert strategy._wrapper_kwargs == {"broadcast_buffers": False, "reduce_fp16": False}


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
