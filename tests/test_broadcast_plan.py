"""Pure tests of resident broadcast buckets (parameters living in their bucket): no process group."""

from __future__ import annotations

import torch
from torch import nn

from sharded._common.broadcast import make_resident, plan_broadcasts, release_residents


def _params(n, size=10):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(size)) for _ in range(n)]


def _resident(tensors, max_numel=100):
    return make_resident(plan_broadcasts([tensors], max_numel))


def test_tensors_move_into_one_buffer_and_keep_their_values():
    params = _params(4)
    values = [p.detach().clone() for p in params]
    (bucket,) = _resident(params)
    assert bucket.is_resident()
    assert {p.untyped_storage().data_ptr() for p in params} == {bucket.flat.untyped_storage().data_ptr()}
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    bucket.flat.fill_(3.0)  # writing the buffer is writing the parameters
    assert all(bool((p == 3.0).all()) for p in params)


def test_tensors_already_sharing_an_old_bucket_move_into_a_new_one():
    params = _params(4)
    _resident(params)
    (bucket,) = _resident(params[:3])  # what a re-partition does
    assert bucket.is_resident() and len(bucket.tensors) == 3


def test_overlapping_tensors_stay_aliased_and_travel_alone():
    base = torch.randn(20)
    first, second = nn.Parameter(base[:12]), nn.Parameter(base[8:])
    buckets = _resident([first, second] + _params(2))
    assert sorted(len(b.tensors) for b in buckets) == [1, 1, 2]
    assert first.data_ptr() + 8 * first.element_size() == second.data_ptr(), "the alias was split"


def test_new_storage_is_noticed_and_dropped_tensors_are_released():
    params = _params(4)
    (bucket,) = _resident(params)
    params[0].data = params[0].data.clone()
    assert not bucket.is_resident()
    kept = _resident(params[:2])
    release_residents([bucket], keep=kept)
    for p in params[2:]:
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), "an old bucket is pinned"
