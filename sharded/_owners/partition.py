"""Which rank owns which parameter: a pure, deterministic, immutable assignment.

Every rank computes the same :class:`Partition` from the same inputs (parameter sizes or costs,
their order and their ``requires_grad`` flags), so no communication is needed to agree on it.

Placement is sorted greedy ("longest processing time first"): parameters are visited costliest
first and each goes to the rank with the smallest load so far. A parameter's cost is its bytes
unless the caller gives others (:mod:`.step_cost`: a whole-matrix optimizer's step costs more
than its bytes say). This keeps the busiest rank within one parameter of the mean, and close to
optimal in practice; an unsorted greedy can end up a whole large parameter over. Trainable and
frozen parameters are balanced separately: frozen parameters carry no optimizer state while
frozen, so they must not skew where trainable ones go, but they still need a keeper for state
they may have from earlier steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .._common.step_cost import place_greedily
from .step_cost import bytes_cost

__all__ = ["Balance", "Partition"]


@dataclass(frozen=True)
class Balance:
    """How evenly a partition spreads its trainable parameters: for each measure, the busiest
    rank's share times the number of ranks (1.00 is even; 2.00 on 4 ranks means one rank holds
    half). ``bytes`` is what the optimizer state scales with, ``cost`` what the step time does
    (the costs the partition balanced; the same as ``bytes`` when it balanced bytes)."""

    bytes: float
    cost: float


@dataclass(frozen=True)
class Partition:
    """Assignment of parameters to owner ranks.

    Attributes:
        params: every parameter, in global order (param group by param group, as a torch
            optimizer numbers them in its state dict).
        group_sizes: how many of ``params`` belong to each param group, in order.
        owners: ``owners[i]`` is the rank that owns ``params[i]``.
        trainable: ``trainable[i]`` is ``params[i].requires_grad`` when the partition was made.
        world_size: number of ranks.
        costs: ``costs[i]`` is the weight ``params[i]`` was placed by (its step cost; its bytes
            unless the caller gave costs).
    """

    params: tuple[torch.Tensor, ...]
    group_sizes: tuple[int, ...]
    owners: tuple[int, ...]
    trainable: tuple[bool, ...]
    world_size: int
    costs: tuple[float, ...]

    @classmethod
    def build(
        cls,
        param_groups: Sequence[Sequence[torch.Tensor]],
        world_size: int,
        costs: Optional[Sequence[float]] = None,
    ) -> Partition:
        """Place every parameter of ``param_groups`` from scratch, balancing ``costs`` (one per
        parameter, in order; default: their bytes)."""
        empty = cls(params=(), group_sizes=(), owners=(), trainable=(), world_size=world_size, costs=())
        return empty._extended(param_groups, costs)

    def with_group(self, new_params: Sequence[torch.Tensor], costs: Optional[Sequence[float]] = None) -> Partition:
        """A partition with one more param group, placed by ``costs`` (default: bytes) on top of
        the current loads; parameters already placed keep their owner."""
        return self._extended([new_params], costs)

    def _extended(self, groups: Sequence[Sequence[torch.Tensor]], costs: Optional[Sequence[float]]) -> Partition:
        """This partition with ``groups`` appended, each new parameter placed on the current loads."""
        new_params = [p for group in groups for p in group]
        new_costs = tuple(bytes_cost(p) for p in new_params) if costs is None else tuple(costs)
        if len(new_costs) != len(new_params):
            raise ValueError(f"{len(new_costs)} costs for {len(new_params)} parameters; give one per parameter")
        return Partition(
            params=self.params + tuple(new_params),
            group_sizes=self.group_sizes + tuple(len(g) for g in groups),
            owners=self.owners + self._place(new_params, new_costs),
            trainable=self.trainable + tuple(p.requires_grad for p in new_params),
            world_size=self.world_size,
            costs=self.costs + new_costs,
        )

    def _place(self, new_params: Sequence[torch.Tensor], costs: Sequence[float]) -> tuple[int, ...]:
        """Owners for ``new_params``, placed greedily by ``costs`` on top of the current loads
        (trainable and frozen parameters apart)."""
        owners = [0] * len(new_params)
        for requires_grad in (True, False):
            candidates = [i for i, p in enumerate(new_params) if p.requires_grad == requires_grad]
            placed = place_greedily([costs[i] for i in candidates], self._loads(self.costs, trainable=requires_grad))
            for i, rank in zip(candidates, placed):
                owners[i] = rank
        return tuple(owners)

    def _loads(self, weights: Sequence[float], trainable: bool) -> list[float]:
        """Per rank, the sum of ``weights`` (one per parameter) of its trainable or frozen parameters."""
        loads = [0.0] * self.world_size
        for weight, owner, is_trainable in zip(weights, self.owners, self.trainable):
            if is_trainable == trainable:
                loads[owner] += weight
        return loads

    # ----------------------------------------------------------------- derived views

    @property
    def group_slices(self) -> tuple[slice, ...]:
        """For each param group, the slice of ``params`` it occupies."""
        slices, start = [], 0
        for size in self.group_sizes:
            slices.append(slice(start, start + size))
            start += size
        return tuple(slices)

    def owner_of(self) -> dict[torch.Tensor, int]:
        """Parameter -> owner rank (tensors hash by identity)."""
        return dict(zip(self.params, self.owners))

    def owned_indices(self, rank: int, trainable_only: bool = False) -> list[int]:
        """Global indices of the parameters ``rank`` owns, in global order."""
        return [
            i
            for i, (owner, is_trainable) in enumerate(zip(self.owners, self.trainable))
            if owner == rank and (is_trainable or not trainable_only)
        ]

    def owned_by_group(self, rank: int) -> list[list[torch.Tensor]]:
        """The parameters ``rank`` owns, split by param group (a group may be empty).

        Its optimizer holds all of them and, as any torch optimizer, steps those that have a
        gradient: a frozen parameter still holding one is stepped too.
        """
        return [
            [p for p, owner in zip(self.params[s], self.owners[s]) if owner == rank]
            for s in self.group_slices
        ]

    def frozen_indices(self) -> list[int]:
        """Global indices of the parameters that were frozen when the partition was made."""
        return [i for i, is_trainable in enumerate(self.trainable) if not is_trainable]

    def trainable_bytes_per_rank(self) -> list[int]:
        """Bytes of trainable parameters each rank owns: what its optimizer state scales with."""
        return [int(load) for load in self._loads([bytes_cost(p) for p in self.params], trainable=True)]

    def trainable_cost_per_rank(self) -> list[float]:
        """The summed costs of the trainable parameters each rank owns: what its step time scales with."""
        return self._loads(self.costs, trainable=True)

    def balance(self) -> Balance:
        """The busiest rank's share of trainable bytes and of trainable cost, times the ranks."""
        return Balance(bytes=_busiest_share(self.trainable_bytes_per_rank()),
                       cost=_busiest_share(self.trainable_cost_per_rank()))

    def is_current(self) -> bool:
        """Whether every parameter's ``requires_grad`` still matches this partition."""
        return all(p.requires_grad == t for p, t in zip(self.params, self.trainable))


def _busiest_share(loads: Sequence[float]) -> float:
    """The largest of ``loads`` over an even share of their sum (1.0 when there is nothing)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0
