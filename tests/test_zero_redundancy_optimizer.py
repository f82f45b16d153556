"""sharded.ZeroRedundancyOptimizer against torch's ZeroRedundancyOptimizer, on real gloo groups.

Both step the same plain optimizer on the same DDP-averaged gradients, and each parameter's new
value comes from its owner's step, so parameters and optimizer state compare bit for bit
(``torch.equal``) with torch's class and with DDP + the plain optimizer, at worlds 1, 2 and 3,
whatever the two partitions are. The clients' loops (Lightning's and Fabric's strategies
consolidating at a checkpoint, pytorch-ignite's ``Checkpoint`` branch, an mmengine-style subclass)
run once with torch's class and once with ours; what they save and the parameters they leave
must be equal.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.optim
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ZeroRedundancyOptimizer
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests._models import gpt, gpt_loss, token_batch

WORLD_SIZES = [1, 2, 3]
STEPS = 3
CASES = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


def _train(model, optimizer, rank, steps, first_step=0):
    ddp = DDP(model)
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad()
        gpt_loss(ddp, token_batch(rank, step)).backward()
        optimizer.step()


def _assert_params_equal(ours, ref, what):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: {name} differs by {(a - b).abs().max().item():.3g}")


def _assert_state_dicts_equal(ours, ref, what):
    assert ours["param_groups"] == ref["param_groups"], what
    assert ours["state"].keys() == ref["state"].keys(), what
    for index, state in ref["state"].items():
        assert state.keys() == ours["state"][index].keys(), f"{what}: state {index}"
        for key, value in state.items():
            assert torch.equal(ours["state"][index][key], value), f"{what}: state {index}/{key}"


def _storage_kept(model, pointers):
    return [p.data_ptr() for p in model.parameters()] == pointers


def _check_steps_state_dicts_and_bucket_views(rank, world):
    recipient = world - 1
    for name, (cls, kwargs) in CASES.items():
        for bucket_view in (False, True):
            what = f"{name}, parameters_as_bucket_view={bucket_view}"
            theirs_model, ours_model, plain_model = gpt(), gpt(), gpt()
            pointers = [p.data_ptr() for p in ours_model.parameters()]
            theirs = TorchZeRO(theirs_model.parameters(), cls, parameters_as_bucket_view=bucket_view, **kwargs)
            ours = ZeroRedundancyOptimizer(ours_model.parameters(), cls, parameters_as_bucket_view=bucket_view, **kwargs)
            plain = cls(plain_model.parameters(), **kwargs)
            assert isinstance(ours, TorchZeRO) and isinstance(ours, OSS)
            for model, optimizer in ((theirs_model, theirs), (ours_model, ours), (plain_model, plain)):
                _train(model, optimizer, rank, STEPS)
            _assert_params_equal(ours_model, theirs_model, f"{what}: against torch's class")
            _assert_params_equal(ours_model, plain_model, f"{what}: against DDP + the plain optimizer")
            assert_same_on_all_ranks(list(ours_model.parameters()), what)
            # False: every parameter where it was; True: the buckets became their storage
            assert _storage_kept(ours_model, pointers) == (not bucket_view), what

            ours.consolidate_state_dict(to=recipient)
            theirs.consolidate_state_dict(to=recipient)
            if rank == recipient:
                consolidated = ours.state_dict()
                _assert_state_dicts_equal(consolidated, theirs.state_dict(), f"{what}: torch's consolidated")
                _assert_state_dicts_equal(consolidated, plain.state_dict(), f"{what}: the plain optimizer's")
            else:
                with pytest.raises(RuntimeError, match=rf"consolidate_state_dict\(to={rank}\)"):
                    ours.state_dict()

            # a plain optimizer's state dict into ours, ours into a plain optimizer: both go on as plain
            resumed_model, plain_copy_model = gpt(), gpt()
            for model in (resumed_model, plain_copy_model):
                model.load_state_dict(plain_model.state_dict())
            resumed = ZeroRedundancyOptimizer(resumed_model.parameters(), cls, parameters_as_bucket_view=bucket_view, lr=1.0)
            resumed.load_state_dict(plain.state_dict())
            assert resumed.param_groups[0]["lr"] == kwargs["lr"], what
            ours.consolidate_state_dict(to=-1)
            plain_copy = cls(plain_copy_model.parameters(), **kwargs)
            plain_copy.load_state_dict(ours.state_dict())
            for model, optimizer in ((plain_model, plain), (resumed_model, resumed), (plain_copy_model, plain_copy)):
                _train(model, optimizer, rank, 2, first_step=STEPS)
            _assert_params_equal(resumed_model, plain_model, f"{what}: ours loaded from a plain optimizer")
            _assert_params_equal(plain_copy_model, plain_model, f"{what}: a plain optimizer loaded from ours")


def _check_oss_keeps_storage_on_request(rank, world):
    """OSS's own default stays fairscale's (buckets are the storage); False acts for OSS too."""
    kept_model, default_model, plain_model = gpt(), gpt(), gpt()
    kept_pointers = [p.data_ptr() for p in kept_model.parameters()]
    default_pointers = [p.data_ptr() for p in default_model.parameters()]
    kept = OSS(kept_model.parameters(), torch.optim.AdamW, lr=1e-2, parameters_as_bucket_view=False)
    default = OSS(default_model.parameters(), torch.optim.AdamW, lr=1e-2)
    assert default.parameters_as_bucket_view and not kept.parameters_as_bucket_view
    for model, optimizer in ((kept_model, kept), (default_model, default),
                             (plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-2))):
        _train(model, optimizer, rank, STEPS)
    assert _storage_kept(kept_model, kept_pointers)
    assert not _storage_kept(default_model, default_pointers)
    _assert_params_equal(kept_model, plain_model, "OSS(parameters_as_bucket_view=False)")
    _assert_params_equal(default_model, plain_model, "OSS()")
    # switched later: the buckets are planned again, and the step still gives DDP's numbers
    kept.parameters_as_bucket_view = True
    default.parameters_as_bucket_view = False
    moved = [p.data_ptr() for p in default_model.parameters()]
    assert len({p.untyped_storage().data_ptr() for p in default_model.parameters()}) == len(moved)
    assert not _storage_kept(kept_model, kept_pointers)
    for model, optimizer in ((kept_model, kept), (default_model, default)):
        _train(model, optimizer, rank, 1, first_step=STEPS)
    assert _storage_kept(default_model, moved)
    _assert_params_equal(kept_model, default_model, "after switching parameters_as_bucket_view")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parameters_and_state_dicts_equal_torchs_class_and_ddp_in_both_bucket_modes(world_size):
    run_on_ranks(_check_steps_state_dicts_and_bucket_views, world_size, timeout=300)
    run_on_ranks(_check_oss_keeps_storage_on_request, world_size)


# ------------------------------------------------------------------------- clients' loops


def _lightning_checkpoint(optimizer, rank, world):
    """What Lightning's Trainer and Fabric save for an optimizer under the "ddp" strategy."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy as TrainerDDP

    environment = LightningEnvironment()
    environment.set_global_rank(rank)
    environment.set_world_size(world)
    trainer_state = TrainerDDP(cluster_environment=environment).optimizer_state(optimizer)
    fabric_state = FabricDDP(cluster_environment=environment).get_optimizer_state(optimizer)
    return [trainer_state, fabric_state]


