"""``state_dict_type="sharded"`` checkpoints of ``sharded_fsdp`` (Trainer and Fabric) are
:mod:`sharded.checkpoint` checkpoints: one layout and one index (``.metadata``) for both, nothing
in them runs code when loaded, a save that fails midway leaves the previous checkpoint loadable
and no folder under the new name, and what two processes saved resumes at one.

One launch at two ranks trains, saves, and fails two saves after every rank has written its data
but before the index exists (where a kill does most harm); the parent then crafts bad copies; one
launch at one process resumes and tries the bad copies. The tests compare what came back.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from examples.gpt import Block
from sharded import checkpoint
from sharded.lightning import ShardedFSDPStrategy
from sharded.lightning.fabric_fsdp import ShardedFSDPStrategy as FabricFSDPStrategy
from tests._harness import run_on_ranks
from tests._lightning import ADAM_LR, GPTModule, decay_groups, loader, make_trainer, quiet_lightning, weights_of
from tests._models import gpt, gpt_loss, token_batch
from tests.test_checkpoint_errors import _RunsCode

CRASH = "simulated crash after this rank wrote its data"
CRAFTED = ("crafted-index", "crafted-value")


# --------------------------------------------------------------------------- rank side


def _strategy() -> ShardedFSDPStrategy:
    return ShardedFSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")


@contextmanager
def _failing_writes(failing_rank: int) -> Iterator[None]:
    """DCP's writer raises on ``failing_rank`` once its data file is written, before any index."""
    write = FileSystemWriter.write_data

    def write_then_fail(self: Any, plan: Any, planner: Any) -> Any:
        written = write(self, plan, planner)
        written.wait()
        if dist.get_rank() == failing_rank:
            raise RuntimeError(CRASH)
        return written

    FileSystemWriter.write_data = write_then_fail
    try:
        yield
    finally:
        FileSystemWriter.write_data = write


