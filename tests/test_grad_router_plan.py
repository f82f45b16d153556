"""Pure tests of the reduce-bucket plan: no process group needed."""

from __future__ import annotations

import random

import pytest
import torch

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