def _ignite_checkpoint(optimizer, rank, world):
    """pytorch-ignite's ``Checkpoint``: an isinstance branch, then consolidation on ``save_on_rank``."""
    save_on_rank = min(1, world - 1)
    if isinstance(optimizer, TorchZeRO):
        optimizer.consolidate_state_dict(to=save_on_rank)
        if rank != save_on_rank:
            return [{}]
    return [optimizer.state_dict()]


_MMENGINE_SHAPED_MODULE = '''
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as _ZeroRedundancyOptimizer


class ZeroRedundancyOptimizer(_ZeroRedundancyOptimizer):
    """A client's subclass made at import time: the optimizer named by a string, and a
    state_dict() that consolidates by itself and returns the state on rank 0 only."""

    def __init__(self, params, optimizer_type, **kwargs):
        super().__init__(params, getattr(torch.optim, optimizer_type), **kwargs)

    def state_dict(self):
        self.consolidate_state_dict()
        return super().state_dict() if dist.get_rank() == 0 else {}
'''


def _import_mmengine_shaped_module():
    module = types.ModuleType("mmengine_shaped")
    exec(compile(_MMENGINE_SHAPED_MODULE, "mmengine_shaped.py", "exec"), module.__dict__)
    return module


def _mmengine_classes():
    """The client's subclass of torch's class, and the same source imported after the swap
    (``torch.distributed.optim.ZeroRedundancyOptimizer`` rebound before the client's import)."""
    theirs = _import_mmengine_shaped_module().ZeroRedundancyOptimizer
    original = torch.distributed.optim.ZeroRedundancyOptimizer
    torch.distributed.optim.ZeroRedundancyOptimizer = ZeroRedundancyOptimizer  # type: ignore[misc]
    try:
        ours = _import_mmengine_shaped_module().ZeroRedundancyOptimizer
    finally:
        torch.distributed.optim.ZeroRedundancyOptimizer = original  # type: ignore[misc]
    assert issubclass(ours, ZeroRedundancyOptimizer) and not issubclass(theirs, ZeroRedundancyOptimizer)
    return theirs, ours


