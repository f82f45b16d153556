"""2-D parallelism: ``fully_shard`` on the data-parallel dim of a model whose layers are already
tensor-parallel (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on the
``"tp"`` dim of a 2x2 mesh), as torchtitan composes them.

Compared with torch's own ``fully_shard`` on the same code and data: losses, gradient norms and
parameters bit for bit (gloo on CPU reduces deterministically, and over two data-parallel ranks
a sum and an average round alike), and ``state_dict()`` holds the same DTensors (mesh,
placements, local tensors). The model mixes TP and plain parameters in one unit, and an uneven
column-parallel layer (10 rows: 5 per TP rank, cut 3 + 2 by the data-parallel ranks).
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


def train(model, mesh, steps=3):
    """AdamW with clipping; every TP rank of a data-parallel rank sees that rank's batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for step in range(steps):
        batch = token_batch(mesh.get_local_rank(0), step, seq=8)
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


def _two_d_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for what, kwargs in (
        ("FSDP + TP", {}),
        ("FSDP + TP, reshard_after_forward=False, bf16 compute", dict(reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))),
    ):
        theirs, ours = parallelize(torch_fully_shard, mesh, **kwargs), parallelize(fully_shard, mesh, **kwargs)
        up = ours.blocks[0].up.weight
        assert isinstance(up, DTensor) and up.device_mesh.mesh_dim_names == ("dp", "tp"), up
        _assert_same_dtensors(ours.state_dict(), theirs.state_dict(), f"{what}, before training")
        for name, a, b in zip(("losses", "gradient norms", "parameters"), train(ours, mesh), train(theirs, mesh)):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"{what}: {name} differ from torch's by {(x - y).abs().max():.3g}"
        _assert_same_dtensors(ours.state_dict(), theirs.state_dict(), f"{what}, after training")
        dist.barrier()


def test_fsdp_on_tensor_parallel_params_matches_torch():
    run_on_ranks(_two_d_cases, 4, timeout=150)


def _refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from sharded import fully_shard
    from sharded.fsdp import summon_full_params

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layer = parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel())
    with pytest.raises(ValueError, match=rf"rank {rank}.*weight.*overlap"):
        fully_shard(layer, mesh=mesh)
    model = parallelize(fully_shard, mesh)
    with pytest.raises(NotImplementedError, match=rf"rank {rank}.*up.weight is tensor-parallel"):
        with summon_full_params(model):
            pass


def test_fsdp_on_tensor_parallel_params_refuses_what_it_cannot_do():
    run_on_ranks(_refusals, 4)
