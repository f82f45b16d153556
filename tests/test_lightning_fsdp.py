"""``ShardedFSDPStrategy`` (``strategy="sharded_fsdp"``) in a real ``lightning.Trainer``, against
Lightning's own ``"ddp"`` on the same model (the example GPT, tiny), seed and data.

As in test_lightning.py: one launch at two ranks runs every configuration and saves the
checkpoints, one launch at one process resumes them; the tests compare what the ranks returned.
Tolerances are explained in tests/_lightning.py. At world 2 a reduce-scatter adds the same two
numbers as DDP's all-reduce, so SGD runs agree to float32 rounding.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.tensor import DTensor

from examples.gpt import Block
from sharded.fsdp.wrap import size_based_auto_wrap_policy
from sharded.lightning import ShardedFSDPStrategy
from sharded.lightning.fabric_fsdp import ShardedFSDPStrategy as FabricFSDPStrategy
from tests._harness import run_on_ranks
from tests._lightning import (
    GPTModule,
    assert_adam_close,
    SGD_TOL,
    assert_sgd_close,
    fabric_run,
    final_weights,
    fit,
    fp16_plugin,
    loader,
    make_trainer,
    quiet_lightning,
    weights_of,
)
from tests._models import gpt, gpt_loss, token_batch

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_one_node")
STATE_DICT_TYPES = ("full", "sharded")


# --------------------------------------------------------------------------- rank side


class MetaInitGPT(GPTModule):
    """The GPT built in ``configure_model``, optionally loaded with ``initial`` weights."""

    def __init__(self, initial: dict | None = None) -> None:
        L.LightningModule.__init__(self)
        self.recipe, self.initial = "sgd", initial

    def configure_model(self) -> None:
        self.model = gpt()
        self.built_on_meta = all(p.is_meta for p in self.model.parameters())
        if self.initial is not None:
            self.model.load_state_dict(self.initial)


class Observe(L.Callback):
    """Initial full weights, each rank's share of them, and the strategy's collectives."""

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        state = module.model.state_dict()
        self.initial = {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in state.items()}
        self.local_numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        strategy, rank = trainer.strategy, trainer.global_rank
        strategy.barrier("observe")
        self.collectives = {
            "broadcast": strategy.broadcast(f"from rank {rank}"),
            "sum": float(strategy.reduce(torch.tensor(float(rank)), reduce_op="sum")),
            "mean": float(strategy.reduce(torch.tensor(float(rank)))),
        }


class CountRecomputation(L.Callback):
    """How many times each block's MLP runs per optimizer step: 1, or 2 when backward recomputes it."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.calls = 0
        for block in module.model.blocks:
            block.mlp.register_forward_pre_hook(self._count)  # recomputation stops before its end

    def _count(self, *_: Any) -> None:
        self.calls += 1

    def runs_per_step(self, trainer: L.Trainer, module: L.LightningModule) -> float:
        return self.calls / (trainer.global_step * len(module.model.blocks))


def _fsdp(**kwargs: Any) -> ShardedFSDPStrategy:
    return ShardedFSDPStrategy(auto_wrap_policy={Block}, **kwargs)


def _observed_fit(rank: int, world: int, root: str, strategy: Any, module: L.LightningModule) -> dict:
    observe = Observe()
    make_trainer(rank, world, root, strategy, callbacks=[observe]).fit(module, loader(rank))
    return {"weights": weights_of(module), "initial": observe.initial, "local_numel": observe.local_numel,
            "collectives": observe.collectives, "built_on_meta": module.built_on_meta}


