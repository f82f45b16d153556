"""Mixed precision's gradient dtypes against torch's own ``fully_shard``, bit for bit, on the torch
the suite runs with (2.13 to 2.15), at worlds 1, 2 and 3.

A small net of blocks with RMS-style norms (1-D weights), a bf16 compute dtype, AdamW, 3 steps:

* ``param_dtype_override_fn`` keeping the norms in fp32 inside bf16 units. Where torch has the
  field (2.15) the reference is torch's ``fully_shard`` with the same policy; on every torch it is
  also torch's with each norm in a unit of its own that computes in fp32 and reduces in the dtype
  ours reduces the whole unit in (the same arithmetic: a reduce-scatter adds element by element).
* ``reduce_dtype=None``: torch 2.15 reduces fp32 masters' gradients in fp32, earlier torches in
  ``param_dtype``; ours equals the torch it runs with. ``reduce_dtype=torch.bfloat16`` keeps bf16.
* ``set_requires_gradient_sync(False)`` over two microbatches: the gradients accumulate in that
  same dtype (bf16 before 2.15, fp32 from it), compared by the sharded gradients after the sync.
* ``Tensor.grad_dtype`` (2.15): kept through ``fully_shard``, ``.to()`` and
  ``load_state_dict(assign=True)`` as torch keeps it, and the gradients land in it;
  ``reset_iter_state()`` drops landed gradients as torch's does (2.15: it does); a parameter
  with ``grad_dtype=None`` and ``set_reduce_scatter_unused_params(True)`` without ``reduce_dtype``
  raises on every rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests._exact_sums import batch_rank
from tests._fsdp_reference import full_tensors
from tests._harness import run_on_ranks

STEPS = 3


class RMSNorm(nn.Module):
    """Computes in fp32 and returns its input's dtype, as LLM norms do; its weight in fp32 or
    in its unit's compute dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class NormNet(nn.Module):
    """Two blocks, a final norm and a head: 5 matrices and 3 norm weights (the only 1-D
    parameters)."""

    def __init__(self, dim: int = 10, hidden: int = 14) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(2))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).float()


def keep_vectors(param: nn.Parameter):
    """The override of the tests: 1-D parameters (the norms' weights) in their own dtype."""
    return param.dtype if param.ndim == 1 else None


def shard(shard_fn, policy, norms_alone=None) -> NormNet:
    """A unit per block and the root's; ``norms_alone``: each norm first in a unit of its own
    with that policy (the reference for the override on a torch without it)."""
    model = NormNet()
    for block in model.blocks:
        if norms_alone is not None:
            shard_fn(block.norm, mp_policy=norms_alone)
        shard_fn(block, mp_policy=policy)
    if norms_alone is not None:
        shard_fn(model.norm, mp_policy=norms_alone)
    return shard_fn(model, mp_policy=policy)


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g)


