"""2-D parallelism: ``fully_shard`` on the data-parallel dim of a model whose layers are already
tensor-parallel (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on the
``"tp"`` dim of a 2x2 mesh), as torchtitan composes them; and ``dp_mesh_dims``, where every
parameter is a DTensor on the whole SPMD mesh and ``fully_shard`` is told which dims are data
parallel (FSDP on ``("dp", "tp")``, hybrid on ``("rep", "shard")`` and on ``("node", "rep", "shard")`` with
two replicate dims; FSDP over the flattened ``("dp", "cp")`` dims of a ``("dp", "cp", "tp")`` mesh).

Compared with torch's own ``fully_shard`` on the same code and data: losses, gradient norms and
parameters bit for bit (gloo on CPU reduces deterministically, and over two data-parallel ranks
a sum and an average round alike), and ``state_dict()`` holds the same DTensors (mesh,
placements, local tensors), also with hybrid sharding (a ``(rep, shard, tp)`` mesh of 2x1x2) and
after a round trip through ``sharded.checkpoint`` into torch's
model. The model mixes TP and plain parameters in one unit, and an uneven column-parallel layer
(10 rows: 5 per TP rank, cut 3 + 2 by the data-parallel ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from tests._fsdp_reference import full_tensors
from tests._harness import run_on_ranks
from tests._models import token_batch


class TPBlock(nn.Module):
    def __init__(self, dim: int = 12, hidden: int = 10) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TPNet(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TPBlock(dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parallelize(shard, mesh, **kwargs) -> TPNet:
    """torchtitan's order: tensor parallelism on ``mesh["tp"]``, then FSDP on ``mesh["dp"]``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = TPNet()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for block in model.blocks:
        shard(block, mesh=mesh["dp"], **kwargs)
    shard(model, mesh=mesh["dp"], **kwargs)
    return model


def train(model, batch_seed, steps=3):
    """AdamW with clipping; every TP rank of a data-parallel rank sees the same batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for step in range(steps):
        batch = token_batch(batch_seed, step, seq=8)
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        norms.append(_clip(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), torch.stack(norms), full_tensors(model.parameters())


def _clip(params, max_norm: float) -> torch.Tensor:
    """Clip by the global norm. (torch's ``clip_grad_norm_`` cannot stack the norms of DTensors
    on two meshes, the TP parameters' 2-D one and the plain ones' data-parallel one.)"""
    from sharded.fsdp._grad_norm import global_grad_norm

    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.stack([g.full_tensor().norm() for g in grads]).norm()
    torch.testing.assert_close(global_grad_norm(params), total)  # sharded's, over both mesh dims
    for g in grads:
        g.mul_(min(1.0, max_norm / (total.item() + 1e-6)))
    return total


def _assert_same_dtensors(ours: dict, theirs: dict, what: str) -> None:
    assert list(ours) == list(theirs), f"{what}: state_dict keys differ"
    for key, a in ours.items():
        b = theirs[key]
        assert type(a) is type(b), f"{what}: {key} is {type(a).__name__}, torch's {type(b).__name__}"
        if isinstance(a, DTensor):
            assert a.placements == b.placements, f"{what}: {key} placed {a.placements}, torch's {b.placements}"
            assert a.device_mesh == b.device_mesh and a.shape == b.shape and a.stride() == b.stride(), key
            a, b = a.to_local(), b.to_local()
        assert torch.equal(a, b), f"{what}: {key} differs from torch's"


def _two_d_cases(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # hybrid: all-reduced over "rep", sharded over a "shard" dim of one rank
    hybrid = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "shard", "tp"))
    hybrid_meshes = {"dp": hybrid["rep", "shard"], "tp": hybrid["tp"]}
    trained = None  # the first case's model, for the checkpoint
    for what, meshes, kwargs in (
        ("FSDP + TP", mesh, {}),
        ("FSDP + TP, reshard_after_forward=False, bf16 compute", mesh, dict(reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))),
        ("HSDP + TP", hybrid_meshes, {}),
    ):
        theirs, ours = parallelize(torch_fully_shard, meshes, **kwargs), parallelize(fully_shard, meshes, **kwargs)
        up = ours.blocks[0].up.weight
        assert isinstance(up, DTensor) and up.device_mesh.ndim == meshes["dp"].ndim + 1, up
        _assert_same_dtensors(ours.state_dict(), theirs.state_dict(), f"{what}, before training")
        batch_seed = rank // 2  # the data-parallel rank (the first mesh dim) on both meshes
        for name, a, b in zip(("losses", "gradient norms", "parameters"), train(ours, batch_seed), train(theirs, batch_seed)):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"{what}: {name} differ from torch's by {(x - y).abs().max():.3g}"
        _assert_same_dtensors(ours.state_dict(), theirs.state_dict(), f"{what}, after training")
        trained = trained or ours
        dist.barrier()
    # sharded.checkpoint: ours saved, loaded into torch's 2-D model
    from sharded import checkpoint

    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    checkpoint.save(checkpoint.get_state_dict(trained, optimizer), f"{directory}/2d")
    fresh = parallelize(torch_fully_shard, mesh)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = checkpoint.get_state_dict(fresh, fresh_optimizer)
    checkpoint.load(state, f"{directory}/2d")
    checkpoint.set_state_dict(fresh, fresh_optimizer, state)
    _assert_same_dtensors(fresh.state_dict(), trained.state_dict(), "loaded from sharded.checkpoint")


def test_fsdp_on_tensor_parallel_params_matches_torch(tmp_path):
    run_on_ranks(_two_d_cases, 4, str(tmp_path), timeout=150)


def spmd_model(mesh, plan) -> nn.Sequential:
    """Layers whose parameters are DTensors on the whole SPMD ``mesh`` (``plan``: name -> the
    placements), as ``distribute_module`` leaves them."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 4))
    for name, param in list(model.named_parameters()):
        owner, attr = name.rsplit(".", 1)
        placed = distribute_tensor(param.detach(), mesh, plan(name))
        setattr(model.get_submodule(owner), attr, nn.Parameter(placed))
    return model