def _run_client(build, save, rank, world):
    model = gpt()
    optimizer = build(model)
    _train(model, optimizer, rank, STEPS)
    return model, save(optimizer, rank, world)


def _check_clients_save_what_they_save_with_torchs_class(rank, world):
    theirs_mm, ours_mm = _mmengine_classes()
    adamw = dict(lr=1e-2, weight_decay=0.1)
    clients = {
        "lightning/fabric": (
            _lightning_checkpoint,
            lambda m: TorchZeRO(m.parameters(), torch.optim.AdamW, **adamw),
            lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, **adamw),
        ),
        "ignite": (
            _ignite_checkpoint,
            lambda m: TorchZeRO(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9),
            lambda m: ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9),
        ),
        "mmengine": (
            lambda opt, rank, world: [opt.state_dict()],
            lambda m: theirs_mm(m.parameters(), "AdamW", **adamw),
            lambda m: ours_mm(m.parameters(), "AdamW", **adamw),
        ),
    }
    for name, (save, build_theirs, build_ours) in clients.items():
        theirs_model, theirs_saved = _run_client(build_theirs, save, rank, world)
        ours_model, ours_saved = _run_client(build_ours, save, rank, world)
        _assert_params_equal(ours_model, theirs_model, name)
        assert len(ours_saved) == len(theirs_saved)
        for ours_state, theirs_state in zip(ours_saved, theirs_saved):
            if not theirs_state:
                assert ours_state == {}, f"{name}: rank {rank} saves nothing with torch's class"
                continue
            _assert_state_dicts_equal(ours_state, theirs_state, name)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clients_branching_on_torchs_class_save_and_train_alike(world_size):
    run_on_ranks(_check_clients_save_what_they_save_with_torchs_class, world_size, timeout=300)


def test_class_is_torchs_with_osss_methods_first():
    """The MRO keeps one implementation: every method torch's class defines that a user or
    client calls is OSS's (or ours), never torch's, whose state is never built."""
    public = ["step", "zero_grad", "state_dict", "load_state_dict", "add_param_group", "consolidate_state_dict"]
    for name in public:
        owner = next(c for c in ZeroRedundancyOptimizer.__mro__ if name in vars(c))
        assert owner in (ZeroRedundancyOptimizer, OSS) or owner is torch.optim.Optimizer, (name, owner)
    assert ZeroRedundancyOptimizer.__mro__.index(OSS) < ZeroRedundancyOptimizer.__mro__.index(TorchZeRO)