def train(model: nn.Module, rank: int, micro_batches: int = 1):
    """AdamW, ``STEPS`` steps on ``rank``'s batches (rank 0's at world 3, where gloo's sum of
    three different terms depends on where an element sits in the buffer: tests._exact_sums);
    with several micro-batches, gradient sync off for all but the last. Returns the losses, the sharded gradients of the last step (full, in their dtype)
    and the final parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            x, y = batch(batch_rank(rank, dist.get_world_size()), step, micro)
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        grads = [p.grad.full_tensor() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses), grads, full_tensors(model.parameters())


def assert_same(ours, theirs, what: str) -> None:
    for name, a, b in zip(("losses", "gradients", "parameters"), ours, theirs):
        for x, y in list(zip(a, b)) if isinstance(a, list) else [(a, b)]:
            assert x.dtype == y.dtype, f"{what}: {name} in {x.dtype}, torch's in {y.dtype}"
            assert torch.equal(x, y), f"{what}: {name} differ from torch's by {(x.float() - y.float()).abs().max():.3g}"


def torch_has_override() -> bool:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return "param_dtype_override_fn" in {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}


def _reduce_dtype_cases(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard
    from sharded.fsdp import MixedPrecisionPolicy
    from sharded.fsdp._grad_dtypes import grads_follow_grad_dtype

    bf16 = torch.bfloat16
    results = {}
    for what, kwargs, micro in (
        ("reduce_dtype=None", dict(param_dtype=bf16), 1),
        ("reduce_dtype=bf16", dict(param_dtype=bf16, reduce_dtype=bf16), 1),
        ("reduce_dtype=None, no_sync over 2 micro-batches", dict(param_dtype=bf16), 2),
        ("reduce_dtype=bf16, no_sync over 2 micro-batches", dict(param_dtype=bf16, reduce_dtype=bf16), 2),
    ):
        theirs = train(shard(torch_fully_shard, TorchMP(**kwargs)), rank, micro)
        ours = train(shard(fully_shard, MixedPrecisionPolicy(**kwargs)), rank, micro)
        assert_same(ours, theirs, what)
        results[what] = ours
    # the default differs from the opt-out exactly where torch's default moved (2.15)
    for micro in ("", ", no_sync over 2 micro-batches"):
        a, b = results[f"reduce_dtype=None{micro}"], results[f"reduce_dtype=bf16{micro}"]
        assert grads_follow_grad_dtype() != torch.equal(a[2][0], b[2][0]), f"reduce_dtype=None{micro} against bf16"


def _override_cases(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard
    from sharded.fsdp import MixedPrecisionPolicy
    from sharded.fsdp._grad_dtypes import grads_follow_grad_dtype

    bf16 = torch.bfloat16
    for reduce_dtype in (None, bf16):
        what = f"param_dtype_override_fn, reduce_dtype={reduce_dtype}"
        ours_policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=reduce_dtype, param_dtype_override_fn=keep_vectors)
        ours = train(shard(fully_shard, ours_policy), rank)
        model = shard(fully_shard, ours_policy)
        assert model.blocks[0].up.weight.dtype == torch.float32
        # each norm alone, computing in fp32 and reducing in the dtype ours reduces its unit in
        unit_reduces_in = reduce_dtype or (torch.float32 if grads_follow_grad_dtype() else bf16)
        alone = shard(torch_fully_shard, TorchMP(param_dtype=bf16, reduce_dtype=reduce_dtype), norms_alone=TorchMP(reduce_dtype=unit_reduces_in))
        assert_same(ours, train(alone, rank), f"{what}, against torch with the norms in units of their own")
        if torch_has_override():
            theirs = shard(torch_fully_shard, TorchMP(param_dtype=bf16, reduce_dtype=reduce_dtype, param_dtype_override_fn=keep_vectors))
            assert_same(ours, train(theirs, rank), f"{what}, against torch's")
            converted = shard(fully_shard, TorchMP(param_dtype=bf16, reduce_dtype=reduce_dtype, param_dtype_override_fn=keep_vectors))
            assert_same(train(converted, rank), ours, f"{what}, torch's policy object given to ours")
    # the override acts: without it the numbers differ
    plain = train(shard(fully_shard, MixedPrecisionPolicy(param_dtype=bf16)), rank)
    overridden = train(shard(fully_shard, MixedPrecisionPolicy(param_dtype=bf16, param_dtype_override_fn=keep_vectors)), rank)
    assert not torch.equal(plain[0], overridden[0]), "param_dtype_override_fn changed nothing"
    _override_refusals()


def _override_refusals() -> None:
    from sharded import fully_shard
    from sharded.fsdp import MixedPrecisionPolicy

    bad = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16)
    with pytest.raises(ValueError, match=r"rank \d.*param_dtype_override_fn returned torch.float16 for parameter weight"):
        fully_shard(nn.Linear(4, 4), mp_policy=bad)
    with pytest.raises(TypeError):
        MixedPrecisionPolicy(torch.bfloat16, None, None, True, keep_vectors)  # keyword-only, as torch's


def with_grad_dtypes(model: NormNet) -> NormNet:
    """Before ``fully_shard``: one matrix's gradients kept in bf16, one norm's in whatever dtype
    they come (``None``)."""
    model.blocks[0].up.weight.grad_dtype = torch.bfloat16
    model.blocks[1].norm.weight.grad_dtype = None
    return model


def grad_dtypes(model: nn.Module) -> list:
    return [p.grad_dtype for p in model.parameters()]


def one_step_grads(model: nn.Module, rank: int) -> list[torch.Tensor]:
    x, y = batch(batch_rank(rank, dist.get_world_size()), 0)
    (model(x) - y).pow(2).mean().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    model.zero_grad()
    return grads


def _grad_dtype_cases(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard
    from sharded.fsdp import MixedPrecisionPolicy

    bf16 = torch.bfloat16
    models = {}
    for name, shard_fn, policy in (("torch's", torch_fully_shard, TorchMP(param_dtype=bf16)), ("ours", fully_shard, MixedPrecisionPolicy(param_dtype=bf16))):
        model = with_grad_dtypes(NormNet())
        for block in model.blocks:
            shard_fn(block, mp_policy=policy)
        models[name] = shard_fn(model, mp_policy=policy)
    theirs, ours = models["torch's"], models["ours"]
    assert grad_dtypes(ours) == grad_dtypes(theirs), "grad_dtype after fully_shard"
    assert_same(([], one_step_grads(ours, rank), []), ([], one_step_grads(theirs, rank), []), "gradients landing in grad_dtype")
    for model in (ours, theirs):
        model.to(torch.float64)
    assert grad_dtypes(ours) == grad_dtypes(theirs), "grad_dtype after .to(torch.float64)"
    for model in (ours, theirs):
        model.to(torch.float32)
        model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
    assert grad_dtypes(ours) == grad_dtypes(theirs), "grad_dtype after load_state_dict(assign=True)"
    assert_same(([], one_step_grads(ours, rank), []), ([], one_step_grads(theirs, rank), []), "gradients after .to() and assign")
    # reset_iter_state drops the landed gradients where torch's does (2.15), keeps them before
    for model in (ours, theirs):
        x, y = batch(rank, 1)
        (model(x) - y).pow(2).mean().backward()
        model.reset_iter_state()
    assert [p.grad is None for p in ours.parameters()] == [p.grad is None for p in theirs.parameters()], "grads after reset_iter_state"
    # an unused parameter's zeros need a dtype every rank agrees on
    model = with_grad_dtypes(NormNet())
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
    model.set_reduce_scatter_unused_params(True)
    from sharded.fsdp._grad_dtypes import grads_follow_grad_dtype

    x, y = batch(0, 0)
    loss = (model(x) - y).pow(2).mean()
    if grads_follow_grad_dtype():
        with pytest.raises(ValueError, match=r"rank \d.*blocks.1.norm.weight has grad_dtype=None"):
            loss.backward()
        model.reset_iter_state()
    else:
        loss.backward()  # before 2.15 grad_dtype plays no part


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_reduce_dtype_and_no_sync_accumulation_match_torch(world_size):
    run_on_ranks(_reduce_dtype_cases, world_size)
    run_on_ranks(_grad_dtype_cases, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_param_dtype_override_keeps_norms_in_fp32_like_torch(world_size):
    run_on_ranks(_override_cases, world_size)


def test_memory_estimate_counts_the_reduce_dtype_fully_shard_uses():
    """The reduce-scatter sends fp32 where torch 2.15's default reduces fp32 masters' gradients
    in fp32, half that with ``reduce_dtype=torch.bfloat16`` or before 2.15."""
    from sharded import estimate_memory
    from sharded.fsdp import MixedPrecisionPolicy
    from sharded.fsdp._grad_dtypes import grads_follow_grad_dtype

    def sent(policy) -> int:
        model = NormNet(dim=64, hidden=256)
        return estimate_memory(model, world_size=2, stage=3, mixed_precision=policy, wrap={Block}, activation_bytes=0).bytes_sent

    bf16 = torch.bfloat16
    default, opt_out = sent(MixedPrecisionPolicy(param_dtype=bf16)), sent(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16))
    fp32 = sent(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32))
    assert opt_out < fp32
    assert default == (fp32 if grads_follow_grad_dtype() else opt_out)


def test_torchs_policy_fields_act_or_raise():
    """Every field of torch's policy objects reaches ours; one a later torch adds that sharded
    does not know raises naming it, unless it holds its default."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    from sharded.fsdp._arguments import as_our_policies

    @dataclasses.dataclass(frozen=True)
    class FuturePolicy(TorchMP):
        future_knob: int = 0

    @dataclasses.dataclass(frozen=TorchOffload.__dataclass_params__.frozen)  # type: ignore[attr-defined]
    class FutureOffload(TorchOffload):
        future_knob: int = 0

    taken = {f.name: getattr(TorchMP(), f.name) for f in dataclasses.fields(TorchMP)}
    taken.update(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float16, cast_forward_inputs=False)
    if "param_dtype_override_fn" in taken:
        taken["param_dtype_override_fn"] = keep_vectors
    mp, offload = as_our_policies(FuturePolicy(**taken), FutureOffload(pin_memory=False))
    assert {name: getattr(mp, name) for name in taken} == taken and offload.pin_memory is False
    with pytest.raises(NotImplementedError, match=r"FuturePolicy\(future_knob=1\)"):
        as_our_policies(FuturePolicy(future_knob=1), None)
    with pytest.raises(NotImplementedError, match=r"FutureOffload\(future_knob=2\)"):
        as_our_policies(TorchMP(), FutureOffload(future_knob=2))