def _parity_configs(rank: int, world: int, root: str) -> dict[str, dict]:
    run = partial(fit, rank, world, root)
    runs = {
        "sgd/ddp": run("ddp"),
        "accumulate_clip/ddp": run("ddp", accumulate_grad_batches=2, gradient_clip_val=0.05),
        "adamw_bf16/ddp": run("ddp", "adamw", precision="bf16-mixed"),
    }
    for name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        runs[f"sgd/{name}"] = run(_fsdp(sharding_strategy=name))
    # replicated over 2 rows of 1 rank each: shards of one rank, gradients averaged across rows
    runs["sgd/HYBRID_SHARD"] = run(_fsdp(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 1)))
    # by default one row per node: here 1 node, so sharded over both ranks
    runs["sgd/HYBRID_SHARD_one_node"] = run(_fsdp(sharding_strategy="HYBRID_SHARD"))
    units_of_1000 = partial(size_based_auto_wrap_policy, min_num_params=1000)
    runs["accumulate_clip/policy_callable"] = run(
        ShardedFSDPStrategy(auto_wrap_policy=units_of_1000), accumulate_grad_batches=2, gradient_clip_val=0.05
    )
    for strategy in ("ddp", _fsdp()):
        result = run(strategy, plugins=[fp16_plugin()], accumulate_grad_batches=2)
        scaler = result["trainer"].precision_plugin.scaler
        runs[f"fp16/{'ddp' if strategy == 'ddp' else 'sharded_fsdp'}"] = {**result, "scale": scaler.get_scale(), "scaler": type(scaler).__name__}
    for result in runs.values():
        del result["trainer"]
    runs["adamw_bf16/activation_checkpointing"] = _checkpointed_fit(rank, world, root)
    for strategy in ("ddp", "sharded_fsdp"):
        module = GPTModule()
        for _ in range(2):
            make_trainer(rank, world, root, strategy).fit(module, loader(rank))
        runs[f"refit/{strategy}"] = {"weights": weights_of(module)}
    return runs


def _checkpointed_fit(rank: int, world: int, root: str) -> dict:
    module, count = GPTModule("adamw"), CountRecomputation()
    strategy = _fsdp(activation_checkpointing_policy={Block})
    trainer = make_trainer(rank, world, root, strategy, callbacks=[count], precision="bf16-mixed")
    trainer.fit(module, loader(rank))
    return {"weights": weights_of(module), "mlp_runs_per_step": count.runs_per_step(trainer, module)}


def _meta_init_configs(rank: int, world: int, root: str) -> dict[str, dict]:
    """configure_model under sharded_fsdp (on the meta device), then DDP from the same weights."""
    ours = _observed_fit(rank, world, root, "sharded_fsdp", MetaInitGPT())
    ref = _observed_fit(rank, world, root, "ddp", MetaInitGPT(initial=ours["initial"]))
    for result in (ours, ref):
        del result["initial"]
    return {"meta_init/sharded_fsdp": ours, "meta_init/ddp": ref}


def _resume_configs(rank: int, world: int, root: str) -> dict[str, dict]:
    """One epoch, save, a second epoch from the checkpoint in a new Trainer (as in test_lightning)."""
    strategies = {"ddp": lambda: "ddp", **{kind: partial(_fsdp, state_dict_type=kind) for kind in STATE_DICT_TYPES}}
    runs = {}
    for name, strategy in strategies.items():
        path = os.path.join(root, f"{name}.ckpt")
        trainer = make_trainer(rank, world, root, strategy(), max_epochs=1, precision="bf16-mixed")
        trainer.fit(GPTModule("adamw"), loader(rank))
        trainer.save_checkpoint(path)
        module = GPTModule("adamw")
        trainer = make_trainer(rank, world, root, strategy(), max_epochs=2, max_steps=-1, precision="bf16-mixed")
        trainer.fit(module, loader(rank), ckpt_path=path)
        runs[f"resume/{name}"] = {"weights": weights_of(module)}
    return runs


def _fabric_configs(rank: int, world: int, root: str) -> dict[str, dict]:
    """The Fabric loop of test_lightning.py (fp16, accumulation, clipping, save, load) per state_dict_type."""
    runs = {"fabric/ddp": fabric_run(rank, world, "ddp", "ddp", root)}
    for kind in STATE_DICT_TYPES:
        strategy = FabricFSDPStrategy(auto_wrap_policy={Block}, state_dict_type=kind)
        runs[f"fabric/{kind}"] = fabric_run(rank, world, kind, strategy, root)
    return runs


def _fabric_meta_init(rank: int, world: int) -> dict:
    """fabric.init_module(empty_init=True) then setup and one step: what each rank held."""
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="sharded_fsdp")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = gpt()
    built_on_meta = all(p.is_meta for p in model.parameters())
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = gpt_loss(model, token_batch(rank, 0))
    fabric.backward(loss)
    optimizer.step()
    local = sum(p.to_local().numel() for p in model.parameters())
    return {"built_on_meta": built_on_meta, "local_numel": local, "full_numel": len(weights_of(model)), "loss": loss.item()}


def _at_two_ranks(rank: int, world: int, root: str) -> dict[str, dict]:
    quiet_lightning()
    return {
        **_parity_configs(rank, world, root),
        **_meta_init_configs(rank, world, root),
        **_resume_configs(rank, world, root),
        **_fabric_configs(rank, world, root),
        "fabric_meta_init": _fabric_meta_init(rank, world),
    }


