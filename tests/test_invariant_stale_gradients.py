"""``MicroBatches`` refuses to start a step's loop over gradients left from an earlier step: the
loop would add them into the first micro-batch's leaf. A NaN or inf (what a step that
``ShardedGradScaler`` skipped leaves behind) is as much a leftover as a finite value; zeros
(``zero_grad(set_to_none=False)``) are not."""

from __future__ import annotations

import pytest
import torch

from sharded.invariant import MicroBatches


def _loop(model: torch.nn.Module, micro_batches: MicroBatches) -> None:
    for _ in micro_batches:
        model(torch.ones(1, 2)).sum().backward()


@pytest.mark.parametrize("left", [1.0, -1.0, float("inf"), float("nan")])
def test_a_gradient_left_from_the_last_step_is_refused_even_a_nan(left):
    model = torch.nn.Linear(2, 1)
    micro_batches = MicroBatches(model, 2)
    model.weight.grad = torch.zeros_like(model.weight)
    model.weight.grad[0, 1] = left
    with pytest.raises(RuntimeError, match="call optimizer.zero_grad"):
        _loop(model, micro_batches)


def test_zeroed_gradients_are_no_leftover():
    model = torch.nn.Linear(2, 1)
    micro_batches = MicroBatches(model, 2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    _loop(model, micro_batches)
    assert torch.equal(model.weight.grad, torch.ones(1, 2))
