"""Bad checkpoints fail loudly, name the file or key and the rank, and load nothing.

The checkpoints are written once in this process (one plain process, so no launch); each rank
of a ZeRO-2 job at world 1, 2 and 3 then tries every bad one, in one launch: every rank must
raise the expected error (none may be left waiting in a collective), the template state dict
must be unchanged, and a good checkpoint must still load afterwards. Nothing in a checkpoint may
run code: a crafted index and a crafted value both try to create a marker file.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sharded import checkpoint
from sharded.checkpoint import CheckpointError
from tests._harness import run_on_ranks
from tests._models import gpt
from tests.test_checkpoint_resharding import ADAMW_LR, assert_holds_reference, build, train
from tests.test_oss import _two_groups


class _RunsCode:
    """Pickles as a call to ``os.system``: unpickling it runs a shell command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _plain(model, optimizer_class=torch.optim.AdamW, steps=1, **hyper):
    model.pos.weight.requires_grad_(False)
    optimizer = optimizer_class(_two_groups(model), **(hyper or {"lr": ADAMW_LR}))
    train(model, optimizer, 0, steps)
    return model, optimizer


def _save(state, directory):
    checkpoint.save(state, directory)
    return directory


def _record_of(directory, key):
    """(data file, offset, length) of ``key``'s record, from DCP's own reader (trusted here)."""
    metadata = dcp.FileSystemReader(directory).read_metadata()
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == key)
    return directory / info.relative_path, info.offset, info.length


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """A good checkpoint and, beside it, one broken copy or mismatched checkpoint per case."""
    root = tmp_path_factory.mktemp("bad")
    model, optimizer = _plain(gpt())
    good = checkpoint.get_state_dict(model, optimizer)
    good["step"] = 7
    _save(good, root / "good")
    torch.save(checkpoint.get_state_dict(model, optimizer, full=True), root / "good.pt")

    for name in ("truncated", "flipped", "no-index", "garbage-index", "crafted-index"):
        shutil.copytree(root / "good", root / name)
    path, offset, length = _record_of(root / "truncated", "optim.state.head.weight.exp_avg")
    os.truncate(path, offset + length // 2)
    path, offset, length = _record_of(root / "flipped", "model.tok.weight")
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0xFF  # inside the tensor's bytes: torch.load alone would not notice
    path.write_bytes(bytes(data))
    shutil.copytree(root / "good", root / "flipped-late")
    path, offset, length = _record_of(root / "flipped-late", "optim.state.head.weight.exp_avg_sq")
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0xFF  # one of the last records: most placeholders are written by then
    path.write_bytes(bytes(data))
    (root / "no-index" / ".metadata").unlink()
    (root / "garbage-index" / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with open(root / "crafted-index" / ".metadata", "wb") as stream:
        pickle.dump(_RunsCode(f"touch {root / 'ran-from-index'}"), stream)
    _save({**good, "extra": _RunsCode(f"touch {root / 'ran-from-value'}")}, root / "crafted-value")

    _save(checkpoint.get_state_dict(*_plain(gpt(vocab=32), steps=0)), root / "other-vocab")
    _save(checkpoint.get_state_dict(*_plain(gpt(layers=3))), root / "deeper")
    _save(checkpoint.get_state_dict(*_plain(gpt(), torch.optim.SGD, lr=0.1, momentum=0.9)), root / "sgd")
    return root


# (checkpoint, model the template comes from, extra template entries, error pattern); {rank} is filled in
CASES = [
    ("truncated", "gpt", {}, r"rank {rank}: .*truncated/__0_0\.distcp is truncated: \d+ bytes, the checkpoint index needs \d+"),
    ("flipped", "gpt", {}, r"flipped/__0_0\.distcp, key 'model\.tok\.weight': unreadable record \(ValueError: checksum mismatch"),
    ("no-index", "gpt", {}, r"rank {rank}: .*no-index/\.metadata is missing: .* not a complete checkpoint"),
    ("garbage-index", "gpt", {}, r"rank {rank}: .*garbage-index/\.metadata: unreadable checkpoint index"),
    ("crafted-index", "gpt", {}, r"crafted-index/\.metadata: unreadable checkpoint index .*refusing global (posix|os|nt)\.system"),
    ("crafted-value", "gpt", {"extra": None}, r"crafted-value/__0_0\.distcp, key 'extra': unreadable record \(UnpicklingError: Weights only load failed"),
    ("missing", "gpt", {}, r"rank {rank}: .*missing: no such checkpoint directory"),
    ("other-vocab", "gpt", {}, r"rank {rank}: checkpoint .*other-vocab does not fit: model shapes differ: tok\.weight saved \(32, 32\), here \(64, 32\)"),
    ("deeper", "gpt", {}, r"rank {rank}: checkpoint .*deeper does not fit: unexpected model keys blocks\.2\.ln1\.weight"),
    ("good", "deeper", {}, r"rank {rank}: checkpoint .*good does not fit: missing model keys blocks\.2\.ln1\.weight"),
    ("sgd", "gpt", {}, r"rank {rank}: checkpoint .*sgd: param group 0 was saved by a torch\.optim\.sgd\.SGD optimizer, it is loaded into a torch\.optim\.adamw\.AdamW"),
    ("good", "gpt", {"epoch": 0}, r"rank {rank}: checkpoint .*good lacks epoch; nothing was loaded"),
]


def _template(model_kind, extra, rank):
    model, wrapped, optimizer = build("zero2", seed=1) if model_kind == "gpt" else _deeper_zero2()
    train(wrapped, optimizer, rank, 1)  # the template holds optimizer state, which must survive
    return {**checkpoint.get_state_dict(wrapped, optimizer), **extra}


def _deeper_zero2():
    from sharded import OSS, ShardedDataParallel

    model = gpt(seed=1, layers=3)
    model.pos.weight.requires_grad_(False)
    optimizer = OSS(_two_groups(model), torch.optim.AdamW, lr=ADAMW_LR)
    return model, ShardedDataParallel(model, optimizer), optimizer


def _snapshot(state):
    """A deep copy of ``state`` to compare against: nested dicts and lists (param groups) are
    copied too, so a load that changed them in place is seen."""
    return copy.deepcopy(state)


def _assert_unchanged(state, before, what):
    if isinstance(before, dict):
        assert state.keys() == before.keys(), f"{what}: keys changed"
        for key, value in before.items():
            _assert_unchanged(state[key], value, f"{what}: {key}")
    elif isinstance(before, (list, tuple)):
        assert len(state) == len(before), f"{what} changed length"
        for index, value in enumerate(before):
            _assert_unchanged(state[index], value, f"{what}[{index}]")
    elif isinstance(before, torch.Tensor):
        assert torch.equal(state, before), f"{what} changed"
    else:
        assert state == before, f"{what} changed"


def _check_bad_checkpoints_load_nothing(rank, world, root):
    for name, model_kind, extra, pattern in CASES:
        state = _template(model_kind, extra, rank)
        before = _snapshot(state)
        with pytest.raises(CheckpointError, match=pattern.format(rank=rank)):
            checkpoint.load(state, root / name)
        _assert_unchanged(state, before, name)
    model, wrapped, optimizer = build("zero2", seed=1)
    _check_a_failed_load_leaves_placeholders_unfilled(wrapped, optimizer, root, rank)
    state = {**checkpoint.get_state_dict(wrapped, optimizer), "step": 0}
    placeholders = [t for held in state["optim"]["state"].values() for t in held.values()]
    checkpoint.load(state, root / "good")  # the process group is still healthy after all that
    loaded = [t for held in state["optim"]["state"].values() for t in held.values()]
    assert all(a is b for a, b in zip(placeholders, loaded, strict=True)), "a fresh optimizer's state was read twice over"
    checkpoint.set_state_dict(wrapped, optimizer, state)
    assert state["step"] == 7
    assert_holds_reference(wrapped, optimizer, torch.load(root / "good.pt", weights_only=True), "good after bad ones")
    _check_set_state_dict_refuses_bad_state_dicts(wrapped, optimizer, rank)


def _check_a_failed_load_leaves_placeholders_unfilled(wrapped, optimizer, root, rank):
    """``load`` reads a fresh optimizer's state straight into the template's placeholders; when
    the read fails midway they must still count as unfilled, so the template is refused."""
    state = checkpoint.get_state_dict(wrapped, optimizer)
    with pytest.raises(CheckpointError, match=f"rank {rank}: .*checksum mismatch"):
        checkpoint.load(state, root / "flipped-late")
    with pytest.raises(CheckpointError, match=f"rank {rank}: .* is still the placeholder"):
        checkpoint.set_state_dict(wrapped, optimizer, state)
    assert not optimizer.state


def _check_set_state_dict_refuses_bad_state_dicts(wrapped, optimizer, rank):
    good = checkpoint.get_state_dict(wrapped, optimizer)
    before = _snapshot(checkpoint.get_state_dict(wrapped, optimizer))
    wrong_shape = {**good, "model": {**good["model"], "head.weight": torch.zeros(3, 3)}}
    one_group = {**good, "optim": {**good["optim"], "param_groups": good["optim"]["param_groups"][:1]}}
    renamed = [dict(g) for g in good["optim"]["param_groups"]]
    renamed[1]["params"] = [f"renamed.{n}" for n in renamed[1]["params"]]
    cases = [
        (wrong_shape, rf"rank {rank}: the state dict does not fit: model shapes differ: head\.weight saved \(3, 3\), here \(64, 32\)"),
        (one_group, r"state dict has 1 optimizer param groups, the optimizers here have 2"),
        ({**good, "optim": {**good["optim"], "param_groups": renamed}}, r"optimizer param group 1 lacks .* and has renamed\."),
        ({"model": good["model"]}, r"has no 'optim' entry"),
    ]
    for bad_state, pattern in cases:
        with pytest.raises(CheckpointError, match=pattern):
            checkpoint.set_state_dict(wrapped, optimizer, bad_state)
        _assert_unchanged(checkpoint.get_state_dict(wrapped, optimizer), before, pattern)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_bad_checkpoints_raise_a_named_error_on_every_rank_and_load_nothing(bad, world_size):
    run_on_ranks(_check_bad_checkpoints_load_nothing, world_size, bad)
    assert not (bad / "ran-from-index").exists() and not (bad / "ran-from-value").exists()


def test_a_crafted_value_would_run_code_through_dcp_default_load(bad):
    """The reason for ``load``'s reader: DCP's default planner unpickles values unrestricted."""
    state = {"extra": None}
    dcp.load(state, checkpoint_id=bad / "crafted-value")
    assert (bad / "ran-from-value").exists()
    (bad / "ran-from-value").unlink()


def test_strict_false_loads_the_model_keys_both_sides_have(bad):
    """As ``module.load_state_dict(strict=False)``: keys the checkpoint lacks keep their values,
    saved keys the model lacks are skipped, and shared keys must still have the same shapes."""
    saved = torch.load(bad / "good.pt", weights_only=True)["model"]
    deeper = gpt(seed=1, layers=3)
    before = {key: value.clone() for key, value in deeper.state_dict().items()}
    state = checkpoint.get_state_dict(deeper)
    checkpoint.load(state, bad / "good", strict=False)
    checkpoint.set_state_dict(deeper, (), state)
    assert before.keys() - saved.keys(), "the deeper model should have keys the checkpoint lacks"
    for key, value in deeper.state_dict().items():
        assert torch.equal(value, saved.get(key, before[key])), key
    checkpoint.load(checkpoint.get_state_dict(gpt(seed=1)), bad / "deeper", strict=False)
    with pytest.raises(CheckpointError, match=r"model shapes differ: tok\.weight saved \(32, 32\)"):
        checkpoint.load(checkpoint.get_state_dict(gpt(seed=1)), bad / "other-vocab", strict=False)


def test_saves_never_overwrite_and_partial_saves_are_never_latest(tmp_path):
    model, optimizer = _plain(gpt())
    state = checkpoint.get_state_dict(model, optimizer)
    _save(state, tmp_path / "step-1")
    with pytest.raises(FileExistsError, match="step-1 exists"):
        checkpoint.save(state, tmp_path / "step-1")
    (tmp_path / ".step-5.partial").mkdir()  # a save killed before its rename
    (tmp_path / ".step-5.partial" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "step-9").mkdir()  # copied by hand, no index
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step-1"
    _save(state, tmp_path / "step-5")  # the stale partial is discarded, not mixed in
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step-5"
    assert not (tmp_path / ".step-5.partial").exists()
    assert sorted(p.name for p in (tmp_path / "step-5").iterdir()) == [".metadata", ".sharded-versions.json", "__0_0.distcp"]
    assert checkpoint.latest_checkpoint(tmp_path / "nowhere") is None
