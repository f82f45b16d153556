"""The all-gather extension point (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, how
torchao's float8 weights plug into FSDP2), with two small subclasses of our own: weights
gathered in bfloat16 (torch 2.13's newer hook signature), and in int8 with a per-row scale (the
older one, two inputs of different dtypes). Against torch's own ``fully_shard`` on the same
subclass, model and data; and the bytes the all-gathers send."""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.nn import functional as F

from tests._exact_sums import batch_rank
from tests._fsdp_reference import CountCollectives
from tests._harness import run_on_ranks


class _Wrapper(torch.Tensor):
    """A tensor subclass holding a plain ``_data`` that every op runs on (results rewrapped)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*pytree.tree_map_only(cls, lambda t: t._data, args), **pytree.tree_map_only(cls, lambda t: t._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return inner["_data"]

    def _padded(self, outer_size, world, dtype) -> torch.Tensor:
        """This rank's rows in ``dtype``, padded to the largest shard (uneven dim 0)."""
        rows = math.ceil(outer_size[0] / world)
        out = torch.zeros(rows, *outer_size[1:], dtype=dtype, device=self.device)
        out[: self._data.shape[0]] = self._data.to(dtype)
        return out


def _write_into(out: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad(), _unsafe_preserve_version_counter(out):
        out.copy_(value)


class Bf16Gathered(_Wrapper):
    """float32 weights all-gathered in bfloat16 (half the bytes), then upcast."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._padded(outer_size, mesh.size(), torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        assert gathered.dtype is torch.bfloat16 and metadata is None
        if out is not None:
            return _write_into(out, gathered)
        upcast = gathered.to(param_dtype)
        return upcast, (gathered, upcast)


class Int8Gathered(_Wrapper):
    """float32 weights all-gathered as int8 with a float32 scale per row (torch's older
    one-argument pre-all-gather hook)."""

    def fsdp_pre_all_gather(self, mesh):
        scale = self._data.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        return ((self._data / scale).round().to(torch.int8), scale), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        data, scale = outputs
        value = (data.to(torch.float32) * scale).to(param_dtype)
        if out is not None:
            return _write_into(out, value)
        return value, (value,)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t._data if isinstance(t, _Wrapper) else t


class Stack(nn.Module):
    """Two square layers and a head (6 rows: even over 1-3 ranks; 5: uneven)."""

    def __init__(self, subclass, bias: bool, head: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(12, 12, bias=bias) for _ in range(2))
        self.head = nn.Linear(12, head, bias=bias)
        if subclass is not None:
            for layer in [*self.layers, self.head]:
                layer.weight = nn.Parameter(subclass(layer.weight.detach().clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


def _shard(model, shard, **kwargs):
    for layer in model.layers:
        shard(layer, **kwargs)
    shard(model, **kwargs)
    return model


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 12, generator=g), torch.randn(4, 6, generator=g)


def _train(model, data_rank, steps=3):
    """AdamW on ``data_rank``'s batches; the losses and the local parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _batch(data_rank, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        losses.append(loss.detach())
    return torch.stack(losses), [_plain(p.to_local()).clone() for p in model.parameters()]


def _parity_cases(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard
    from sharded.fsdp._full_params import summon_full_params

    data_rank = batch_rank(rank, world)  # at world 3 rank 0's batches: exact sums, tests/_exact_sums.py
    cases = [
        (Bf16Gathered, False, {}),
        (Bf16Gathered, True, {"reshard_after_forward": False}),
        (Bf16Gathered, True, {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}),
    ]
    if world > 1:  # torch 2.13 at world 1 skips the all-gather and keeps only a hook's first input
        cases.append((Int8Gathered, True, {}))
    for subclass, bias, kwargs in cases:
        what = f"{subclass.__name__}, bias={bias}, {kwargs}"
        theirs, ours = (_shard(Stack(subclass, bias), shard, **kwargs) for shard in (torch_fully_shard, fully_shard))
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert type(a.to_local()) is type(b.to_local()), what
            assert torch.equal(_plain(a.to_local()), _plain(b.to_local())), what
        (losses, params), (ref_losses, ref_params) = _train(ours, data_rank), _train(theirs, data_rank)
        assert torch.equal(losses, ref_losses), f"{what}: losses {losses} != torch's {ref_losses}"
        for a, b in zip(params, ref_params):
            assert torch.equal(a, b), f"{what}: parameters differ from torch's by {(a - b).abs().max():.3g}"
        # state_dict: torch's DTensors (the subclass inside); full parameters on demand
        state, ref_state = ours.state_dict(), theirs.state_dict()
        for key, value in state.items():
            assert type(value.to_local()) is type(ref_state[key].to_local()), key
            assert torch.equal(_plain(value.full_tensor()), _plain(ref_state[key].full_tensor())), key
        with summon_full_params(ours, writeback=False):
            for key, value in ours.named_parameters():
                assert torch.equal(_plain(value.detach()), _plain(ref_state[key].full_tensor())), key
        # the gathered weights are the rounded ones: bf16 / int8 rounding, no more
        plain = _shard(Stack(None, bias), fully_shard, **kwargs)
        x, _ = _batch(rank, 7)
        exact_out, rounded_out = plain(x), _shard(Stack(subclass, bias), fully_shard, **kwargs)(x)
        torch.testing.assert_close(rounded_out, exact_out, rtol=0.05, atol=0.02)
        if "mp_policy" not in kwargs:  # (with bfloat16 compute, the plain model rounds alike)
            assert not torch.equal(rounded_out, exact_out), f"{what}: the weights were not gathered through the hooks"

    # an uneven head: the hook pads its input (torch's rule); the first gather builds the weight
    # (torch 2.13 cannot refill an uneven one in place yet: pytorch/pytorch#154836)
    x, _ = _batch(rank, 8)
    outs = [_shard(Stack(Bf16Gathered, True, head=5), shard)(x) for shard in (torch_fully_shard, fully_shard)]
    assert torch.equal(outs[0], outs[1])

    if world == 2:
        _bytes_case(rank, world)
        _errors(rank)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gather_extension_matches_torch_fully_shard(world_size):
    """(At world 2, also the bytes sent and the errors: one launch fewer.)"""
    run_on_ranks(_parity_cases, world_size)


def _bytes_case(rank, world):
    from sharded import fully_shard

    sent = {}
    for subclass in (None, Bf16Gathered, Int8Gathered):
        model = _shard(Stack(subclass, bias=False), fully_shard)
        with CountCollectives() as count:
            model(_batch(rank, 0)[0]).sum().backward()
        sent[subclass] = count.gathered_bytes
    # rows each rank sends: the layers' in forward and again in backward, the root's head once
    rows_sent = 2 * 2 * 12 // world + 6 // world
    assert sent[None] == rows_sent * 12 * 4, sent
    assert sent[Bf16Gathered] * 2 == sent[None], sent
    assert sent[Int8Gathered] == rows_sent * (12 * 1 + 4), sent


def _errors(rank):
    from torch.distributed.tensor import Shard

    from sharded import fully_shard

    with pytest.raises(NotImplementedError, match=f"rank {rank}.*layers.0.weight.*Shard\\(1\\)"):
        fully_shard(Stack(Bf16Gathered, False), shard_placement_fn=lambda p: Shard(1))
    # hooks patched onto a local tensor after fully_shard (torch honours them): loud, not skipped
    model = _shard(Stack(None, False), fully_shard)
    local = model.layers[0].weight._local_tensor
    local.fsdp_pre_all_gather = local.fsdp_post_all_gather = lambda *args, **kwargs: None
    with pytest.raises(NotImplementedError, match=f"rank {rank}.*layers.0.weight.*after fully_shard"):
        model(_batch(rank, 0)[0])
