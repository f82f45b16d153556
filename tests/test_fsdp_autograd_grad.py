"""``torch.autograd.grad`` over a model sharded by ``fully_shard``, against torch's own ``fully_shard``.

Gradient penalties, saliency maps and meta-learning differentiate a sharded model with
``torch.autograd.grad``, and torch's pipelining schedules compute their stages' input gradients
so. Over our units it raised ("A leaf node was passed to _will_engine_execute_node but we are
currently running autograd.grad()", from torch's multi-gradient hook on the units' inputs).
Here, on the same model, data and calls, ours equals torch's ``fully_shard`` bit for bit (world
3: every rank on rank 0's data, tests/_exact_sums.py):

* the input's gradient, for inputs only: no parameter's ``.grad`` is touched and nothing is
  reduced (no collective runs, none is left pending), with a leaf input and a computed one;
* for inputs and parameters: the sharded parameters are not in the graph (the units compute with
  the gathered ones), so torch's raises "appears to not have been used in the graph" and, with
  ``allow_unused=True``, returns ``None`` for each; ours does the same;
* between micro-batches accumulated with sync off: the accumulated gradients survive untouched;
* ``create_graph=True`` (a gradient penalty, ``loss + ||dL/dx||^2``, then ``backward()``): torch's
  allows it where the gathered parameters stay gathered through both backwards
  (``reshard_after_forward=False`` and ``set_reshard_after_backward(False)``), and so does ours
  with the same gradients; where they are freed after forward, both raise (the second backward
  reads the freed storage), never train on wrong numbers (ours trains at world 1, where the
  gathered parameters are the shards themselves and nothing is freed: as the unsharded model);
* normal training steps, each after an input-gradient pass, train as torch's does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests._exact_sums import batch_rank
from tests._fsdp_reference import CountCollectives, full_tensors
from tests._harness import run_on_ranks


def _mlp(fully_shard, kept: bool = False) -> nn.Module:
    """A 3-layer tanh MLP (tanh: a gradient penalty has a second derivative to follow), a unit
    per layer and the root; ``kept``: gathered parameters kept through forward and backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=not kept)
    fully_shard(model, reshard_after_forward=not kept)
    if kept:
        model.set_reshard_after_backward(False)
    return model


def _batch(rank: int, world: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * batch_rank(rank, world) + step)
    return torch.randn(5, 6, generator=generator)


def _reshard(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "reshard"):
            module.reshard()


def _input_gradients(model: nn.Module, rank: int, world: int) -> dict:
    """Input gradients alone, with a leaf input and with a computed one; then what grad
    returns for inputs and (sharded) parameters."""
    x = _batch(rank, world, 0).requires_grad_()
    with CountCollectives() as counted:
        (leaf,) = torch.autograd.grad(model(x).sum(), x)
        x0 = _batch(rank, world, 1).requires_grad_()
        (computed,) = torch.autograd.grad(model(x0 * 2).pow(2).sum(), x0)
    with_params = torch.autograd.grad(model(x).sum(), [x, *model.parameters()], allow_unused=True)
    try:
        torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
        strict = "returned"
    except RuntimeError as error:
        strict = str(error)
    return {
        "grads": [leaf, computed, with_params[0]],
        "reduces": counted.reduces,
        "untouched": all(p.grad is None for p in model.parameters()),
        "param_results": [g is None for g in with_params[1:]],
        "strict": strict,
    }


def _between_micro_batches(model: nn.Module, rank: int, world: int) -> list[torch.Tensor]:
    """Micro-batch 1 with sync off, an input-gradient pass, micro-batch 2 with sync on."""
    model.set_requires_gradient_sync(False)
    model(_batch(rank, world, 2)).pow(2).sum().backward()
    x = _batch(rank, world, 3).requires_grad_()
    torch.autograd.grad(model(x).sum(), x)
    model.set_requires_gradient_sync(True)
    model(_batch(rank, world, 4)).pow(2).sum().backward()
    grads = full_tensors(p.grad for p in model.parameters())
    model.zero_grad()
    return grads


def _penalty(model: nn.Module, rank: int, world: int) -> list[torch.Tensor]:
    """Two steps of ``loss + ||dL/dx||^2`` with SGD: input gradients, parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(2):
        x = _batch(rank, world, 10 + step).requires_grad_()
        loss = model(x).pow(2).sum()
        (dx,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + dx.pow(2).sum()).backward()
        _reshard(model)
        optimizer.step()
        optimizer.zero_grad()
        out.append(dx.detach())
    return out + full_tensors(model.parameters())


def _penalty_over_freed_parameters(model: nn.Module, rank: int, world: int) -> object:
    """One penalty backward with the gathered parameters freed after forward: the error's type,
    or the gradients if it trained (ours at world 1, whose gathered parameters are the shards)."""
    x = _batch(rank, world, 20).requires_grad_()
    loss = model(x).sum()
    (dx,) = torch.autograd.grad(loss, x, create_graph=True)
    try:
        (loss + dx.pow(2).sum()).backward()
    except RuntimeError as error:
        return type(error).__name__
    return full_tensors(p.grad for p in model.parameters())


def _training_after_input_gradients(model: nn.Module, rank: int, world: int) -> list[torch.Tensor]:
    """Three SGD steps, each after a saliency pass over its batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        x = _batch(rank, world, 30 + step).requires_grad_()
        torch.autograd.grad(model(x).sum(), x)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses + full_tensors(model.parameters())


def _run(fully_shard, rank: int, world: int) -> dict:
    return {
        "input": _input_gradients(_mlp(fully_shard), rank, world),
        "micro": _between_micro_batches(_mlp(fully_shard), rank, world),
        "penalty": _penalty(_mlp(fully_shard, kept=True), rank, world),
        "training": _training_after_input_gradients(_mlp(fully_shard), rank, world),
        "freed": _penalty_over_freed_parameters(_mlp(fully_shard), rank, world),
    }


def _assert_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert not isinstance(a, DTensor), what
        assert torch.equal(a, b), f"{what}: tensor {i} differs from torch's by {(a - b).abs().max():.3g}"


def _autograd_grad_matches_torch(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from sharded import fully_shard

    ours, theirs = _run(fully_shard, rank, world), _run(torch_fully_shard, rank, world)
    mine, torch_input = ours["input"], theirs["input"]
    _assert_equal(mine["grads"], torch_input["grads"], "input gradients")
    assert mine["reduces"] == 0, f"autograd.grad for inputs reduced {mine['reduces']} times"
    assert mine["untouched"] and torch_input["untouched"], "autograd.grad filled a parameter's .grad"
    assert mine["param_results"] == torch_input["param_results"] == [True] * 6, mine["param_results"]
    assert "not have been used in the graph" in torch_input["strict"], torch_input["strict"]
    assert mine["strict"] == torch_input["strict"], mine["strict"]
    _assert_equal(ours["micro"], theirs["micro"], "gradients accumulated around an autograd.grad")
    _assert_equal(ours["penalty"], theirs["penalty"], "gradient penalty (create_graph=True)")
    _assert_equal(ours["training"], theirs["training"], "training after input-gradient passes")
    assert theirs["freed"] == "RuntimeError", theirs["freed"]
    if world > 1:
        assert ours["freed"] == "RuntimeError", ours["freed"]
    else:  # nothing was freed: the gradients are those of the model unsharded
        _assert_equal(ours["freed"], _penalty_over_freed_parameters(_mlp(lambda m, **_: m), rank, world), "penalty at world 1")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_autograd_grad_for_inputs_parameters_and_penalties_matches_torch(world_size):
    run_on_ranks(_autograd_grad_matches_torch, world_size, timeout=120)