def train_spmd(model, mesh, batch_placements, steps=3):
    """DTensor inputs cut over the data-parallel dims; AdamW; the loss a DTensor too."""
    from torch.distributed.tensor import distribute_tensor

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x = distribute_tensor(torch.randn(8, 8, generator=torch.Generator().manual_seed(step)), mesh, batch_placements)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().full_tensor())
    return torch.stack(losses), full_tensors(model.parameters())


def _spmd_cases(rank, world):
    """``dp_mesh_dims``: FSDP on the "dp" dim of a (dp, tp) mesh, hybrid on a (rep, shard) one;
    then what is refused, and how."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, Shard

    from sharded import fully_shard

    tp_plan = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}  # column-, row-parallel
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    two_replicate_dims = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("node", "rep", "shard"))
    two_shard_dims = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
    for what, mesh, dims, plan, batch in (
        ("FSDP + TP on an SPMD mesh", dp_tp, DataParallelMeshDims(shard="dp"),
         lambda n: [Replicate(), tp_plan.get(n, Replicate())],
         [Shard(0), Replicate()]),
        ("HSDP on an SPMD mesh", hybrid, DataParallelMeshDims(shard="shard", replicate="rep"),
         lambda n: [Replicate(), Replicate()], [Shard(0), Shard(0)]),
        ("HSDP over two replicate dims (flattened)", two_replicate_dims, DataParallelMeshDims(shard="shard", replicate=("node", "rep")),
         lambda n: [Replicate()] * 3, [Shard(0), Replicate(), Shard(0)]),
        ("FSDP over two shard dims (flattened) + TP", two_shard_dims, DataParallelMeshDims(shard=("dp", "cp")),
         lambda n: [Replicate(), Replicate(), tp_plan.get(n, Replicate())], [Shard(0), Replicate(), Replicate()]),
    ):
        theirs, ours = spmd_model(mesh, plan), spmd_model(mesh, plan)
        torch_fully_shard(theirs, mesh=mesh, dp_mesh_dims=dims)
        fully_shard(ours, mesh=mesh, dp_mesh_dims=dims)
        _assert_same_dtensors(ours.state_dict(), theirs.state_dict(), f"{what}, before training")
        for name, a, b in zip(("losses", "parameters"), train_spmd(ours, mesh, batch), train_spmd(theirs, mesh, batch)):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"{what}: {name} differ from torch's by {(x - y).abs().max():.3g}"
        _assert_same_dtensors(ours.state_dict(), theirs.state_dict(), f"{what}, after training")
    _refusals(rank, dp_tp)


def _refusals(rank, mesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from sharded import fully_shard
    from sharded.fsdp import summon_full_params

    layer = parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel())
    with pytest.raises(ValueError, match=rf"rank {rank}.*weight.*overlap"):
        fully_shard(layer, mesh=mesh)
    model = parallelize(fully_shard, mesh)
    with pytest.raises(NotImplementedError, match=rf"rank {rank}.*up.weight is tensor-parallel"):
        with summon_full_params(model):
            pass
    replicated = lambda n: [Replicate(), Replicate()]  # noqa: E731
    wide = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    for call, error, words in (
        (lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")), ValueError, "plain tensor for parameter weight"),
        (lambda: fully_shard(spmd_model(mesh, lambda n: [Shard(0), Replicate()]), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")), ValueError, "Replicate"),
        (lambda: fully_shard(spmd_model(mesh, replicated), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="sp")), ValueError, "'sp' not found"),
        (lambda: fully_shard(spmd_model(mesh, replicated), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("tp", "dp"))), NotImplementedError, "consecutive"),
        (lambda: fully_shard(spmd_model(mesh, replicated), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp")), NotImplementedError, "replicate-only"),
        (lambda: fully_shard(spmd_model(mesh, replicated), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"), reshard_after_forward=2), NotImplementedError, "reshard_after_forward as int"),
        (lambda: fully_shard(nn.Linear(4, 4), dp_mesh_dims=object()), TypeError, "DataParallelMeshDims"),
        (lambda: fully_shard(parallelize_module(nn.Linear(4, 4), wide["tp"], ColwiseParallel()), mesh=wide["dp"], reshard_after_forward=2),
         NotImplementedError, "weight is a DTensor; resharding to a smaller mesh"),
    ):
        with pytest.raises(error) as raised:
            call()
        assert f"rank {rank}" in str(raised.value) and words in str(raised.value), raised.value


def test_dp_mesh_dims_matches_torch_and_refuses_what_it_cannot_do():
    run_on_ranks(_spmd_cases, 4, timeout=150)
