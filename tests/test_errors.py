"""The one producer of the rank prefix: the global rank, and the group rank where it differs."""

from __future__ import annotations

import torch.distributed as dist

from sharded._common.errors import on_rank
from tests._harness import run_on_ranks


def test_a_lone_process_is_rank_0():
    assert on_rank("boom") == "rank 0: boom"
    assert on_rank("boom", group_rank=0) == "rank 0: boom"


def _prefixes_in_a_subgroup(rank, world):
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    group_rank = dist.get_rank(group)
    return on_rank("boom", group_rank=group_rank)


def test_the_prefix_is_the_global_rank_and_adds_a_differing_group_rank():
    messages = run_on_ranks(_prefixes_in_a_subgroup, 3)
    assert messages == [None, "rank 1 (rank 0 in its group): boom", "rank 2 (rank 1 in its group): boom"]
