"""Pure tests of the Partition: no process group needed."""

from __future__ import annotations

import random

import pytest
import torch

from sharded._owners.partition import Partition


def _params(sizes, frozen=()):
    params = [torch.zeros(n, requires_grad=True) for n in sizes]
    for i in frozen:
        params[i].requires_grad_(False)
    return params


def _random_groups(rng: random.Random):
    groups = []
    for _ in range(rng.randint(1, 4)):
        sizes = [rng.choice([1, 3, 64, 100, 1000, 4096]) for _ in range(rng.randint(0, 12))]
        groups.append(_params(sizes))
    return groups


@pytest.mark.parametrize("seed", range(20))
def test_every_parameter_owned_once_and_balance_bound_holds(seed):
    rng = random.Random(seed)
    groups = _random_groups(rng)
    world = rng.randint(1, 5)
    part = Partition.build(groups, world)
    flat = [p for g in groups for p in g]
    assert part.params == tuple(flat)
    owned = sorted(i for r in range(world) for i in part.owned_indices(r))
    assert owned == list(range(len(flat)))
    loads = part.trainable_bytes_per_rank()
    assert sum(loads) == sum(p.numel() * 4 for p in flat)
    largest = max((p.numel() * 4 for p in flat), default=0)
    # list scheduling bound: the fullest rank exceeds the mean by at most one parameter
    assert max(loads) <= sum(loads) / world + largest


def test_same_inputs_give_same_partition():
    groups = _random_groups(random.Random(7))
    twin = [[torch.zeros_like(p, requires_grad=True) for p in g] for g in groups]
    assert Partition.build(groups, 3).owners == Partition.build(twin, 3).owners


def test_sorting_places_the_largest_first():
    # in the given order greedy would end at loads 3 and 1; largest first reaches 2 and 2
    part = Partition.build([_params([1, 1, 2])], 2)
    assert part.trainable_bytes_per_rank() == [8, 8]


def test_frozen_parameters_do_not_skew_trainable_balance():
    params = _params([100, 100, 1000, 1000], frozen=(2, 3))
    part = Partition.build([params], 2)
    assert part.trainable_bytes_per_rank() == [400, 400]
    frozen_keepers = {part.owners[2], part.owners[3]}
    assert frozen_keepers == {0, 1}


def test_new_group_keeps_existing_owners_and_fills_the_lighter_rank():
    first = _params([1000, 10])
    part = Partition.build([first], 2)
    extended = part.with_group(_params([500, 400]))
    assert extended.owners[:2] == part.owners
    assert extended.group_sizes == (2, 2)
    # rank 0 holds the 1000, so both new parameters go to rank 1
    assert extended.owners[2:] == (1 - part.owners[0],) * 2


def test_more_ranks_than_parameters_leaves_ranks_empty():
    part = Partition.build([_params([5, 5])], 4)
    assert [len(part.owned_indices(r)) for r in range(4)] == [1, 1, 0, 0]
    assert part.owned_by_group(3) == [[]]


def test_is_current_tracks_requires_grad():
    params = _params([3, 4])
    part = Partition.build([params], 2)
    assert part.is_current()
    params[0].requires_grad_(False)
    assert not part.is_current()
