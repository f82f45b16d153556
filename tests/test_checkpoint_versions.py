"""Checkpoints across torch versions: every save records its torch, and one written under torch
2.15 (whose DCP index has a field 2.13 and 2.14 lack) loads exactly under the torch the suite runs
with, or stops with an error naming both versions.

The fixture ``tests/data/torch-2.15-world-2`` was written by ``sharded.fully_shard`` at world 2
under torch 2.15.0 (tests/make_checkpoint_fixture.py); ``expected.json`` holds its full state as
the writer saw it, every float exactly.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties

import sharded
from sharded import checkpoint
from sharded.checkpoint import _storage, _versions
from tests._harness import run_on_ranks
from tests.make_checkpoint_fixture import as_json, model_and_optimizer

FIXTURE = Path(__file__).parent / "data" / "torch-2.15-world-2"


def _expected() -> dict:
    return json.loads((FIXTURE / "expected.json").read_text())


def _load_fixture(model, optimizer, where):
    template = checkpoint.get_state_dict(model, optimizer)
    checkpoint.load(template, FIXTURE / "checkpoint")
    checkpoint.set_state_dict(model, optimizer, template)
    full = checkpoint.get_state_dict(model, optimizer, full=True)
    if full:  # rank 0 of a sharded model, or a plain one
        assert as_json(full) == _expected()["state"], f"{where}: not the state torch 2.15 saved"


def _load_at_world(rank, world):
    model, _ = model_and_optimizer()
    for layer in model:
        sharded.fully_shard(layer)
    sharded.fully_shard(model)
    _load_fixture(model, torch.optim.AdamW(model.parameters(), lr=0.01), f"fully_shard at world {world}, rank {rank}")


def test_a_checkpoint_written_under_torch_2_15_loads_exactly_here(tmp_path):
    """In one process into a plain model, and resharded from 2 ranks to 3 under ``fully_shard``;
    a fresh save records this torch."""
    assert _expected()["torch"].startswith("2.15.")
    assert _versions.written_by(FIXTURE / "checkpoint")["torch"] == _expected()["torch"]
    model, optimizer = model_and_optimizer()
    _load_fixture(model, optimizer, "a plain model")
    run_on_ranks(_load_at_world, 3)
    saved = checkpoint.save(checkpoint.get_state_dict(model, optimizer), tmp_path / "again")
    assert _versions.written_by(saved) == {"torch": torch.__version__, "sharded": sharded.__version__}


def test_an_index_with_fields_this_torch_does_not_know_names_both_versions(tmp_path, monkeypatch):
    """A future torch's index (two more fields than any torch we know) is refused, saying which
    torch wrote it and which reads it: never a trace from inside DCP."""
    future = tmp_path / "future"
    shutil.copytree(FIXTURE / "checkpoint", future)
    metadata = _storage.read_metadata(future)
    for entry in metadata.state_dict_metadata.values():
        if hasattr(entry, "properties"):
            entry.properties.__class__ = TensorProperties  # pickled as torch's own class, as a writer does
    own_state = TensorProperties.__getstate__
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (*own_state(self), None, "a field from torch 9.1"))
    (future / ".metadata").write_bytes(pickle.dumps(metadata))
    monkeypatch.undo()
    (future / _versions.VERSIONS_FILE).write_text(json.dumps({"torch": "9.1.0", "sharded": "9.0.0"}))
    model, optimizer = model_and_optimizer()
    template = checkpoint.get_state_dict(model, optimizer)
    expected = rf"unreadable checkpoint index .*written under torch 9\.1\.0 \(sharded 9\.0\.0\), read under torch {re.escape(torch.__version__)}"
    with pytest.raises(checkpoint.CheckpointError, match=expected):
        checkpoint.load(template, future)
    (future / _versions.VERSIONS_FILE).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="does not record the torch that wrote it"):
        checkpoint.load(template, future)
