"""Whole tensors of owner-placed parameters (``sharded.fsdp.Owned``) through every route a user
takes to them: ``p.full_tensor()``, ``p.redistribute(mesh, [Replicate()])``, ``model.state_dict()``
+ ``full_tensor()``, torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` /
``get_state_dict`` with full state dicts and their ``set_*`` back, ``summon_full_params``, the
FSDP wrapper's ``state_dict()`` and the Lightning strategy's full checkpoint.

Each is compared with the same route over the element-sharded model (``Shard(0)`` everywhere),
bit for bit (``torch.equal``): the two models start from the same weights and train on batches
that are the same on every rank, so every gradient is the same sum of equal terms in any order,
and AdamW / SGD, element-wise, step both to the same bits at worlds 2 and 3. At world 2 the
owners come from ``Owned()`` (one is rank 1); at world 3 they are explicit and rank 0 owns
nothing. Muon, which only owned matrices can take, is compared with ``sharded.checkpoint``'s full
form instead, another route to the same state.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from sharded import FullyShardedDataParallel, fully_shard
from sharded.fsdp import Owned, summon_full_params
from tests._harness import run_on_ranks

EXPLICIT_OWNERS = {"0.weight": Owned(2), "1.weight": Owned(1), "2.weight": Owned(2)}  # world 3: rank 0 owns none


def _model() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))


def _placement(model: nn.Module, world: int, owned: bool):
    """``Owned()`` for every matrix (world 2), the explicit owners (world 3), or nothing owned."""
    if not owned:
        return None
    if world == 2:
        return lambda p: Owned() if p.ndim == 2 else None
    table = {id(p): EXPLICIT_OWNERS.get(name) for name, p in model.named_parameters()}
    return lambda p: table[id(p)]


def _sharded(world: int, owned: bool) -> nn.Sequential:
    model = _model()
    fully_shard(model, shard_placement_fn=_placement(model, world, owned))
    return model


def _optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW over the matrices (all owned when owned), SGD with momentum over the biases."""
    weights = [p for p in model.parameters() if p.ndim == 2]
    biases = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.AdamW(weights, lr=1e-2, weight_decay=0.1), torch.optim.SGD(biases, lr=0.1, momentum=0.9)]


def _batch(step: int) -> torch.Tensor:
    """The same on every rank: every rank's gradient is the same, so sums in any order agree."""
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + step))


