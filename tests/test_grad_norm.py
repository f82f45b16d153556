"""One gradient norm: every entry point that clips by the global norm returns the same norm on
the same gradients, and clips them alike.

The entry points: ``OSS.clip_grad_norm`` and ``ShardedDataParallel.clip_grad_norm_`` (layers
1-2), ``sharded.fsdp.clip_grad_norm_`` (layer 3) and the Lightning strategies' clipping (which
dispatches to one of them by optimizer). Every rank is given the same full gradients; the
reference is the norm of all of them, accumulated in fp32 (also for bf16 gradients, where a
norm rounded per tensor in bf16 would differ by ~1e-3). The inf-norm, the 1-norm and
non-finite gradients are included: a non-finite norm is returned as it is by every entry point,
or refused with the same error before anything is scaled.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor

from sharded import OSS, ShardedDataParallel, fully_shard
from tests._fsdp_reference import full_tensors
from tests._harness import run_on_ranks

HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
MAX_NORM = 0.5


class _Net(nn.Module):
    """Uneven rows (a rank past the last row of ``b`` holds an empty shard) and a 0-dim
    parameter (replicated under layer 3)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(7, 5, dtype=dtype))
        self.b = nn.Parameter(torch.zeros(2, 3, dtype=dtype))
        self.c = nn.Parameter(torch.zeros(11, dtype=dtype))
        self.scale = nn.Parameter(torch.zeros((), dtype=dtype))


def _grads(dtype: torch.dtype, poison: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(p.shape, generator=g).to(dtype) for p in _Net(dtype).parameters()]
    grads[2][3] = poison  # 1.0, or a non-finite value
    return grads


def _reference(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads]), norm_type)


def _with_grads(model: nn.Module, grads: list[torch.Tensor]) -> nn.Module:
    for p, grad in zip(model.parameters(), grads):
        if hasattr(p, "device_mesh"):  # a layer-3 DTensor parameter: its shard of the gradient
            p.grad = distribute_tensor(grad.clone(), p.device_mesh, p.placements)
        else:
            p.grad = grad.clone()
    return model


def _entry_points(dtype: torch.dtype, grads: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool):
    """(name, clip) pairs; ``clip()`` clips fresh copies of ``grads`` and returns (norm, full
    clipped gradients)."""
    from sharded.fsdp import clip_grad_norm_

    def oss():
        model = _with_grads(_Net(dtype), grads)
        optimizer = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
        norm = optimizer.clip_grad_norm(MAX_NORM, norm_type, error_if_nonfinite=error_if_nonfinite)
        return norm, _owned_grads(model, optimizer)

    def sharded_ddp():
        model = _Net(dtype)
        optimizer = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
        wrapped = ShardedDataParallel(model, optimizer)
        _with_grads(model, grads)
        norm = wrapped.clip_grad_norm_(MAX_NORM, norm_type, error_if_nonfinite=error_if_nonfinite)
        return norm, _owned_grads(model, optimizer)

    def layer3():
        model = _with_grads(fully_shard(_Net(dtype)), grads)
        norm = clip_grad_norm_(model.parameters(), MAX_NORM, norm_type, error_if_nonfinite=error_if_nonfinite)
        return norm, full_tensors([p.grad for p in model.parameters()])

    points = [("OSS.clip_grad_norm", oss), ("ShardedDataParallel.clip_grad_norm_", sharded_ddp), ("fsdp.clip_grad_norm_", layer3)]
    if HAS_LIGHTNING and norm_type == 2.0 and not error_if_nonfinite:
        from sharded.lightning._sharding import clip_optimizer_grads

        def lightning_oss():
            model = _with_grads(_Net(dtype), grads)
            optimizer = OSS(model.parameters(), torch.optim.SGD, lr=0.1)
            return clip_optimizer_grads(optimizer, MAX_NORM), _owned_grads(model, optimizer)

        def lightning_layer3():
            model = _with_grads(fully_shard(_Net(dtype)), grads)
            norm = clip_optimizer_grads(torch.optim.SGD(model.parameters(), lr=0.1), MAX_NORM)
            return norm, full_tensors([p.grad for p in model.parameters()])

        points += [("lightning (OSS)", lightning_oss), ("lightning (layer 3)", lightning_layer3)]
    return points


def _owned_grads(model: nn.Module, optimizer: OSS) -> list[torch.Tensor]:
    """Full gradients after an OSS clip: each owner broadcasts the gradients it scaled."""
    grads = []
    for p in model.parameters():
        grad = p.grad.clone()
        torch.distributed.broadcast(grad, src=optimizer.param_to_rank[p])
        grads.append(grad)
    return grads


def _check_one_norm(rank, world):
    cases = [(dtype, norm_type, 1.0) for dtype in (torch.float32, torch.bfloat16) for norm_type in (2.0, 1.0, math.inf)]
    cases += [(torch.float32, 2.0, math.inf), (torch.float32, math.inf, math.nan)]
    for dtype, norm_type, poison in cases:
        grads = _grads(dtype, poison)
        expected = _reference(grads, norm_type)
        what = f"{dtype} norm {norm_type} poison {poison}"
        for name, clip in _entry_points(dtype, grads, norm_type, error_if_nonfinite=False):
            norm, clipped = clip()
            assert norm.dtype == torch.float32, f"{name}, {what}: {norm.dtype}"
            torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0, equal_nan=True, msg=f"{name}, {what}")
            coefficient = torch.clamp(MAX_NORM / (expected + 1e-6), max=1.0)
            for mine, grad in zip(clipped, grads):
                torch.testing.assert_close(mine, grad * coefficient.to(grad.dtype), equal_nan=True, msg=f"{name}, {what}: clipped")
    grads = _grads(torch.float32, math.inf)
    for name, clip in _entry_points(torch.float32, grads, 2.0, error_if_nonfinite=True):
        with pytest.raises(RuntimeError, match=f"^rank {rank}: the total norm of order 2.0 of the gradients is non-finite"):
            clip()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_entry_point_returns_the_same_norm(world_size):
    run_on_ranks(_check_one_norm, world_size)