def _at_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Resume the two-rank checkpoints at one process: each with its own strategy, and the full
    one also under plain "ddp" (it is in torch's format); then read the full file as torch does."""
    quiet_lightning()
    resumes = {"ddp": ("ddp", "ddp"), "full/ddp": ("full", "ddp"),
               **{kind: (kind, partial(_fsdp, state_dict_type=kind)) for kind in STATE_DICT_TYPES}}
    runs: dict[str, Any] = {}
    for name, (saved, strategy) in resumes.items():
        module = GPTModule("adamw")
        trainer = make_trainer(rank, world, root, strategy if isinstance(strategy, str) else strategy(),
                               max_epochs=2, max_steps=-1, precision="bf16-mixed")
        trainer.fit(module, loader(rank), ckpt_path=os.path.join(root, f"{saved}.ckpt"))
        runs[f"resume_at_1/{name}"] = {"weights": weights_of(module)}
    full = torch.load(os.path.join(root, "full.ckpt"), map_location="cpu", weights_only=True)
    runs["full_file"] = {
        "keys": sorted(full["state_dict"]),
        "optimizer_keys": sorted(full["optimizer_states"][0]["state"]),
        "expected_keys": sorted(GPTModule().state_dict()),
    }
    runs["sharded_folder"] = sorted(p.name for p in Path(root, "sharded.ckpt").iterdir())
    return runs


# ------------------------------------------------------------------------- parent side


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("lightning_fsdp"))
    two = run_on_ranks(_at_two_ranks, 2, root, timeout=240)
    one = run_on_ranks(_at_one_rank, 1, root, timeout=120)
    return {"two": two, "one": one[0]}


@pytest.mark.parametrize("sharding_strategy", STRATEGIES)
def test_every_sharding_strategy_matches_ddp(launches, sharding_strategy):
    name = f"sgd/{sharding_strategy}"
    assert_sgd_close(final_weights(launches, name), final_weights(launches, "sgd/ddp"), sharding_strategy)
    assert launches["two"][0][name]["wrapper"] == "FullyShardedDataParallel"


def test_accumulation_clipping_and_a_policy_callable_match_ddp(launches):
    ours, ref = final_weights(launches, "accumulate_clip/policy_callable"), final_weights(launches, "accumulate_clip/ddp")
    assert_sgd_close(ours, ref, "accumulate_grad_batches=2 + gradient_clip_val")


def test_adamw_bf16_with_activation_checkpointing_recomputes_and_matches_ddp(launches):
    assert launches["two"][0]["adamw_bf16/activation_checkpointing"]["mlp_runs_per_step"] == 2
    ours, ref = final_weights(launches, "adamw_bf16/activation_checkpointing"), final_weights(launches, "adamw_bf16/ddp")
    assert_adam_close(ours, ref, "bf16-mixed + activation checkpointing")


def test_fp16_loss_scaling_with_accumulation_matches_ddp(launches):
    ours, ref = launches["two"][0]["fp16/sharded_fsdp"], launches["two"][0]["fp16/ddp"]
    assert ours["scaler"] == "ShardedGradScaler"
    assert ours["scale"] == ref["scale"] == 2.0**20, "expected exactly one skipped step"
    assert_sgd_close(final_weights(launches, "fp16/sharded_fsdp"), final_weights(launches, "fp16/ddp"), "fp16")


def test_a_module_fitted_twice_matches_ddp(launches):
    assert_sgd_close(final_weights(launches, "refit/sharded_fsdp"), final_weights(launches, "refit/ddp"), "second fit")


def test_configure_model_runs_on_the_meta_device_and_training_matches_ddp(launches):
    ours, ref = launches["two"][0]["meta_init/sharded_fsdp"], launches["two"][0]["meta_init/ddp"]
    assert ours["built_on_meta"] and not ref["built_on_meta"]
    full = len(ref["weights"])
    held = [runs["meta_init/sharded_fsdp"]["local_numel"] for runs in launches["two"]]
    assert sum(held) == full and max(held) < 0.6 * full, f"each rank should hold about half: {held} of {full}"
    assert_sgd_close(final_weights(launches, "meta_init/sharded_fsdp"), final_weights(launches, "meta_init/ddp"), "meta init")


def test_barrier_broadcast_and_reduce_behave_as_lightning_documents(launches):
    for runs in launches["two"]:
        assert runs["meta_init/sharded_fsdp"]["collectives"] == {"broadcast": "from rank 0", "sum": 1.0, "mean": 0.5}