def _backward(model: nn.Module, step: int) -> None:
    (model(_batch(step)) ** 2).mean().backward()


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: range) -> None:
    for step in steps:
        _backward(model, step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def _owned_names(model: nn.Module) -> list[str]:
    """The owner-placed matrices: replicated on their owner mesh (element-sharded ones are cut)."""
    return [n for n, p in model.named_parameters() if p.ndim == 2 and all(pl.is_replicate() for pl in p.placements)]


def _assert_equal(ours, theirs, what: str) -> None:
    """Equal nested state dicts: tensors bit for bit, the rest by ==."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), f"{what}: keys {list(ours)} against {list(theirs)}"
        for key in theirs:
            _assert_equal(ours[key], theirs[key], f"{what}/{key}")
    elif isinstance(theirs, (list, tuple)):  # torch's load turns a tuple hyperparameter (betas) into a list
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), what
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_equal(a, b, f"{what}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype), f"{what}: {ours!r} against {theirs!r}"
        assert torch.equal(ours, theirs), f"{what}: differs by {(ours - theirs).abs().max()}"
    else:
        assert ours == theirs, f"{what}: {ours} against {theirs}"


# ----------------------------------------------------------------- DTensor's own calls


def _check_dtensor_calls(owned: nn.Module, cut: nn.Module) -> None:
    """``full_tensor()``, ``redistribute`` to ``Replicate()`` on the parameter's own mesh and on
    the unit's mesh, to ``Shard(0)`` on the unit's mesh, and ``model.state_dict()`` +
    ``full_tensor()``: the element-sharded model's tensors, on every rank."""
    unit_mesh = cut[0].bias.device_mesh
    for (name, p), q in zip(owned.named_parameters(), cut.parameters()):
        whole = q.full_tensor()
        _assert_equal(p.full_tensor(), whole, f"{name}.full_tensor()")
        _assert_equal(p.redistribute(p.device_mesh, [Replicate()]).to_local(), whole, f"{name} replicated on its mesh")
        _assert_equal(p.redistribute(unit_mesh, [Replicate()]).to_local(), whole, f"{name} replicated on the unit's mesh")
        rows = q.redistribute(unit_mesh, [Shard(0)]).to_local()
        _assert_equal(p.redistribute(unit_mesh, [Shard(0)]).to_local(), rows, f"{name} cut on the unit's mesh")
    name = _owned_names(owned)[0]
    p, q = (dict(m.named_parameters())[name] for m in (owned, cut))
    for options in ({"forward_dtype": torch.float64}, {"async_op": True}):
        ours, theirs = (x.redistribute(x.device_mesh, [Replicate()], **options).to_local() for x in (p, q))
        _assert_equal(ours, theirs, f"{name} replicated with {options}")
    states = [{k: v.full_tensor() for k, v in m.state_dict().items()} for m in (owned, cut)]
    _assert_equal(*states, "model.state_dict() + full_tensor()")


def _check_full_tensor_is_differentiable(owned: nn.Module, cut: nn.Module) -> None:
    """The gradient of ``full_tensor()`` reaches the owner's local tensor, as the element-sharded
    one's reaches each rank's rows; the others' gradient is empty, as their value is."""
    name = _owned_names(owned)[0]
    p, q = (dict(m.named_parameters())[name].detach().requires_grad_() for m in (owned, cut))
    scale = torch.arange(p.numel(), dtype=p.dtype).view(p.shape)
    for x in (p, q):
        (x.full_tensor() * scale).sum().backward()
        x.redistribute(x.device_mesh, [Replicate()], backward_dtype=torch.float64).to_local().sum().backward()
    _assert_equal(p.grad.full_tensor(), q.grad.full_tensor(), f"{name}: gradient through full_tensor() and redistribute()")
    assert p.grad.dtype == p.dtype, "backward_dtype: the gradient comes back in the parameter's dtype"
    held = p.to_local().numel() == p.numel()
    assert p.grad.to_local().numel() == (p.numel() if held else 0), f"{name}: the gradient lands on the owner alone"


# ------------------------------------------------------------ torch's state dict calls


def _full_options(cpu_offload: bool, **kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, **kwargs)


def _check_torch_state_dicts(owned: nn.Module, ours: list, cut: nn.Module, theirs: list, rank: int) -> dict:
    """torch's full model, optimizer and combined state dicts, offloaded to rank 0 and kept on
    every rank: the element-sharded model's. Returns the latter's kept on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, get_state_dict

    for cpu_offload in (True, False):
        options = _full_options(cpu_offload)
        what = f"cpu_offload={cpu_offload}"
        model = [get_model_state_dict(m, options=options) for m in (owned, cut)]
        optim = [get_optimizer_state_dict(m, o, options=options) for m, o in ((owned, ours), (cut, theirs))]
        both = [get_state_dict(m, o, options=options) for m, o in ((owned, ours), (cut, theirs))]
        if cpu_offload and rank != 0:
            assert model[0] == optim[0] == {} and both[0] == ({}, {}), "rank 0 alone gets offloaded state dicts"
            continue
        _assert_equal(model[0], model[1], f"get_model_state_dict, {what}")
        _assert_equal(optim[0], optim[1], f"get_optimizer_state_dict, {what}")
        _assert_equal(list(both[0]), list(both[1]), f"get_state_dict, {what}")
        assert all(model[0][n].numel() for n in _owned_names(owned)), "owned weights written"
    flat = [get_optimizer_state_dict(m, o, options=_full_options(False, flatten_optimizer_state_dict=True)) for m, o in ((owned, ours), (cut, theirs))]
    _assert_equal(flat[0], flat[1], "get_optimizer_state_dict, flatten_optimizer_state_dict=True")
    return {"model": model[1], "optim": optim[1]}


def _check_set_back(full: dict, cut: nn.Module, theirs: list, world: int, rank: int, build=None) -> None:
    """torch's ``set_model_state_dict`` / ``set_optimizer_state_dict`` from the element-sharded
    model's full state dicts into a new owned model (owners may differ from the first), from
    every rank's copy and broadcast from rank 0's: its full state dicts are those loaded, ranks
    keep no state of owned parameters they do not hold, and a step after gives the element-sharded
    model's parameters."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    for broadcast in (False, True):
        owned = build() if build is not None else _sharded(world, owned=True)
        ours = _optimizers(owned)
        # a copy, as if read from a file: torch's get keeps plain tensors (AdamW's step) as they
        # are and its set adopts them, so two optimizers would step one shared step count
        given = copy.deepcopy(full) if not broadcast or rank == 0 else {"model": {}, "optim": {}}
        options = _full_options(False, broadcast_from_rank0=broadcast)
        set_model_state_dict(owned, given["model"], options=options)
        set_optimizer_state_dict(owned, ours, given["optim"], options=options)
        _assert_equal(get_optimizer_state_dict(owned, ours, options=_full_options(False)), full["optim"], f"loaded, broadcast={broadcast}")
        named = dict(owned.named_parameters())
        elsewhere = [named[n] for n in _owned_names(owned) if named[n].to_local().numel() == 0]
        assert not any(p in optimizer.state for optimizer in ours for p in elsewhere), "state of another rank's owned parameter kept"
        step = range(3 + broadcast, 4 + broadcast)
        _train(owned, ours, step)
        _train(cut, theirs, step)
        for (name, p), q in zip(owned.named_parameters(), cut.parameters()):
            _assert_equal(p.full_tensor(), q.full_tensor(), f"{name} a step after loading, broadcast={broadcast}")
        full = _check_torch_full(cut, theirs)


def _check_torch_full(model: nn.Module, optimizers: list) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _full_options(False)
    return {"model": get_model_state_dict(model, options=options), "optim": get_optimizer_state_dict(model, optimizers, options=options)}


def _check_summon_and_wrapper(owned: nn.Module, cut: nn.Module, world: int) -> None:
    """``summon_full_params`` and the FSDP wrapper built with ``shard_placement_fn``."""
    with summon_full_params(owned, writeback=False), summon_full_params(cut, writeback=False):
        for (name, p), q in zip(owned.named_parameters(), cut.parameters()):
            _assert_equal(p.detach().clone(), q.detach().clone(), f"summon_full_params: {name}")
    wrapped = []
    for is_owned in (True, False):
        model = _model()
        wrapped.append(FullyShardedDataParallel(model, shard_placement_fn=_placement(model, world, is_owned)))
    assert len(_owned_names(wrapped[0].module)) == 3 and not _owned_names(wrapped[1].module), "the wrapper placed the matrices Owned()"
    for model in wrapped:
        _train(model, _optimizers(model), range(2))
    _assert_equal(wrapped[0].state_dict(), wrapped[1].state_dict(), "FullyShardedDataParallel.state_dict()")


def _check_muon_state(world: int, rank: int) -> None:
    """Muon, which only owned matrices can take: torch's full optimizer state dict is
    ``sharded.checkpoint``'s full form (another route, gathered from the owners), and loading it
    back into a fresh Muon (torch first steps it at ``lr=0``, on ranks owning none of its
    matrices too) leaves each rank only its own matrices' state."""
    from sharded import checkpoint
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = _sharded(world, owned=True)
    muon = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    _train(model, [muon], range(2))
    ours = get_optimizer_state_dict(model, muon, options=_full_options(True))
    reference = checkpoint.get_state_dict(model, muon, full=True)
    if rank == 0:
        names = ours["param_groups"][0]["params"]
        _assert_equal({names[i]: s for i, s in reference["optim"]["state"].items()}, ours["state"], "Muon's full state")
    fresh = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    set_optimizer_state_dict(model, fresh, ours, options=_full_options(False, broadcast_from_rank0=True))
    held = [p for p in fresh.param_groups[0]["params"] if p.to_local().numel()]
    assert list(fresh.state) == held, "Muon's state of the matrices this rank owns, and of no other"
    for p in held:
        _assert_equal(fresh.state[p]["momentum_buffer"].to_local(), muon.state[p]["momentum_buffer"].to_local(), "Muon's loaded momentum")


def _check_every_route(rank: int, world: int) -> None:
    owned, cut = _sharded(world, owned=True), _sharded(world, owned=False)
    assert len(_owned_names(owned)) == 3
    holders = {n: p.to_local().numel() > 0 for n, p in owned.named_parameters() if n in _owned_names(owned)}
    if world == 3:
        assert not any(holders.values()) if rank == 0 else True, "rank 0 owns nothing at world 3"
    ours, theirs = _optimizers(owned), _optimizers(cut)
    _train(owned, ours, range(2))
    _train(cut, theirs, range(2))
    _backward(owned, 2)
    _backward(cut, 2)
    _check_dtensor_calls(owned, cut)
    _check_full_tensor_is_differentiable(owned, cut)
    for optimizer in [*ours, *theirs]:
        optimizer.step()
        optimizer.zero_grad()
    full = _check_torch_state_dicts(owned, ours, cut, theirs, rank)
    _check_summon_and_wrapper(owned, cut, world)
    _check_set_back(full, cut, theirs, world, rank)
    _check_muon_state(world, rank)


@pytest.mark.parametrize("world_size", [2, 3])
def test_owned_parameters_come_whole_through_every_full_route_as_element_sharded_ones(world_size):
    run_on_ranks(_check_every_route, world_size, timeout=180)


# ---------------------------------------------------------------------- hybrid sharding


def _check_hybrid(rank: int, world: int) -> None:
    """A ``(replicate 2, shard 2)`` mesh: each replica row has its owner of each matrix; the
    whole tensors, torch's full model and optimizer state dicts and a load back are the
    element-sharded model's."""
    from sharded.fsdp._placement.mesh import hybrid_mesh

    mesh = hybrid_mesh(2)
    models = []
    for owned in (True, False):
        model = _model()
        fully_shard(model, mesh=mesh, shard_placement_fn=(lambda p: Owned() if p.ndim == 2 else None) if owned else None)
        models.append(model)
    owned, cut = models
    assert all(p.device_mesh.ndim == 1 and p.device_mesh.size() == 2 for n, p in owned.named_parameters() if p.ndim == 2), "an owner per row"
    ours, theirs = _optimizers(owned), _optimizers(cut)
    _train(owned, ours, range(2))
    _train(cut, theirs, range(2))
    for (name, p), q in zip(owned.named_parameters(), cut.parameters()):
        _assert_equal(p.full_tensor(), q.full_tensor(), f"hybrid: {name}.full_tensor()")
        _assert_equal(p.redistribute(q.device_mesh, [Replicate(), Shard(0)]).to_local(), q.to_local(), f"hybrid: {name} cut as the element-sharded one")
    full = _check_torch_full(cut, theirs)
    _assert_equal(_check_torch_full(owned, ours), full, "hybrid: torch's full state dicts")
    _check_set_back(full, cut, theirs, world, rank, lambda: _hybrid_owned(mesh))


def _hybrid_owned(mesh) -> nn.Sequential:
    model = _model()
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Owned() if p.ndim == 2 else None)
    return model


def test_hybrid_sharding_gives_owned_parameters_whole_as_element_sharded_ones():
    run_on_ranks(_check_hybrid, 4, timeout=180)
