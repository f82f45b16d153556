"""``ShardedFSDPStrategy(shard_placement_fn=...)``: the Lightning strategy places matrices
``Owned()`` (through ``sharded.FullyShardedDataParallel``), and its full checkpoint holds them
whole, with their optimizer state: the file equals, bit for bit, the one the same strategy writes
for the element-sharded model.

One launch at world 3, where the owners are ranks 1 and 2 and rank 0, which writes the file, owns
nothing. Every rank trains on the same batches, so every gradient is a sum of equal terms and
AdamW steps both layouts to the same bits.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from sharded.fsdp import Owned
from sharded.lightning import ShardedFSDPStrategy
from tests._harness import run_on_ranks
from tests._lightning import make_trainer, quiet_lightning

OWNERS = {"model.0.weight": Owned(2), "model.1.weight": Owned(1), "model.2.weight": Owned(2)}


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return (self.model(batch) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def _loader() -> DataLoader:
    """The same batches on every rank."""
    return DataLoader([torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + i)) for i in range(2)], batch_size=None)


def _fit_and_save(rank: int, world: int, root: str, owned: bool) -> str:
    module = _Net()
    table = {id(p): OWNERS.get(name) for name, p in module.named_parameters()}
    placement = (lambda p: table[id(p)]) if owned else None
    strategy = ShardedFSDPStrategy(state_dict_type="full", shard_placement_fn=placement)
    trainer = make_trainer(rank, world, root, strategy, max_steps=2)
    trainer.fit(module, _loader())
    held = [p.to_local().numel() for p in module.parameters() if p.ndim == 2]
    whole = [p.numel() for p in module.parameters() if p.ndim == 2]
    expected = [n if OWNERS[f"model.{i}.weight"].rank == rank else 0 for i, n in enumerate(whole)]
    assert not owned or held == expected, f"rank {rank} holds {held} of the matrices, expected {expected}"
    path = os.path.join(root, f"{'owned' if owned else 'cut'}.ckpt")
    trainer.save_checkpoint(path)
    return path


def _save_both(rank: int, world: int, root: str) -> None:
    quiet_lightning()
    _fit_and_save(rank, world, root, owned=True)
    _fit_and_save(rank, world, root, owned=False)


def _assert_same(ours, theirs, what: str) -> None:
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), f"{what}: {list(ours)} against {list(theirs)}"
        for key in theirs:
            _assert_same(ours[key], theirs[key], f"{what}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), what
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, f"{what}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs), f"{what}: {ours} against {theirs}"
    else:
        assert ours == theirs, f"{what}: {ours} against {theirs}"


def test_the_strategy_places_matrices_owned_and_its_full_checkpoint_holds_them_whole(tmp_path):
    run_on_ranks(_save_both, 3, str(tmp_path), timeout=240)
    owned, cut = (torch.load(tmp_path / f"{name}.ckpt", weights_only=True) for name in ("owned", "cut"))
    assert all(owned["state_dict"][name].shape == cut["state_dict"][name].shape for name in OWNERS)
    _assert_same(owned["state_dict"], cut["state_dict"], "state_dict")
    _assert_same(owned["optimizer_states"], cut["optimizer_states"], "optimizer_states")
    assert len(owned["optimizer_states"][0]["state"]) == 6, "every parameter's AdamW state is in the file"
