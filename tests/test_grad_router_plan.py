"""Pure tests of the router's parts (the reduce-bucket plan, the averages set aside): no process
group needed."""

from __future__ import annotations

import random
import weakref

import pytest
import torch

from sharded._owners.held_averages import HeldAverages
from sharded._owners.reduce_plan import plan_reduce_buckets


def _params(sizes):
    return [torch.zeros(n, requires_grad=True) for n in sizes]


@pytest.mark.parametrize("seed", range(10))
def test_every_gradient_in_one_bucket_of_one_owner_within_the_size_bound(seed):
    rng = random.Random(seed)
    params = _params([rng.choice([1, 10, 100, 1000, 5000]) for _ in range(rng.randint(1, 40))])
    owner_of = {p: rng.randrange(3) for p in params}
    max_numel = rng.choice([0, 50, 1000, 10**6])
    buckets = plan_reduce_buckets(params, owner_of, max_numel, reduce_fp16=False)
    placed = [p for b in buckets for p in b.params]
    assert sorted(map(id, placed)) == sorted(map(id, params))
    position = {p: i for i, p in enumerate(params)}
    for b in buckets:
        assert {owner_of[p] for p in b.params} == {b.owner}
        assert b.numel <= max(max_numel, 0) or len(b.params) == 1
    completions = [position[b.params[-1]] for b in buckets]
    assert completions == sorted(completions), "buckets must launch in the order they complete"


def test_interleaved_owners_still_start_reducing_early_in_backward():
    params = _params([100] * 40)
    owner_of = {p: i % 2 for i, p in enumerate(params)}  # greedy partitions interleave like this
    buckets = plan_reduce_buckets(params, owner_of, 1000, reduce_fp16=False)
    first_done = next(i for i, p in enumerate(params) if p is buckets[0].params[-1])
    assert first_done < 10, "the first bucket should complete after a quarter of backward at most"
    assert len(buckets) == 8  # 4 windows of 10 parameters, 2 owners each


def test_reduce_fp16_narrows_only_fp32_and_wider():
    params = [torch.zeros(4, requires_grad=True), torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)]
    buckets = plan_reduce_buckets(params, {p: 0 for p in params}, 100, reduce_fp16=True)
    assert sorted(str(b.wire_dtype) for b in buckets) == ["torch.bfloat16", "torch.float16"]


@pytest.mark.parametrize(
    "max_numel, window_sizes",
    [(10**6, [4, 36]), (2500, [2] * 20), (0, [1] * 40)],  # first 16000 bytes; the bucket size; alone
)
def test_first_window_is_small_like_ddps_first_bucket_and_capped_by_the_bucket_size(max_numel, window_sizes):
    params = _params([1000] * 40)  # 4000 bytes each; one owner, so each window is one bucket
    buckets = plan_reduce_buckets(params, {p: 0 for p in params}, max_numel, reduce_fp16=False, first_bytes=16000)
    assert [len(b.params) for b in buckets] == window_sizes


# ------------------------------------------------------------------------- held averages


def _held_average(value: float) -> tuple[torch.nn.Parameter, HeldAverages, list]:
    """A parameter holding ``value`` as the average a flush handed out, with the router's two
    hooks wired to a ``HeldAverages`` (``synced`` picked per backward through the list)."""
    p = torch.nn.Parameter(torch.ones(3))
    held = HeldAverages([p])
    synced = [False]
    p.register_hook(lambda grad: held.before_accumulate(0))
    p.register_post_accumulate_grad_hook(lambda param: held.after_accumulate(0, synced[0]))
    p.grad = torch.full((3,), value)
    held.after_flush(handed_out=[0])
    return p, held, synced


def _flush(p: torch.nn.Parameter, held: HeldAverages, reduced: float | None) -> None:
    """What a flush does to ``p``: a bucket takes its gradient (if a hook did not already),
    ``reduced`` comes back (None: no rank produced one), and ``held`` gives back its averages."""
    if p.grad is not None and not held.set_aside_if_average(0):
        p.grad = None
        held.joins_reduce(0)
    if reduced is not None:
        p.grad = torch.full((3,), reduced)
    held.after_flush(handed_out=[0] if reduced is not None else [])


def test_an_average_added_to_is_set_aside_and_comes_back_on_top_of_the_new_reduce():
    p, held, synced = _held_average(2.0)
    (p * 3).sum().backward()  # inside no_sync: the new gradient alone
    assert p.grad.tolist() == [3.0] * 3
    (p * 4).sum().backward()
    assert p.grad.tolist() == [7.0] * 3
    _flush(p, held, reduced=10.0)  # the reduce of 3 + 4 (and other ranks') came back as 10
    assert p.grad.tolist() == [12.0] * 3 and held.holds_average(0)
    synced[0] = True
    (p * 5).sum().backward()  # a synced backward: the hook would take it into a bucket
    p.grad = None
    _flush(p, held, reduced=1.0)
    assert p.grad.tolist() == [13.0] * 3


def test_an_average_nothing_was_added_to_stays_as_it_was():
    p, held, _ = _held_average(2.0)
    average = p.grad
    torch.autograd.grad((p * 3).sum(), [p])  # fires the pre-hook, adds nothing
    assert p.grad is average and held.holds_average(0)
    _flush(p, held, reduced=None)  # no rank produced a gradient: not reduced again
    assert p.grad is average and p.grad.tolist() == [2.0] * 3


@pytest.mark.parametrize("zeroing", ["release", "in place", "through .data", "replaced"])
def test_zeroing_the_gradient_added_on_top_voids_the_average_set_aside(zeroing):
    p, held, _ = _held_average(2.0)
    (p * 3).sum().backward()  # inside no_sync
    if zeroing == "release":
        p.grad = None
    elif zeroing == "in place":
        p.grad.zero_()
    elif zeroing == "through .data":
        p.grad.data.zero_()
    else:
        p.grad = torch.full((3,), 5.0)
    (p * 4).sum().backward()
    _flush(p, held, reduced=10.0)
    assert p.grad.tolist() == [10.0] * 3, zeroing


def test_a_released_average_is_not_kept_alive():
    p, held, _ = _held_average(2.0)
    average = weakref.ref(p.grad)
    p.grad = None
    assert average() is None and not held.holds_average(0)
