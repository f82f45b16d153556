"""ShardedDataParallel over a model compiled whole: reduces still overlap the compiled backward.

AOTAutograd runs a compiled graph's backward as one autograd node, so without a split every
gradient would become ready, and every reduce leave, only when the whole backward is done. The
wrapper has Dynamo split the graph into bucket-sized pieces (as DDP does); each piece's backward
is then its own node. What is asserted is a count, not a time: how many of the backward's
reduces had been issued when the autograd engine started the last piece of backward compute
(the piece that computes the first layer's gradients). ``backend="aot_eager"`` keeps the
arithmetic eager's, so the results must equal DDP's to the tolerances of test_oss.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from sharded import OSS, ShardedDataParallel
from tests._harness import assert_same_on_all_ranks, run_on_ranks
from tests.test_oss import _assert_close

# Six layers of 1 MiB of parameters each: Dynamo's split refuses pieces below 1 MiB (DDP's
# first-bucket size), so a bucket of 2**18 elements makes one piece per layer.
WIDTH, LAYERS, BUCKET = 512, 6, 2**18
SGD = dict(lr=0.1, momentum=0.9)
STEPS = 3
MIN_SHARE_BEFORE_LAST_PIECE = 0.8


def _stack() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, WIDTH, generator=g)


def _node_computing_grad_of(loss: torch.Tensor, param: torch.Tensor) -> torch.autograd.graph.Node:
    """The autograd node that hands ``param`` its gradient (walks the graph from ``loss``)."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and getattr(child, "variable", None) is param:
                return node
            todo.append(child)
    raise AssertionError("no node computes the first layer's gradient")


class _ReduceCounter:
    """Counts the ``dist.reduce`` calls of this rank (the wrapper reduces through it)."""

    def __init__(self) -> None:
        self.calls = 0
        self._reduce: Callable = dist.reduce

    def __enter__(self) -> _ReduceCounter:
        def counting(*args, **kwargs):
            self.calls += 1
            return self._reduce(*args, **kwargs)

        dist.reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.reduce = self._reduce


def _train_and_count(rank: int, wrapped: nn.Module, first_weight: torch.Tensor, optimizer) -> list[float]:
    """Train STEPS steps; per step, the share of reduces issued before the last piece ran."""
    shares = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = F.mse_loss(wrapped(_batch(rank, step)), torch.zeros(4, WIDTH))
        before_last = []
        with _ReduceCounter() as counter:
            last = _node_computing_grad_of(loss, first_weight)
            handle = last.register_prehook(lambda grads: before_last.append(counter.calls))
            loss.backward()
            handle.remove()
        optimizer.step()
        if counter.calls:
            shares.append(before_last[0] / counter.calls)
    return shares


def _check_compiled_whole_overlaps(rank: int, world: int, order: str) -> None:
    ref_model = _stack()
    ref = DDP(ref_model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), **SGD)
    for step in range(STEPS):
        ref_opt.zero_grad()
        F.mse_loss(ref(_batch(rank, step)), torch.zeros(4, WIDTH)).backward()
        ref_opt.step()

    model = _stack()
    optimizer = OSS(model.parameters(), torch.optim.SGD, **SGD)
    if order == "compile, then wrap":
        wrapped = ShardedDataParallel(torch.compile(model, backend="aot_eager"), optimizer, reduce_buffer_size=BUCKET)
    else:
        wrapped = torch.compile(ShardedDataParallel(model, optimizer, reduce_buffer_size=BUCKET), backend="aot_eager")
    shares = _train_and_count(rank, wrapped, model[0].weight, optimizer)
    _assert_close(model, ref_model, order)
    assert_same_on_all_ranks(list(model.parameters()), order)
    assert len(shares) == STEPS
    assert min(shares) >= MIN_SHARE_BEFORE_LAST_PIECE, (
        f"rank {rank}, {order}: share of the reduces issued before the last piece of the "
        f"compiled backward began, per step: {shares}"
    )


# One order per world size: compiling is slow on this machine, and test_sharded_ddp_loops checks
# the results of both orders at every world size. (World 1 reduces nothing.)
@pytest.mark.parametrize("world_size, order", [(2, "compile, then wrap"), (3, "wrap, then compile")])
def test_whole_compiled_model_matches_ddp_and_reduces_overlap_its_backward(world_size, order):
    run_on_ranks(_check_compiled_whole_overlaps, world_size, order, timeout=240)