def _error_of(run: Any) -> str:
    """``error_of``, also catching DCP's ``CheckpointException`` (a ``BaseException``)."""
    try:
        run()
    except (Exception, dcp.api.CheckpointException) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _trainer_saves(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Epoch 1, saved as "kept" (plus a copy) and "replaced"; epoch 2 resumed from "kept"; then a
    save over "kept" and one to "never" fail midway, and one over "replaced" succeeds."""
    module = GPTModule("adamw")
    trainer = make_trainer(rank, world, str(root), _strategy(), max_epochs=1)
    trainer.fit(module, loader(rank))
    trainer.save_checkpoint(root / "kept.ckpt")
    trainer.save_checkpoint(root / "replaced.ckpt")
    if rank == 0:
        shutil.copytree(root / "kept.ckpt", root / "kept-copy.ckpt")
    dist.barrier()
    trainer = make_trainer(rank, world, str(root), _strategy(), max_epochs=2, max_steps=-1)
    trainer.fit(module, loader(rank), ckpt_path=root / "kept.ckpt")
    with _failing_writes(failing_rank=world - 1):
        errors = {name: _error_of(lambda: trainer.save_checkpoint(root / f"{name}.ckpt")) for name in ("kept", "never")}
    trainer.save_checkpoint(root / "replaced.ckpt")
    return {"errors": errors, "weights": weights_of(module)}


def _fabric(rank: int, world: int) -> tuple:
    """A Fabric with sharded_fsdp (default state_dict_type="sharded"): GPT, AdamW, StepLR."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=FabricFSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAM_LR)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return (fabric, *fabric.setup(model, optimizer, scheduler=schedule))


def _fabric_state(model: Any, optimizer: Any, schedule: Any) -> dict[str, Any]:
    """Collective: whole weights, the whole optimizer state as nested lists (rank 0), schedule."""
    full = checkpoint.get_state_dict(model.module, optimizer.optimizer, full=True)
    return {"weights": weights_of(model), "optim": _as_lists(full.get("optim")), "schedule": schedule.state_dict()}


def _as_lists(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _as_lists(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_lists(item) for item in value]
    return value


def _fabric_saves(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Two steps, a save after each to the same folder (the second replaces the first)."""
    fabric, model, optimizer, schedule = _fabric(rank, world)
    for step in range(2):
        fabric.backward(gpt_loss(model, token_batch(rank, step)))
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        fabric.save(root / "fabric.ckpt", {"model": model, "optimizer": optimizer, "schedule": schedule, "step": step + 1})
    return _fabric_state(model, optimizer, schedule)


def _at_two_ranks(rank: int, world: int, root: Path) -> dict[str, Any]:
    quiet_lightning()
    return {"trainer": _trainer_saves(rank, world, root), "fabric": _fabric_saves(rank, world, root)}


def _resume_trainer(rank: int, world: int, root: Path, name: str) -> list[float]:
    module = GPTModule("adamw")
    trainer = make_trainer(rank, world, str(root), _strategy(), max_epochs=2, max_steps=-1)
    trainer.fit(module, loader(rank), ckpt_path=root / f"{name}.ckpt")
    return weights_of(module)


def _load_fabric(rank: int, world: int, path: Path) -> dict[str, Any]:
    fabric, model, optimizer, schedule = _fabric(rank, world)
    state = {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 0}
    fabric.load(path, state)
    return {**_fabric_state(model, optimizer, schedule), "step": state["step"]}


def _at_one_process(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Resume what two ranks saved; then try the crafted copies through the Trainer and Fabric."""
    quiet_lightning()
    runs: dict[str, Any] = {name: _resume_trainer(rank, world, root, name) for name in ("kept", "kept-copy", "replaced")}
    runs["fabric"] = _load_fabric(rank, world, root / "fabric.ckpt")
    for name in CRAFTED:
        runs[f"trainer/{name}"] = _error_of(lambda: _resume_trainer(rank, world, root, f"trainer-{name}"))
        runs[f"fabric/{name}"] = _error_of(lambda: _load_fabric(rank, world, root / f"fabric-{name}.ckpt"))
    return runs


# ------------------------------------------------------------------------- parent side


def _craft(source: Path, target: Path, how: str) -> None:
    """A copy of checkpoint ``source`` whose index (``crafted-index``), or every non-tensor record
    the index lists (``crafted-value``), is a pickle that creates ``ran-<target name>`` when run."""
    shutil.copytree(source, target)
    payload = _RunsCode(f"touch {target.parent / f'ran-{target.name}'}")
    if how == "crafted-index":
        (target / ".metadata").write_bytes(pickle.dumps(payload))
        return
    record = io.BytesIO()
    torch.save(payload, record)
    (target / "crafted.distcp").write_bytes(record.getvalue())
    metadata = dcp.FileSystemReader(source).read_metadata()  # our own file: trusted here
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
            metadata.storage_data[index] = dataclasses.replace(
                info, relative_path="crafted.distcp", offset=0, length=len(record.getvalue())
            )
    (target / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lightning_fsdp_checkpoint")
    two = run_on_ranks(_at_two_ranks, 2, root, timeout=240)
    listings = {name: sorted(p.name for p in (root / name).iterdir()) for name in ("kept.ckpt", "fabric.ckpt")}
    for how in CRAFTED:
        _craft(root / "kept.ckpt", root / f"trainer-{how}.ckpt", how)
        _craft(root / "fabric.ckpt", root / f"fabric-{how}.ckpt", how)
    one = run_on_ranks(_at_one_process, 1, root, timeout=180)
    return {"root": root, "two": two, "one": one[0], "listings": listings}


def test_trainer_and_fabric_write_one_sharded_checkpoint_layout_with_one_index(launches):
    """Both folders are sharded.checkpoint checkpoints holding the model, the optimizer and
    Lightning's own state; a plain (unsharded) model and optimizer read them in one process."""
    root, two = launches["root"], launches["two"][0]
    for name in ("kept.ckpt", "fabric.ckpt"):
        assert launches["listings"][name] == [".metadata", ".sharded-versions.json", "__0_0.distcp", "__1_0.distcp"], launches["listings"]
    trainer_module, fabric_model = GPTModule("adamw"), gpt()
    for module, optimizer, folder in (
        (trainer_module, torch.optim.AdamW(decay_groups(trainer_module), lr=ADAM_LR), root / "replaced.ckpt"),
        (fabric_model, torch.optim.AdamW(fabric_model.parameters(), lr=ADAM_LR), root / "fabric.ckpt"),
    ):
        state = {**checkpoint.get_state_dict(module, optimizer), "lightning": None}
        checkpoint.load(state, folder)
        checkpoint.set_state_dict(module, optimizer, state)
        (lightning_state,) = state["lightning"]
        if module is trainer_module:
            assert weights_of(module) == two["trainer"]["weights"]
            assert {"epoch", "global_step", "loops", "lr_schedulers", "callbacks"} <= lightning_state.keys()
            assert lightning_state["global_step"] == 4 and not {"state_dict", "optimizer_states"} & lightning_state.keys()
        else:
            assert weights_of(module) == two["fabric"]["weights"]
            assert lightning_state == {"schedule": two["fabric"]["schedule"], "step": 2}


def test_a_save_failing_midway_leaves_the_previous_checkpoint_and_nothing_under_a_new_name(launches):
    root, one = launches["root"], launches["one"]
    assert not (root / "never.ckpt").exists(), "a failed save left a folder under its name"
    assert one["kept"] == one["kept-copy"], "the folder a failed save would have replaced no longer holds what it held"
    assert one["replaced"] == launches["two"][0]["trainer"]["weights"], "a successful save did not replace the folder"
    for rank, runs in enumerate(launches["two"]):
        for name, error in runs["trainer"]["errors"].items():
            assert error.startswith("CheckpointError") and f"{name}.ckpt" in error, (rank, error)
    assert any(CRASH in error for runs in launches["two"] for error in runs["trainer"]["errors"].values())


def test_what_two_processes_saved_resumes_at_one_exactly(launches):
    saved, loaded = launches["two"][0]["fabric"], launches["one"]["fabric"]
    assert loaded["step"] == 2
    for part in ("weights", "optim", "schedule"):
        assert loaded[part] == saved[part], f"fabric.load at 1 process: {part} differs from what 2 saved"


@pytest.mark.parametrize("how", CRAFTED)
@pytest.mark.parametrize("via", ["trainer", "fabric"])
def test_a_crafted_checkpoint_is_refused_naming_the_file_without_running_code(launches, via, how):
    root, error = launches["root"], launches["one"][f"{via}/{how}"]
    assert not (root / f"ran-{via}-{how}.ckpt").exists(), f"loading {via}-{how}.ckpt ran code from it"
    where = r"\.metadata: unreadable checkpoint index" if how == "crafted-index" else r"crafted\.distcp, key '[^']+': unreadable record"
    assert error.startswith("CheckpointError"), error
    assert re.search(rf"{via}-{how}\.ckpt/{where}", error), error
