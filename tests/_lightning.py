"""Rank-side and parent-side pieces shared by the Lightning tests: a LightningModule around the
example GPT, Trainers as each rank builds them, and the comparisons against Lightning's "ddp".

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
import warnings
from typing import Any, Callable

import lightning as L
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests._models import gpt, gpt_loss, token_batch

SGD_TOL = dict(atol=1e-6, rtol=1e-5)
ADAM_LR = 1e-2
STEPS = 4  # optimizer steps per run; the data is 2 batches per epoch, so 2 epochs


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
        optimizer = torch.optim.AdamW(decay_groups(self), lr=ADAM_LR)
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


def decay_groups(module: torch.nn.Module) -> list[dict]:
    return [
        {"params": [p for p in module.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def loader(rank: int, batches: int = 2) -> DataLoader:
    return DataLoader([token_batch(rank, step) for step in range(batches)], batch_size=None)


def make_trainer(rank: int, world: int, root: str, strategy: Any, **kwargs: Any) -> L.Trainer:
    # Lightning's teardown deletes WORLD_SIZE, so every Trainer gets the variables afresh.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    return L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, default_root_dir=root, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, **{"max_steps": STEPS, **kwargs},
    )


def weights_of(module: torch.nn.Module) -> list[float]:
    """All parameters, whole, as one list (tensors would leave a rank by a file descriptor that
    dies with it). Collective when they are sharded (DTensors)."""
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in module.parameters()]
    return torch.cat([p.detach().reshape(-1).float() for p in full]).tolist()


def fit(rank: int, world: int, root: str, strategy: Any, recipe: str = "sgd", **kwargs: Any) -> dict:
    """Fit a fresh GPTModule; its final weights, what was built, and the warnings raised."""
    module, evidence = GPTModule(recipe), Evidence()
    trainer = make_trainer(rank, world, root, strategy, callbacks=[evidence], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(rank))
    return {
        "weights": weights_of(module),
        "wrapper": evidence.wrapper,
        "optimizer": evidence.optimizer,
        "grads_held": evidence.grads_held,
        "lrs": [group["lr"] for group in trainer.optimizers[0].param_groups],
        "warnings": [str(w.message) for w in caught],
        "trainer": trainer,
    }


def fp16_plugin() -> MixedPrecision:
    # Lightning turns precision="16-mixed" into bf16 on CPU, so fp16 comes as a plugin. With the
    # loss halved for accumulation over 2, a scale of 2**21 overflows in the first step only.
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**21))


def fabric_run(rank: int, world: int, name: str, strategy: Any, root: str) -> dict:
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
    path = os.path.join(root, f"fabric-{name}.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "schedule": schedule})
    model, optimizer, schedule = setup()
    fabric.load(path, {"model": model, "optimizer": optimizer, "schedule": schedule})
    norms += train(model, optimizer, schedule, range(2, 4))
    return {
        "weights": weights_of(model),
        "norms": norms,
        "optimizer": type(optimizer.optimizer).__name__,
        "wrapper": type(model._forward_module).__name__,
        "lrs": [group["lr"] for group in optimizer.param_groups],
        "scaler": type(fabric.strategy.precision.scaler).__name__,
        "scale": fabric.strategy.precision.scaler.get_scale(),
    }


def quiet_lightning() -> None:
    """Keep Lightning's per-Trainer banners out of the output that failures show."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


def error_of(run: Callable[[], Any]) -> str:
    try:
        run()
    except Exception as error:  # the message is what the tests check
        return f"{type(error).__name__}: {error}"
    return "no error"


def final_weights(launches: dict, name: str) -> torch.Tensor:
    """Rank 0's final weights of a two-rank run, after checking every rank holds the same."""
    ranks = [torch.tensor(runs[name]["weights"]) for runs in launches["two"]]
    for rank, weights in enumerate(ranks[1:], start=1):
        assert torch.equal(weights, ranks[0]), f"{name}: rank {rank}'s replica differs from rank 0's"
    return ranks[0]


def assert_sgd_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(ours, ref, **SGD_TOL, msg=lambda m: f"{what}: {m}")


def assert_adam_close(ours: torch.Tensor, ref: torch.Tensor, what: str, steps: int = STEPS) -> None:
    diff = (ours - ref).abs()
    assert diff.max() <= 0.1 * ADAM_LR * steps, f"{what}: max diff {diff.max():.3g}"
    assert diff.mean() <= 1e-6, f"{what}: mean diff {diff.mean():.3g}"