@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
def test_save_and_resume_match_uninterrupted_ddp(launches, state_dict_type):
    ours, ref = final_weights(launches, f"resume/{state_dict_type}"), final_weights(launches, "adamw_bf16/ddp")
    assert_adam_close(ours, ref, f"state_dict_type={state_dict_type!r} resumed")


@pytest.mark.parametrize("resumed", [*STATE_DICT_TYPES, "full/ddp"])
def test_resume_at_one_process_matches_ddp_resumed_there(launches, resumed):
    ours, ref = launches["one"][f"resume_at_1/{resumed}"], launches["one"]["resume_at_1/ddp"]
    what = f"{resumed} checkpoint resumed at 1 process"
    assert_adam_close(torch.tensor(ours["weights"]), torch.tensor(ref["weights"]), what, steps=2)


def test_full_checkpoint_is_one_file_in_torch_format_and_sharded_one_a_folder_per_rank(launches):
    full = launches["one"]["full_file"]
    assert full["keys"] == full["expected_keys"]
    assert full["optimizer_keys"] == list(range(len(full["expected_keys"])))
    assert launches["one"]["sharded_folder"] == [".metadata", ".sharded-versions.json", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
def test_fabric_strategy_matches_ddp_in_fp16_with_accumulation_clipping_and_save_load(launches, state_dict_type):
    ours, ref = launches["two"][0][f"fabric/{state_dict_type}"], launches["two"][0]["fabric/ddp"]
    assert_sgd_close(final_weights(launches, f"fabric/{state_dict_type}"), final_weights(launches, "fabric/ddp"), "fabric")
    torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(ref["norms"]), **SGD_TOL)
    assert ref["norms"][0] == float("inf") and min(ref["norms"][1:]) > 0.05, "one overflow, then clipping"
    assert ours["scaler"] == "ShardedGradScaler" and ours["scale"] == ref["scale"] == 2.0**20
    assert ours["lrs"] == ref["lrs"] == [0.05 * 0.5**4] and ours["wrapper"] == "FullyShardedDataParallel"


def test_fabric_init_module_builds_on_the_meta_device_and_each_rank_holds_half(launches):
    held = [runs["fabric_meta_init"] for runs in launches["two"]]
    assert all(h["built_on_meta"] for h in held)
    full = held[0]["full_numel"]
    assert sum(h["local_numel"] for h in held) == full and max(h["local_numel"] for h in held) < 0.6 * full, held
    assert all(0 < h["loss"] < 10 for h in held), held


# ------------------------------------------------------------------- single process


def test_registered_as_sharded_fsdp_for_the_trainer_and_fabric():
    assert StrategyRegistry["sharded_fsdp"]["strategy"] is ShardedFSDPStrategy
    assert FABRIC_REGISTRY["sharded_fsdp"]["strategy"] is FabricFSDPStrategy


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(sharding_strategy="FULL"), ValueError, "sharding_strategy must be one of FULL_SHARD"),
        (dict(state_dict_type="dcp"), ValueError, "state_dict_type must be 'full' or 'sharded'"),
        (dict(auto_wrap_policy=[1]), TypeError, "auto_wrap_policy must be a set of module classes"),
        (dict(activation_checkpointing_policy=3), TypeError, "activation_checkpointing_policy must be"),
        (dict(mixed_precision="bf16"), TypeError, "mixed_precision must be a MixedPrecision"),
        (dict(use_orig_param=True), ValueError, "does not take use_orig_param;"),
        (dict(precision_plugin=FSDPPrecision("bf16-mixed")), TypeError, "got FSDPPrecision"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        ShardedFSDPStrategy(**kwargs)


def test_a_checkpoint_holding_arbitrary_objects_is_refused_naming_the_file(tmp_path):
    import argparse
    import pickle

    from sharded.lightning._fsdp_checkpoint import read_file

    path = tmp_path / "hparams.ckpt"
    torch.save({"hyper_parameters": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(pickle.UnpicklingError, match=f"rank 0: {path} holds an object"):
        read_file(path)


def test_torch_fsdp_argument_types_are_accepted():
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy

    strategy = ShardedFSDPStrategy(
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        cpu_offload=CPUOffload(offload_params=True),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    assert strategy.sharding_strategy.name == "SHARD_GRAD_OP"
    assert strategy._fsdp.cpu_offload.offload_params
    assert (strategy._fsdp.mixed_precision.param_dtype, strategy._fsdp.mixed_precision.reduce_dtype) == (
        torch.bfloat16,
        torch.float32,
    )
