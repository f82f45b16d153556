"""The multi-rank harness itself: results, failures and hangs are reported, never swallowed."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests._harness import RankFailure, assert_same_on_all_ranks, run_on_ranks


def _rank_and_sum(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world, t.item()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_come_back_in_rank_order(world_size):
    total = sum(range(world_size))
    assert run_on_ranks(_rank_and_sum, world_size) == [(r, world_size, total) for r in range(world_size)]


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("the root cause")
    dist.barrier()  # rank 0 is left waiting for rank 1


def test_an_exception_names_its_rank_and_comes_first():
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(_fail_on_rank_one, 2, timeout=30)
    message = str(failure.value)
    assert message.startswith("rank 1 error:")
    assert "ValueError: the root cause" in message


def _hang_on_rank_one(rank, world):
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def test_a_hang_fails_at_the_deadline_and_names_the_stuck_ranks():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0, 1\] were still running after 5 s"):
        run_on_ranks(_hang_on_rank_one, 2, timeout=5)
    assert time.monotonic() - start < 30


def _differ_on_last_rank(rank, world):
    assert_same_on_all_ranks([torch.ones(3)], "same")
    with pytest.raises(AssertionError, match=rf"tensor 0 differs between rank 0 and ranks \[{world - 1}\]"):
        assert_same_on_all_ranks([torch.full((3,), float(rank == world - 1))], "different")


def test_assert_same_on_all_ranks_spots_the_odd_rank():
    run_on_ranks(_differ_on_last_rank, 3)


def test_back_to_back_launches_do_not_collide():
    for _ in range(3):
        assert len(run_on_ranks(_rank_and_sum, 2)) == 2
